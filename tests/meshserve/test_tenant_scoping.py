"""Per-tenant scoping in the shared library: request ids (``meshserve.request_ids``) and
the prefix cache's chain salt (``meshserve.block_hash.cache_salt``)."""

import pytest

from meshserve.block_hash import ModelFingerprint, cache_salt, routing_block_hashes, salted_root
from meshserve.errors import InvalidArgument
from meshserve.request_ids import MAX_REQUEST_ID_LEN, check_request_id, scoped_request_id


def test_scoped_request_ids_never_collide_across_tenant_and_id_splits():
    assert scoped_request_id("a/b", "c") != scoped_request_id("a", "b/c")
    assert scoped_request_id("a", "1:x") != scoped_request_id("a/1", "x")
    assert scoped_request_id("acme", "r1") == "4:acme/r1"


def test_request_id_length_limit():
    check_request_id("r" * MAX_REQUEST_ID_LEN)
    with pytest.raises(InvalidArgument, match="257 characters; the limit is 256"):
        check_request_id("r" * (MAX_REQUEST_ID_LEN + 1))


def test_tenant_scope_salts_the_chain_per_tenant_and_global_scope_does_not():
    prompt = list(range(100, 164))  # 4 blocks of 16
    chain = {t: routing_block_hashes(prompt, 16, "m", "r", cache_salt=cache_salt("tenant", t)) for t in "ab"}
    assert chain["a"] != chain["b"] and len(chain["a"]) == 4
    assert not set(chain["a"]) & set(chain["b"])  # not one block in common
    shared = routing_block_hashes(prompt, 16, "m", "r")
    assert routing_block_hashes(prompt, 16, "m", "r", cache_salt=cache_salt("global", "a")) == shared
    root = ModelFingerprint("m", "r").root_hash
    assert salted_root(root, "") == root and salted_root(root, "a") != root


def test_unknown_prefix_cache_scope_is_rejected():
    with pytest.raises(ValueError, match="tenant, global"):
        cache_salt("per-user", "a")
