"""Tenants: the TOML file, both key headers, unknown keys, open mode."""

from __future__ import annotations

import pytest

from gateway.tenants import Tenant, TenantRegistry
from meshserve.errors import Unauthenticated

TENANTS_TOML = """
[[tenants]]
name = "acme"
api_keys = ["key-1", "key-2"]
default_priority = 0
kv_quota_blocks = 4096

[[tenants]]
name = "globex"
api_keys = ["key-3"]
default_priority = 5
"""


@pytest.fixture
def registry(tmp_path) -> TenantRegistry:
    path = tmp_path / "tenants.toml"
    path.write_text(TENANTS_TOML)
    return TenantRegistry.from_file(path)


def test_file_parsing(registry):
    assert registry.tenants == (Tenant("acme", 0, 4096), Tenant("globex", 5, None))
    assert registry.get("globex") == Tenant("globex", 5, None)
    assert registry.get("nobody") is None
    assert not registry.open_mode


@pytest.mark.parametrize(
    "metadata, name",
    [
        ([("x-api-key", "key-1")], "acme"),
        ([("x-api-key", "key-2")], "acme"),
        ([("authorization", "Bearer key-3")], "globex"),
        ([("authorization", "bearer  key-3 ")], "globex"),
        ([("Authorization", b"Bearer key-1")], "acme"),
        ([("x-api-key", b"key-3")], "globex"),
        ([("user-agent", "grpc"), ("x-api-key", "key-1"), ("authorization", "Bearer key-1")], "acme"),
    ],
)
def test_authenticate_both_headers(registry, metadata, name):
    assert registry.authenticate(metadata).name == name


@pytest.mark.parametrize(
    "metadata, message",
    [
        ([], "missing API key"),
        (None, "missing API key"),
        ([("user-agent", "grpc")], "missing API key"),
        ([("x-api-key", "")], "missing API key"),
        ([("x-api-key", "key-9")], "unknown API key"),
        ([("authorization", "Bearer key-9")], "unknown API key"),
        ([("authorization", "Basic a2V5LTE=")], "Bearer"),
        ([("authorization", "Bearer")], "Bearer"),
        ([("x-api-key", "key-1"), ("authorization", "Bearer key-3")], "conflicting"),
    ],
)
def test_authenticate_refuses(registry, metadata, message):
    with pytest.raises(Unauthenticated, match=message):
        registry.authenticate(metadata)


def test_open_mode_everyone_is_default():
    registry = TenantRegistry.open()
    assert registry.open_mode
    assert registry.authenticate([]) == Tenant("default")
    assert registry.authenticate([("x-api-key", "anything")]) == Tenant("default")
    assert registry.authenticate([("authorization", "Basic zzz")]) == Tenant("default")
    assert registry.tenants == (Tenant("default"),)


@pytest.mark.parametrize(
    "text, problem",
    [
        ("[[tenants]\nname = 1", "not valid TOML"),
        ("", r"\[\[tenants\]\]"),
        ('title = "x"\n[[tenants]]\nname = "a"\napi_keys = ["k"]', "unknown top-level keys"),
        ('[[tenants]]\napi_keys = ["k"]', "'name'"),
        ('[[tenants]]\nname = "a\\u0000b"\napi_keys = ["k"]', "'name' must not hold a NUL character"),
        ('[[tenants]]\nname = "a"', "'api_keys'"),
        ('[[tenants]]\nname = "a"\napi_keys = []', "'api_keys'"),
        ('[[tenants]]\nname = "a"\napi_keys = [""]', "'api_keys'"),
        ('[[tenants]]\nname = "a"\napi_keys = [" k"]', "whitespace"),
        ('[[tenants]]\nname = "a"\napi_keys = ["clé-secrète"]', "other than printable ASCII"),
        ('[[tenants]]\nname = "a"\napi_keys = ["k\\u0007y"]', "other than printable ASCII"),
        ('[[tenants]]\nname = "a"\napi_keys = ["k"]\ndefault_priority = "high"', "'default_priority'"),
        ('[[tenants]]\nname = "a"\napi_keys = ["k"]\nkv_quota_blocks = 0', "'kv_quota_blocks'"),
        ('[[tenants]]\nname = "a"\napi_keys = ["k"]\nkv_quota = 5', "unknown fields"),
        ('[[tenants]]\nname = "a"\napi_keys = ["k"]\nmax_unfinished_tasks = 0',
         "'max_unfinished_tasks' must be an integer >= 1 \\(tasks\\), got 0"),
        ('[[tenants]]\nname = "a"\napi_keys = ["k"]\nmax_unfinished_tasks = 2.5', "got 2.5"),
        ('[[tenants]]\nname = "a"\napi_keys = ["k"]\nmax_unfinished_tasks = true', "got True"),
        ('[[tenants]]\nname = "a"\napi_keys = ["k"]\n[[tenants]]\nname = "a"\napi_keys = ["j"]', "duplicate tenant"),
        ('[[tenants]]\nname = "a"\napi_keys = ["k"]\n[[tenants]]\nname = "b"\napi_keys = ["k"]', "listed twice"),
    ],
)
def test_bad_file_names_path_and_problem(tmp_path, text, problem):
    path = tmp_path / "tenants.toml"
    path.write_text(text)
    with pytest.raises(ValueError, match=problem) as info:
        TenantRegistry.from_file(path)
    assert str(path) in str(info.value)


def test_max_unfinished_tasks_is_read_per_tenant_and_unset_by_default(tmp_path):
    path = tmp_path / "tenants.toml"
    path.write_text('[[tenants]]\nname = "acme"\napi_keys = ["k"]\nmax_unfinished_tasks = 3\n\n'
                    '[[tenants]]\nname = "globex"\napi_keys = ["g"]\n')
    registry = TenantRegistry.from_file(path)
    assert [(t.name, t.max_unfinished_tasks) for t in registry.tenants] == [("acme", 3), ("globex", None)]


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError):
        TenantRegistry.from_file(tmp_path / "absent.toml")
