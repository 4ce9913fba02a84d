"""An outbox in several databases: one relay per alias, each publishing only its own events.

tests/settings.py adds the alias ``other`` (same server as ``default`` with ``_other`` in the
database's names, or ``OTHER_DATABASE_URL``): PostgreSQL + PostgreSQL, MariaDB + MariaDB,
PostgreSQL + MariaDB, or two SQLite files. Only the tests marked with ``BOTH`` touch it.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from django.core.checks import Warning as CheckWarning
from django.core.management import call_command
from django.core.management.base import CommandError
from django.db import connections, transaction
from django.test import override_settings
from django.urls import reverse
from prometheus_client import CollectorRegistry

from django_outbox import counting, metrics, outbox, stats
from django_outbox.backends.locmem import LocmemBackend
from django_outbox.celery import beat_schedule
from django_outbox.checks import Codes, check_outbox_aliases
from django_outbox.exceptions import NotInTransaction
from django_outbox.models import OutboxEvent, Status
from django_outbox.relay import Relay
from django_outbox.relay.wake import PostgresNotifyWaker, make_waker
from orders.models import Order
from tests.faults.harness import Processes
from tests.utils.amqp import Broker
from tests.utils.rows import make_events
from tests.utils.waiting import wait_for

BOTH = ["default", "other"]
COMMANDS = [
    "publish_outbox",
    "compensate_outbox",
    "purge_outbox",
    "outbox_stats",
    "outbox_requeue",
    "outbox_check",
]


class OtherRouter:
    """Routes the outbox to ``other``; ``migrate_there`` says whether migrate may create it."""

    migrate_there = True

    def db_for_write(self, model, **hints):
        return "other" if model._meta.app_label == "django_outbox" else None

    db_for_read = db_for_write

    def allow_migrate(self, db, app_label, **hints):
        if app_label == "django_outbox":
            return db == "other" and self.migrate_there
        return None


class UnmigratedRouter(OtherRouter):
    migrate_there = False


class TypoRouter(OtherRouter):
    def db_for_write(self, model, **hints):
        return "otehr" if model._meta.app_label == "django_outbox" else None


def emit_in(using: str, n: int, event_type: str = "MULTI") -> set[str]:
    """``n`` events committed in database ``using``; their event ids."""
    ids = set()
    with outbox.atomic(using=using) as box:
        for i in range(n):
            ids.add(box.emit(event_type, payload={"i": i, "db": using}).event_id)
    return ids


def emit_in_a_thread(using: str) -> None:
    try:
        emit_in(using, 1)
    finally:
        connections.close_all()  # this thread's: the test database is dropped at the end


def statuses(using: str) -> dict[int, int]:
    counts: dict[int, int] = {}
    for status in OutboxEvent.objects.using(using).values_list("status", flat=True):
        counts[status] = counts.get(status, 0) + 1
    return counts


# -- the relays ------------------------------------------------------------------------------


@pytest.fixture
def procs(tmp_path: Path, broker: Broker) -> Iterator[Processes]:
    p = Processes(tmp_path, broker)
    yield p
    p.cleanup()


@pytest.mark.django_db(transaction=True, databases=BOTH)
def test_each_relay_publishes_only_its_own_database_exactly_once(procs, broker):
    """Two publish_outbox processes, --database other and --database default, on the real
    RabbitMQ: each takes only its database's rows, and every event arrives once."""
    broker.bind_all()
    mine = {"default": emit_in("default", 40), "other": emit_in("other", 25)}

    other = procs.relay("--database", "other", name="relay-other")
    assert wait_for(lambda: statuses("other") == {Status.SENT: 25}, timeout=60), procs.tails()
    # The relay of "other" left the default database alone.
    assert statuses("default") == {Status.PENDING: 40}

    default = procs.relay("--database", "default", name="relay-default")
    more = emit_in("other", 5, "MULTI_LATE")  # while both run
    assert wait_for(lambda: statuses("default") == {Status.SENT: 40}, timeout=60), procs.tails()
    assert wait_for(lambda: statuses("other") == {Status.SENT: 30}, timeout=60), procs.tails()
    assert other.stop() == 0, other.tail()
    assert default.stop() == 0, default.tail()

    received = broker.collect()
    expected = mine["default"] | mine["other"] | more
    assert set(received) == expected
    assert [n for n in received.values() if n != 1] == []
    assert other.summary()["sent"] == 30
    assert default.summary()["sent"] == 40


@pytest.mark.django_db(transaction=True, databases=BOTH)
def test_compensate_and_purge_work_on_the_alias_given(procs, broker):
    broker.bind_all()
    stale = make_events({"age": 900}, {"age": 900}, using="other")
    make_events({"age": 900}, using="default")
    run = procs.run("compensate_outbox", "--database", "other")
    assert run.popen.returncode == 0, run.tail()
    assert statuses("other") == {Status.SENT: 2}
    assert statuses("default") == {Status.PENDING: 1}
    assert set(broker.collect()) == {row.event_id for row in stale}

    make_events({"status": Status.SENT, "age": 30 * 86400}, using="other")
    make_events({"status": Status.SENT, "age": 30 * 86400}, using="default")
    run = procs.run("purge_outbox", "--database", "other")
    assert run.popen.returncode == 0, run.tail()
    assert OutboxEvent.objects.using("other").count() == 2  # the two compensated, recent
    assert OutboxEvent.objects.using("default").count() == 2


@pytest.mark.django_db(transaction=True, databases=BOTH)
def test_relay_counters_carry_the_database_label():
    emit_in("other", 3, "LABELLED")
    emit_in("default", 1, "LABELLED")

    def published(database: str) -> float:
        from prometheus_client import REGISTRY

        labels = {"event_type": "LABELLED", "job": "publish", "database": database}
        return REGISTRY.get_sample_value("django_outbox_events_published_total", labels) or 0

    before = {alias: published(alias) for alias in BOTH}
    result = Relay(backend=LocmemBackend(), using="other", db_thread=False).drain()
    assert result.sent == 3
    assert published("other") - before["other"] == 3
    assert published("default") == before["default"]
    assert statuses("default") == {Status.PENDING: 1}


@pytest.mark.django_db(databases=BOTH)
def test_gauges_are_labelled_per_database():
    make_events({}, {}, {"status": Status.DEAD}, using="other")
    make_events({}, using="default")
    assert stats.outbox_databases() == BOTH
    registry = CollectorRegistry()
    registry.register(metrics.OutboxCollector())

    def sample(name: str, database: str) -> float | None:
        return registry.get_sample_value(name, {"database": database})

    assert sample("django_outbox_pending_events", "other") == 2
    assert sample("django_outbox_dead_events", "other") == 1
    assert sample("django_outbox_pending_events", "default") == 1
    assert sample("django_outbox_database_up", "other") == 1
    # a relay's --metrics-port reports its own database only
    only = CollectorRegistry()
    only.register(metrics.OutboxCollector(using="other"))
    assert only.get_sample_value("django_outbox_pending_events", {"database": "default"}) is None
    assert only.get_sample_value("django_outbox_pending_events", {"database": "other"}) == 2


@pytest.mark.django_db(databases=BOTH)
def test_outbox_databases_setting_pins_the_list(settings):
    settings.OUTBOX_DATABASES = ["other"]
    assert stats.outbox_databases() == ["other"]
    settings.OUTBOX_DATABASES = ["other", "default"]
    registry = CollectorRegistry()
    registry.register(metrics.OutboxCollector())
    assert registry.get_sample_value("django_outbox_database_up", {"database": "default"}) == 1


@pytest.mark.django_db(databases=BOTH)
def test_outbox_stats_reads_the_alias_given(capsys):
    make_events({}, {}, {}, using="other")
    call_command("outbox_stats", "--json", "--database", "other")
    assert '"pending": 3' in capsys.readouterr().out
    call_command("outbox_stats", "--json", "--database", "default")
    assert '"pending": 0' in capsys.readouterr().out


@pytest.mark.django_db(transaction=True, databases=BOTH)
def test_celery_tasks_and_beat_take_the_alias(settings):
    from django_outbox import tasks

    settings.OUTBOX_BACKEND = "django_outbox.backends.locmem.LocmemBackend"
    emit_in("other", 2)
    emit_in("default", 1)
    assert tasks.publish.apply(kwargs={"database": "other"}).get()["sent"] == 2
    assert statuses("default") == {Status.PENDING: 1}
    make_events({"status": Status.SENT, "age": 30 * 86400}, using="other")
    assert tasks.purge.apply(kwargs={"database": "other"}).get()["sent"] == 1

    schedule = beat_schedule(databases=BOTH)
    assert sorted(schedule) == [
        "outbox-compensate@default",
        "outbox-compensate@other",
        "outbox-purge@default",
        "outbox-purge@other",
    ]
    assert schedule["outbox-purge@other"]["kwargs"] == {"database": "other"}
    assert schedule["outbox-purge@other"]["task"] == "django_outbox.purge"
    with pytest.raises(ValueError, match="at least one alias"):
        beat_schedule(databases=[])


@pytest.mark.django_db(transaction=True, databases=BOTH)
def test_notify_wakes_only_the_relay_of_that_database():
    if connections["other"].vendor != "postgresql":
        pytest.skip("LISTEN/NOTIFY is PostgreSQL's")
    stop = threading.Event()
    waker = make_waker("other", stop)
    assert isinstance(waker, PostgresNotifyWaker)
    try:
        waker.wait(0.01)  # LISTEN on "other"
        started = time.monotonic()
        timer = threading.Timer(0.3, emit_in_a_thread, args=("default",))
        timer.start()
        waker.wait(1.5)
        timer.join()
        assert time.monotonic() - started >= 1.4  # a commit in "default" is not ours
        started = time.monotonic()
        timer = threading.Timer(0.3, emit_in_a_thread, args=("other",))
        timer.start()
        waker.wait(10)
        timer.join()
        assert time.monotonic() - started < 5
    finally:
        waker.close()
        connections.close_all()


# -- bad aliases: one line, exit 2; the system checks ---------------------------------------


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.django_db
def test_an_unknown_alias_exits_2_in_one_line(command):
    args = ["--once"] if command == "publish_outbox" else []
    with pytest.raises(CommandError) as caught:
        call_command(command, *args, "--database", "nope")
    assert caught.value.returncode == 2
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith(f"{command}: there is no database 'nope' in DATABASES")
    assert "'default'" in message and "'other'" in message


@pytest.fixture(scope="module")
def bare_alias() -> Iterator[str]:
    """A third alias: an empty in-memory SQLite database, never migrated. Module-scoped, so
    it exists before a test's database access rules are set (they allow "__all__")."""
    connections.settings["bare"] = {"ENGINE": "django.db.backends.sqlite3", "NAME": ":memory:"}
    connections.configure_settings(connections.settings)
    try:
        yield "bare"
    finally:
        if hasattr(connections._connections, "bare"):
            connections["bare"].close()
            del connections["bare"]
        del connections.settings["bare"]


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.django_db(databases="__all__")  # "bare" too, whenever it was added
def test_an_unmigrated_alias_exits_2_in_one_line(command, bare_alias):
    args = ["--once"] if command == "publish_outbox" else []
    with pytest.raises(CommandError) as caught:
        call_command(command, *args, "--database", bare_alias)
    assert caught.value.returncode == 2
    assert "\n" not in str(caught.value)
    assert "has no outbox table" in str(caught.value)
    assert "migrate django_outbox --database bare" in str(caught.value)


@pytest.mark.django_db(databases="__all__")
def test_unmigrated_alias_is_not_shown(bare_alias):
    assert "bare" not in stats.outbox_databases()


def ids(messages: list[CheckWarning]) -> list[str]:
    return [m.id for m in messages]


@pytest.mark.once
def test_checks_w001_w002():
    assert check_outbox_aliases() == []
    with override_settings(DATABASE_ROUTERS=[OtherRouter()]):
        assert check_outbox_aliases() == []
    with override_settings(DATABASE_ROUTERS=[UnmigratedRouter()]):
        (warning,) = check_outbox_aliases()
        assert warning.id == Codes.ROUTED_UNMIGRATED
        assert "'other'" in warning.msg and "migrate django_outbox --database other" in warning.hint
    with override_settings(DATABASE_ROUTERS=[TypoRouter()]):
        (warning,) = check_outbox_aliases()
        assert warning.id == Codes.UNKNOWN_ALIAS
        assert "'otehr'" in warning.msg and "'default'" in warning.hint
    with override_settings(OUTBOX_DATABASES=["default", "nope"]):
        assert ids(check_outbox_aliases()) == [Codes.UNKNOWN_ALIAS]
    with override_settings(OUTBOX_DATABASES=["other"], DATABASE_ROUTERS=[UnmigratedRouter()]):
        # "other" is named twice (router, setting): one warning
        assert ids(check_outbox_aliases()) == [Codes.ROUTED_UNMIGRATED]


# -- the admin dashboard ---------------------------------------------------------------------

DASHBOARD = "admin:django_outbox_outboxevent_dashboard"
CHANGELIST = "admin:django_outbox_outboxevent_changelist"
CHANGE = "admin:django_outbox_outboxevent_change"


@pytest.mark.django_db(databases=BOTH)
def test_dashboard_shows_every_outbox_database(superuser_client):
    make_events({}, {}, {"status": Status.DEAD}, using="other")
    make_events({}, using="default")
    body = superuser_client.get(reverse(DASHBOARD)).content.decode()
    assert 'id="database-default"' in body and 'id="database-other"' in body
    assert "showing default" in body
    assert f'href="{reverse(DASHBOARD)}?database=other"' in body

    response = superuser_client.get(reverse(DASHBOARD), {"database": "other"})
    body = response.content.decode()
    assert "showing other" in body
    figure = body.split('id="figure-pending"')[1].split("</li>")[0]
    assert '<span class="value">2</span>' in figure
    # the figures link to the event list of the database shown
    assert f"{reverse(CHANGELIST)}?status__exact=0&amp;" in figure
    assert figure.count("&amp;database=other") == 1
    assert superuser_client.get(reverse(DASHBOARD), {"database": "nope"}).status_code == 404


@pytest.mark.django_db(databases=BOTH)
def test_a_count_past_the_bound_is_estimated_on_the_database_of_its_rows():
    """Past the bound the planner is asked about the query compiled for the rows' own
    database (PostgreSQL and MariaDB quote names differently)."""
    make_events({}, {}, {}, using="other")
    counted = counting.count_rows(OutboxEvent.objects.using("other"), exact_up_to=1)
    if connections["other"].vendor == "sqlite":
        assert counted == counting.RowCount(3)  # no planner: counted
    else:
        assert counted.estimated and counted.value >= 2


@pytest.mark.django_db(databases=BOTH)
def test_event_list_and_actions_on_another_database(superuser_client):
    dead = make_events({"status": Status.DEAD}, {"status": Status.DEAD}, using="other")
    (mine,) = make_events({"status": Status.DEAD}, using="default")
    changelist = reverse(CHANGELIST)

    body = superuser_client.get(changelist, {"database": "other"}).content.decode()
    assert all(row.event_id in body for row in dead) and mine.event_id not in body
    assert 'id="changelist-filter"' in body and "?database=default" in body
    body = superuser_client.get(changelist).content.decode()
    assert mine.event_id in body and dead[0].event_id not in body

    # the change page of a row of "other", as the list links it
    url = reverse(CHANGE, args=[dead[0].pk]) + "?_changelist_filters=database%3Dother"
    assert dead[0].event_id in superuser_client.get(url).content.decode()

    # the requeue action works on the rows of the database listed: its confirmation
    # counts them there, and so does the change once confirmed
    selected = {"action": "requeue", "_selected_action": [row.pk for row in dead]}
    response = superuser_client.post(f"{changelist}?database=other", selected)
    assert response.status_code == 200
    assert response.context["count"] == 2
    response = superuser_client.post(f"{changelist}?database=other", {**selected, "post": "yes"})
    assert response.status_code == 302
    assert statuses("other") == {Status.PENDING: 2}
    assert statuses("default") == {Status.DEAD: 1}
    assert superuser_client.get(changelist, {"database": "nope"}).status_code == 404


@pytest.mark.django_db
def test_dashboard_with_one_database_has_no_database_table(superuser_client, settings):
    settings.OUTBOX_DATABASES = ["default"]
    body = superuser_client.get(reverse(DASHBOARD)).content.decode()
    assert 'id="databases"' not in body


@pytest.mark.once
def test_shipped_rules_and_dashboard_keep_the_database_label():
    import json
    import re

    import yaml

    deploy = Path(__file__).resolve().parent.parent / "docs" / "deploy"
    rules = yaml.safe_load((deploy / "prometheus-rules.yaml").read_text())
    for group in rules["groups"]:
        for rule in group["rules"]:
            # max without (...) keeps every label it does not name; by (...) drops the rest
            assert " by (" not in rule["expr"] or "database" in rule["expr"], rule["alert"]
            assert not re.search(r"without \([^)]*database", rule["expr"]), rule["alert"]
            assert "{{ $labels.database }}" in rule["annotations"]["summary"], rule["alert"]
    dashboard = json.loads((deploy / "grafana-dashboard.json").read_text())
    assert "database" in [v["name"] for v in dashboard["templating"]["list"]]
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            assert 'database=~"$database"' in target["expr"]
            assert "{{database}}" in target["legendFormat"]


@pytest.mark.django_db(transaction=True, databases=BOTH)
def test_a_dead_letter_alert_names_its_database(caplog):
    from django_outbox.alerts import DeadLetter, WebhookChannel
    from django_outbox.backends import locmem
    from django_outbox.backends.base import Reason

    make_events({"retry_count": 99}, using="other")
    locmem.fail_next.append(Reason.NACKED)
    result = Relay(backend=LocmemBackend(), using="other", db_thread=False).drain()
    locmem.reset()
    assert result.dead == 1
    assert "database=other" in caplog.text  # the default LoggingChannel
    (row,) = OutboxEvent.objects.using("other").dead()
    letter = DeadLetter.from_event(row)
    assert letter.as_dict()["database"] == "other"
    slack = WebhookChannel(url="https://hooks.slack.com/x", shape="slack")
    assert "[database other]" in json.dumps(slack.payload([letter]))
    # the default database's rows say nothing about it, as with a single database
    (default_row,) = make_events({"status": Status.DEAD})
    assert "database" not in DeadLetter.from_event(default_row).as_dict()


@pytest.mark.django_db(databases=BOTH)
def test_requeue_all_from_the_dashboard_of_another_database(superuser_client):
    make_events(*[{"status": Status.DEAD, "event_type": "ORDER_PAID"}] * 3, using="other")
    make_events({"status": Status.DEAD, "event_type": "ORDER_PAID"}, using="default")
    body = superuser_client.get(reverse(DASHBOARD), {"database": "other"}).content.decode()
    requeue = reverse("admin:django_outbox_outboxevent_requeue")
    assert f"{requeue}?database=other&amp;event_type=ORDER_PAID" in body

    url = f"{requeue}?database=other&event_type=ORDER_PAID"
    page = superuser_client.get(url).content.decode()
    assert "--database other" in page  # the same from a shell
    response = superuser_client.post(url, {"event_type": "ORDER_PAID"})
    assert response.status_code == 302
    assert response["Location"].endswith("?database=other")
    assert statuses("other") == {Status.PENDING: 3}
    assert statuses("default") == {Status.DEAD: 1}


# -- what is atomic with what (issue 32, item 1) ---------------------------------------------


class OrdersApartRouter(OtherRouter):
    """The outbox on ``other``, every other model on ``default`` (Django's fallback)."""


class ReplicaRouter:
    """Reads of orders from ``other`` (a replica), every write to ``default``."""

    def db_for_read(self, model, **hints):
        return "other" if model._meta.app_label == "orders" else None

    def db_for_write(self, model, **hints):
        return "default"


def new_order(using: str = "default") -> Order:
    return Order.objects.using(using).create(number=uuid.uuid4().hex[:12], user_id=1)


@pytest.mark.django_db(transaction=True, databases=BOTH)
def test_emit_refuses_an_aggregate_written_to_another_database_than_the_box():
    """The router sends the outbox to ``other`` and the orders to ``default``: the block's
    transaction is on ``other``, so the order would commit on its own. emit() says so and
    the block rolls back (before the fix the order stayed and no event was written)."""
    with (
        override_settings(DATABASE_ROUTERS=[OrdersApartRouter()]),
        pytest.raises(NotInTransaction) as refused,
        outbox.atomic() as box,
    ):
        order = Order.objects.create(number="APART-1", user_id=1)
        box.emit("ORDER_CREATED", aggregate=order, payload={})
    message = str(refused.value)
    assert "'default'" in message and "'other'" in message
    assert "outbox.atomic(using='default')" in message
    assert OutboxEvent.objects.using("other").count() == 0
    # Its write was never in the block's transaction: it stands, which is why emit() refuses.
    assert Order.objects.filter(number="APART-1").exists()


@pytest.mark.django_db(transaction=True, databases=BOTH)
def test_module_emit_refuses_it_too_and_names_both_aliases():
    order = new_order("default")
    with transaction.atomic(using="other"), pytest.raises(NotInTransaction, match="'other'"):
        outbox.emit("ORDER_PAID", aggregate=order, payload={}, using="other")


@pytest.mark.django_db(transaction=True, databases=BOTH)
def test_an_aggregate_of_the_boxs_own_database_is_accepted():
    """A tenant's rows and its outbox in the same database: one transaction."""
    with outbox.atomic(using="other") as box:
        order = new_order("other")
        box.emit("ORDER_CREATED", aggregate=order, payload={})
    assert OutboxEvent.objects.using("other").filter(aggregate_id=str(order.pk)).count() == 1


@pytest.mark.django_db(transaction=True, databases=BOTH)
def test_an_aggregate_read_from_a_replica_counts_where_its_writes_go():
    """Loaded from the replica, its writes go to ``default``, where the outbox is."""
    written = new_order("default")
    Order.objects.using("other").create(pk=written.pk, number=written.number, user_id=1)
    with override_settings(DATABASE_ROUTERS=[ReplicaRouter()]):
        read = Order.objects.get(pk=written.pk)
        assert read._state.db == "other"
        with outbox.atomic() as box:
            box.emit("ORDER_VIEWED", aggregate=read, payload={})
    assert OutboxEvent.objects.using("default").filter(event_type="ORDER_VIEWED").count() == 1
