"""deploy/docker-compose.yml (with the observability file it includes) as compose
resolves it: the services' runtime settings, field by field."""

import shlex

import pytest

from tests.support.deploy import DEPLOY, compose_config


@pytest.fixture(scope="module")
def compose() -> dict:
    return compose_config()


def args(compose: dict, service: str) -> list[str]:
    """A service's command as a list of words (the executor's shell line split)."""
    command = compose["services"][service]["command"]
    return shlex.split(command[0]) if compose["services"][service].get("entrypoint") == ["sh", "-c"] else command


def arg(words: list[str], flag: str) -> str:
    return words[words.index(flag) + 1]


def test_compose_executors_run_two_torch_threads(compose):
    assert arg(args(compose, "executor"), "--num-threads") == "2"


def test_compose_redis_is_bounded_below_its_kubernetes_limit_and_never_evicts(compose):
    command = compose["services"]["redis"]["command"]
    assert arg(command, "--maxmemory") == "384mb" and arg(command, "--maxmemory-policy") == "noeviction"


def test_grafana_lets_anonymous_visitors_view_only_from_this_host(compose):
    grafana = compose["services"]["grafana"]
    assert grafana["environment"]["GF_AUTH_ANONYMOUS_ORG_ROLE"] == "Viewer"
    assert [(p["host_ip"], p["published"], p["target"]) for p in grafana["ports"]] == [("127.0.0.1", "3000", 3000)]


@pytest.mark.parametrize("service", ["kvstore", "scheduler", "executor", "gateway"])
def test_compose_services_send_their_traces_to_the_collector(compose, service):
    """The collector (deploy/observability/otel-collector.yaml) takes OTLP/gRPC on 4317 and
    passes the traces to Jaeger; without --traces a service exports none."""
    words = args(compose, service)
    assert arg(words, "--traces") == "otlp" and arg(words, "--otlp-endpoint") == "otel-collector:4317"
    assert "otel-collector" in compose["services"]


@pytest.mark.parametrize("dockerfile", ["Dockerfile", "Dockerfile.cuda"])
def test_the_images_healthcheck_comment_says_what_compose_does(compose, dockerfile):
    """The image's HEALTHCHECK asks MESHSERVE_HEALTH_ADDRESS over plaintext; compose never
    sets that address but replaces the check of every meshserve service by its own over
    mutual TLS, as the Dockerfile's comment says."""
    for name in ("kvstore", "scheduler", "executor", "gateway"):
        service = compose["services"][name]
        assert "MESHSERVE_HEALTH_ADDRESS" not in (service.get("environment") or {}), name
        test = service["healthcheck"]["test"]
        assert test[1:4] == ["python", "-m", "meshserve.healthcheck"] and "--tls-ca" in test, name
    lines = (DEPLOY / dockerfile).read_text().splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("ENV MESHSERVE_HEALTH_ADDRESS"))
    comment = " ".join(line.lstrip("# ") for line in lines[at - 5:at])
    assert comment.startswith("The image's check: the overall grpc.health.v1 status") and "over plaintext" in comment
    assert "Compose sets no address: it replaces this check per service" in comment
