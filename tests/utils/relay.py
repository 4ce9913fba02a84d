"""The relay under test."""

from __future__ import annotations

from typing import Any

from django_outbox.backends import locmem
from django_outbox.relay import Relay


def make_relay(**kwargs: Any) -> Relay:
    """A Relay that publishes to a fresh locmem backend unless the test gives a backend."""
    kwargs.setdefault("backend", locmem.LocmemBackend())
    return Relay(**kwargs)
