"""The compatibility modes a table is registered with, as Confluent Schema Registry
names them: plain names the registry's read side needs (a registration stores its
mode as text, :attr:`proto.registry.Registration.mode` parses it). The judgment a mode
asks for (:func:`registration.compat.check`) is made above the rows stage, since it
looks at how each field becomes a column.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Final

from blockagg.proto.exceptions import UnknownMode


class Direction(StrEnum):
    """Which version reads which: ``BACKWARD`` = the new version reads the previous
    one's data; ``FORWARD`` = the previous version reads the new one's."""

    BACKWARD = "BACKWARD"
    FORWARD = "FORWARD"


class Mode(StrEnum):
    BACKWARD = "BACKWARD"
    BACKWARD_TRANSITIVE = "BACKWARD_TRANSITIVE"
    FORWARD = "FORWARD"
    FORWARD_TRANSITIVE = "FORWARD_TRANSITIVE"
    FULL = "FULL"
    FULL_TRANSITIVE = "FULL_TRANSITIVE"
    NONE = "NONE"

    @property
    def directions(self) -> tuple[Direction, ...]:
        base = self.value.removesuffix("_TRANSITIVE")
        if base == "NONE":
            return ()
        if base == "FULL":
            return (Direction.BACKWARD, Direction.FORWARD)
        return (Direction(base),)

    @property
    def transitive(self) -> bool:
        return self.value.endswith("_TRANSITIVE")


DEFAULT_MODE: Final = Mode.BACKWARD


def parse_mode(text: str) -> Mode:
    """The mode named ``text`` (any case; empty = :data:`DEFAULT_MODE`, which is how
    registrations written before modes existed read)."""
    if not text:
        return DEFAULT_MODE
    try:
        return Mode(text.strip().upper())
    except ValueError:
        raise UnknownMode(f"unknown compatibility mode {text!r}; use one of "
                          f"{', '.join(m.value for m in Mode)}") from None
