"""Settings of the CLI and the worker: durations, and (growing) the layered configuration."""

from __future__ import annotations

import re

from filters.errors import ConfigError

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d|w)?\s*$")
_UNIT = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 604800.0, None: 1.0}


def parse_duration(text: str | float | int) -> float:
    """'90s', '30m', '12h', '7d', '1.5h' or plain seconds → seconds."""
    if isinstance(text, int | float) and not isinstance(text, bool):
        seconds = float(text)
    else:
        m = _DURATION.match(str(text))
        if not m:
            raise ConfigError(f"not a duration: {text!r} (use e.g. 90s, 30m, 12h, 7d)")
        seconds = float(m.group(1)) * _UNIT[m.group(2)]
    if seconds <= 0:
        raise ConfigError(f"duration must be positive: {text!r}")
    return seconds
