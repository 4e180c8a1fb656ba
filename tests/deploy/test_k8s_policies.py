"""The rendered Kubernetes objects' runtime settings, field by field: executor
threads, who owns the executors' replica count, disruption budgets, Redis's memory
bound and network policy, where the API keys live, the GPU executors' rollout."""

import pytest

from tests.support.deploy import OVERLAYS, by_kind, container, overlay


def arg(args: list[str], flag: str) -> str:
    return args[args.index(flag) + 1]


@pytest.mark.parametrize("name", ["cpu", "cpu-hpa"])
def test_cpu_executors_run_as_many_torch_threads_as_they_request_cores(name):
    executor = container(overlay(name), "executor")
    assert arg(executor["args"], "--num-threads") == "2" == executor["resources"]["requests"]["cpu"]


@pytest.mark.parametrize("name", OVERLAYS)
def test_the_autoscaler_alone_sets_the_executor_count(name):
    """A replicas field in the manifest would reset the autoscaled count on every `kubectl apply`."""
    objects = overlay(name)
    assert "replicas" not in by_kind(objects, "Deployment")["executor"]["spec"]
    scalers = {**by_kind(objects, "ScaledObject"), **by_kind(objects, "HorizontalPodAutoscaler")}
    assert list(scalers) == ["executor"]


def test_disruption_budgets_let_drains_evict_unready_pods():
    budgets = by_kind(overlay("cpu"), "PodDisruptionBudget")
    assert {name: b["spec"]["unhealthyPodEvictionPolicy"] for name, b in budgets.items()} \
        == {"executor": "AlwaysAllow", "gateway": "AlwaysAllow"}


def mebibytes(quantity: str) -> float:
    """A Kubernetes (``512Mi``) or Redis (``384mb``) memory size in MiB."""
    units = {"Mi": 1, "Gi": 1024, "mb": 1e6 / 2**20, "gb": 1e9 / 2**20}
    unit = next(u for u in units if quantity.endswith(u))
    return float(quantity.removesuffix(unit)) * units[unit]


@pytest.mark.parametrize("name", OVERLAYS)
def test_redis_refuses_writes_before_its_memory_limit_kills_it(name):
    redis = container(overlay(name), "redis")
    assert arg(redis["args"], "--maxmemory") == "384mb" and arg(redis["args"], "--maxmemory-policy") == "noeviction"
    assert mebibytes("384mb") < mebibytes(redis["resources"]["limits"]["memory"]) == 512


@pytest.mark.parametrize("name", OVERLAYS)
def test_only_gateway_pods_reach_redis(name):
    policy = by_kind(overlay(name), "NetworkPolicy")["redis"]["spec"]
    assert policy == {"podSelector": {"matchLabels": {"app.kubernetes.io/name": "redis"}},
                      "policyTypes": ["Ingress"],
                      "ingress": [{"from": [{"podSelector": {"matchLabels": {"app.kubernetes.io/name": "gateway"}}}],
                                   "ports": [{"protocol": "TCP", "port": 6379}]}]}


@pytest.mark.parametrize("name", OVERLAYS)
def test_api_keys_are_in_a_secret_and_pools_in_the_configmap_both_at_config(name):
    """The tenants file (API keys) is a Secret's, the pools file the ConfigMap's; the
    gateway and the scheduler read both under /config, where their args name them."""
    objects = overlay(name)
    (secret,) = by_kind(objects, "Secret").values()
    (config,) = by_kind(objects, "ConfigMap").values()
    assert secret["metadata"]["name"].startswith("meshserve-tenants-") and set(secret["data"]) == {"tenants.toml"}
    assert config["metadata"]["name"].startswith("meshserve-config-") and set(config["data"]) == {"pools.toml"}
    for service in ("gateway", "scheduler"):
        pod = by_kind(objects, "Deployment")[service]["spec"]["template"]["spec"]
        assert {"name": "config", "projected": {"sources": [{"secret": {"name": secret["metadata"]["name"]}},
                                                            {"configMap": {"name": config["metadata"]["name"]}}]}} \
            in pod["volumes"]
        assert {"name": "config", "mountPath": "/config", "readOnly": True} in pod["containers"][0]["volumeMounts"]
        assert arg(pod["containers"][0]["args"], "--tenants") == "/config/tenants.toml"
    assert arg(container(objects, "scheduler")["args"], "--pools") == "/config/pools.toml"
    assert all("configMap" not in v for d in by_kind(objects, "Deployment").values()
               for v in d["spec"]["template"]["spec"]["volumes"])  # no pod mounts the tenants as a ConfigMap


@pytest.mark.parametrize("name", OVERLAYS)
def test_every_scraped_pod_serves_metrics_on_its_annotated_port(name):
    """deploy/observability/prometheus-k8s.yml scrapes the container port named metrics,
    at the prometheus.io/port annotation, as job meshserve-<app.kubernetes.io/name>."""
    scraped = {}
    for deployment in by_kind(overlay(name), "Deployment").values():
        template = deployment["spec"]["template"]
        annotations = template["metadata"].get("annotations", {})
        if annotations.get("prometheus.io/scrape") == "true":
            ports = {p["name"]: p["containerPort"] for p in template["spec"]["containers"][0]["ports"]}
            scraped[template["metadata"]["labels"]["app.kubernetes.io/name"]] = (
                str(ports["metrics"]), annotations["prometheus.io/port"])
    assert scraped == {"gateway": ("9400", "9400"), "scheduler": ("9401", "9401"), "executor": ("9402", "9402"),
                       "kvstore": ("9403", "9403")}


def test_gpu_executors_roll_out_in_place_without_a_surge_pod():
    """No spare GPU waits for a surge pod: one old executor goes (it drains) before its new one comes."""
    gpu = by_kind(overlay("gpu"), "Deployment")["executor"]["spec"]
    assert gpu["strategy"] == {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}}
    assert "strategy" not in by_kind(overlay("cpu"), "Deployment")["executor"]["spec"]  # CPU: the default surge
