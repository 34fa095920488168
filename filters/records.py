"""Constructors for the frozen records made once or more per message (verdicts, entries, fingerprints...)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


def maker(cls: type[T]) -> Callable[..., T]:
    """A constructor of `cls` from all its field values, in field order (defaults are not filled in): the
    compiled core's `Frozen(cls)`, which makes the very objects `cls(*values)` makes at a quarter of the
    cost, or `cls` itself where the core was not built. For frozen, slotted dataclasses only."""
    try:
        from filters import _native
    except ImportError:  # pragma: no cover - exercised on machines without a compiler
        return cls
    made: Any = _native.Frozen(cls)
    return made  # type: ignore[no-any-return]
