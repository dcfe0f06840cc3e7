"""Vision- and audio-language rows: images, audio, the processor, and masks on its tokens.

A row's images come from its `images` column (paths, relative to the dataset file, or PIL
images) and from image parts of its messages (`{"type": "image", "image"|"path": ...}`); a
part without its own source takes the next image of the column, and a row whose messages
name no image gets its images at the start of the first user turn (a LLaVA-style `<image>`
in the text marks the place instead). Audio works the same way: the `audios` column and
`{"type": "audio", "audio"|"path": ...}` parts (`<audio>` in the text), read by `audio.py`
for processors with a feature extractor (Qwen2-Audio, Gemma 3n). Videos come from
`{"type": "video", "video"|"path": ...}` parts (frame images, a folder of them, or a video file;
`video.py`) for processors with a video processor (Qwen2-VL, Qwen2.5-VL, Qwen3-VL). Every path
is checked before anything is tokenized.

The chat is rendered by the processor's template (or the `chat_template` override) and
handed to the processor, which expands each image placeholder into the model's media
tokens. Masks are then found on those tokens by role boundaries (`role_boundaries`); for
processors of families without built-in boundaries, the masks of the rendered text are
aligned onto the expanded tokens instead. Media tokens and padding are never trained, nor is
any text the processor writes in place of a video (Qwen3-VL's `<1.0 seconds>` timestamps).
"""

from __future__ import annotations

import difflib
import io
import logging
import re
from pathlib import Path
from typing import Any

import torch
from PIL import Image

from protrain.train.data.audio import AudioReader
from protrain.train.data.config import MANAGED_PROCESSOR_KWARGS, DatasetConfig, DataSettings
from protrain.train.data.encoding import Encoded, encode_chat
from protrain.train.data.errors import DataError
from protrain.train.data.formats import ChatSample
from protrain.train.data.masks import IGNORE_INDEX, MaskSettings
from protrain.train.data.rendering import ChatRenderer, TemplateMismatch, TemplateRenderError
from protrain.train.data.role_boundaries import (
    boundaries_for,
    boundary_labels,
    media_token_ids,
)
from protrain.train.data.video import Video, VideoReader

logger = logging.getLogger("protrain.train.data")
_warned_no_offsets: set[str] = set()

_IMAGE_KEYS = ("image", "path", "url", "image_url")
_AUDIO_KEYS = ("audio", "path", "url", "audio_url")
_VIDEO_KEYS = ("video", "path", "url", "video_url")
_PLACEHOLDERS = {"image": "<image>", "audio": "<audio>"}

# Media outputs that are never per token, even when their length happens to equal the
# number of tokens (audio feature masks are as long as the audio's frames).
_MEDIA_KEYS = frozenset(
    {"input_features", "feature_attention_mask", "input_features_mask", "audio_attention_mask"}
)


def _split_placeholders(text: str, kinds: list[str]) -> str | list[dict[str, Any]]:
    """A LLaVA-style text (`<image>` / `<audio>` marking where media go) as parts; the text
    itself when it names no media of the given kinds."""
    marks = {_PLACEHOLDERS[k]: k for k in kinds}
    if not any(m in text for m in marks):
        return text
    pattern = "(" + "|".join(re.escape(m) for m in marks) + ")"
    parts: list[dict[str, Any]] = []
    for piece in re.split(pattern, text):
        if piece in marks:
            parts.append({"type": marks[piece]})
        elif piece.strip():
            parts.append({"type": "text", "text": piece})
    return parts


def _is_prefix_lm(processor) -> bool:
    """PaliGemma (1 and 2): its `token_type_ids` split a row into a prefix (0, attended
    bidirectionally: image and prompt) and a suffix (1, causal: the answer)."""
    # the config check imports this module: transformers loads where a model is built
    from transformers import PaliGemmaProcessor

    return isinstance(processor, PaliGemmaProcessor)


def prefix_lm_token_types(labels: list[int]) -> list[int]:
    """A prefix-LM row's token types: 0 before its first trained token, 1 from it on. Its
    processor marks all 0 without a `suffix`, which would let every token attend to the
    answer it is trained to predict; from the first trained token on attention is causal,
    as PaliGemma was trained (its processor's `suffix`)."""
    first = next((i for i, label in enumerate(labels) if label != IGNORE_INDEX), len(labels))
    return [0] * first + [1] * (len(labels) - first)


def processor_from_pretrained_kwargs(settings: DataSettings) -> dict[str, Any]:
    """`processor_kwargs` minus the keys the project manages itself (warned and ignored)."""
    kwargs = dict(settings.processor_kwargs)
    for key in MANAGED_PROCESSOR_KWARGS:
        if key in kwargs:
            logger.warning(
                "processor_kwargs.%s=%r is ignored: protrain sets %s itself (use the top-level key)",
                key,
                kwargs[key],
                key,
            )
            del kwargs[key]
    return kwargs


def load_processor(
    settings: DataSettings,
    name_or_path: str,
    *,
    revision: str | None = None,
    trust_remote_code: bool = False,
):
    """The processor named by `processor_type` (default: AutoProcessor) for a model."""
    # the config check imports this module: transformers loads where a model is built
    import transformers

    cls_name = settings.processor_type or "AutoProcessor"
    cls = getattr(transformers, cls_name, None)
    if cls is None or not hasattr(cls, "from_pretrained"):
        raise DataError(
            f"processor_type {cls_name!r} is not a processor class of transformers "
            "(e.g. AutoProcessor, Qwen2VLProcessor)",
            field="processor_type",
        )
    return cls.from_pretrained(
        name_or_path,
        revision=revision,
        trust_remote_code=trust_remote_code,
        **processor_from_pretrained_kwargs(settings),
    )


def _dataset_root(cfg: DatasetConfig) -> Path:
    path = Path(cfg.path).expanduser()
    return path if path.is_dir() else path.parent


class VisionEncoder:
    """Encodes chat rows with images through a processor."""

    def __init__(
        self,
        settings: DataSettings,
        cfg: DatasetConfig,
        processor,
        tokenizer,
        renderer: ChatRenderer,
        mask: MaskSettings,
    ) -> None:
        self.cfg = cfg
        self.processor = processor
        self.tokenizer = tokenizer
        self.renderer = renderer
        self.mask = mask
        self.root = _dataset_root(cfg)
        self.boundaries = boundaries_for(
            settings.role_boundaries, processor, renderer.template, tokenizer
        )
        self.never_trained = media_token_ids(tokenizer, processor)
        pad = getattr(tokenizer, "pad_token_id", None)
        if pad is not None and pad != tokenizer.eos_token_id:
            self.never_trained.add(pad)
        self.feature_extractor = getattr(processor, "feature_extractor", None)
        self.audio = AudioReader(
            cfg.path,
            self.root,
            getattr(self.feature_extractor, "sampling_rate", None),
            getattr(self.feature_extractor, "n_samples", None),
        )
        self.video_processor = getattr(processor, "video_processor", None)
        sample_frames = None
        if getattr(self.video_processor, "do_sample_frames", False):
            sample_frames = self.video_processor.sample_frames
        self.video = VideoReader(cfg.path, self.root, sample_frames)

    # --- audio --------------------------------------------------------------------------------

    def _load_audio(self, source: Any, row: int, field: str):
        if self.feature_extractor is None:
            raise DataError(
                f"audio needs a processor that takes audio; {type(self.processor).__name__} "
                "has no feature extractor",
                dataset=self.cfg.path,
                row=row,
                field=field,
            )
        return self.audio.load(source, row, field)

    # --- images -------------------------------------------------------------------------------

    def _load_image(self, source: Any, row: int, field: str):
        if isinstance(source, Image.Image):
            return source.convert("RGB")
        if isinstance(source, dict):
            if source.get("bytes"):
                return Image.open(io.BytesIO(source["bytes"])).convert("RGB")
            source = source.get("path")
        if not isinstance(source, str) or not source:
            raise DataError(
                f"an image must be a path or an image, got {type(source).__name__}",
                dataset=self.cfg.path,
                row=row,
                field=field,
            )
        if source.startswith(("http://", "https://")):
            raise DataError(
                f"image URL {source!r}: download images first; only local files are read",
                dataset=self.cfg.path,
                row=row,
                field=field,
            )
        path = Path(source).expanduser()
        if not path.is_absolute() and (self.root / path).exists():
            path = self.root / path
        if not path.exists():
            raise DataError(
                f"image file {source!r} does not exist (looked in {self.root} and the working folder)",
                dataset=self.cfg.path,
                row=row,
                field=field,
            )
        try:
            with Image.open(path) as im:
                return im.convert("RGB")
        except Exception as e:  # PIL raises several types for unreadable files
            raise DataError(
                f"cannot read image {str(path)!r}: {e}", dataset=self.cfg.path, row=row, field=field
            ) from e

    def _media_kinds(self, sample: ChatSample) -> dict[str, dict[str, Any]]:
        """Per media kind: the row's column, its field name, its part keys and its loader."""
        return {
            "image": {
                "column": list(sample.images),
                "field": self.cfg.field_images,
                "keys": _IMAGE_KEYS,
                "load": self._load_image,
                "plural": "images",
            },
            "audio": {
                "column": list(sample.audios),
                "field": self.cfg.field_audios,
                "keys": _AUDIO_KEYS,
                "load": self._load_audio,
                "plural": "audios",
            },
            "video": {  # no column: a video part names its own source
                "column": [],
                "field": None,
                "keys": _VIDEO_KEYS,
                "load": self.video.load,
                "plural": "videos",
            },
        }

    def _place_media(
        self, sample: ChatSample, row: int
    ) -> tuple[list[dict[str, Any]], list[Any], list[Any], list[Video]]:
        """Messages with bare `{"type": "image"|"audio"|"video"}` parts, and the images, audios
        and videos in their order. Every source is checked (and read) here, before tokenizing."""
        kinds = self._media_kinds(sample)
        loaded: dict[str, list[Any]] = {kind: [] for kind in kinds}
        used = {kind: 0 for kind in kinds}  # column entries taken by parts without a source
        n_parts = {kind: 0 for kind in kinds}
        messages: list[dict[str, Any]] = []
        for i, message in enumerate(sample.messages):
            content = message["content"]
            if isinstance(content, str):
                content = _split_placeholders(
                    content, [kind for kind, spec in kinds.items() if spec["column"]]
                )
            if isinstance(content, list):
                parts = []
                for j, part in enumerate(content):
                    kind = part["type"]
                    if kind not in kinds:
                        parts.append(part)
                        continue
                    if kind == "video" and self.video_processor is None:
                        raise DataError(
                            f"video needs a processor that takes video; "
                            f"{type(self.processor).__name__} has no video processor",
                            dataset=self.cfg.path,
                            row=row,
                            field=f"messages[{i}].content[{j}]",
                        )
                    spec = kinds[kind]
                    n_parts[kind] += 1
                    source = next((part[k] for k in spec["keys"] if part.get(k)), None)
                    if source is None and spec["field"] is None:
                        raise DataError(
                            f"a {kind} part needs its source ('{kind}'): a list of frame images, "
                            "a folder of frame images or a video file",
                            dataset=self.cfg.path,
                            row=row,
                            field=f"messages[{i}].content[{j}]",
                        )
                    if source is None:
                        if used[kind] >= len(spec["column"]):
                            raise DataError(
                                f"message {i} has more {kind} parts than the row has "
                                f"{spec['plural']} ({len(spec['column'])})",
                                dataset=self.cfg.path,
                                row=row,
                                field=spec["field"],
                            )
                        source = spec["column"][used[kind]]
                        field = f"{spec['field']}[{used[kind]}]"
                        used[kind] += 1
                    else:
                        field = f"messages[{i}].content[{j}]"
                    if kind == "video":
                        loaded[kind].append(self.video.load(source, row, field, part.get("fps")))
                    else:
                        loaded[kind].append(spec["load"](source, row, field))
                    parts.append({"type": kind})
                content = parts
            messages.append({**message, "content": content})
        prefix: list[dict[str, Any]] = []
        for kind, spec in kinds.items():
            column = spec["column"]
            if n_parts[kind] == 0 and column:
                loaded[kind] = [
                    spec["load"](src, row, f"{spec['field']}[{k}]") for k, src in enumerate(column)
                ]
                prefix += [{"type": kind} for _ in column]
            elif used[kind] < len(column) and n_parts[kind]:
                raise DataError(
                    f"the row has {len(column)} {spec['plural']} but its messages use {used[kind]}",
                    dataset=self.cfg.path,
                    row=row,
                    field=spec["field"],
                )
        if prefix:
            first_user = next((k for k, m in enumerate(messages) if m["role"] == "user"), None)
            if first_user is None:
                kind = prefix[0]["type"]
                raise DataError(
                    f"the row has {kinds[kind]['plural']} but no user message to put them in",
                    dataset=self.cfg.path,
                    row=row,
                    field=kinds[kind]["field"],
                )
            content = messages[first_user]["content"]
            text_parts = (
                [{"type": "text", "text": content}] if isinstance(content, str) else content
            )
            messages[first_user] = {**messages[first_user], "content": prefix + text_parts}
        return messages, loaded["image"], loaded["audio"], loaded["video"]

    # --- encoding -----------------------------------------------------------------------------

    def encode(self, sample: ChatSample, row: int) -> Encoded:
        messages, images, audios, videos = self._place_media(sample, row)
        try:
            _, text = self.renderer.prepare(messages, sample.template_kwargs)
        except TemplateRenderError as e:
            raise DataError(str(e), dataset=self.cfg.path, row=row, field="messages") from e
        call: dict[str, Any] = {"text": [text], "return_tensors": "pt", "add_special_tokens": False}
        if images:
            call["images"] = images
        if audios:
            call["audio"] = audios
            call["sampling_rate"] = self.audio.sampling_rate
        if videos:
            call["videos"] = [v.frames for v in videos]
            # Copies: Qwen3-VL's processor pads `frames_indices` in place.
            call["video_metadata"] = [
                {**v.metadata, "frames_indices": list(v.metadata["frames_indices"])} for v in videos
            ]
            call["do_sample_frames"] = False  # the frames are final (video.py)
            # Where the processor wrote each video's expansion, and where each token lies.
            call["return_text_replacement_offsets"] = True
            call["return_offsets_mapping"] = True
        try:
            out = self.processor(**call)
        except Exception as e:  # processors raise ValueError, TypeError... for bad input
            raise DataError(
                f"the processor rejected the row: {type(e).__name__}: {e}",
                dataset=self.cfg.path,
                row=row,
                field=self.cfg.field_images
                if images
                else self.cfg.field_audios
                if audios
                else "messages",
            ) from e
        token_offsets = out.pop("offset_mapping", None)
        replacements = out.pop("text_replacement_offsets", None)
        ids = out["input_ids"][0].tolist()
        if self.boundaries is not None:
            placed = ChatSample(messages, [], template_kwargs=sample.template_kwargs)
            labels = boundary_labels(
                self.renderer, placed, text, ids, self.boundaries, self.mask,
                self.never_trained, dataset=self.cfg.path, row=row,
            )  # fmt: skip
        else:
            sample = ChatSample(messages, [], template_kwargs=sample.template_kwargs)
            labels = self._aligned_labels(sample, ids, row)
        if videos:
            labels = self._untrain_video_text(labels, token_offsets, replacements)
        extras: dict[str, Any] = {}
        for key, value in out.items():
            # `labels`: PaliGemma's processor writes its own (none trained without a suffix)
            skip = key in ("input_ids", "attention_mask", "labels")
            if skip or not isinstance(value, torch.Tensor):
                continue
            if key not in _MEDIA_KEYS and value.dim() == 2 and value.shape == (1, len(ids)):
                extras[key] = value[0].tolist()  # per token, collated like input_ids
            else:
                extras[key] = value
        if "token_type_ids" in extras and _is_prefix_lm(self.processor):
            extras["token_type_ids"] = prefix_lm_token_types(labels)
        return Encoded(ids, labels, text, extras)

    def _untrain_video_text(
        self, labels: list[int], token_offsets: Any, replacements: Any
    ) -> list[int]:
        """Labels with every token of a video's expansion ignored: besides the media tokens,
        the processor may write text there (Qwen3-VL: a `<1.0 seconds>` timestamp per frame)."""
        if token_offsets is None or not replacements:
            key = type(self.processor).__name__
            if key not in _warned_no_offsets:
                _warned_no_offsets.add(key)
                logger.warning(
                    "%s does not report where it expands videos (return_text_replacement_offsets); "
                    "of a video's expansion only its media tokens are kept out of training",
                    key,
                )
            return labels
        spans = [r["new_span"] for r in replacements[0] if r["type"] == "video"]
        offsets = token_offsets[0].tolist()
        return [
            IGNORE_INDEX if any(a < end and b > start for start, end in spans) else lab
            for lab, (a, b) in zip(labels, offsets)
        ]

    def _aligned_labels(self, sample: ChatSample, ids: list[int], row: int) -> list[int]:
        """Masks of the rendered text, carried onto the expanded tokens by sequence alignment."""
        try:
            text_enc = encode_chat(sample, self.tokenizer, self.renderer, self.mask)
        except TemplateMismatch as e:
            raise e.data_error(self.cfg.path, row) from e
        labels = [IGNORE_INDEX] * len(ids)
        matcher = difflib.SequenceMatcher(None, text_enc.input_ids, ids, autojunk=False)
        for a, b, size in matcher.get_matching_blocks():
            for k in range(size):
                labels[b + k] = text_enc.labels[a + k]
        return [IGNORE_INDEX if t in self.never_trained else lab for t, lab in zip(ids, labels)]
