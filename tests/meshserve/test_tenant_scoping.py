"""Per-tenant scoping in the shared library: request ids (``meshserve.request_ids``) and
the prefix cache's chain salt (``meshserve.block_hash.cache_salt``), with a request's own
``cache_salt``."""

import pytest

from meshserve.block_hash import (MAX_CACHE_SALT_CHARS, ModelFingerprint, cache_salt, check_cache_salt,
                                  routing_block_hashes, salted_root)
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


def test_a_requests_own_salt_joins_the_tenants_and_no_salt_is_the_tenants_alone():
    assert cache_salt("tenant", "acme", "") == cache_salt("tenant", "acme") == "acme"  # as before salts existed
    assert cache_salt("tenant", "acme", "s1") == "acme\x00s1"
    assert cache_salt("global", "acme", "s1") == cache_salt("global", "other", "s1") == "\x00s1"
    assert cache_salt("global", "acme") == ""
    with pytest.raises(ValueError, match="holds NUL"):
        cache_salt("tenant", "a\x00b", "s")


def test_salted_chains_are_shared_by_the_same_tenant_and_salt_only():
    prompt = list(range(100, 164))  # 4 blocks of 16
    chains = {(t, s): tuple(routing_block_hashes(prompt, 16, "m", "r", cache_salt=cache_salt("tenant", t, s)))
              for t in ("a", "b") for s in ("", "s1", "s2", "b\x00s1")}
    assert len(set(chains.values())) == 2 * 4  # every (tenant, salt) pair its own chain
    for chain in chains.values():
        assert len(chain) == 4
    assert not set(chains["a", "s1"]) & set(chains["a", ""])  # not one block in common
    assert chains["a", "s1"] == tuple(routing_block_hashes(prompt, 16, "m", "r", cache_salt="a\x00s1"))


@pytest.mark.parametrize("salt, message", [
    ("", "cache_salt must be a non-empty string when set"),
    (7, "cache_salt must be a non-empty string when set"),
    ("s" * (MAX_CACHE_SALT_CHARS + 1), "cache_salt has 257 characters; the limit is 256"),
    ("ok\ud800", "cache_salt is not valid Unicode: a lone surrogate at character 2"),
])
def test_a_bad_cache_salt_is_invalid_argument_naming_it(salt, message):
    with pytest.raises(InvalidArgument) as err:
        check_cache_salt(salt)
    assert str(err.value) == message


def test_good_cache_salts_pass():
    for salt in (None, " ", "s" * MAX_CACHE_SALT_CHARS, "sel-é-😀", "a\x00b"):
        check_cache_salt(salt)
