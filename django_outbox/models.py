"""The outbox table."""

from __future__ import annotations

from datetime import datetime
from typing import TYPE_CHECKING

from django.core.serializers.json import DjangoJSONEncoder
from django.db import models, router
from django.utils.translation import gettext_lazy as _

from .querysets import InboxMessageQuerySet, OutboxEventQuerySet
from .states import Status

if TYPE_CHECKING:
    from django.db.backends.base.base import BaseDatabaseWrapper

__all__ = [
    "AggregateSequence",
    "InboxMessage",
    "OutboxEvent",
    "OutboxTaskResult",
    "Status",
    "outbox_db",
]


class LeaseTokenField(models.CharField):
    """The lease token: ``CHAR`` on MySQL/MariaDB, where a token and no token ("") take the
    same room in the record, so that a claim (and a settle) can rewrite the row in place.

    InnoDB rewrites a record that grows by deleting and inserting it, and the outbox's pages
    are full (rows are inserted in key order): every claim split pages, 5.3 kB of redo log
    per row claimed against 0.2 kB once neither ``lease_token`` nor ``leased_until`` (see
    ``OutboxEventQuerySet.new_pending``) changes length (migration 0010). ``CHAR`` pads
    with spaces and MySQL strips them when reading, so the column still reads "" when no
    lease holds the row. Elsewhere it is the ``varchar`` of a ``CharField``: PostgreSQL's
    claim is a HOT update whatever the length.
    """

    def db_type(self, connection: BaseDatabaseWrapper) -> str | None:
        if connection.vendor == "mysql":
            return f"char({self.max_length})"
        return super().db_type(connection)


class OutboxEvent(models.Model):
    """One event written in the business transaction, relayed to the broker later."""

    id = models.BigAutoField(primary_key=True)
    event_id = models.CharField(
        _("event id"),
        max_length=64,
        help_text=_("Globally unique; the AMQP message_id consumers de-duplicate on."),
    )
    aggregate_type = models.CharField(_("aggregate type"), max_length=64, blank=True)
    aggregate_id = models.CharField(_("aggregate id"), max_length=64, blank=True)
    event_type = models.CharField(_("event type"), max_length=128)
    payload = models.JSONField(_("payload"), encoder=DjangoJSONEncoder)
    headers = models.JSONField(_("headers"), encoder=DjangoJSONEncoder, default=dict, blank=True)
    occurred_at = models.DateTimeField(_("occurred at"))
    status = models.PositiveSmallIntegerField(
        _("status"), choices=Status.choices, default=Status.PENDING
    )
    retry_count = models.PositiveIntegerField(_("retry count"), default=0)
    # An IntegerField: a PositiveIntegerField's CHECK would make adding the column scan
    # the whole table under an exclusive lock (PostgreSQL validates it on ADD COLUMN).
    replay_count = models.IntegerField(
        _("replay count"),
        default=0,
        # Kept in the schema too: during a rolling upgrade the previous release's emit()
        # inserts rows without this column.
        db_default=0,
        help_text=_(
            "How many times the event was replayed after it had been sent "
            "(manage.py outbox_requeue --status sent); sent as the x-outbox-replay header."
        ),
    )
    next_retry_time = models.DateTimeField(
        _("next retry time"),
        help_text=_(
            "When the row is next due: at once, when scheduled, or after a failed attempt."
        ),
    )
    # Not next_retry_time: the lease must change no indexed column, so that on PostgreSQL
    # the claim's UPDATE is a HOT update that writes no index entry (migration 0008).
    # Written at the INSERT too (the time of it: a lease that has run out), so that the
    # claim, which sets it, does not make the record longer (see LeaseTokenField).
    leased_until = models.DateTimeField(
        _("leased until"),
        null=True,
        blank=True,
        help_text=_(
            "While a relay holds the row: the end of its lease. Another relay may claim the "
            "row once it has passed."
        ),
    )
    lease_token = LeaseTokenField(
        _("lease token"),
        max_length=32,
        blank=True,
        default="",
        help_text=_("Identifies the relay claim holding the row; settles are fenced on it."),
    )
    last_error = models.TextField(_("last error"), blank=True, default="")
    due_at = models.DateTimeField(
        _("due at"),
        null=True,
        blank=True,
        help_text=_(
            "When the row became due: set by emit(deliver_at=, delay=) and by a requeue; "
            "empty when it was due from its creation. Staleness and the oldest PENDING age "
            "count from here, so a scheduled event waits without alarming anyone."
        ),
    )
    created_at = models.DateTimeField(_("created at"))
    updated_at = models.DateTimeField(_("updated at"), auto_now=True)
    sent_at = models.DateTimeField(_("sent at"), null=True, blank=True)

    # Not columns: what an ordered claim tells the relay about a row it claimed
    # (django_outbox.ordering, relay/runs.py). The class's defaults hold on every other row.
    #: The ``sequence`` of its aggregate's event published before it (0: none), sent as the
    #: ``previous_sequence`` header. None: not claimed as an ordered row.
    previous_sequence: int | None = None
    #: A follower in an ordered run: the id of the row before it in the run, whose confirm
    #: the relay waits for before it sends this one. None: not a follower.
    run_follows: int | None = None

    objects = OutboxEventQuerySet.as_manager()

    class Meta:
        verbose_name = _("outbox event")
        verbose_name_plural = _("outbox events")
        ordering = ("-id",)
        constraints = [
            models.UniqueConstraint(fields=["event_id"], name="django_outbox_event_id_uniq"),
        ]
        indexes = [
            # The relay's index: every scan is status = PENDING AND next_retry_time <= now.
            models.Index(fields=["status", "next_retry_time"], name="django_outbox_due_idx"),
            # The claim also has a partial index of the unsent rows by id, PostgreSQL and
            # SQLite only: migration 0005_claim_index says why it is not declared here.
            # Compensation (stale PENDING), purge (old SENT), the triage table and the
            # oldest-pending gauge all filter on status and created_at.
            models.Index(fields=["status", "created_at"], name="django_outbox_created_idx"),
            # Triage by business key, and ordered mode's per-aggregate lookups (the last
            # SENT event before a head, the PENDING events behind a dead one): status before
            # id skips the other states. (aggregate_type, aggregate_id, id) was dropped in
            # 0009: this one serves all it served, and every event paid for both.
            models.Index(
                fields=["aggregate_type", "aggregate_id", "status", "id"],
                name="django_outbox_agg_head_idx",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.event_type} {self.event_id}"

    @property
    def status_label(self) -> str:
        return str(Status(self.status).label)

    @property
    def due_since(self) -> datetime:
        """When the row became due: the Python twin of :func:`~.querysets.due_since`."""
        return self.due_at or self.created_at


def outbox_db(using: str | None = None) -> str:
    """The alias of the database that holds the outbox: ``using``, else the router's choice.

    One choice for every reader and writer: the write alias. The relay claims and settles
    there, and the figures (dashboard, gauges, ``outbox_stats``) must be read where it writes:
    a read replica lags, so it would show events as PENDING that the relay already sent,
    and the oldest PENDING age would be wrong just when someone looks at it in an incident.
    """
    return using or router.db_for_write(OutboxEvent)


class InboxMessage(models.Model):
    """An event a consumer handler has processed: the inbox style of de-duplication.

    The row is inserted in the handler's transaction, before ``handle()`` runs; a second
    delivery of the same event to the same handler hits ``django_outbox_inbox_uniq``.
    """

    id = models.BigAutoField(primary_key=True)
    handler = models.CharField(_("handler"), max_length=200)
    source_event_id = models.CharField(_("source event id"), max_length=64)
    event_type = models.CharField(_("event type"), max_length=128, blank=True)
    processed_at = models.DateTimeField(_("processed at"), auto_now_add=True)

    objects = InboxMessageQuerySet.as_manager()

    class Meta:
        verbose_name = _("inbox message")
        verbose_name_plural = _("inbox messages")
        constraints = [
            models.UniqueConstraint(
                fields=["handler", "source_event_id"], name="django_outbox_inbox_uniq"
            ),
        ]
        indexes = [
            # Purging old inbox rows filters on processed_at.
            models.Index(fields=["processed_at"], name="django_outbox_inbox_at_idx"),
        ]

    def __str__(self) -> str:
        return f"{self.handler} {self.source_event_id}"


class AggregateSequence(models.Model):
    """The last ordered event a consumer handler processed, per aggregate.

    Written in the handler's transaction by handlers that check order
    (``IdempotentHandler.out_of_order``): an event whose ``previous_sequence`` is later
    than ``last_sequence`` came before its predecessor; one at or below it came after a
    successor.
    """

    id = models.BigAutoField(primary_key=True)
    handler = models.CharField(_("handler"), max_length=200)
    aggregate_type = models.CharField(_("aggregate type"), max_length=64, blank=True)
    aggregate_id = models.CharField(_("aggregate id"), max_length=64)
    last_sequence = models.BigIntegerField(_("last sequence"))
    updated_at = models.DateTimeField(_("updated at"), auto_now=True)

    class Meta:
        verbose_name = _("aggregate sequence")
        verbose_name_plural = _("aggregate sequences")
        constraints = [
            models.UniqueConstraint(
                fields=["handler", "aggregate_type", "aggregate_id"],
                name="django_outbox_aggseq_uniq",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.handler} {self.aggregate_type}:{self.aggregate_id} @{self.last_sequence}"


class OutboxTaskResult(models.Model):
    """The result of one Django task enqueued on the outbox (``tasks_backend.py``).

    Written by the worker (``outbox_worker``), not at ``enqueue()``: the enqueue is one
    outbox row, as cheap as an ``emit()``, and until the worker takes the task
    ``get_result()`` reads its READY state from that row. The status values are Django's
    ``TaskResultStatus``, spelt out here so that the table does not depend on the tasks
    library being installed.
    """

    class TaskStatus(models.TextChoices):
        READY = "READY", _("Ready")
        RUNNING = "RUNNING", _("Running")
        FAILED = "FAILED", _("Failed")
        SUCCESSFUL = "SUCCESSFUL", _("Successful")

    #: The TaskResult's id: the task's outbox event_id.
    id = models.CharField(_("id"), max_length=64, primary_key=True)
    task_path = models.CharField(_("task path"), max_length=255)
    backend_name = models.CharField(_("backend"), max_length=100)
    queue_name = models.CharField(_("queue"), max_length=100)
    priority = models.IntegerField(_("priority"), default=0)
    args_kwargs = models.JSONField(_("arguments"), encoder=DjangoJSONEncoder, default=dict)
    run_after = models.DateTimeField(_("run after"), null=True, blank=True)
    status = models.CharField(
        _("status"), max_length=10, choices=TaskStatus.choices, default=TaskStatus.READY
    )
    enqueued_at = models.DateTimeField(_("enqueued at"))
    started_at = models.DateTimeField(_("started at"), null=True, blank=True)
    finished_at = models.DateTimeField(_("finished at"), null=True, blank=True)
    last_attempted_at = models.DateTimeField(_("last attempted at"), null=True, blank=True)
    return_value = models.JSONField(
        _("return value"), encoder=DjangoJSONEncoder, null=True, blank=True
    )
    #: One ``{"exception_class_path": ..., "traceback": ...}`` per failed attempt.
    errors = models.JSONField(_("errors"), default=list, blank=True)
    #: One worker id per attempt (``TaskResult.attempts`` is their count).
    worker_ids = models.JSONField(_("worker ids"), default=list, blank=True)
    #: Retries the worker may still schedule after this attempt's failure is decided from
    #: the task's ``max_retries`` (or the backend's MAX_RETRIES).
    max_retries = models.PositiveIntegerField(_("max retries"), default=0)
    #: The event_id of the outbox message the next attempt comes in (the task's id for the
    #: first, a new one per retry or requeue): any other delivery of the task is stale (a
    #: redelivery of an attempt already recorded) and is acknowledged without running.
    message_id = models.CharField(_("message id"), max_length=64, blank=True, default="")

    class Meta:
        verbose_name = _("task result")
        verbose_name_plural = _("task results")
        ordering = ("-enqueued_at",)
        indexes = [
            # The admin's filters and triage: FAILED tasks of a queue.
            models.Index(fields=["status", "queue_name"], name="django_outbox_task_status_idx"),
        ]

    def __str__(self) -> str:
        return f"{self.task_path} {self.id} {self.status}"
