"""argparse ``type=`` functions shared by the commands: bad values fail before any work."""

from __future__ import annotations

import argparse
import re
from datetime import datetime, timedelta

from django.utils.dateparse import parse_datetime

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)?\s*$")
_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, None: 1.0}


def _whole_number(value: str, minimum: int) -> int:
    try:
        number = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a whole number") from None
    if number < minimum:
        raise argparse.ArgumentTypeError(f"{value!r} must be {minimum} or more")
    return number


def positive_int(value: str) -> int:
    return _whole_number(value, 1)


def non_negative_int(value: str) -> int:
    return _whole_number(value, 0)


def duration(value: str) -> float:
    """Seconds from ``90``, ``1.5s``, ``10m``, ``2h``, ``7d`` or ``250ms``; must be > 0."""
    match = _DURATION.match(value)
    if not match:
        raise argparse.ArgumentTypeError(
            f"{value!r} is not a duration; use seconds or a unit: 250ms, 30s, 10m, 2h, 7d"
        )
    seconds = float(match.group(1)) * _UNITS[match.group(2)]
    if seconds <= 0:
        raise argparse.ArgumentTypeError(f"{value!r} must be longer than zero")
    return seconds


def non_negative_duration(value: str) -> float:
    """A :func:`duration`, or ``0``/``0s`` for none."""
    return 0.0 if value.strip() in {"0", "0s"} else duration(value)


def days(value: str) -> float:
    """A positive number of days, e.g. ``7`` or ``3.5``."""
    try:
        number = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a number of days") from None
    if not number > 0:
        raise argparse.ArgumentTypeError(f"{value!r} must be more than 0 days")
    return number


def queue_type(value: str) -> str:
    if value not in {"quorum", "classic"}:
        raise argparse.ArgumentTypeError(f"{value!r} is not a queue type; use quorum or classic")
    return value


def port(value: str) -> int:
    number = non_negative_int(value)
    if number > 65535:
        raise argparse.ArgumentTypeError(f"{value!r} is not a TCP port (0-65535)")
    return number


def moment(value: str) -> datetime | timedelta:
    """A point in time: ISO 8601 (``2026-12-03T10:00Z``, ``2026-12-03 18:00+08:00``) or a
    :func:`duration` ago (``6h``, ``2d``), which the caller measures by the database clock."""
    if _DURATION.match(value):
        return timedelta(seconds=duration(value))
    try:
        parsed = parse_datetime(value.strip())
    except ValueError:  # well formed but not a date: 2026-13-45
        parsed = None
    if parsed is None:
        raise argparse.ArgumentTypeError(
            f"{value!r} is neither a date and time (2026-12-03T10:00Z, 2026-12-03 "
            "18:00+08:00) nor a duration ago (30m, 6h, 2d)"
        )
    return parsed
