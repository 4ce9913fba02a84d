"""A broker cluster on loopback ports for the optional cluster tests (tests/faults/
test_cluster.py, test_nats_cluster.py), as a ``scripts/<broker>-cluster start`` prints it:
``<PREFIX>`` (the nodes' URLs, ``;`` between them) and ``<PREFIX>_STOP`` /
``<PREFIX>_START`` (a shell command that stops or starts node ``{n}``, 1-based)."""

from __future__ import annotations

import os
import subprocess

import pytest

from django_outbox.conf import broker_urls


class Cluster:
    def __init__(self, prefix: str, script: str) -> None:
        self.prefix = prefix
        #: The nodes' URLs; empty when the cluster's variables are not exported.
        self.urls = broker_urls(os.environ.get(prefix, ""))
        self.skip_unless_up = pytest.mark.skipif(
            len(self.urls) < 3,
            reason=f"needs a cluster of three nodes: run `bash {script} start` and export "
            f"what it prints ({prefix}, {prefix}_STOP/START)",
        )

    def node(self, action: str, n: int) -> None:
        """Stop or start node ``n`` (1-based)."""
        command = os.environ[f"{self.prefix}_{action.upper()}"].format(n=n)
        subprocess.run(command, shell=True, check=True, timeout=120)
