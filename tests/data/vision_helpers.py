"""Tiny processors built in the tests: real transformers processor classes where they run
without torchvision (Qwen2-VL image-only, Gemma 3), and small stand-ins for the rest."""

from __future__ import annotations

import torch
from PIL import Image
from transformers import (
    BatchFeature,
    Gemma3Processor,
    Qwen2_5_VLProcessor,
    Qwen2VLProcessor,
    Qwen3VLProcessor,
)
from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
from transformers.processing_utils import ProcessorMixin

from protrain.train.data.templates import BUILTIN_TEMPLATES

from .helpers import byte_tokenizer

QWEN_SPECIALS = [
    "<|im_start|>",
    "<|im_end|>",
    "<|endoftext|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
]


def _image_only(processor_cls):
    """A Qwen-VL processor class without its video processor (which needs torchvision)."""

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        self.image_token = "<|image_pad|>"
        self.video_token = "<|video_pad|>"
        self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
        self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)
        ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)
        self.vision_start_token, self.vision_end_token = "<|vision_start|>", "<|vision_end|>"
        self.vision_start_token_id = tokenizer.convert_tokens_to_ids(self.vision_start_token)
        self.vision_end_token_id = tokenizer.convert_tokens_to_ids(self.vision_end_token)

    name = processor_cls.__name__.replace("Processor", "ImageOnlyProcessor")
    return type(name, (processor_cls,), {"__init__": __init__})


Qwen2VLImageOnlyProcessor = _image_only(Qwen2VLProcessor)
Qwen2_5_VLImageOnlyProcessor = _image_only(Qwen2_5_VLProcessor)
Qwen3VLImageOnlyProcessor = _image_only(Qwen3VLProcessor)


def qwen2_vl_processor(processor_cls=Qwen2VLImageOnlyProcessor):
    tok = byte_tokenizer(QWEN_SPECIALS, eos="<|im_end|>", pad="<|endoftext|>")
    # 56x56 images: a 4x4 grid of 14-pixel patches, merged 2x2 into 4 image tokens.
    image_processor = Qwen2VLImageProcessorPil(
        min_pixels=28 * 28, max_pixels=56 * 56, patch_size=14, merge_size=2, temporal_patch_size=2
    )
    return processor_cls(
        image_processor=image_processor, tokenizer=tok, chat_template=BUILTIN_TEMPLATES["qwen2_vl"]
    )


def gemma3_processor():
    tok = byte_tokenizer(
        ["<start_of_turn>", "<end_of_turn>"],
        bos="<bos>",
        eos="<eos>",
        pad="<pad>",
        extra_special_tokens={
            "boi_token": "<start_of_image>",
            "eoi_token": "<end_of_image>",
            "image_token": "<image_soft_token>",
        },
    )
    image_processor = Gemma3ImageProcessorPil(
        size={"height": 28, "width": 28}, do_pan_and_scan=False
    )
    return Gemma3Processor(
        image_processor=image_processor,
        tokenizer=tok,
        chat_template=BUILTIN_TEMPLATES["gemma3"],
        image_seq_length=4,
    )


class TinyPixtralProcessor:
    """Pixtral's expansion: each [IMG] becomes rows of [IMG] tokens ending in [IMG_BREAK],
    the last row ending in [IMG_END]; one token per 16x16 patch."""

    patch = 16

    def __init__(self, tokenizer, chat_template):
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.image_token_id = tokenizer.convert_tokens_to_ids("[IMG]")

    def apply_chat_template(self, messages, **kwargs):
        kwargs.setdefault("chat_template", self.chat_template)
        return self.tokenizer.apply_chat_template(messages, **kwargs)

    def __call__(self, text, images=None, return_tensors="pt", add_special_tokens=False):
        (text,) = text
        pieces = text.split("[IMG]")
        images = images or []
        assert len(pieces) - 1 == len(images)
        out, pixels, sizes = pieces[0], [], []
        for image, piece in zip(images, pieces[1:]):
            cols, rows = image.width // self.patch, image.height // self.patch
            out += (
                ("[IMG]" * cols + "[IMG_BREAK]") * (rows - 1) + "[IMG]" * cols + "[IMG_END]" + piece
            )
            pixels.append(torch.zeros(3, image.height, image.width))
            sizes.append([image.height, image.width])
        enc = self.tokenizer([out], add_special_tokens=add_special_tokens, return_tensors="pt")
        data = dict(enc)
        if images:
            data["pixel_values"] = (
                torch.stack(pixels) if len({p.shape for p in pixels}) == 1 else pixels[0][None]
            )
            data["image_sizes"] = torch.tensor(sizes)
        return BatchFeature(data)


def pixtral_processor():
    tok = byte_tokenizer(
        [
            "[INST]",
            "[/INST]",
            "[SYSTEM_PROMPT]",
            "[/SYSTEM_PROMPT]",
            "[IMG]",
            "[IMG_BREAK]",
            "[IMG_END]",
        ],
        bos="<s>",
        eos="</s>",
        pad="<pad>",
    )
    return TinyPixtralProcessor(tok, BUILTIN_TEMPLATES["mistral_v7_tekken"])


class ToyProcessor(TinyPixtralProcessor):
    """A processor of no known family: ChatML text, `<img>` expanded to three tokens."""

    def __init__(self):
        tok = byte_tokenizer([*QWEN_SPECIALS[:3], "<img>"], eos="<|im_end|>", pad="<|endoftext|>")
        template = BUILTIN_TEMPLATES["chatml"].replace(
            "message['content']",
            "(message['content'] if message['content'] is string else "
            "message['content'] | map(attribute='text', default='<img>') | join(''))",
        )
        super().__init__(tok, template)
        self.image_token_id = tok.convert_tokens_to_ids("<img>")

    def __call__(self, text, images=None, return_tensors="pt", add_special_tokens=False):
        (text,) = text
        text = text.replace("<img>", "<img>" * 3)
        enc = self.tokenizer([text], add_special_tokens=add_special_tokens, return_tensors="pt")
        data = dict(enc)
        if images:
            data["pixel_values"] = torch.zeros(len(images), 3, 4, 4)
        return BatchFeature(data)


def write_image(path, size=(56, 56)):
    Image.new("RGB", size, (200, 30, 30)).save(path)
    return path


LLAMA3_VISION_TEMPLATE = (
    "{{- bos_token }}{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] | trim }}"
    "{%- else %}{%- for part in message['content'] %}"
    "{%- if part['type'] == 'image' %}{{- '<|image|>' }}"
    "{%- elif part['type'] == 'text' %}{{- part['text'] | trim }}{%- endif %}"
    "{%- endfor %}{%- endif %}{{- '<|eot_id|>' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)


def mllama_processor():
    """Llama 3.2 Vision's processor (one `<|image|>` token per image, cross-attention)."""
    from transformers import MllamaProcessor
    from transformers.models.mllama.image_processing_pil_mllama import MllamaImageProcessorPil

    tok = byte_tokenizer(
        ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|image|>"],
        bos="<|begin_of_text|>",
        eos="<|eot_id|>",
        pad="<|finetune_right_pad_id|>",
    )
    image_processor = MllamaImageProcessorPil(size={"height": 28, "width": 28}, max_image_tiles=1)
    return MllamaProcessor(
        image_processor=image_processor, tokenizer=tok, chat_template=LLAMA3_VISION_TEMPLATE
    )
