"""Chat templates: the tokenizer's own, or an override by name, Jinja string or file.

The built-in templates are the Jinja of each family's published chat template, limited to
what training data needs (messages, system prompts, reasoning, images; no tool schemas).
Where a family's template has a quirk that the loss masks must survive, it is kept:
Gemma folds the system prompt into the first user turn, Mistral (v3) puts it into the last
user turn, Qwen2.5 inserts a default system prompt, Qwen3 renders `<think>` blocks only after the
last user query.
"""

from __future__ import annotations

from pathlib import Path

from protrain.train.data.errors import DataError

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

QWEN2_5 = (
    "{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or (message.role == 'system' and not loop.first) or message.role == 'assistant' %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != 'tool') %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or (messages[loop.index0 + 1].role != 'tool') %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

QWEN3 = (
    "{%- if messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}"
    "{%- for message in messages[::-1] %}"
    "{%- set index = (messages|length - 1) - loop.index0 %}"
    "{%- if ns.multi_step_tool and message.role == 'user' and message.content is string"
    " and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}"
    "{%- set ns.multi_step_tool = false %}{%- set ns.last_query_index = index %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- for message in messages %}"
    "{%- if message.content is string %}{%- set content = message.content %}{%- else %}{%- set content = '' %}{%- endif %}"
    "{%- if (message.role == 'user') or (message.role == 'system' and not loop.first) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{%- set reasoning_content = '' %}"
    "{%- if message.reasoning_content is string %}{%- set reasoning_content = message.reasoning_content %}"
    "{%- else %}{%- if '</think>' in content %}"
    "{%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}"
    "{%- endif %}{%- endif %}"
    "{%- if loop.index0 > ns.last_query_index %}"
    "{%- if loop.last or (not loop.last and reasoning_content) %}"
    "{{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}"
    "{%- else %}{{- '<|im_start|>' + message.role + '\\n' + content }}{%- endif %}"
    "{%- else %}{{- '<|im_start|>' + message.role + '\\n' + content }}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.first or (messages[loop.index0 - 1].role != 'tool') %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + content + '\\n</tool_response>' }}"
    "{%- if loop.last or (messages[loop.index0 + 1].role != 'tool') %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)

LLAMA3 = (
    "{% for message in messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' %}"
    "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
    "{{ content }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)

LLAMA4 = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{{- '<|header_start|>' + message['role'] + '<|header_end|>\\n\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] | trim }}"
    "{%- else %}{%- for part in message['content'] %}"
    "{%- if part['type'] == 'image' %}{{- '<|image|>' }}{%- elif part['type'] == 'text' %}{{- part['text'] | trim }}{%- endif %}"
    "{%- endfor %}{%- endif %}"
    "{{- '<|eot|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|header_start|>assistant<|header_end|>\\n\\n' }}{%- endif %}"
)

GEMMA = (
    "{{ bos_token }}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- if messages[0]['content'] is string -%}{%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}"
    "{%- else -%}{%- set first_user_prefix = messages[0]['content'][0]['text'] + '\\n\\n' -%}{%- endif -%}"
    "{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}{%- set first_user_prefix = '' -%}{%- set loop_messages = messages -%}{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{%- endif -%}"
    "{%- if message['role'] == 'assistant' -%}{%- set role = 'model' -%}{%- else -%}{%- set role = message['role'] -%}{%- endif -%}"
    "{{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else '') }}"
    "{%- if message['content'] is string -%}{{ message['content'] | trim }}"
    "{%- else -%}{%- for item in message['content'] -%}"
    "{%- if item['type'] == 'image' -%}{{ '<start_of_image>' }}{%- elif item['type'] == 'text' -%}{{ item['text'] | trim }}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{{ '<end_of_turn>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\\n' }}{%- endif -%}"
)


def _mistral_last_user_system(sep: str) -> str:
    """Mistral v3 format: the system prompt goes into the last user turn; `sep` after markers."""
    return (
        "{%- if messages[0]['role'] == 'system' %}"
        "{%- set system_message = messages[0]['content'] %}{%- set loop_messages = messages[1:] %}"
        "{%- else %}{%- set loop_messages = messages %}{%- endif %}"
        "{%- set ns = namespace(last_user=-1) %}"
        "{%- for message in loop_messages %}{%- if message['role'] == 'user' %}"
        "{%- set ns.last_user = loop.index0 %}{%- endif %}{%- endfor %}"
        "{{- bos_token }}"
        "{%- for message in loop_messages %}"
        "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
        "{{- raise_exception('After the optional system message, conversation roles must alternate user/assistant/user/assistant/...') }}"
        "{%- endif %}"
        "{%- if message['role'] == 'user' %}"
        "{%- if loop.index0 == ns.last_user and system_message is defined %}"
        f"{{{{- '[INST]{sep}' + system_message + '\\n\\n' + message['content'] + '[/INST]' }}}}"
        f"{{%- else %}}{{{{- '[INST]{sep}' + message['content'] + '[/INST]' }}}}{{%- endif %}}"
        f"{{%- elif message['role'] == 'assistant' %}}{{{{- '{sep}' + message['content'] + eos_token }}}}"
        "{%- else %}{{- raise_exception('Only user and assistant roles are supported, with the exception of an initial optional system message!') }}"
        "{%- endif %}"
        "{%- endfor %}"
    )


def _mistral_system_prompt(sep: str) -> str:
    """Mistral v7 format: `[SYSTEM_PROMPT]` turns; images as `[IMG]` (Pixtral)."""
    return (
        "{{- bos_token }}"
        "{%- for message in messages %}"
        "{%- if message['role'] == 'system' %}"
        f"{{{{- '[SYSTEM_PROMPT]{sep}' + message['content'] + '[/SYSTEM_PROMPT]' }}}}"
        "{%- elif message['role'] == 'user' %}"
        f"{{%- if message['content'] is string %}}{{{{- '[INST]{sep}' + message['content'] + '[/INST]' }}}}"
        f"{{%- else %}}{{{{- '[INST]{sep}' }}}}{{%- for part in message['content'] %}}"
        "{%- if part['type'] == 'image' %}{{- '[IMG]' }}{%- elif part['type'] == 'text' %}{{- part['text'] }}{%- endif %}"
        "{%- endfor %}{{- '[/INST]' }}{%- endif %}"
        f"{{%- elif message['role'] == 'assistant' %}}{{{{- '{sep}' + message['content'] + eos_token }}}}"
        "{%- else %}{{- raise_exception('Only user, system and assistant roles are supported!') }}"
        "{%- endif %}"
        "{%- endfor %}"
    )


# SentencePiece Mistral tokenizers want a space after the markers; Tekken ones none.
MISTRAL = _mistral_last_user_system(" ")
MISTRAL_TEKKEN = _mistral_last_user_system("")
MISTRAL_V7 = _mistral_system_prompt(" ")
MISTRAL_V7_TEKKEN = _mistral_system_prompt("")

QWEN2_VL = (
    "{% set image_count = namespace(value=0) %}"
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' %}{% set image_count.value = image_count.value + 1 %}"
    "{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}"
    "{% endfor %}<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

BUILTIN_TEMPLATES: dict[str, str] = {
    "chatml": CHATML,
    "qwen2_5": QWEN2_5,
    "qwen3": QWEN3,
    "llama3": LLAMA3,
    "llama4": LLAMA4,
    "gemma": GEMMA,
    "gemma3": GEMMA,
    "mistral": MISTRAL,
    "mistral_tekken": MISTRAL_TEKKEN,
    "mistral_v7": MISTRAL_V7,
    "mistral_v7_tekken": MISTRAL_V7_TEKKEN,
    "pixtral": MISTRAL_V7_TEKKEN,
    "qwen2_vl": QWEN2_VL,
}


class TemplateError(DataError):
    """A `chat_template` value is neither a built-in name, a file nor a Jinja string."""


def _looks_like_jinja(text: str) -> bool:
    return "{{" in text or "{%" in text


def template_file(spec: str | None) -> Path | None:
    """The Jinja file a `chat_template` value names, or None (a built-in name, a Jinja
    string, the tokenizer's own)."""
    if spec is None or spec in BUILTIN_TEMPLATES or _looks_like_jinja(spec):
        return None
    path = Path(spec).expanduser()
    return path if path.is_file() else None


def check_template_spec(spec: str | None) -> str | None:
    """Config-time check of a `chat_template` value; the message says what is allowed."""
    if spec is None or spec in BUILTIN_TEMPLATES or _looks_like_jinja(spec):
        return spec
    if Path(spec).expanduser().is_file():
        return spec
    raise ValueError(
        f"chat_template: {spec!r} is not a built-in template ({', '.join(sorted(BUILTIN_TEMPLATES))}), "
        "an existing Jinja file or a Jinja string"
    )


def resolve_chat_template(spec: str | None, tokenizer) -> str:
    """The Jinja source to render chats with.

    `spec` is a built-in name (`BUILTIN_TEMPLATES`), a path to a Jinja file, a Jinja string,
    or None for the tokenizer's (or processor's) own template.
    """
    if spec is None:
        own = getattr(tokenizer, "chat_template", None)
        if isinstance(own, dict):  # several named templates: take the default one
            own = own.get("default") or next(iter(own.values()), None)
        if not own:
            raise TemplateError(
                "chat_template: the tokenizer has no chat template of its own; set `chat_template` "
                f"to one of {sorted(BUILTIN_TEMPLATES)}, a Jinja file or a Jinja string"
            )
        return own
    if spec in BUILTIN_TEMPLATES:
        return BUILTIN_TEMPLATES[spec]
    if _looks_like_jinja(spec):
        return spec
    path = Path(spec).expanduser()
    if path.is_file():
        try:
            return path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise TemplateError(
                f"chat_template: cannot read {str(path)!r} as UTF-8 text: {e}"
            ) from e
    raise TemplateError(
        f"chat_template: {spec!r} is not a built-in template ({', '.join(sorted(BUILTIN_TEMPLATES))}), "
        "an existing Jinja file or a Jinja string"
    )
