"""PikaBackend.publish() alone (no database, no relay), against the raw pika baseline.

Builds unsaved OutboxEvent rows of the benchmark's sample event, publishes them through
one :class:`~django_outbox.backends.pika.PikaBackend` in batches (as the relay hands them
over), and prints events/s with the ratio to raw pika streaming (``bench.raw_pika``) and
to raw pika waiting per batch of the same size.

    python -m bench.backend_bench [--smoke] [--count 20000] [--batch-sizes 100,500]
        [--repeat 3] [--profile]
"""

from __future__ import annotations

from typing import Any

from bench.common import (
    bench_exchange,
    best_of,
    count_from,
    parser,
    publish_rate,
    report,
    sample_row,
    setup_django,
)
from bench.raw_pika import raw_pika_rate


def make_rows(count: int) -> list[Any]:
    return [sample_row(i, pk=i, headers={}, retry_count=0) for i in range(1, count + 1)]


def backend_rate(count: int, *, url: str, batch_size: int, exchange: str | None = None) -> float:
    """Events/s of PikaBackend.publish() over ``count`` rows in batches of ``batch_size``.

    ``exchange`` must route to a durable queue; by default a temporary one is made (a fresh
    queue per run, as raw_pika_rate does, so a growing queue does not skew the ratio).
    """
    if exchange is None:
        with bench_exchange(url, prefix="bench.backend") as name:
            return backend_rate(count, url=url, batch_size=batch_size, exchange=name)
    from django_outbox.backends.pika import PikaBackend

    rows = make_rows(count)
    batches = [rows[i : i + batch_size] for i in range(0, count, batch_size)]
    backend = PikaBackend(broker_url=url, exchange=exchange)
    return publish_rate(backend, batches)


def main(argv: list[str] | None = None) -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--batch-sizes", default="100,500", help="comma-separated batch sizes")
    p.add_argument("--profile", action="store_true", help="cProfile the first batch size")
    args = p.parse_args(argv)
    setup_django()
    count = count_from(args)
    sizes = [int(s) for s in args.batch_sizes.split(",")]
    if args.profile:
        import cProfile
        import pstats

        profiler = cProfile.Profile()
        profiler.runcall(backend_rate, count, url=args.url, batch_size=sizes[0])
        pstats.Stats(profiler).sort_stats("tottime").print_stats(25)
        return
    baseline = best_of(args.repeat, lambda: raw_pika_rate(count, url=args.url))
    report("raw pika (window 1000) = baseline", baseline, count=count)
    for size in sizes:
        raw = best_of(
            args.repeat, lambda size=size: raw_pika_rate(count, url=args.url, batch_size=size)
        )
        report(f"raw pika, batches of {size}", raw, baseline=baseline, count=count)
        rate = best_of(
            args.repeat, lambda size=size: backend_rate(count, url=args.url, batch_size=size)
        )
        report(f"PikaBackend.publish, batches of {size}", rate, baseline=baseline, count=count)
        print(f"{'':<40}  ratio to raw pika with the same batches: {rate / raw:5.2f}")


if __name__ == "__main__":
    main()
