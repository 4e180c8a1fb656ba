"""Every HTTP error from its cause, in OpenAI's JSON error shape, through the
``openai`` client (status and body) and raw ``httpx`` (headers, bodies the client
would refuse to send)."""

import json

import httpx2 as httpx
import openai
import pytest

from tests.support.http_mesh import KEY_A, KEY_QUOTA, SERVED

pytestmark = pytest.mark.model
CHAT = [{"role": "user", "content": "Hi"}]


@pytest.fixture
def aclient(http_mesh):
    return openai.AsyncOpenAI(base_url=f"{http_mesh.http_url}/v1", api_key=KEY_A, max_retries=0)


def _check_shape(response: httpx.Response, status: int, code, param=None):
    assert response.status_code == status
    assert response.headers["content-type"] == "application/json"
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["code"], error["param"]) == (code, param)
    return error


async def test_bad_parameter_is_400_naming_it(aclient):
    with pytest.raises(openai.BadRequestError) as err:
        await aclient.chat.completions.create(model=SERVED, messages=CHAT, temperature=-1)
    assert err.value.status_code == 400 and err.value.body["param"] == "temperature"
    assert "temperature" in err.value.body["message"]


async def test_malformed_json_is_400(http_mesh):
    async with httpx.AsyncClient(base_url=http_mesh.http_url) as http:
        r = await http.post("/v1/chat/completions", content=b"{not json", headers={
            "authorization": f"Bearer {KEY_A}", "content-type": "application/json"})
    _check_shape(r, 400, "invalid_value", None)


async def test_missing_or_unknown_key_is_401(http_mesh):
    client = openai.AsyncOpenAI(base_url=f"{http_mesh.http_url}/v1", api_key="not-a-key", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as err:
        await client.chat.completions.create(model=SERVED, messages=CHAT)
    assert err.value.status_code == 401 and err.value.body["code"] == "invalid_api_key"
    async with httpx.AsyncClient(base_url=http_mesh.http_url) as http:  # no key at all
        r = await http.post("/v1/chat/completions", json={"model": SERVED, "messages": CHAT})
    assert "missing API key" in _check_shape(r, 401, "invalid_api_key")["message"]


async def test_unknown_model_is_404_model_not_found(http_mesh, aclient):
    with pytest.raises(openai.NotFoundError) as err:
        await aclient.completions.create(model="gpt-4", prompt="Hi", max_tokens=2)
    assert err.value.body["code"] == "model_not_found" and err.value.body["param"] == "model"
    with pytest.raises(openai.NotFoundError):  # the model id is not a served name when names are given
        await aclient.completions.create(model=http_mesh.engines[0].model_id, prompt="Hi", max_tokens=2)


async def test_a_request_that_never_fits_its_tenant_quota_is_429_insufficient_quota_without_retry_after(
        http_mesh):
    """A request that alone needs more KV blocks than its tenant's quota (1 block):
    the scheduler's RESOURCE_EXHAUSTED with no retry delay (waiting never helps), as
    OpenAI's 429 ``insufficient_quota`` with no Retry-After."""
    async with httpx.AsyncClient(base_url=http_mesh.http_url) as http:
        r = await http.post("/v1/completions", headers={"authorization": f"Bearer {KEY_QUOTA}"},
                            json={"model": SERVED, "prompt": "word " * 40, "max_tokens": 4})
    error = _check_shape(r, 429, "insufficient_quota")
    assert error["type"] == "insufficient_quota" and "has a quota of 1 blocks" in error["message"]
    assert "retry-after" not in r.headers and r.headers["x-should-retry"] == "false"


async def test_body_over_the_limit_is_413(http_mesh):
    """Case C37 (HTTP): a 64 MB body is refused with 413 before it is read."""
    async with httpx.AsyncClient(base_url=http_mesh.http_url) as http:
        r = await http.post("/v1/completions", headers={"authorization": f"Bearer {KEY_A}",
                                                        "content-type": "application/json"},
                            content=b"x" * (64 << 20))
    _check_shape(r, 413, "request_too_large")


async def test_a_chunked_body_over_the_limit_is_413(http_mesh):
    """Case C37 (HTTP): a body with no Content-Length (chunked) that passes 8 MiB is
    refused with 413 once the bytes received pass it, not FastAPI's 400."""
    async def chunks():
        for _ in range(16):
            yield b"x" * (1 << 20)

    async with httpx.AsyncClient(base_url=http_mesh.http_url) as http:
        r = await http.post("/v1/completions", headers={"authorization": f"Bearer {KEY_A}",
                                                        "content-type": "application/json"}, content=chunks())
    assert "content-length" not in r.request.headers
    _check_shape(r, 413, "request_too_large")


@pytest.mark.parametrize("field,value,cap", [("n", 1_000_000, "16"), ("stop", ["s"] * 100_000, "16"),
                                             ("stop_token_ids", list(range(10_000)), "64")])
async def test_huge_fields_are_400_naming_field_and_cap(http_mesh, field, value, cap):
    """Case C37 (HTTP): n = 1,000,000, 100,000 stop strings, 10,000 stop_token_ids:
    400 naming the field and its cap, and the executor does no work."""
    engine = http_mesh.engines[0]
    steps = engine.num_steps
    async with httpx.AsyncClient(base_url=http_mesh.http_url) as http:
        r = await http.post("/v1/completions", headers={"authorization": f"Bearer {KEY_A}"},
                            json={"model": SERVED, "prompt": "Hi", field: value})
    error = _check_shape(r, 400, "invalid_value", field)
    assert cap in error["message"]
    assert engine.num_steps == steps


@pytest.mark.parametrize("field,value,param", [("prompt", "\ud800", "prompt"), ("stop", ["\ud800"], "stop"),
                                               ("seed", 1 << 63, "seed")])
async def test_lone_surrogates_and_out_of_range_seeds_are_400(http_mesh, field, value, param):
    """JSON can carry what the wire cannot: a lone surrogate ("\\ud800") in a prompt or
    stop string, a seed past int64. Each is 400 (was 500), and the executor does no work."""
    engine = http_mesh.engines[0]
    steps = engine.num_steps
    body = {"model": SERVED, "prompt": "Hi", "max_tokens": 1, field: value}
    async with httpx.AsyncClient(base_url=http_mesh.http_url) as http:
        r = await http.post("/v1/completions", headers={"authorization": f"Bearer {KEY_A}",
                                                        "content-type": "application/json"},
                            content=json.dumps(body).encode())  # json.dumps escapes the surrogate
    error = _check_shape(r, 400, "invalid_value", param)
    assert "Unicode" in error["message"] or "seed must be in" in error["message"]
    assert engine.num_steps == steps


async def test_health_version_metrics_and_ready(http_mesh):
    async with httpx.AsyncClient(base_url=http_mesh.http_url) as http:
        assert (await http.get("/health")).json() == {"status": "ok"}
        head = await http.head("/health")
        assert (head.status_code, head.content) == (200, b"")
        assert (await http.get("/ready")).status_code == 200
        from meshserve import __version__
        assert (await http.get("/version")).json() == {"version": __version__}
        metrics = await http.get("/metrics", headers={"authorization": f"Bearer {KEY_QUOTA}"})
        error = _check_shape(metrics, 404, "not_found")  # a tenants file: every tenant's traffic, not for a tenant
        assert error["message"] == ("/metrics is not served on the API port when a tenants file is in use; "
                                    "scrape the gateway's --metrics-port")
        r = await http.get("/v1/nothing-here")
        _check_shape(r, 404, "not_found")
