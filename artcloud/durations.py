"""Durations, one rule everywhere: a string with its unit ("90s", "15m", "8h", "1d"), a `timedelta`, or a number
of seconds (Python's convention, as `asyncio.sleep` and `httpx.Timeout`). Never minutes: a string without a unit
is refused, since it read as minutes before 0.2."""

from __future__ import annotations

import datetime as _dt
import math
import re

from artcloud.errors import InvalidArgument

_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_PATTERN = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*$", re.IGNORECASE)


def parse_duration(value: str | int | float | _dt.timedelta, *, what: str = "duration") -> float:
    """Seconds, from "90s"/"15m"/"8h"/"1d", a timedelta, or a number of seconds."""
    if isinstance(value, _dt.timedelta):
        seconds = value.total_seconds()
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        seconds = float(value)
    else:
        match = _PATTERN.match(str(value))
        if match is None:
            raise InvalidArgument(f"{what} {value!r} is not a duration: write e.g. 90s, 15m, 8h or 1d",
                                  field=_field(what))
        if not match.group(2):
            number = match.group(1)
            raise InvalidArgument(f"{what} {value!r} needs a unit: write {number}m for minutes or {number}s for "
                                  "seconds", field=_field(what))
        seconds = float(match.group(1)) * _UNITS[match.group(2).lower()]
    if not math.isfinite(seconds) or seconds <= 0:  # nan and inf pass `<= 0` (code review 3, R8)
        raise InvalidArgument(f"{what} must be a positive, finite duration, not {value!r}", field=_field(what))
    return seconds


def _field(what: str) -> str:
    return what.lstrip("-").replace("-", "_")


def format_duration(seconds: float) -> str:
    """Short and human: 45s, 12m, 3h05m, 2d04h."""
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    minutes, _ = divmod(seconds, 60)
    if minutes < 60:
        return f"{minutes}m"
    hours, minutes = divmod(minutes, 60)
    if hours < 24:
        return f"{hours}h{minutes:02d}m"
    days, hours = divmod(hours, 24)
    return f"{days}d{hours:02d}h"
