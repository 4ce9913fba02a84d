"""Every benchmark's smoke run, one after the other in one interpreter: ``python -m bench
--smoke`` (what CI runs, scripts/test).

Each ``bench/*_bench.py`` with ``--smoke``, and ``raw_pika`` with the options of its own that
no bench uses. Django, pika and the app are imported and set up once (Django on
``bench.settings``, the database ``DATABASE_URL`` names), where a process per bench paid for
them each time; every bench still makes its own database and broker objects, and drops
them. A failing bench is reported and the others still run; the exit status is 1 if any
failed.

Each bench stays a program of its own (``python -m bench.relay_bench ...``): a figure worth
reporting comes from a bench run alone, on a quiet machine.
"""

from __future__ import annotations

import argparse
import importlib
import os
import pkgutil
import sys
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
#: Runs beyond each bench's --smoke: the baseline's own options that no *_bench.py uses.
EXTRA_RUNS = [
    ("raw_pika", ["--coalesce"]),
    ("raw_nats", []),
    ("relay_bench", ["--transport", "nats"]),
    ("raw_redis", []),
    ("relay_bench", ["--transport", "redis"]),
    ("tasks_bench", ["--processes", "2"]),
    ("tasks_bound", ["--processes", "1,2"]),
]


def smoke_runs() -> list[tuple[str, list[str]]]:
    """(module, arguments besides --smoke) of every smoke run, in order."""
    benches = sorted(m.name for m in pkgutil.iter_modules([str(HERE)]) if m.name.endswith("_bench"))
    return [(name, []) for name in benches] + EXTRA_RUNS


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--smoke",
        action="store_true",
        required=True,
        help="tiny sizes: proves every script runs (for figures, run one bench alone)",
    )
    p.parse_args(argv)
    sys.path[:0] = [str(HERE.parent), str(HERE.parent / "testproject")]
    os.environ["DJANGO_SETTINGS_MODULE"] = "bench.settings"
    import django

    django.setup()
    failed = []
    for name, extra in smoke_runs():
        args = ["--smoke", *extra]
        print(f"\n--- python -m bench.{name} {' '.join(args)}", flush=True)
        started = time.monotonic()
        try:
            importlib.import_module(f"bench.{name}").main(args)
        except SystemExit as exc:
            if exc.code == 143:  # SIGTERM (the benches' handler): stop here
                raise
            if exc.code not in (None, 0):
                print(f"bench.{name} exited: {exc.code}", file=sys.stderr, flush=True)
                failed.append(name)
        except Exception:
            traceback.print_exc()
            failed.append(name)
        print(f"--- bench.{name}: {time.monotonic() - started:.1f} s", flush=True)
    if failed:
        print(f"smoke runs that failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
