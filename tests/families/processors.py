"""Tiny processors of the matrix's vision-language families, their real transformers
processor classes built offline (byte tokenizer, PIL image processors: no torchvision)."""

from __future__ import annotations

from tests.data.helpers import byte_tokenizer
from tests.data.vision_helpers import gemma3_processor

# ChatML with image parts written as `<image>`, the placeholder LLaVA and PaliGemma expand
_IMAGE_CHATML = (
    "{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}"
    "{%- else %}{%- for part in message['content'] %}"
    "{%- if part['type'] == 'image' %}{{- '<image>' }}"
    "{%- elif part['type'] == 'text' %}{{- part['text'] }}{%- endif %}"
    "{%- endfor %}{%- endif %}{{- '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
_CHATML = ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<image>"]
IMAGE_SIZE = 16  # pixels a side: 2x2 patches of 8, 4 image tokens


def llava_processor():
    from transformers import LlavaProcessor
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    tok = byte_tokenizer(_CHATML, eos="<|im_end|>", pad="<|endoftext|>")
    side = {"height": IMAGE_SIZE, "width": IMAGE_SIZE}
    images = CLIPImageProcessorPil(size=side, crop_size=side)
    return LlavaProcessor(image_processor=images, tokenizer=tok, patch_size=8,
                          vision_feature_select_strategy="default", num_additional_image_tokens=1,
                          chat_template=_IMAGE_CHATML)  # fmt: skip


def paligemma_processor():
    from transformers import PaliGemmaProcessor
    from transformers.models.siglip.image_processing_pil_siglip import SiglipImageProcessorPil

    tok = byte_tokenizer(_CHATML, bos="<bos>", eos="<|im_end|>", pad="<|endoftext|>")
    images = SiglipImageProcessorPil(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})
    images.image_seq_length = 4
    return PaliGemmaProcessor(image_processor=images, tokenizer=tok, chat_template=_IMAGE_CHATML)


PROCESSORS = {"llava": llava_processor, "paligemma": paligemma_processor,
              "gemma3": gemma3_processor}  # fmt: skip
