"""Prometheus metrics after a real run through the mesh (gateway, scheduler, one
executor with a small KV pool, kvstore), scraped over HTTP from each service's
own /metrics endpoint: every metric is there, request counts are exact (TTFT
once per request, a one-token request and a preempted one included), engine
figures equal the engine's own counters; and the Grafana dashboard and the
alerting rules name only metrics the services export."""

import asyncio
import urllib.request

import pytest
import pytest_asyncio
from prometheus_client.parser import text_string_to_metric_families

from kvstore.store import KVStore
from meshserve.client import build_request, generate, generate_choices
from meshserve.device_metrics import DeviceCollector
from tests.support.engines import make_engine
from tests.support.mesh_harness import start_local_mesh
from tests.support.metrics import fake_nvml
from tests.support.promql import alert_exprs, dashboard_exprs, metric_names

pytestmark = pytest.mark.model

NUM_BLOCKS = 10  # 160 token slots: two 40 + 60 token sequences (7 blocks each) cannot both finish
PROMPT_LEN = 40


def prompt(seed: int) -> list[int]:
    return [1000 + (i * 7919 + seed * 104729) % 40000 for i in range(PROMPT_LEN)]


REQUIRED = {
    "gateway": ["meshserve_request_ttft_seconds_bucket", "meshserve_request_tpot_seconds_bucket",
                "meshserve_request_e2e_seconds_bucket", "meshserve_request_queue_seconds_bucket",
                "meshserve_request_prompt_tokens_total", "meshserve_request_generation_tokens_total",
                "meshserve_requests_total", "meshserve_gateway_requests_running"],
    "scheduler": ["meshserve_scheduler_queue_seconds_bucket", "meshserve_scheduler_requests_admitted_total",
                  "meshserve_scheduler_queue_tokens", "meshserve_scheduler_requests_running",
                  "meshserve_scheduler_executors", "meshserve_scheduler_executor_free_blocks",
                  "meshserve_scheduler_predictor_observed_total", "meshserve_scheduler_predictor_abs_error_tokens"],
    "executor-0": ["meshserve_engine_requests_running", "meshserve_engine_requests_waiting",
                   "meshserve_engine_prompt_tokens_total", "meshserve_engine_generation_tokens_total",
                   "meshserve_engine_preemptions_total", "meshserve_kv_cache_usage_ratio", "meshserve_kv_cache_blocks",
                   "meshserve_prefix_cache_hit_ratio", "meshserve_prefix_cache_hit_tokens_total",
                   "meshserve_executor_kvstore_hit_ratio", "meshserve_executor_kvstore_fetch_seconds_count",
                   "meshserve_engine_busy_ratio", "meshserve_model_flops_utilization_ratio",
                   "meshserve_process_cpu_utilization_ratio", "meshserve_engine_forward_seconds_total"],
    "kvstore": ["meshserve_kvstore_hit_ratio", "meshserve_kvstore_hit_blocks_total", "meshserve_kvstore_misses_total",
                "meshserve_kvstore_received_bytes_total", "meshserve_kvstore_sent_bytes_total",
                "meshserve_kvstore_get_seconds_bucket", "meshserve_kvstore_evictions_total",
                "meshserve_kvstore_used_bytes"],
}


def scrape(url: str) -> tuple[dict[str, float], set[str]]:
    """(sample name → value summed over its labels, every family and sample name) of one endpoint."""
    with urllib.request.urlopen(url, timeout=10) as resp:
        assert resp.status == 200
        text = resp.read().decode()
    values: dict[str, float] = {}
    names: set[str] = set()
    for family in text_string_to_metric_families(text):
        names.add(family.name)
        for s in family.samples:
            if s.name.endswith("_bucket"):  # summing buckets over le means nothing; presence is enough
                values.setdefault(s.name, 0.0)
            else:
                values[s.name] = values.get(s.name, 0.0) + s.value
            names.add(s.name)
    return values, names


@pytest_asyncio.fixture(scope="module")
async def run(tokenizer):
    """The mesh after 5 requests that produce tokens (one of 1 token, one that hits the
    prefix cache, one of 2 choices, two concurrent ones that force a preemption) and
    one invalid request."""
    engine = make_engine(num_blocks=NUM_BLOCKS)
    m = await start_local_mesh([engine], tokenizer, kvstore=KVStore(64 << 20), metrics=True)
    greedy = dict(temperature=0.0, ignore_eos=True)
    results = [await generate(m.stub, build_request(prompt(0), max_tokens=1, **greedy), timeout=300)]
    results.append(await generate(m.stub, build_request(prompt(0), max_tokens=2, **greedy), timeout=300))
    results += await generate_choices(m.stub, build_request(prompt(3), max_tokens=3, n=2, temperature=1.0, seed=7,
                                                            ignore_eos=True), timeout=300)
    results += await asyncio.gather(*(generate(m.stub, build_request(prompt(s), max_tokens=60, **greedy), timeout=600)
                                      for s in (1, 2)))
    with pytest.raises(Exception, match="max_model_len"):
        await generate(m.stub, build_request(list(range(1, 1100)), max_tokens=1), timeout=60)
    await m.wait_idle()
    connector = engine.kv_connector
    deadline = asyncio.get_running_loop().time() + 120  # publishes to the kvstore are asynchronous
    while asyncio.get_running_loop().time() < deadline:
        if connector.stats().published_blocks + connector.stats().publish_dropped_blocks and \
                m.kvstore.servicer.store.stats().bytes_in == connector.stats().bytes_out:
            break
        await asyncio.sleep(0.05)
    scraped = {name: scrape(url) for name, url in m.metrics_urls().items()}
    yield m, engine, results, scraped
    await m.stop()


async def test_every_metric_is_exported_by_its_service(run):
    m, _, _, scraped = run
    assert set(m.metrics_urls()) == {"gateway", "scheduler", "executor-0", "kvstore"}
    for service, names in REQUIRED.items():
        missing = [n for n in names if n not in scraped[service][1]]
        assert not missing, f"{service} lacks {missing}"
        assert scraped[service][0]["meshserve_build_info"] == 1.0


async def test_request_metrics_count_every_request_exactly_once(run):
    _, engine, results, scraped = run
    assert [len(r.token_ids) for r in results] == [1, 2, 3, 3, 60, 60]
    assert engine.stats().num_preemptions > 0  # one of the two long requests was preempted
    gw = scraped["gateway"][0]
    # once per request with tokens: the preempted one and the one of 2 choices included
    assert gw["meshserve_request_ttft_seconds_count"] == 5
    assert gw["meshserve_request_queue_seconds_count"] == 5
    assert gw["meshserve_request_tpot_seconds_count"] == 5  # per choice of >= 2 tokens: 1 + 2 + 2
    assert gw["meshserve_request_e2e_seconds_count"] == 6  # every request, the invalid one too
    assert gw["meshserve_requests_total"] == 6
    assert gw["meshserve_request_prompt_tokens_total"] == 5 * PROMPT_LEN
    assert gw["meshserve_request_generation_tokens_total"] == 129
    assert gw["meshserve_gateway_requests_running"] == 0
    sched = scraped["scheduler"][0]
    assert sched["meshserve_scheduler_requests_admitted_total"] == 5
    assert sched["meshserve_scheduler_queue_seconds_count"] == 5
    assert sched["meshserve_scheduler_executors"] == 1
    assert sched["meshserve_scheduler_requests_running"] == 0
    assert sched["meshserve_scheduler_predictor_observed_total"] == 5


async def test_request_outcomes_and_labels(run):
    m, *_ = run
    get = m.gateway.servicer.core.metrics.registry.get_sample_value
    labels = {"tenant": "default", "priority": "0"}
    assert get("meshserve_requests_total", {**labels, "outcome": "ok"}) == 5
    assert get("meshserve_requests_total", {**labels, "outcome": "invalid_argument"}) == 1
    assert get("meshserve_request_ttft_seconds_count", labels) == 5


async def test_engine_metrics_are_the_engine_counters(run):
    _, engine, _, scraped = run
    s = engine.stats()
    ex = scraped["executor-0"][0]
    assert ex["meshserve_engine_preemptions_total"] == s.num_preemptions > 0
    assert ex["meshserve_engine_generation_tokens_total"] == s.num_generation_tokens == 129
    assert ex["meshserve_engine_prompt_tokens_total"] == s.num_prompt_tokens
    assert ex["meshserve_engine_requests_finished_total"] == s.num_finished == 6  # one per choice
    assert ex["meshserve_engine_requests_running"] == ex["meshserve_engine_requests_waiting"] == 0
    assert ex["meshserve_kv_cache_usage_ratio"] == 0.0
    assert ex["meshserve_kv_cache_blocks"] == NUM_BLOCKS + s.num_free_blocks + s.num_cached_free_blocks
    assert ex["meshserve_prefix_cache_hit_tokens_total"] == s.prefix_cache_hit_tokens >= 32  # the repeated prompt
    assert ex["meshserve_prefix_cache_hit_ratio"] == pytest.approx(s.prefix_cache_hit_rate)
    assert ex["meshserve_engine_forward_tokens_total"] == s.num_forward_tokens
    assert ex["meshserve_engine_forward_seconds_total"] == pytest.approx(s.forward_seconds)
    assert ex["meshserve_model_parameters"] == engine.num_params > 100_000_000
    assert 0.0 < ex["meshserve_engine_busy_ratio"] <= 1.0
    assert 0.0 < ex["meshserve_model_flops_utilization_ratio"] <= 1.0
    assert 0.0 <= ex["meshserve_process_cpu_utilization_ratio"] <= 1.0
    assert "meshserve_gpu_utilization_ratio" not in scraped["executor-0"][1]  # CPU engine: no NVML


async def test_kvstore_metrics_match_the_executor_side(run):
    _, engine, _, scraped = run
    kv = scraped["kvstore"][0]
    conn = engine.kv_connector.stats()
    assert kv["meshserve_kvstore_received_bytes_total"] == conn.bytes_out > 0
    assert kv["meshserve_kvstore_blocks_stored_total"] == conn.published_blocks > 0
    assert scraped["executor-0"][0]["meshserve_executor_kvstore_sent_bytes_total"] == conn.bytes_out


async def test_dashboard_and_alerts_name_only_exported_metrics(run):
    """Every metric of the dashboard's and the rules' PromQL is exposed by some service
    after this run; the GPU gauges come from the NVML path (a fake NVML module here)."""
    _, _, _, scraped = run
    exposed = set().union(*(names for _, names in scraped.values()))
    exposed |= {s.name for f in DeviceCollector("cuda:0", nvml=fake_nvml()).collect() for s in f.samples}
    dashboard = set().union(*map(metric_names, dashboard_exprs()))
    assert len(dashboard) >= 20
    assert sorted(dashboard - exposed) == []
    assert sorted(set().union(*map(metric_names, alert_exprs())) - exposed) == ["up"]  # Prometheus' own
