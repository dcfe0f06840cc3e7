"""The one error the data side raises for bad input data, and where text is not UTF-8."""

from __future__ import annotations


class DataError(ValueError):
    """A dataset file or row cannot be used.

    The message is one line naming the dataset, the row index and the field, so that the CLI
    can print it as is and exit non-zero.
    """

    def __init__(
        self,
        message: str,
        *,
        dataset: str | None = None,
        row: int | None = None,
        field: str | None = None,
    ) -> None:
        self.dataset = dataset
        self.row = row
        self.field = field
        message = " ".join(message.splitlines())  # one line, whatever the cause says
        self.reason = message
        where = []
        if dataset is not None:
            where.append(f"dataset {dataset!r}")
        if row is not None:
            where.append(f"row {row}")
        if field is not None:
            where.append(f"field {field!r}")
        prefix = ", ".join(where)
        super().__init__(f"{prefix}: {message}" if prefix else message)


def not_utf8_place(data: bytes, exc: UnicodeDecodeError) -> str:
    """Where bytes stop being UTF-8, as an editor shows it: line, column and the byte."""
    line = data.count(b"\n", 0, exc.start) + 1
    column = exc.start - (data.rfind(b"\n", 0, exc.start) + 1) + 1
    return f"line {line}, column {column}: byte 0x{data[exc.start]:02x} ({exc.reason})"
