"""The records a batch is decided in (messages, verdicts), and constructors for the frozen records made once or
more per message (verdicts, entries, fingerprints...)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

T = TypeVar("T")


def maker(cls: type[T]) -> Callable[..., T]:
    """A constructor of `cls` from all its field values, in field order (defaults are not filled in): the
    compiled core's `Frozen(cls)`, which makes the very objects `cls(*values)` makes at a quarter of the
    cost, or `cls` itself where the core was not built. For frozen, slotted dataclasses only."""
    try:
        import filters._native as _native
    except ImportError:  # pragma: no cover - exercised on machines without a compiler
        return cls
    made: Any = _native.Frozen(cls)
    return made  # type: ignore[no-any-return]


@dataclass(frozen=True, slots=True)
class Message:
    id: str
    text: str
    ts: float


@dataclass(frozen=True, slots=True)
class Verdict:
    """The routing decision for one message."""

    id: str
    duplicate: bool
    duplicate_of: str | None = None
    similarity: float = 0.0
    method: str | None = None

    @property
    def label(self) -> str:
        return "duplicate" if self.duplicate else "unique"


# The compiled loops make a verdict per message: from all its field values, without the __init__'s cost.
new_verdict = maker(Verdict)
