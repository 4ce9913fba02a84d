"""The periodic jobs as Celery tasks: publish one pass, compensate, purge.

Each task is a thin wrapper around the engine its management command uses
(:class:`~django_outbox.relay.Relay`, :meth:`Relay.compensator
<django_outbox.relay.Relay.compensator>`, :func:`~django_outbox.purge.purge`), registered
with ``shared_task`` so ``app.autodiscover_tasks()`` finds it in this app's ``tasks``
module. :func:`django_outbox.celery.beat_schedule` schedules them.

**Overlapping runs.** A run first takes a database lock named after the job
(:func:`django_outbox.db.job_lock`: ``pg_try_advisory_lock`` on PostgreSQL, ``GET_LOCK``
on MySQL/MariaDB) and, if another job holds it, returns at once with ``skipped``. The
database is the one thing every worker already shares, so no shared cache is needed; the
lock belongs to the job's connection, so a worker that dies releases it with its
connection, and there is no expiry to guess (a cache lock that expires before a long purge
ends lets a second purge start; one that outlives a crashed worker blocks the job).

**Several databases.** Each task takes ``database`` (an alias, default the router's choice
for the outbox), like the commands' ``--database``; ``beat_schedule(databases=[...])``
schedules one entry per alias. The lock is per database, so the aliases' runs never skip
each other.

A run that finds the broker unreachable raises :class:`~django_outbox.relay.BrokerOutage`
(an expected error: the task fails without a traceback); its claimed rows were released
without counting an attempt, and the next tick tries again.
"""

from __future__ import annotations

import logging
from typing import Any

from celery import shared_task

from .celery import COMPENSATE_TASK, PUBLISH_TASK, PURGE_TASK
from .db import job_lock
from .models import outbox_db
from .purge import purge as purge_rows
from .relay import BrokerOutage, PassResult, Relay

logger = logging.getLogger("django_outbox.tasks")

SKIPPED = "skipped"


def _pass_summary(result: PassResult) -> dict[str, Any]:
    return {
        "found": result.found,
        "sent": result.sent,
        "failed": result.failed,
        "dead": result.dead,
        "batches": result.batches,
    }


def _skipped(job: str) -> dict[str, Any]:
    logger.info("%s: another run holds the lock; skipped", job)
    return {SKIPPED: True}


def _drain(relay: Relay, job: str, max_events: int | None = None) -> dict[str, Any]:
    with job_lock(job, relay.using) as held:
        if not held:
            return _skipped(job)
        result = relay.drain(max_events=max_events)
    logger.info("%s: %s", job, result.summary())
    return _pass_summary(result)


@shared_task(name=PUBLISH_TASK, throws=(BrokerOutage,))
def publish(
    *, batch_size: int | None = None, max_events: int | None = None, database: str | None = None
) -> dict[str, Any]:
    """One relay pass, like ``publish_outbox --once``: drain what is due, then return."""
    return _drain(Relay(batch_size=batch_size, using=database), "publish", max_events)


@shared_task(name=COMPENSATE_TASK, throws=(BrokerOutage,))
def compensate(
    *,
    stale_after: float | None = None,
    max_batch: int | None = None,
    database: str | None = None,
) -> dict[str, Any]:
    """One compensation pass, like ``compensate_outbox``: stale PENDING rows, at most
    ``max_batch`` (OUTBOX_COMPENSATE_MAX_BATCH)."""
    relay = Relay.compensator(stale_after=stale_after, max_batch=max_batch, using=database)
    return _drain(relay, "compensate")


@shared_task(name=PURGE_TASK)
def purge(
    *,
    older_than_days: float | None = None,
    batch_size: int | None = None,
    include_dead: bool | None = None,
    database: str | None = None,
) -> dict[str, Any]:
    """Delete old SENT rows and old inbox rows in batches, like ``purge_outbox`` (same
    settings)."""
    using = outbox_db(database)
    with job_lock("purge", using) as held:
        if not held:
            return _skipped("purge")
        result = purge_rows(
            older_than_days=older_than_days,
            batch_size=batch_size,
            include_dead=include_dead,
            using=using,
        )
    for warning in result.warnings:
        logger.warning("purge: %s", warning)
    logger.info("%s", result.summary())
    return {
        "sent": result.sent,
        "dead": result.dead,
        "batches": result.batches,
        "inbox": result.inbox,
    }
