"""``GET /metrics`` on the gateway's API port: served in open mode (no tenants file:
every caller is tenant ``default``), 404 with a tenants file, even to a valid key,
since the metrics name every tenant and its traffic (operators scrape
``--metrics-port``)."""

from __future__ import annotations

from gateway.tenants import TenantRegistry
from tests.support.served_gateway import served_gateway


async def test_open_mode_serves_metrics_on_the_api_port():
    async with served_gateway() as (http, _):
        r = await http.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    assert "# TYPE meshserve_request_ttft_seconds histogram" in r.text


async def test_with_a_tenants_file_the_api_port_does_not_serve_metrics(tmp_path):
    path = tmp_path / "tenants.toml"
    path.write_text('[[tenants]]\nname = "acme"\napi_keys = ["key-acme"]\n')
    async with served_gateway(tenants=TenantRegistry.from_file(path)) as (http, _):
        r = await http.get("/metrics", headers={"authorization": "Bearer key-acme"})
        assert r.status_code == 404
        assert r.json()["error"]["code"] == "not_found"
        assert "scrape the gateway's --metrics-port" in r.json()["error"]["message"]
        with_key = await http.get("/v1/models", headers={"authorization": "Bearer key-acme"})
        assert with_key.status_code == 200  # the key is valid: /metrics is refused for what it would show
