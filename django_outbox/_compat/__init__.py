"""Every use of a library's private or undocumented internals, one module per library.

They buy measured speed on the relay's hot paths (docs/benchmarks.md), and they are the
first thing a new release of the library can break, so they live here and nowhere else:
``pika.py`` (the hand-turned I/O loop, one socket write per batch), ``django.py`` (rows
built from a cursor, a connection's undocumented state) and ``celery.py`` (Celery's task
messages written by the Celery backend, routed and signalled as ``send_task()`` would;
imported only by that backend, so Celery stays optional). ``tests/test_compat.py``
checks each assumption against the installed version and names what to re-check when one
no longer holds.
"""
