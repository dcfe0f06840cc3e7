"""The one error the data side raises for bad input data."""

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
