"""deploy/observability: the alerting rules pass `promtool test rules`, the scrape
config passes `promtool check config`, the dashboard's and the rules' PromQL parse
into metric names, and the OpenTelemetry Collector config wires an OTLP receiver
through its pipeline to an exporter aimed at the compose file's Jaeger (the config
is read, no collector runs here). (That those names are the ones the services export is checked
after a real run in tests/mesh/test_metrics.py.)

promtool comes from Debian's ``prometheus`` package, installed by ``make setup``;
these tests fail, not skip, without it."""

import re
import shutil
import subprocess

import grpc
import yaml

from tests.support.promql import ALERTS, OBSERVABILITY, alert_exprs, dashboard_exprs, metric_names


def promtool(*args: str) -> subprocess.CompletedProcess:
    exe = shutil.which("promtool")
    assert exe, "promtool is missing: run `make setup` (installs Debian's prometheus package)"
    return subprocess.run([exe, *args], cwd=OBSERVABILITY, capture_output=True, text=True, timeout=120)


def test_promtool_rule_unit_tests_pass():
    done = promtool("test", "rules", "alerts_test.yml")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS" in done.stdout


def test_promtool_rejects_a_wrong_expectation(tmp_path):
    """The rule tests can fail: the same file expecting no backlog alert does."""
    text = (OBSERVABILITY / "alerts_test.yml").read_text()
    wrong = text.replace("""        alertname: MeshserveQueueBacklog
        exp_alerts:
          - exp_labels: {severity: warning}
            exp_annotations: {summary: "60 requests wait in the admission queue"}""",
                         """        alertname: MeshserveQueueBacklog
        exp_alerts: []""")
    assert wrong != text
    (tmp_path / "alerts.yml").write_text((OBSERVABILITY / "alerts.yml").read_text())
    (tmp_path / "alerts_test.yml").write_text(wrong)
    exe = shutil.which("promtool")
    assert exe, "promtool is missing: run `make setup`"
    done = subprocess.run([exe, "test", "rules", "alerts_test.yml"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 1 and "MeshserveQueueBacklog" in done.stdout + done.stderr


def test_promtool_accepts_the_scrape_config_and_its_rules():
    done = promtool("check", "config", "prometheus.yml")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS: 1 rule files found" in done.stdout + done.stderr
    jobs = {j["job_name"]: j.get("static_configs", j.get("dns_sd_configs"))[0]
            for j in yaml.safe_load((OBSERVABILITY / "prometheus.yml").read_text())["scrape_configs"]}
    assert jobs == {"meshserve-gateway": {"targets": ["gateway:9400"]},
                    "meshserve-scheduler": {"targets": ["scheduler:9401"]},
                    # every container of the scaled executor service, by DNS
                    "meshserve-executor": {"names": ["executor"], "type": "A", "port": 9402},
                    "meshserve-kvstore": {"targets": ["kvstore:9403"]}}


def test_metric_names_of_promql():
    assert metric_names('histogram_quantile(0.95, sum by (le, tenant) (rate(a_bucket{job="x", le!="1e9"}[5m])))') \
        == {"a_bucket"}
    assert metric_names("sum(rate(b_total[$__rate_interval])) / sum without (gpu) (c) > 1e9 and on (i) d offset 5m") \
        == {"b_total", "c", "d"}
    assert metric_names('up{job=~"meshserve-.*"} == 0') == {"up"}


def test_dashboard_covers_every_topic():
    exprs = dashboard_exprs()
    names = set().union(*map(metric_names, exprs))
    assert len(exprs) == 31 and all(metric_names(e) for e in exprs)
    for topic in ("ttft", "tpot", "generation_tokens", "queue_seconds", "requests_waiting", "kv_cache_usage",
                  "prefix_cache_hit", "kvstore", "busy_ratio", "flops_utilization", "gpu_utilization",
                  "cpu_utilization"):
        assert any(topic in n for n in names), topic


def test_alert_rules_name_meshserve_metrics():
    names = set().union(*map(metric_names, alert_exprs()))
    assert names == {"up", "meshserve_scheduler_executors", "meshserve_request_ttft_seconds_bucket",
                     "meshserve_scheduler_requests_waiting", "meshserve_kv_cache_usage_ratio",
                     "meshserve_engine_preemptions_total", "meshserve_requests_total"}


def test_otel_collector_config_wires_an_otlp_receiver_to_the_composed_jaeger():
    """The collector's config (as the compose file mounts it): OTLP in on 4317/4318,
    one traces pipeline whose every component is defined, out to ``jaeger:4317``,
    a service of the same compose file that takes OTLP."""
    config = yaml.safe_load((OBSERVABILITY / "otel-collector.yaml").read_text())
    assert set(config) == {"receivers", "processors", "exporters", "extensions", "service"}
    protocols = config["receivers"]["otlp"]["protocols"]
    assert protocols["grpc"]["endpoint"] == "0.0.0.0:4317" and protocols["http"]["endpoint"] == "0.0.0.0:4318"
    pipelines = config["service"]["pipelines"]
    assert list(pipelines) == ["traces"]
    for pipeline in pipelines.values():  # every component a pipeline names is defined
        for kind in ("receivers", "processors", "exporters"):
            assert pipeline[kind] and all(name in config[kind] for name in pipeline[kind]), kind
    assert pipelines["traces"]["receivers"] == ["otlp"]
    assert pipelines["traces"]["processors"][0] == "memory_limiter"  # first, as the collector advises
    jaeger = [config["exporters"][name] for name in pipelines["traces"]["exporters"]
              if name.split("/")[0] == "otlp" and config["exporters"][name]["endpoint"].startswith("jaeger:")]
    assert jaeger == [{"endpoint": "jaeger:4317", "tls": {"insecure": True}}]
    assert all(ext in config["extensions"] for ext in config["service"]["extensions"])
    compose = yaml.safe_load((OBSERVABILITY / "docker-compose.yml").read_text())["services"]
    collector = compose["otel-collector"]
    assert "./observability/otel-collector.yaml:/etc/otelcol/config.yaml:ro" in collector["volumes"]
    assert "--config=/etc/otelcol/config.yaml" in collector["command"] and "jaeger" in collector["depends_on"]
    assert compose["jaeger"]["environment"]["COLLECTOR_OTLP_ENABLED"] == "true"


def alert_outcomes(alertname: str) -> set[str]:
    """The ``outcome`` values an alert's numerator selects (``outcome=~"a|b"``)."""
    rules = {r["alert"]: r for g in yaml.safe_load(ALERTS.read_text())["groups"] for r in g["rules"]}
    (values,) = re.findall(r'outcome=~"([^"]+)"', rules[alertname]["expr"])
    return set(values.split("|"))


def test_the_error_rate_alert_counts_only_the_meshs_failures():
    """``outcome`` is the lower-case gRPC status name (gateway/metrics.py ``outcome_of``):
    the critical alert counts what the mesh failed at; the callers' mistakes and quotas
    have their own warning. (promtool's cases: alerts_test.yml.)"""
    codes = {code.name.lower() for code in grpc.StatusCode}
    server = alert_outcomes("MeshserveErrorRate")
    caller = alert_outcomes("MeshserveRequestsRefused")
    assert server == {"unavailable", "internal", "unknown", "deadline_exceeded", "data_loss"}
    assert caller == {"invalid_argument", "resource_exhausted", "not_found", "permission_denied", "already_exists",
                      "failed_precondition", "out_of_range"}
    assert server | caller <= codes and not server & caller and not {"ok", "cancelled"} & (server | caller)


def relabel(rules: list[dict], labels: dict[str, str]) -> dict[str, str] | None:
    """Prometheus's ``relabel_configs`` (actions keep and replace, the only ones used) on
    one target's labels; None when a rule drops it."""
    labels = dict(labels)
    for rule in rules:
        value = rule.get("separator", ";").join(labels.get(name, "") for name in rule.get("source_labels", []))
        match = re.fullmatch(rule.get("regex", "(.*)"), value)
        if rule.get("action", "replace") == "keep":
            if not match:
                return None
        elif match:
            labels[rule["target_label"]] = re.sub(r"\$(\d+)", lambda m: match.group(int(m.group(1))),
                                                  rule.get("replacement", "$1"))
    return labels


def pod_target(name: str, port_name: str, annotations: dict[str, str]) -> dict[str, str]:
    """The labels Kubernetes' pod discovery gives one container port of a pod."""
    meta = {"__address__": f"10.1.2.3:{port_name}", "__meta_kubernetes_pod_ip": "10.1.2.3",
            "__meta_kubernetes_pod_name": f"{name}-7d4b9-x2x5q", "__meta_kubernetes_pod_container_port_name": port_name,
            "__meta_kubernetes_pod_label_app_kubernetes_io_name": name}
    return meta | {"__meta_kubernetes_pod_annotation_" + k.replace(".", "_").replace("/", "_"): v
                   for k, v in annotations.items()}


def test_the_kubernetes_scrape_config_names_each_pods_job_as_the_alerts_expect(tmp_path):
    """prometheus-k8s.yml: pods of the namespace meshserve with the prometheus.io/scrape
    annotation, at their prometheus.io/port, as job meshserve-<app.kubernetes.io/name>
    (MeshserveServiceDown selects ``job=~"meshserve-.*"``). promtool checks it; Debian's
    promtool is built without Kubernetes discovery, so where it rejects the field the
    same file with a static target instead is checked."""
    config = yaml.safe_load((OBSERVABILITY / "prometheus-k8s.yml").read_text())
    assert config["rule_files"] == ["alerts.yml"]
    (job,) = config["scrape_configs"]
    assert job["kubernetes_sd_configs"] == [{"role": "pod", "namespaces": {"names": ["meshserve"]}}]
    done = promtool("check", "config", "prometheus-k8s.yml")
    if "field kubernetes_sd_configs not found" in done.stdout + done.stderr:
        static = {**config, "scrape_configs": [{**{k: v for k, v in job.items() if k != "kubernetes_sd_configs"},
                                                "static_configs": [{"targets": ["10.1.2.3:9402"]}]}]}
        (tmp_path / "prometheus-k8s.yml").write_text(yaml.safe_dump(static))
        (tmp_path / "alerts.yml").write_text((OBSERVABILITY / "alerts.yml").read_text())
        done = subprocess.run([shutil.which("promtool"), "check", "config", "prometheus-k8s.yml"], cwd=tmp_path,
                              capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "SUCCESS: 1 rule files found" in done.stdout + done.stderr, done.stdout
    rules = job["relabel_configs"]
    scraped = {"prometheus.io/scrape": "true", "prometheus.io/port": "9402"}
    target = relabel(rules, pod_target("executor", "metrics", scraped))
    assert (target["job"], target["__address__"], target["pod"]) \
        == ("meshserve-executor", "10.1.2.3:9402", "executor-7d4b9-x2x5q")
    assert relabel(rules, pod_target("executor", "grpc", scraped)) is None  # one target per pod, not per port
    assert relabel(rules, pod_target("redis", "redis", {})) is None  # not annotated
    assert re.fullmatch(r"meshserve-.*", relabel(rules, pod_target("gateway", "metrics", scraped))["job"])
