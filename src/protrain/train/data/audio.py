"""Audio of chat rows: WAV files read with the standard library, as the processor wants them.

A source is a path (relative to the dataset file, or absolute), `{"path": ...}`,
`{"bytes": ...}` (a WAV file's bytes) or `{"array": [...], "sampling_rate": N}` (decoded
samples, as `datasets` hands them over). Files are read with the standard library's `wave`
module: PCM WAV of 8, 16, 24 or 32 bits, any number of channels (averaged to mono). Other
formats (FLAC, MP3, float WAV) are a `DataError` that says to convert them.

Nothing is resampled: a file whose rate is not the one the processor's feature extractor
requires is a `DataError` naming both rates (convert it first, e.g.
`ffmpeg -i in.wav -ar 16000 out.wav`), so that no silent, lower-quality resampling happens
inside training. Audio longer than the feature extractor's window (Whisper's `n_samples`,
30 s for Qwen2-Audio) is a `DataError` too: the processor would cut it silently.
"""

from __future__ import annotations

import io
import wave
from pathlib import Path
from typing import Any

import numpy as np

from protrain.train.data.errors import DataError


def _pcm_to_float(frames: bytes, width: int, channels: int) -> np.ndarray:
    """Interleaved PCM frames as float32 mono samples in [-1, 1]."""
    if width == 1:  # 8-bit WAV is unsigned
        data = (np.frombuffer(frames, dtype=np.uint8).astype(np.float32) - 128.0) / 128.0
    elif width == 2:
        data = np.frombuffer(frames, dtype="<i2").astype(np.float32) / 32768.0
    elif width == 3:
        raw = np.frombuffer(frames, dtype=np.uint8).reshape(-1, 3).astype(np.int32)
        value = raw[:, 0] | (raw[:, 1] << 8) | (raw[:, 2] << 16)
        value = np.where(value >= 1 << 23, value - (1 << 24), value)
        data = value.astype(np.float32) / float(1 << 23)
    elif width == 4:
        data = np.frombuffer(frames, dtype="<i4").astype(np.float32) / float(1 << 31)
    else:
        raise ValueError(f"unsupported sample width of {width} bytes")
    if channels > 1:
        data = data.reshape(-1, channels).mean(axis=1)
    return np.ascontiguousarray(data, dtype=np.float32)


def read_wav(file: str | Path | io.BytesIO) -> tuple[np.ndarray, int]:
    """Float32 mono samples and the sampling rate of a PCM WAV file."""
    with wave.open(file if isinstance(file, io.BytesIO) else str(file), "rb") as w:
        frames = w.readframes(w.getnframes())
        return _pcm_to_float(frames, w.getsampwidth(), w.getnchannels()), w.getframerate()


class AudioReader:
    """Reads the audio of one dataset's rows at the rate the processor requires."""

    def __init__(
        self, dataset: str, root: Path, sampling_rate: int | None, max_samples: int | None = None
    ) -> None:
        self.dataset = dataset
        self.root = root
        self.sampling_rate = sampling_rate
        self.max_samples = max_samples  # the feature extractor's window (Whisper: 30 s)

    def _error(self, message: str, row: int, field: str) -> DataError:
        return DataError(message, dataset=self.dataset, row=row, field=field)

    def resolve(self, source: Any, row: int, field: str) -> Path | None:
        """The file of a path source (checked to exist); None for in-memory sources."""
        if isinstance(source, dict):
            if source.get("bytes") or source.get("array") is not None:
                return None
            source = source.get("path")
        if not isinstance(source, str) or not source:
            raise self._error(
                "an audio must be a path, {'path': ...}, {'bytes': ...} or "
                f"{{'array': ..., 'sampling_rate': ...}}, got {type(source).__name__}",
                row,
                field,
            )
        if source.startswith(("http://", "https://")):
            raise self._error(
                f"audio URL {source!r}: download audio files first; only local files are read",
                row,
                field,
            )
        path = Path(source).expanduser()
        if not path.is_absolute() and (self.root / path).exists():
            path = self.root / path
        if not path.exists():
            raise self._error(
                f"audio file {source!r} does not exist (looked in {self.root} and the working folder)",
                row,
                field,
            )
        return path

    def load(self, source: Any, row: int, field: str) -> np.ndarray:
        path = self.resolve(source, row, field)
        if path is None and isinstance(source, dict) and source.get("array") is not None:
            rate = source.get("sampling_rate")
            if not isinstance(rate, int):
                raise self._error("an audio array needs an integer 'sampling_rate'", row, field)
            samples = np.asarray(source["array"], dtype=np.float32)
            if samples.ndim != 1:
                raise self._error(
                    f"an audio array must be 1-D (mono), got shape {samples.shape}", row, field
                )
            where = "the audio array"
        else:
            file = io.BytesIO(source["bytes"]) if path is None else path
            where = "the audio bytes" if path is None else f"audio file {str(path)!r}"
            try:
                samples, rate = read_wav(file)
            except (wave.Error, EOFError, ValueError) as e:
                raise self._error(
                    f"cannot read {where} as PCM WAV ({e}); only 8/16/24/32-bit PCM WAV is "
                    "read: convert other formats first (e.g. ffmpeg -i in.flac -c:a pcm_s16le "
                    "out.wav)",
                    row,
                    field,
                ) from e
        if self.sampling_rate is not None and rate != self.sampling_rate:
            raise self._error(
                f"{where} has {rate} Hz; the processor requires {self.sampling_rate} Hz and "
                f"protrain does not resample: convert it first (e.g. ffmpeg -i in.wav -ar "
                f"{self.sampling_rate} out.wav)",
                row,
                field,
            )
        if samples.size == 0:
            raise self._error(f"{where} has no samples", row, field)
        if self.max_samples is not None and samples.size > self.max_samples:
            raise self._error(
                f"{where} is {samples.size / rate:.2f} s long; the processor's window is "
                f"{self.max_samples / rate:.2f} s and would cut it: split it first",
                row,
                field,
            )
        return samples
