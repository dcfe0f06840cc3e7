"""Tiny audio processors and WAV files built in the tests (nothing is downloaded)."""

from __future__ import annotations

import wave

import numpy as np
from transformers import Gemma3nProcessor, Qwen2AudioProcessor, WhisperFeatureExtractor
from transformers.models.gemma3n.feature_extraction_gemma3n import Gemma3nAudioFeatureExtractor
from transformers.models.siglip.image_processing_pil_siglip import SiglipImageProcessorPil

from protrain.train.data.templates import BUILTIN_TEMPLATES

from .helpers import byte_tokenizer

QWEN_AUDIO_SPECIALS = [
    "<|im_start|>",
    "<|im_end|>",
    "<|endoftext|>",
    "<|AUDIO|>",
    "<|audio_bos|>",
    "<|audio_eos|>",
]


def qwen2_audio_processor() -> Qwen2AudioProcessor:
    """Qwen2-Audio's processor with a small Whisper feature extractor: 16 kHz, 8 mel bins,
    a 1-second window of 100 frames; an audio of F frames becomes
    ((F - 1) // 2 + 1 - 2) // 2 + 1 `<|AUDIO|>` tokens (0.5 s: 12, 0.3 s: 7)."""
    tok = byte_tokenizer(QWEN_AUDIO_SPECIALS, eos="<|im_end|>", pad="<|endoftext|>")
    fe = WhisperFeatureExtractor(
        feature_size=8, sampling_rate=16000, hop_length=160, chunk_length=1, n_fft=64
    )
    # chat_template=None: the processor's own (Qwen2-Audio's published ChatML template).
    return Qwen2AudioProcessor(feature_extractor=fe, tokenizer=tok)


# Gemma 3's template with Gemma 3n's audio part: `<audio_soft_token>`, which the processor
# expands into `\n\n<start_of_audio>` + audio_seq_length soft tokens + `<end_of_audio>\n\n`.
GEMMA3N_TEMPLATE = BUILTIN_TEMPLATES["gemma3"].replace(
    "{%- elif item['type'] == 'text' -%}",
    "{%- elif item['type'] == 'audio' -%}{{ '<audio_soft_token>' }}"
    "{%- elif item['type'] == 'text' -%}",
)


def gemma3n_processor(audio_seq_length: int = 5) -> Gemma3nProcessor:
    """Gemma 3n's processor (PIL image processor, no torchvision or timm) with 8 mel bins
    and a fixed number of audio soft tokens per audio."""
    tok = byte_tokenizer(
        ["<start_of_turn>", "<end_of_turn>"],
        bos="<bos>",
        eos="<eos>",
        pad="<pad>",
        extra_special_tokens={
            "boi_token": "<start_of_image>",
            "eoi_token": "<end_of_image>",
            "image_token": "<image_soft_token>",
            "boa_token": "<start_of_audio>",
            "eoa_token": "<end_of_audio>",
            "audio_token": "<audio_soft_token>",
        },
    )
    return Gemma3nProcessor(
        feature_extractor=Gemma3nAudioFeatureExtractor(feature_size=8),
        image_processor=SiglipImageProcessorPil(size={"height": 28, "width": 28}),
        tokenizer=tok,
        chat_template=GEMMA3N_TEMPLATE,
        audio_seq_length=audio_seq_length,
        image_seq_length=4,
    )


def write_wav(path, seconds=0.5, rate=16000, width=2, channels=1, samples=None):
    """A PCM WAV file: a 440 Hz tone, or the given float samples in [-1, 1] per channel."""
    if samples is None:
        t = np.arange(int(seconds * rate)) / rate
        mono = 0.5 * np.sin(2 * np.pi * 440 * t)
        samples = np.stack([mono] * channels, axis=1)
    samples = np.asarray(samples, dtype=np.float64).reshape(-1, channels)
    if width == 1:
        data = np.round(samples * 127 + 128).astype(np.uint8).tobytes()
    elif width == 2:
        data = np.round(samples * 32767).astype("<i2").tobytes()
    elif width == 3:
        v = np.round(samples * (2**23 - 1)).astype(np.int64).reshape(-1) & 0xFFFFFF
        data = np.stack([v & 0xFF, (v >> 8) & 0xFF, (v >> 16) & 0xFF], axis=1)
        data = data.astype(np.uint8).tobytes()
    else:
        data = np.round(samples * (2**31 - 1)).astype("<i4").tobytes()
    with wave.open(str(path), "wb") as w:
        w.setnchannels(channels)
        w.setsampwidth(width)
        w.setframerate(rate)
        w.writeframes(data)
    return path
