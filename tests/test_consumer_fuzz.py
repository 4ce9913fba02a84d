"""Fuzz the consumer with seeded random malformed messages among good ones (issue 19).

A few hundred messages, each a good event with zero to two mutations: reserved headers of a
wrong type or out of range, missing properties, bodies that are not JSON (not UTF-8,
truncated, nested 100,000 deep), content types that are not JSON, payloads the handler
fails on, delivery counters that are not counts, and harmless variants (digit strings,
AMQP timestamps, odd own headers, no optional header at all). Each message's fate is
known from its mutations; the consumer runs in a thread the whole time and every message
must end where it should: processed exactly once, in the dead-letter queue with a reason,
or acked as an unknown event type. ``FUZZ_SEED=<n>`` replays a failing run.
"""

from __future__ import annotations

import datetime
import os
import random
import threading
from collections import Counter
from collections.abc import Callable
from decimal import Decimal
from typing import Any

import pytest

from django_outbox.consumer import DELIVERY_HEADER, REASON_HEADER, Consumer, Outcome
from django_outbox.message import encode_body
from points.models import PointsLedger
from tests.utils.amqp import properties
from tests.utils.rows import unsaved_event
from tests.utils.threads import db_thread
from tests.utils.waiting import wait_for

pytestmark = [pytest.mark.amqp, pytest.mark.django_db(transaction=True)]

MESSAGES = 500
TAG = "fuzz-index"  # an own header: it survives retries and dead-lettering

# Fates, from the worst: a message ends where its worst mutation sends it.
DEAD, UNKNOWN, FAILS, GOOD = "dead", "unknown", "fails", "good"

BAD_VALUES: dict[str, list[Any]] = {
    "attempt": ["abc", 0, -3, [1], {"a": 1}, True, "1.5", b"\xff", Decimal("1.5")],
    "sequence": ["x", [1, 2], 0, -1, "9223372036854775808", False, {"s": 2}],
    "previous_sequence": ["zz", -1, {"x": 1}, [0], "0x10"],
    "occurred_at": ["2024-13-45T00:00:00", "yesterday", 12, [], b"\xff", "2024-02-30"],
    "aggregate_type": [{"a": 1}, [1], b"\xff\xfe", "A" * 65, True, Decimal("2")],
    "aggregate_id": [{"a": 1}, [1], b"\xc3\x28", "9" * 65, False],
}
BAD_BODIES = [
    b"not json",
    b"\xff\xfe\xfd",
    b'{"user_id": 1, "amount": ',
    b"",
    b"[" * 100_000 + b"]" * 100_000,
    b'{"a": "\xff"}',
]
FAILING_PAYLOADS = [
    {},
    "a string",
    [1, 2],
    {"user_id": "x", "amount": "y", "number": "N"},
    {"user_id": 1, "amount": "-5", "number": "N"},  # the ledger's check constraint
]
ODD_OWN_HEADERS = [{"x": [1, {"y": None}]}, b"\x00\xff", None, True, 2**40, Decimal("3.25")]


class Message:
    def __init__(self, index: int, rng: random.Random) -> None:
        self.event = unsaved_event(pk=index + 1)
        self.props = properties(self.event)
        self.props.headers[TAG] = index
        self.body = encode_body(self.event)
        self.routing_key = "ORDER_CREATED"
        self.fates = [GOOD]
        self.applied: list[str] = []
        # bad_header twice as often: it has the most kinds.
        kinds = [*MUTATIONS, bad_header]
        chosen = [rng.choice(kinds) for _ in range(rng.choice([0, 1, 1, 1, 2]))]
        # In the list's order: a harmless change must not undo a bad one made before it.
        for mutation in sorted(chosen, key=MUTATIONS.index):
            self.applied.append(mutation.__name__)
            mutation(self, rng)

    @property
    def fate(self) -> str:
        return min(self.fates, key=[DEAD, UNKNOWN, FAILS, GOOD].index)


def bad_header(m: Message, rng: random.Random) -> None:
    name = rng.choice(list(BAD_VALUES))
    m.props.headers[name] = rng.choice(BAD_VALUES[name])
    m.fates.append(DEAD)


def bad_body(m: Message, rng: random.Random) -> None:
    m.body = rng.choice(BAD_BODIES)
    m.fates.append(DEAD)


def random_bytes_body(m: Message, rng: random.Random) -> None:
    m.body = b"\x00" + rng.randbytes(rng.randrange(1, 64))  # NUL first: never JSON
    m.fates.append(DEAD)


def bad_properties(m: Message, rng: random.Random) -> None:
    choice = rng.randrange(5)
    if choice == 0:
        m.props.message_id = None
    elif choice == 1:
        m.props.type = None
    elif choice == 2:
        m.props.message_id = "m" * 65
    elif choice == 3:
        m.props.type = "T" * 129
    else:
        m.props.message_id = b"\xff" + os.urandom(8)  # not UTF-8 (a short string in AMQP)
    m.fates.append(DEAD)


def wrong_content_type(m: Message, rng: random.Random) -> None:
    m.props.content_type = rng.choice(["text/plain", "application/xml", "application/msgpack"])
    m.fates.append(DEAD)


def unknown_type(m: Message, rng: random.Random) -> None:
    m.props.type = rng.choice(["ORDER_SHIPPED", "ORDER_CANCELLED"])
    m.fates.append(UNKNOWN)


def failing_payload(m: Message, rng: random.Random) -> None:
    payload = rng.choice(FAILING_PAYLOADS)
    m.body = encode_body(unsaved_event(payload=payload))
    m.fates.append(FAILS)


def bad_delivery_count(m: Message, rng: random.Random) -> None:
    # Read only when the handler fails (then: dead-lettered at once); harmless otherwise.
    name = rng.choice(["x-delivery-count", DELIVERY_HEADER])
    m.props.headers[name] = rng.choice(["abc", -2, [1], True])


def missing_headers(m: Message, rng: random.Random) -> None:
    for name in ("aggregate_type", "aggregate_id", "occurred_at", "attempt", "sequence"):
        if rng.random() < 0.7:
            m.props.headers.pop(name, None)


def harmless_variants(m: Message, rng: random.Random) -> None:
    m.props.headers["attempt"] = str(rng.randrange(1, 9))
    m.props.headers["sequence"] = rng.choice([str(m.event.pk), 2**62])
    m.props.headers["occurred_at"] = datetime.datetime.now(datetime.timezone.utc)
    m.props.headers[f"own-{rng.randrange(100)}"] = rng.choice(ODD_OWN_HEADERS)
    m.props.content_type = rng.choice([None, "application/json; charset=utf-8", "app/x+json"])
    if m.props.content_type == "app/x+json":
        m.props.content_type = "application/vnd.outbox+json"


# Applied in this order: the harmless ones first, then those that set the fate.
MUTATIONS: list[Callable[[Message, random.Random], None]] = [
    missing_headers,
    harmless_variants,
    bad_delivery_count,
    failing_payload,
    unknown_type,
    bad_header,
    bad_body,
    random_bytes_body,
    bad_properties,
    wrong_content_type,
]


@pytest.mark.parametrize("queue_type", ["classic", "quorum"])
def test_fuzzed_messages_all_end_somewhere_and_the_consumer_stays_up(broker, queue_type):
    seed = int(os.environ.get("FUZZ_SEED") or random.randrange(2**32))
    print(f"FUZZ_SEED={seed} ({queue_type})")  # shown by pytest when the test fails
    rng = random.Random(seed)
    messages = [Message(i, rng) for i in range(MESSAGES)]
    duplicates = [m for m in messages if m.fate == GOOD and rng.random() < 0.1]
    consumer = Consumer(
        handlers=["points.handlers.AwardPointsHandler"],
        url=broker.url,
        queue=broker.queue,
        exchange=broker.exchange,
        queue_type=queue_type,
        max_retries=1,
        retry_delay=0,
        idle_timeout=0.2,
    )
    consumer.connect()
    stop, results = threading.Event(), []
    thread = db_thread(lambda: results.append(consumer.serve(stop=stop)))
    thread.start()
    try:
        for m in [*messages, *duplicates]:
            broker.publish_raw(m.body, m.props, m.routing_key)
        expected = Counter(m.fate for m in messages)
        dead_expected = expected[DEAD] + expected[FAILS]

        def settled() -> bool:
            return not thread.is_alive() or (
                broker.count(broker.queue) == 0
                and broker.count(broker.dlq) >= dead_expected
                and PointsLedger.objects.count() >= expected[GOOD]
            )

        assert wait_for(settled, timeout=120) and thread.is_alive(), (
            f"seed {seed}: not settled: queue {broker.count(broker.queue)}, dead-letter "
            f"queue {broker.count(broker.dlq)} of {dead_expected}, processed "
            f"{PointsLedger.objects.count()} of {expected[GOOD]}, consumer alive: "
            f"{thread.is_alive()}"
        )
    finally:
        stop.set()
        thread.join(timeout=60)
    assert not thread.is_alive() and results, f"seed {seed}: the consumer did not stop"
    # The stop may come with duplicates or unknown types still prefetched (they change no
    # row to wait for): they went back to the queue, once each, and a restart takes them.
    rest = consumer.serve(until_idle=True)
    counts = Counter(results[0].counts) + Counter(rest.counts)
    dead = {
        props.headers[TAG]: props.headers.get(REASON_HEADER, "")
        for props, _ in broker.drain(broker.dlq)
    }
    assert broker.count(broker.queue) == 0

    def wrong(fate: str, got: set[int]) -> list[str]:
        want = {i for i, m in enumerate(messages) if m.fate == fate}
        return [f"{i}: {messages[i].applied}" for i in sorted(want ^ got)]

    processed = set(PointsLedger.objects.values_list("source_event_id", flat=True))
    got_good = {i for i, m in enumerate(messages) if m.event.event_id in processed}
    assert not wrong(GOOD, got_good), f"seed {seed}: processed wrongly {wrong(GOOD, got_good)}"
    assert PointsLedger.objects.count() == len(got_good), f"seed {seed}: processed twice"
    got_dead = set(dead)
    want_dead = {i for i, m in enumerate(messages) if m.fate in (DEAD, FAILS)}
    assert got_dead == want_dead, f"seed {seed}: dead-lettered wrongly " + ", ".join(
        f"{i} ({messages[i].fate}, {messages[i].applied}): {dead.get(i, 'not dead')!r}"
        for i in sorted(got_dead ^ want_dead)
    )
    for i in want_dead:
        prefix = "undecodable: " if messages[i].fate == DEAD else "failed"
        assert dead[i].startswith(prefix), f"seed {seed}: message {i} reason {dead[i]!r}"
    assert counts[Outcome.UNKNOWN_TYPE] == expected[UNKNOWN], f"seed {seed}"
    assert counts[Outcome.DUPLICATE] == len(duplicates), f"seed {seed}"
