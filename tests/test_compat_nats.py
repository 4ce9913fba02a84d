"""What django_outbox/_compat/nats.py assumes of nats-py's internals, checked against the
installed release and the real server (tests/test_compat.py does pika's and Django's).

A failure here after an upgrade names the assumption that no longer holds. Do not loosen
the test: fix django_outbox/_compat/nats.py, or keep the pin in pyproject.toml below the
release.
"""

from __future__ import annotations

import asyncio
import inspect
import threading
from importlib.metadata import version
from pathlib import Path

import nats
import pytest

from django_outbox._compat import nats as compat_nats
from django_outbox._compat.nats import LoopThread, take_replies, write_frames

pytestmark = pytest.mark.once

PYPROJECT = Path(__file__).resolve().parent.parent / "pyproject.toml"
INTERNALS = (
    "Client._send_command(), Client._flush_pending(), Client._process_msg() "
    "(nats/aio/client.py) and Subscription._id"
)


def nats_requires(ok: bool, what: str) -> None:
    if not ok:
        pytest.fail(
            f"nats-py {version('nats-py')} no longer behaves as django_outbox/_compat/nats.py "
            f"assumes: {what}. Those internals were checked for {compat_nats.PINNED} "
            f"(pyproject.toml). Re-check {INTERNALS} in this release and fix _compat/nats.py, "
            "or keep the pin below the release.",
            pytrace=False,
        )


def test_the_pin_the_messages_name_is_the_packaging_one():
    assert f'"{compat_nats.PINNED}"' in PYPROJECT.read_text()


def test_the_private_methods_have_the_signatures_used():
    client = nats.NATS()
    send = inspect.signature(client._send_command)
    nats_requires(list(send.parameters)[:1] == ["cmd"], "_send_command(cmd, ...) changed")
    process = inspect.signature(client._process_msg)
    nats_requires(
        list(process.parameters) == ["sid", "subject", "reply", "data", "headers"],
        f"_process_msg{process} is not (sid, subject, reply, data, headers)",
    )
    nats_requires(callable(getattr(client, "_flush_pending", None)), "_flush_pending() is gone")


def test_frames_written_reach_the_server_and_replies_reach_the_handler(nats_url):
    """Two PUBs written as one piece, each with a reply subject of the subscription taken
    over: the handler gets both replies' raw bytes; another subscription's callback still
    gets its own messages."""
    loop = LoopThread("test-compat-nats")
    seen: list[tuple[bytes, bytes, bytes | None]] = []
    others: list[bytes] = []

    async def scenario() -> None:
        requester = await nats.connect(nats_url)
        responder = await nats.connect(nats_url)
        try:

            async def echo(msg) -> None:
                await responder.publish(msg.reply, b"re:" + msg.data, headers={"k": "v"})

            await responder.subscribe("compat.echo", cb=echo)

            async def other(msg) -> None:
                others.append(msg.data)

            await requester.subscribe("compat.other", cb=other)
            await responder.flush()
            inbox = requester.new_inbox()
            replies = await requester.subscribe(f"{inbox}.*", cb=other)
            take_replies(requester, replies, lambda s, d, h: seen.append((s, d, h)))
            frames = b"".join(
                b"PUB compat.echo %s.%d %d\r\n%s\r\n" % (inbox.encode(), n, len(body), body)
                for n, body in enumerate([b"one", b"two"])
            )
            await write_frames(requester, frames)
            await requester.publish("compat.other", b"plain")
            for _ in range(100):
                if len(seen) == 2 and others:
                    break
                await asyncio.sleep(0.02)
        finally:
            await requester.close()
            await responder.close()

    try:
        loop.run(scenario(), 10)
    finally:
        loop.stop()
    nats_requires(len(seen) == 2, f"the handler got {len(seen)} of 2 replies")
    subjects = sorted(s for s, _, _ in seen)
    nats_requires(
        all(isinstance(s, bytes) for s in subjects) and subjects[0].endswith(b".0"),
        f"reply subjects came as {subjects!r}, not bytes with the number last",
    )
    nats_requires(sorted(d for _, d, _ in seen) == [b"re:one", b"re:two"], "the reply data differs")
    nats_requires(
        all(h is not None and h.startswith(b"NATS/1.0") for _, _, h in seen),
        "the headers do not come as the raw NATS/1.0 block",
    )
    nats_requires(others == [b"plain"], "another subscription's callback lost its message")


def test_the_loop_thread_runs_coroutines_and_stops():
    loop = LoopThread("test-loop")
    try:
        assert loop.run(asyncio.sleep(0, result=7), 2) == 7
        assert not loop.in_loop()
        assert loop.run(_in_loop(loop), 2) is True
        with pytest.raises(TimeoutError):
            loop.run(asyncio.sleep(5), 0.1)
    finally:
        loop.stop()
    assert not loop.alive
    assert not any(t.name == "test-loop" for t in threading.enumerate())


async def _in_loop(loop: LoopThread) -> bool:
    return loop.in_loop()
