"""The deploy recipes of docs/deploy.md: Kubernetes manifests valid against Kubernetes' own schemas, probes
on the worker's health port, grace periods longer than the drain, and the image built when a container
builder is available."""

from __future__ import annotations

import configparser
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
yaml = pytest.importorskip("yaml", reason="PyYAML comes with kubernetes-validate (the test extra)")
kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate is in the test extra")


def _documents() -> list[dict[str, Any]]:
    docs: list[dict[str, Any]] = []
    for path in sorted((DEPLOY / "kubernetes").glob("*.yaml")):
        docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


def _worker_container() -> tuple[dict[str, Any], dict[str, Any]]:
    [deployment] = [d for d in _documents() if d["kind"] == "Deployment"]
    spec = deployment["spec"]["template"]["spec"]
    [container] = spec["containers"]
    return spec, container


def test_the_manifests_are_valid_kubernetes_strictly() -> None:
    docs = _documents()
    assert {d["kind"] for d in docs} == {"Deployment", "PodDisruptionBudget", "Job"}
    for doc in docs:
        kubernetes_validate.validate(doc, kubernetes_validate.latest_version(), strict=True)


def test_the_probes_use_the_workers_health_port() -> None:
    _, container = _worker_container()
    assert container["ports"] == [{"name": "metrics", "containerPort": 9464}]
    assert container["livenessProbe"]["httpGet"] == {"path": "/livez", "port": "metrics"}
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    assert '"--metrics-port", "9464"' in dockerfile


def _drain(args: list[str]) -> float:
    return float(args[args.index("--drain-timeout") + 1])


def test_the_grace_period_exceeds_the_drain_margin() -> None:
    spec, container = _worker_container()
    assert spec["terminationGracePeriodSeconds"] > _drain(container["args"]) + 10
    unit = configparser.ConfigParser(interpolation=None, strict=False)
    unit.read(DEPLOY / "systemd" / "stepstone-worker.service")
    stop = float(unit["Service"]["TimeoutStopSec"])
    assert stop > _drain(unit["Service"]["ExecStart"].split()) + 10
    assert unit["Service"]["KillSignal"] == "SIGTERM"


def _unit(name: str) -> configparser.SectionProxy:
    unit = configparser.ConfigParser(interpolation=None, strict=False)
    assert unit.read(DEPLOY / "systemd" / name), name
    return unit["Service"]


def _database_secret(container: dict[str, Any]) -> str:
    [url] = [e for e in container["env"] if e["name"] == "STEPSTONE_DATABASE_URL"]
    return str(url["valueFrom"]["secretKeyRef"]["name"])


def test_migrations_run_as_the_owner_and_workers_as_the_runtime_role() -> None:
    """docs/operations.md, "Roles and grants": only the migration holds the schema owner's URL."""
    [job] = [d for d in _documents() if d["kind"] == "Job"]
    [migrate] = job["spec"]["template"]["spec"]["containers"]
    _, worker = _worker_container()
    assert migrate["command"] == ["stepstone", "db", "migrate"]
    assert _database_secret(migrate) != _database_secret(worker)
    service, migration = _unit("stepstone-worker.service"), _unit("stepstone-migrate.service")
    assert "ExecStartPre" not in service
    assert migration["ExecStart"].endswith(" db migrate") and migration["Type"] == "oneshot"
    assert service["EnvironmentFile"] != migration["EnvironmentFile"]
    unit = configparser.ConfigParser(interpolation=None, strict=False)
    unit.read(DEPLOY / "systemd" / "stepstone-worker.service")
    assert "stepstone-migrate.service" in unit["Unit"]["Requires"].split()
    assert "stepstone-migrate.service" in unit["Unit"]["After"].split()


def _builder() -> str | None:
    docker = shutil.which("docker")
    if docker is None:
        return None
    probe = subprocess.run([docker, "info"], capture_output=True, timeout=30, check=False)
    return docker if probe.returncode == 0 else None


def test_the_image_builds() -> None:
    docker = _builder()
    if docker is None:
        pytest.skip("no container builder here (no docker daemon answers `docker info`)")
    subprocess.run([docker, "build", "-f", str(DEPLOY / "Dockerfile"), "-t", "stepstone-worker:test", str(ROOT)],
                   check=True, timeout=900)
    out = subprocess.run([docker, "run", "--rm", "--entrypoint", "stepstone", "stepstone-worker:test", "--version"],
                         capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.startswith("stepstone")
