"""docs/deploy/ manifests validate against the Kubernetes schema offline and match the docs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

DEPLOY = Path(__file__).resolve().parent.parent / "docs" / "deploy"
# Oldest Kubernetes release we claim to support; batch/v1 CronJob is GA since 1.21.
K8S_VERSION = "1.29.0"
# Files that are not Kubernetes objects of the core API (a Prometheus rule file, Grafana JSON).
NOT_MANIFESTS = {"prometheus-rules.yaml"}


def manifests() -> list[tuple[str, dict[str, Any]]]:
    docs = []
    for path in sorted(DEPLOY.glob("*.y*ml")):
        if path.name in NOT_MANIFESTS:
            continue
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                docs.append((f"{path.name}:{doc['kind']}/{doc['metadata']['name']}", doc))
    return docs


def by_name(name: str) -> dict[str, Any]:
    (doc,) = [d for _, d in manifests() if d["metadata"]["name"] == name]
    return doc


def test_there_are_manifests():
    kinds = sorted(d["kind"] for _, d in manifests())
    assert kinds == ["CronJob", "CronJob", "Deployment", "Deployment", "Secret"]


@pytest.mark.parametrize(("label", "doc"), manifests(), ids=[label for label, _ in manifests()])
def test_manifest_is_valid_kubernetes(label, doc):
    # strict: an unknown (misspelt) field is an error, not silently dropped by the cluster.
    kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_compensate_cronjob_is_configured_as_the_article():
    job = by_name("outbox-compensate-job")
    spec = job["spec"]
    assert spec["schedule"] == "*/5 * * * *"
    assert spec["concurrencyPolicy"] == "Forbid"
    assert spec["startingDeadlineSeconds"] == 300
    assert spec["successfulJobsHistoryLimit"] == 3
    assert spec["failedJobsHistoryLimit"] == 3
    pod = spec["jobTemplate"]["spec"]["template"]["spec"]
    assert pod["restartPolicy"] == "OnFailure"
    (container,) = pod["containers"]
    assert container["args"] == ["python", "manage.py", "compensate_outbox"]


def test_purge_cronjob_runs_daily():
    spec = by_name("outbox-purge-job")["spec"]
    minute, hour, *rest = spec["schedule"].split()
    assert minute.isdigit() and hour.isdigit() and rest == ["*", "*", "*"]
    assert spec["concurrencyPolicy"] == "Forbid"
    pod = spec["jobTemplate"]["spec"]["template"]["spec"]
    assert pod["containers"][0]["args"] == ["python", "manage.py", "purge_outbox"]


def test_relay_deployment_probes_its_heartbeat_and_drains_on_sigterm():
    deployment = by_name("publish-outbox")
    assert deployment["spec"]["replicas"] == 2
    pod = deployment["spec"]["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] >= 30
    (container,) = pod["containers"]
    args = container["args"]
    assert args[:3] == ["python", "manage.py", "publish_outbox"]
    heartbeat = args[args.index("--heartbeat-file") + 1]
    port = int(args[args.index("--metrics-port") + 1])
    assert [p["containerPort"] for p in container["ports"]] == [port]
    probe = " ".join(container["livenessProbe"]["exec"]["command"])
    assert heartbeat in probe and "stat -c %Y" in probe
    mounts = [m["mountPath"] for m in container["volumeMounts"]]
    assert str(Path(heartbeat).parent) in mounts


def test_every_pod_reads_its_connection_strings_from_a_secret():
    for label, doc in manifests():
        if doc["kind"] == "Secret":
            continue
        spec = doc["spec"]
        pod = (spec.get("jobTemplate", {}).get("spec", spec))["template"]["spec"]
        for container in pod["containers"]:
            assert container["envFrom"][0]["secretRef"]["name"], label
            assert container["image"].startswith("your-registry/"), label
            values = [e.get("value", "") for e in container.get("env", [])]
            assert not any("://" in v for v in values), f"{label} has a URL in plain env"
