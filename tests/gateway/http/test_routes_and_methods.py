"""What the HTTP face answers a path it does not serve or a method a path does not take:
OpenAI's error body, and for a wrong method the ``Allow`` header RFC 9110 requires of a
405 (Starlette's own answer carries it)."""

from __future__ import annotations

from tests.support.served_gateway import served_gateway

WRONG_METHODS = [  # (method, path, the methods it allows, in any order: Starlette joins a set)
    ("GET", "/v1/completions", {"POST"}),
    ("PUT", "/v1/chat/completions", {"POST"}),
    ("POST", "/v1/models", {"GET"}),
    ("POST", "/health", {"GET", "HEAD"}),
    ("PUT", "/v1/tasks/t-1", {"GET", "DELETE"}),  # two routes on one path: the methods of both
    ("POST", "/v1/tasks/t-1", {"GET", "DELETE"}),
    ("GET", "/v1/tasks/t-1/cancel", {"POST"}),
]


async def test_a_wrong_method_is_405_naming_the_methods_allowed_and_an_unknown_path_404():
    async with served_gateway() as (http, _):
        for method, path, allow in WRONG_METHODS:
            r = await http.request(method, path)
            assert r.status_code == 405, (method, path)
            assert set(r.headers.get("allow", "").split(", ")) == allow, (method, path)
            assert r.json() == {"error": {"message": "Method Not Allowed", "type": "invalid_request_error",
                                          "param": None, "code": None}}
        r = await http.post("/v1/embeddings", json={"input": "Hi"})
        assert (r.status_code, r.json()["error"]["code"]) == (404, "not_found")
