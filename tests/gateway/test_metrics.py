"""gateway.metrics: one observation per request, bounded tenant and priority labels, outcomes."""

import asyncio

import grpc
import pytest

from gateway.metrics import GatewayMetrics, outcome_of
from meshserve.errors import InvalidArgument, ResourceExhausted


def value(m: GatewayMetrics, name: str, **labels) -> float:
    return m.registry.get_sample_value(name, labels) or 0.0


def test_a_request_is_observed_once_whatever_its_tokens():
    m = GatewayMetrics()
    rm = m.start("acme", 1, started_at=10.0)
    assert value(m, "meshserve_gateway_requests_running", tenant="acme", priority="1") == 1
    rm.num_prompt_tokens = 7
    rm.assigned(10.5)
    for at in (11.0, 11.2, 11.4):  # three messages with tokens: TTFT once, at the first
        rm.first_token(at)
        rm.tokens(2)
    rm.choice_done(4, 11.0, 11.6)  # (11.6 - 11.0) / 3
    rm.choice_done(1, 11.0, 11.0)  # a one-token choice has no inter-token latency
    rm.end(12.0)
    rm.end(13.0)  # a second end is ignored
    labels = dict(tenant="acme", priority="1")
    assert value(m, "meshserve_request_ttft_seconds_count", **labels) == 1
    assert value(m, "meshserve_request_ttft_seconds_sum", **labels) == 1.0
    assert value(m, "meshserve_request_queue_seconds_sum", **labels) == 0.5
    assert value(m, "meshserve_request_tpot_seconds_count", **labels) == 1
    assert value(m, "meshserve_request_tpot_seconds_sum", **labels) == pytest.approx(0.2)
    assert value(m, "meshserve_request_e2e_seconds_sum", **labels) == 2.0
    assert value(m, "meshserve_request_prompt_tokens_total", **labels) == 7
    assert value(m, "meshserve_request_generation_tokens_total", **labels) == 6
    assert value(m, "meshserve_requests_total", outcome="ok", **labels) == 1
    assert value(m, "meshserve_gateway_requests_running", **labels) == 0


def test_a_request_without_tokens_has_no_ttft_but_an_outcome():
    m = GatewayMetrics()
    m.start("acme", 0, 0.0).end(0.1, ResourceExhausted("quota"))
    assert value(m, "meshserve_request_ttft_seconds_count", tenant="acme", priority="0") == 0
    assert value(m, "meshserve_request_e2e_seconds_count", tenant="acme", priority="0") == 1
    assert value(m, "meshserve_requests_total", tenant="acme", priority="0", outcome="resource_exhausted") == 1


def test_tenant_and_priority_labels_are_bounded():
    m = GatewayMetrics(max_tenants=2, max_priorities=1)
    for i, tenant in enumerate(["t0", "t1", "t2", "t3", "t0"]):
        m.start(tenant, i % 2, 0.0).end(1.0)
    series = {(s.labels["tenant"], s.labels["priority"]) for f in m.registry.collect()
              if f.name == "meshserve_requests" for s in f.samples if s.name == "meshserve_requests_total"}
    assert series == {("t0", "0"), ("t1", "other"), ("other", "0"), ("other", "other")}
    assert value(m, "meshserve_requests_total", tenant="other", priority="other", outcome="ok") == 1  # t3, prio 1
    assert value(m, "meshserve_requests_total", tenant="t0", priority="0", outcome="ok") == 2  # first and last


def test_outcome_names():
    class RpcError(Exception):
        def code(self):
            return grpc.StatusCode.DEADLINE_EXCEEDED

    assert [outcome_of(e) for e in (None, InvalidArgument("x"), asyncio.CancelledError(), GeneratorExit(),
                                     RpcError(), KeyError("bug"))] == [
        "ok", "invalid_argument", "cancelled", "cancelled", "deadline_exceeded", "internal"]


async def test_the_gateways_priority_labels_keep_its_tenants_classes(tmp_path):
    from gateway.tenants import TenantRegistry
    from tests.support.served_gateway import served_gateway

    tenants = tmp_path / "tenants.toml"
    tenants.write_text('[[tenants]]\nname = "a"\napi_keys = ["key-a"]\ndefault_priority = 1\nmax_priority = 4\n')
    async with served_gateway(tenants=TenantRegistry.from_file(tenants)) as (_, svc):
        assert svc.servicer.core.metrics.priority_label.kept == {"0", "1", "2", "3", "4"}
