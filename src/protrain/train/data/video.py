"""Video of chat rows: frames read as the processor wants them.

A video part (`{"type": "video", "video"|"path": ...}`) gives its frames as
- a list of frame images (paths relative to the dataset file or absolute, or PIL images), in
  order;
- a folder of frame images (.png, .jpg, .jpeg, .webp, .bmp), in natural name order (`f2`
  before `f10`);
- a video file (.mp4, .webm, ...), decoded through transformers' `load_video` where a decoder
  is installed (PyAV, decord, torchcodec, OpenCV); without one it is a `DataError` that says to
  give frames instead.

Frames given as images are used as given, none dropped; the part's `fps` (default 2.0, the
rate qwen-vl-utils assumes for frame lists) is the rate they were taken at, which Qwen2.5-VL
(temporal positions) and Qwen3-VL (timestamps in the text) use. A video file is sampled when
it is read, by the video processor's own `sample_frames` where its `do_sample_frames` is on,
and keeps the file's rate. Either way the frames handed to the processor are final.
"""

from __future__ import annotations

import importlib.util
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from protrain.train.data.errors import DataError

FRAME_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp")
DEFAULT_FRAMES_FPS = 2.0
ALLOWED = (
    "a video must be a list of frame images, a folder of frame images, or a video file "
    "(read only where PyAV, decord, torchcodec or OpenCV is installed)"
)

# transformers' `load_video` backends, by the module each needs, in order of preference.
_DECODERS = (("av", "pyav"), ("decord", "decord"), ("torchcodec", "torchcodec"), ("cv2", "opencv"))


def video_decoder() -> str | None:
    """The `load_video` backend that can decode video files here, or None."""
    for module, backend in _DECODERS:
        if importlib.util.find_spec(module) is not None:
            return backend
    return None


@dataclass
class Video:
    """Final frames of one video and the metadata the processor reads (its `video_metadata`)."""

    frames: np.ndarray  # (frames, height, width, 3), uint8 RGB
    metadata: dict[str, Any]  # total_num_frames, fps, frames_indices, height, width, duration


def _natural_key(name: str) -> list[Any]:
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)]


class VideoReader:
    """Reads the videos of one dataset's rows.

    `sample_indices(metadata=...)` picks the frames of a video file (the video processor's
    `sample_frames`); None keeps every frame.
    """

    def __init__(
        self,
        dataset: str,
        root: Path,
        sample_indices: Callable[..., Any] | None = None,
    ) -> None:
        self.dataset = dataset
        self.root = root
        self.sample_indices = sample_indices

    def _error(self, message: str, row: int, field: str) -> DataError:
        return DataError(message, dataset=self.dataset, row=row, field=field)

    def _path(self, source: str, what: str, row: int, field: str) -> Path:
        if source.startswith(("http://", "https://")):
            raise self._error(
                f"{what} URL {source!r}: download it first; only local files are read", row, field
            )
        path = Path(source).expanduser()
        if not path.is_absolute() and (self.root / path).exists():
            path = self.root / path
        if not path.exists():
            raise self._error(
                f"{what} {source!r} does not exist (looked in {self.root} and the working folder)",
                row,
                field,
            )
        return path

    def load(self, source: Any, row: int, field: str, fps: Any = None) -> Video:
        """The video of a part's source; `fps` is the part's own (frame images only)."""
        if isinstance(source, dict):
            source = source.get("path")
        if isinstance(source, str) and source:
            path = self._path(source, "video", row, field)
            if path.is_dir():
                frames = sorted(
                    (p for p in path.iterdir() if p.suffix.lower() in FRAME_SUFFIXES),
                    key=lambda p: _natural_key(p.name),
                )
                if not frames:
                    raise self._error(
                        f"video folder {source!r} holds no frame images ({', '.join(FRAME_SUFFIXES)})",
                        row,
                        field,
                    )
                return self.from_frames([str(p) for p in frames], row, field, fps)
            if fps is not None:
                raise self._error(
                    "'fps' is for frame images; a video file's rate is read from the file",
                    row,
                    field,
                )
            return self.from_file(path, row, field)
        if isinstance(source, (list, tuple)):
            return self.from_frames(list(source), row, field, fps)
        raise self._error(f"{ALLOWED}; got {type(source).__name__}", row, field)

    def from_frames(self, sources: list[Any], row: int, field: str, fps: Any = None) -> Video:
        if not sources:
            raise self._error("a video needs at least one frame", row, field)
        if fps is None:
            fps = DEFAULT_FRAMES_FPS
        if isinstance(fps, bool) or not isinstance(fps, (int, float)) or fps <= 0:
            raise self._error(f"'fps' must be a positive number, got {fps!r}", row, field)
        frames = []
        for k, source in enumerate(sources):
            if isinstance(source, Image.Image):
                frames.append(np.asarray(source.convert("RGB")))
                continue
            if not isinstance(source, str) or not source:
                raise self._error(
                    f"video frame {k} must be an image path or an image, got "
                    f"{type(source).__name__}; {ALLOWED}",
                    row,
                    field,
                )
            path = self._path(source, f"video frame {k}", row, field)
            try:
                with Image.open(path) as im:
                    frames.append(np.asarray(im.convert("RGB")))
            except Exception as e:  # PIL raises several types for unreadable files
                raise self._error(
                    f"cannot read video frame {k} {str(path)!r}: {e}", row, field
                ) from e
            if frames[-1].shape != frames[0].shape:
                h0, w0 = frames[0].shape[:2]
                h, w = frames[-1].shape[:2]
                raise self._error(
                    f"video frames differ in size: frame 0 is {w0}x{h0}, frame {k} is {w}x{h}",
                    row,
                    field,
                )
        n = len(frames)
        return Video(
            np.stack(frames),
            {
                "total_num_frames": n,
                "fps": float(fps),
                "frames_indices": list(range(n)),
                "height": int(frames[0].shape[0]),
                "width": int(frames[0].shape[1]),
                "duration": n / float(fps),
            },
        )

    def from_file(self, path: Path, row: int, field: str) -> Video:
        backend = video_decoder()
        if backend is None:
            raise self._error(
                f"video file {str(path)!r} cannot be decoded: no video decoder is installed "
                "(PyAV, decord, torchcodec or OpenCV); give the video as a list of frame images "
                "or a folder of frame images instead",
                row,
                field,
            )
        # the config check imports this module: transformers loads where a model is built
        from transformers.video_utils import load_video

        sample = self.sample_indices or (
            lambda metadata, **_: np.arange(metadata.total_num_frames, dtype=int)
        )
        try:
            frames, meta = load_video(str(path), backend=backend, sample_indices_fn=sample)
        except Exception as e:  # decoders raise their own types for broken files
            raise self._error(
                f"cannot decode video file {str(path)!r} with {backend}: {type(e).__name__}: {e}",
                row,
                field,
            ) from e
        frames = np.asarray(frames)
        if frames.ndim != 4 or frames.shape[0] == 0:
            raise self._error(f"video file {str(path)!r} gave no frames ({backend})", row, field)
        indices = meta.frames_indices
        return Video(
            frames,
            {
                "total_num_frames": int(meta.total_num_frames),
                "fps": None if meta.fps is None else float(meta.fps),
                "frames_indices": [int(i) for i in indices]
                if indices is not None
                else list(range(len(frames))),
                "height": int(frames.shape[1]),
                "width": int(frames.shape[2]),
                "duration": meta.duration,
            },
        )
