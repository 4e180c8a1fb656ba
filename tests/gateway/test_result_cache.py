"""The result cache: which requests are deterministic, what the key covers, LRU and TTL."""

from __future__ import annotations

from dataclasses import fields, replace

import pytest

from gateway.result_cache import ResultCache, cache_key, is_deterministic
from meshserve.errors import InvalidArgument
from meshserve.sampling import SamplingParams
from meshserve.structured_output import StructuredOutput


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize("params, deterministic", [
    (SamplingParams(temperature=0.0), True),
    (SamplingParams(temperature=0.0009), True),
    (SamplingParams(temperature=0.7, top_k=1), True),
    (SamplingParams(temperature=0.7, seed=3), True),
    (SamplingParams(temperature=1.0, seed=0), True),
    (SamplingParams(temperature=0.7), False),
    (SamplingParams(temperature=1.0, top_k=2), False),
])
def test_deterministic_means_greedy_or_seeded(params, deterministic):
    assert is_deterministic(params) is deterministic


# a value different from the default for every field of SamplingParams
CHANGED = {"max_tokens": 17, "temperature": 0.5, "top_p": 0.9, "top_k": 5, "seed": 1, "stop": ("x",),
           "stop_token_ids": (7,), "ignore_eos": True, "min_p": 0.1, "repetition_penalty": 1.1,
           "presence_penalty": 0.5, "frequency_penalty": 0.5, "min_tokens": 2, "n": 2, "logprobs": 0,
           "prompt_logprobs": 0, "logit_bias": ((5, 1.0),), "structured_output": StructuredOutput("json_object")}


def test_every_parameter_model_and_prompt_change_the_key():
    assert set(CHANGED) == {f.name for f in fields(SamplingParams)}  # a new field must be added here
    base = SamplingParams(temperature=0.0)
    a = "tenant:a"
    key = cache_key("m", "r1", [1, 2, 3], base, scope=a)
    assert key == cache_key("m", "r1", [1, 2, 3], SamplingParams(temperature=0.0), scope=a)
    assert len(key) == 64
    keys = {cache_key("m", "r1", [1, 2, 3], replace(base, **{name: value}), scope=a)
            for name, value in CHANGED.items()}
    keys |= {cache_key("m2", "r1", [1, 2, 3], base, scope=a), cache_key("m", "r2", [1, 2, 3], base, scope=a),
             cache_key("m", "r1", [1, 2], base, scope=a), cache_key("m", "r1", [1, 2, 4], base, scope=a),
             cache_key("m", "r1", [1, 2, 3], base, scope="tenant:b")}
    assert len(keys) == len(CHANGED) + 5 and key not in keys


def test_each_logit_bias_has_its_own_key_and_validate_makes_the_order_irrelevant():
    from meshserve.sampling import validate

    def key(*pairs):
        params = validate(SamplingParams(temperature=0.0, logit_bias=pairs), max_model_len=64, vocab_size=100)
        return cache_key("m", "r1", [1, 2, 3], params, scope="tenant:a")

    keys = [key(), key((5, 1.0)), key((5, 2.0)), key((6, 1.0)), key((5, 1.0), (6, 1.0)), key((5, -1.0))]
    assert len(set(keys)) == len(keys)
    assert key((6, 1.0), (5, 1.0)) == key((5, 1.0), (6, 1.0))  # a JSON object's key order means nothing


def test_each_structured_output_has_its_own_key():
    def key(structured):
        return cache_key("m", "r1", [1, 2, 3], SamplingParams(temperature=0.0, structured_output=structured),
                         scope="tenant:a")

    keys = [key(None), key(StructuredOutput("json_object")), key(StructuredOutput("json", '{"type":"object"}')),
            key(StructuredOutput("json", '{"type":"array"}')), key(StructuredOutput("regex", "[a-z]+")),
            key(StructuredOutput("grammar", "[a-z]+")), key(StructuredOutput("choice", choices=("a", "b"))),
            key(StructuredOutput("choice", choices=("b", "a"))), key(StructuredOutput("choice", choices=("a,b",)))]
    assert len(set(keys)) == len(keys)


def test_a_cache_salt_changes_the_key_and_no_salt_keeps_the_documented_one():
    base = SamplingParams(temperature=0.0)
    key = cache_key("m", "r1", [1, 2, 3], base, scope="tenant:a")
    assert cache_key("m", "r1", [1, 2, 3], base, scope="tenant:a", cache_salt="") == key
    salted = {cache_key("m", "r1", [1, 2, 3], base, scope="tenant:a", cache_salt=s) for s in ("s1", "s2")}
    assert len(salted) == 2 and key not in salted


def test_lru_bound_and_counters():
    cache = ResultCache(max_entries=2, ttl_s=60.0, clock=FakeClock())
    cache.put("a", 1)
    cache.put("b", 2)
    assert cache.get("a") == 1            # a is now the most recent
    cache.put("c", 3)                     # evicts b, the least recently used
    assert (cache.get("b"), cache.get("a"), cache.get("c")) == (None, 1, 3)
    assert (cache.hits, cache.misses, len(cache)) == (3, 1, 2)
    cache.put("a", 10)
    assert cache.get("a") == 10


def test_entries_expire_after_the_ttl():
    clock = FakeClock()
    cache = ResultCache(max_entries=8, ttl_s=10.0, clock=clock)
    cache.put("a", "x")
    clock.now = 9.9
    cache.put("b", "y")
    assert cache.get("a") == "x"          # a read does not extend the TTL
    clock.now = 10.0
    assert cache.get("a") is None and cache.get("b") == "y"
    clock.now = 19.9
    assert cache.get("b") is None and len(cache) == 0


def test_bad_bounds_are_invalid_arguments():
    with pytest.raises(InvalidArgument, match="size"):
        ResultCache(0)
    with pytest.raises(InvalidArgument, match="TTL"):
        ResultCache(4, ttl_s=0.0)


def test_the_key_is_the_documented_sha256_so_gateways_of_other_versions_share_entries():
    """The key is SHA-256 over the canonical JSON of model fingerprint, prompt ids, every
    sampling field (``asdict``; ``logit_bias`` and ``structured_output`` only when set) and scope:
    gateways sharing a Redis cache must agree on it, those that predate them included (the pinned hex)."""
    import hashlib
    import json
    from dataclasses import asdict

    from meshserve.block_hash import ModelFingerprint

    params = SamplingParams(max_tokens=9, temperature=0.0, stop=("\n", "END"), stop_token_ids=(2, 7), seed=5,
                            logprobs=2)
    sampling = {k: v for k, v in asdict(params).items() if k not in ("logit_bias", "structured_output")}
    body = json.dumps({"model": f"{ModelFingerprint('m', 'r1').root_hash:x}", "prompt": [1, 2, 3],
                       "sampling": sampling, "scope": "tenant:acme"}, sort_keys=True, separators=(",", ":"))
    key = cache_key("m", "r1", (1, 2, 3), params, scope="tenant:acme")
    assert key == hashlib.sha256(body.encode()).hexdigest()
    assert key == "45462c2087b41b2bda9b7327f537d9d460a62ff10d45a5338907238a0d578abc"  # before logit_bias existed
    biased = replace(params, logit_bias=((2, -1.5), (7, 100.0)))
    body = json.dumps({"model": f"{ModelFingerprint('m', 'r1').root_hash:x}", "prompt": [1, 2, 3],
                       "sampling": {k: v for k, v in asdict(biased).items() if k != "structured_output"},
                       "scope": "tenant:acme"}, sort_keys=True, separators=(",", ":"))
    assert '"logit_bias":[[2,-1.5],[7,100.0]]' in body
    assert cache_key("m", "r1", (1, 2, 3), biased, scope="tenant:acme") == hashlib.sha256(body.encode()).hexdigest()
    salted = json.dumps({"cache_salt": "s1", "model": f"{ModelFingerprint('m', 'r1').root_hash:x}", "prompt": [1, 2, 3],
                         "sampling": sampling, "scope": "tenant:acme"}, sort_keys=True, separators=(",", ":"))
    assert cache_key("m", "r1", (1, 2, 3), params, scope="tenant:acme", cache_salt="s1") == \
        hashlib.sha256(salted.encode()).hexdigest()
