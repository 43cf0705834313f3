"""Errors of registration (``ba-schema register``): a new version the table's
compatibility mode refuses. Messages carry the offending value and say what to change."""

from __future__ import annotations

from blockagg.proto.exceptions import CompatibilityError


class IncompatibleSchema(CompatibilityError):
    """A new version breaks the table's compatibility mode; ``differences`` lists
    every rule broken (:class:`registration.compat.Difference`), one sentence each."""

    def __init__(self, table: str, mode: str, differences: list[str]) -> None:
        self.table = table
        self.mode = mode
        self.differences = list(differences)
        lines = "\n".join(f"  - {d}" for d in self.differences)
        super().__init__(
            f"{table}: the new version is not {mode} compatible ({len(self.differences)} "
            f"difference(s)):\n{lines}\nfix the message type, change the table's mode with "
            f"ba-schema compatibility {table} MODE, or override once with "
            "--force-incompatible")
