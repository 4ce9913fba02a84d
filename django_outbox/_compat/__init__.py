"""Every use of a library's private or undocumented internals, one module per library.

They buy measured speed on the relay's hot paths (docs/benchmarks.md), and they are the
first thing a new release of the library can break, so they live here and nowhere else:
``pika.py`` (the hand-turned I/O loop, one socket write per batch) and ``django.py`` (rows
built from a cursor, a connection's undocumented state). ``tests/test_compat.py``
checks each assumption against the installed version and names what to re-check when one
no longer holds.
"""
