"""The one error type that workloads raises for bad input files and bad parameters."""

from __future__ import annotations

_MAX_VALUE_CHARS = 60  # long values (a whole JSON line, a hash-id list) are shortened


class TraceError(ValueError):
    """A trace file or a workload parameter is invalid.

    Carries where the problem is, so the CLI can print one line naming it:
    `path` (the file), `line` (1-based physical line, the header being line 1 in CSV files),
    `column` (the column or JSON key, or the flag: "--first-n") and `value` (the offending
    text or number).
    Any of them may be None when it does not apply (e.g. a bad parameter has no line).
    """

    def __init__(
        self,
        message: str,
        *,
        path: str | None = None,
        line: int | None = None,
        column: str | None = None,
        value: object = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.path = path
        self.line = line
        self.column = column
        self.value = value

    def __str__(self) -> str:
        where = ""
        if self.path is not None:
            where = self.path if self.line is None else f"{self.path}:{self.line}"
        elif self.line is not None:
            where = f"line {self.line}"
        parts = [where] if where else []
        if self.column is not None:  # a flag ("--time-scale") is named as one, bare
            parts.append(self.column if self.column.startswith("--")
                         else f"column {self.column!r}")
        if self.value is not None:
            parts.append(f"value {_short(self.value)}")
        parts.append(self.message)
        return ": ".join(parts)

    def at(self, path: str | None, line: int | None = None) -> TraceError:
        """A copy located in file `path` at `line` (a given line wins over the stored one)."""
        return TraceError(self.message, path=path, line=self.line if line is None else line,
                          column=self.column, value=self.value)


def _short(value: object) -> str:
    text = repr(value)
    if len(text) > _MAX_VALUE_CHARS:
        text = text[: _MAX_VALUE_CHARS - 3] + "..."
    return text
