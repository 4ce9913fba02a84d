#!/usr/bin/env python
"""The demo project's manage.py: `python testproject/manage.py demo` from the repo root."""

import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main() -> None:
    # Runs from a checkout without installing: the project dir and the repo root (for
    # django_outbox itself) go on the path.
    sys.path[:0] = [str(HERE), str(HERE.parent)]
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")
    from django.core.management import execute_from_command_line

    execute_from_command_line(sys.argv)


if __name__ == "__main__":
    main()
