"""Prefix KV shared between engines through a real kvstore service: a
prefix computed on engine A is fetched by engine B, whose output equals the cold
run token for token; corrupt and missing blocks, a kvstore that is down or
restarted empty all fall back to recompute with the same output; case C06 (keys
carry model identity and dtype); one chain hash names a block everywhere."""

from __future__ import annotations

import time

import pytest

from executor.engine.config import BatchSchedulerConfig, CacheConfig, EngineConfig
from executor.engine.llm_engine import LLMEngine
from executor.kv_events import KvEventBatcher
from executor.kvstore_connector import KVStoreConnector
from kvstore.server import KVStoreServicer
from kvstore.store import KVStore
from meshserve.block_hash import hash_full_blocks, hash_to_bytes, routing_block_hashes
from meshserve.sampling import SamplingParams
from scheduler.prefix_index import PrefixIndex
from tests.support.served_kvstore import STALL_S, CorruptingStore, DelayingServicer, DroppingStore, ServedKVStore

pytestmark = pytest.mark.model

BLOCK = 16
PROMPT_LEN = 300          # 18 full blocks; the last token is always recomputed
HIT = 18 * BLOCK          # 288 tokens loadable from the kvstore


def make_engine(model: str = "default", dtype: str = "float32") -> LLMEngine:
    return LLMEngine(EngineConfig(model=model, dtype=dtype, max_model_len=2048,
                                  cache=CacheConfig(block_size=BLOCK, num_blocks=160),
                                  batch=BatchSchedulerConfig(max_num_seqs=8, max_num_batched_tokens=512)))


@pytest.fixture(scope="module")
def engines():
    return make_engine(), make_engine()


def prompt_of(tokenizer, n: int, salt: str) -> list[int]:
    text = " ".join(f"{salt}: record {i} notes a quiet harbour and {i * 7} gulls." for i in range(120))
    ids = tokenizer(text, add_special_tokens=False)["input_ids"][:n]
    assert len(ids) == n
    return ids


def run_one(engine: LLMEngine, request_id: str, prompt: list[int] | None, max_tokens: int = 24):
    """Runs one greedy request alone (``prompt`` None: ``request_id`` was added already);
    returns (tokens, cached, kvstore tokens, prompt tokens computed)."""
    before = engine.stats().num_prompt_tokens
    if prompt is not None:
        engine.add_request(request_id, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                              ignore_eos=True))
    tokens, first = [], None
    while engine.has_unfinished_requests():
        outs = engine.step()
        if engine.last_step_was_empty:
            time.sleep(0.001)  # a kvstore fetch in flight
        for out in outs:
            tokens += out.new_token_ids
            first = first or out
    engine.check_integrity()
    return tokens, first.num_cached_tokens, first.num_kvstore_tokens, engine.stats().num_prompt_tokens - before


class Shared:
    """Engines connected to one served store for the length of a test."""

    def __init__(self, store: KVStore, *engines: LLMEngine, port: int = 0, servicer_cls=KVStoreServicer):
        self.served = ServedKVStore(store, port, servicer_cls)
        self.engines = engines
        self.connectors = []
        for engine in engines:
            engine.reset_prefix_cache()
            # generous: on a loaded 2-core machine a fetch must never be given up on here (deadlines
            # are tested without a model in tests/executor/test_kv_fetch_scheduling.py)
            connector = KVStoreConnector(self.served.address, engine.kv_store_fingerprint, fetch_timeout_s=120)
            engine.set_kv_connector(connector)
            self.connectors.append(connector)

    def flush(self):
        for connector in self.connectors:
            connector.flush()

    def close(self):
        for engine, connector in zip(self.engines, self.connectors):
            engine.set_kv_connector(None)
            connector.close()
        self.served.stop()


def test_prefix_computed_on_A_is_fetched_by_B(engines, tokenizer):
    a, b = engines
    shared = Shared(KVStore(memory_bytes=64 << 20), a, b)
    try:
        p = prompt_of(tokenizer, PROMPT_LEN, "shared")
        cold, cached, from_store, computed = run_one(a, "a-1", p)
        assert (cached, from_store, computed) == (0, 0, PROMPT_LEN)
        shared.flush()
        # A published every full block it cached: 18 of the prompt, 2 more while decoding (323 tokens computed)
        assert shared.served.stats().blocks_stored == 20
        warm, cached, from_store, computed = run_one(b, "b-1", p)
        assert warm == cold
        assert (cached, from_store, computed) == (HIT, HIT, PROMPT_LEN - HIT)
        s = b.stats()
        assert (s.kvstore_hit_tokens, s.kvstore_queried_tokens) == (HIT, HIT)
        assert (s.kvstore.fetches, s.kvstore.fetched_blocks, s.kvstore.fetch_failures) == (1, 18, 0)
        assert s.kvstore.bytes_in == 18 * b.kv_store_fingerprint.block_bytes
        again, cached, from_store, _ = run_one(b, "b-2", p)   # now a local hit: no second fetch
        assert again == cold and (cached, from_store, b.stats().kvstore.fetches) == (HIT, 0, 1)
        shared.flush()
        assert shared.served.stats().num_leases == 0
    finally:
        shared.close()


def test_corrupt_and_missing_blocks_fall_back_to_recompute(engines, tokenizer):
    a, b = engines
    p = prompt_of(tokenizer, PROMPT_LEN, "faults")
    hashes = hash_full_blocks(p, BLOCK, a.fingerprint.root_hash)  # the one chain: the kvstore's keys too
    store = CorruptingStore(memory_bytes=64 << 20)
    store.corrupt = {hashes[5]}
    shared = Shared(store, a, b)
    try:
        cold, *_ = run_one(a, "a-1", p)
        shared.flush()
        warm, cached, from_store, computed = run_one(b, "b-1", p)
        assert warm == cold
        assert (cached, from_store, computed) == (5 * BLOCK, 5 * BLOCK, PROMPT_LEN - 5 * BLOCK)
        k = b.stats().kvstore
        assert (k.corrupt_blocks, k.fetch_failures, k.fetched_blocks) == (1, 1, 5)
    finally:
        shared.close()

    store = DroppingStore(memory_bytes=64 << 20)
    store.drop = {hashes[7]}
    shared = Shared(store, a, b)
    try:
        cold, *_ = run_one(a, "a-2", p)
        shared.flush()
        warm, cached, from_store, computed = run_one(b, "b-2", p)
        assert warm == cold
        assert (cached, from_store, computed) == (7 * BLOCK, 7 * BLOCK, PROMPT_LEN - 7 * BLOCK)
        assert b.stats().kvstore.fetch_failures == 0  # a miss, not a fault
    finally:
        shared.close()


def test_kvstore_down_or_restarted_loses_only_cache(engines, tokenizer):
    a, b = engines
    p, q = prompt_of(tokenizer, PROMPT_LEN, "restart-p"), prompt_of(tokenizer, PROMPT_LEN, "restart-q")
    shared = Shared(KVStore(memory_bytes=64 << 20), a, b)
    try:
        cold, *_ = run_one(a, "a-1", p)
        shared.flush()
        port = shared.served.port
        shared.served.stop()                              # the kvstore goes away
        warm, cached, from_store, computed = run_one(b, "b-1", p)
        assert warm == cold and (cached, from_store, computed) == (0, 0, PROMPT_LEN), b.stats()
        assert b.stats().kvstore.fetch_failures == 1, b.stats()
        shared.served = ServedKVStore(KVStore(memory_bytes=64 << 20), port)  # back, empty
        for connector in shared.connectors:
            # when it reconnects is gRPC's back-off after the downtime (up to 120 s + jitter;
            # the longer the downtime on a loaded machine, the longer): the bound only stops a hang
            connector.wait_ready(timeout_s=300)
        cold_q, *_ = run_one(b, "b-2", q)
        shared.flush()
        assert shared.served.stats().blocks_stored == 20, (shared.served.stats(), b.stats())
        warm_q, cached, from_store, _ = run_one(a, "a-2", q)
        assert warm_q == cold_q and (cached, from_store) == (HIT, HIT), a.stats()
        again, cached, from_store, _ = run_one(a, "a-3", p)  # A still has p locally
        assert again == cold and (cached, from_store) == (HIT, 0), a.stats()
    finally:
        shared.close()


def test_a_late_fetch_is_given_up_and_recomputed(engines, tokenizer):
    """B's fetch stalls (the store sends one message, then nothing until cancelled);
    on B's fake clock its deadline passes: B gives the fetch up, cancels it and
    recomputes the prompt, with A's tokens."""
    a, b = engines
    p = prompt_of(tokenizer, PROMPT_LEN, "late")
    shared = Shared(KVStore(memory_bytes=64 << 20), a, b, servicer_cls=DelayingServicer)
    now = [1000.0]
    try:
        cold, *_ = run_one(a, "a-1", p)
        shared.flush()
        DelayingServicer.get_delay_s = STALL_S  # only B's fetch stalls (A's own lookup would wait its deadline)
        b.batch_scheduler.clock = lambda: now[0]
        b.add_request("b-1", p, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
        assert b.step() == [] and b.last_step_was_empty   # waiting for the fetch
        now[0] += b.kv_connector.fetch_timeout_s          # its deadline passes
        warm, cached, from_store, computed = run_one(b, "b-1", None)
        assert warm == cold and (cached, from_store, computed) == (0, 0, PROMPT_LEN), b.stats()
        k = b.stats().kvstore
        assert (k.fetch_failures, k.fetches, k.fetched_blocks) == (1, 0, 0)  # cancelled: never finished
        deadline = time.monotonic() + 120
        while shared.served.stats().num_leases:        # the cancelled Get released its leases
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert b.kv_connector._fetches == {} and b.kv_connector.poll() == []
    finally:
        b.batch_scheduler.clock = time.monotonic
        DelayingServicer.get_delay_s = 0.0
        shared.close()


@pytest.fixture(scope="module")
def scaled_model(tmp_path_factory, default_model_files):
    """The default model with one layer's MLP output weights scaled by -1: same
    tokenizer and config, other weights, another model id."""
    import torch
    from safetensors.torch import load_file, save_file

    src = default_model_files.path
    out = tmp_path_factory.mktemp("scaled-model")
    for f in src.iterdir():
        if f.suffix != ".safetensors" and f.is_file():
            (out / f.name).symlink_to(f)
    state = load_file(str(src / "model.safetensors"))
    state["model.layers.3.mlp.down_proj.weight"] = state["model.layers.3.mlp.down_proj.weight"] * -1.0
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    del state
    torch.cuda.empty_cache() if torch.cuda.is_available() else None
    return str(out)


def test_prefix_cache_is_keyed_by_model_identity_and_dtype(engines, tokenizer, scaled_model):
    """Case C06: another model's weights, or the same model in another dtype, never
    get this model's blocks from the kvstore (each computes its own, equal to its cold
    run); the same model on another engine does."""
    a, b = engines
    m2 = make_engine(scaled_model)
    bf16 = make_engine("default", "bfloat16")
    p = prompt_of(tokenizer, PROMPT_LEN, "identity")
    ref_m2, *_ = run_one(m2, "ref-m2", p, 32)           # cold references, no kvstore
    ref_bf16, *_ = run_one(bf16, "ref-bf16", p, 32)
    assert len({a.kv_store_fingerprint.namespace, m2.kv_store_fingerprint.namespace,
                bf16.kv_store_fingerprint.namespace}) == 3
    shared = Shared(KVStore(memory_bytes=128 << 20), a, m2, bf16, b)
    try:
        out_a, *_ = run_one(a, "a-1", p, 32)
        shared.flush()
        assert out_a != ref_m2                           # the weights really differ
        for engine, ref in ((m2, ref_m2), (bf16, ref_bf16)):
            out, cached, from_store, computed = run_one(engine, "other", p, 32)
            assert out == ref and (cached, from_store, computed) == (0, 0, PROMPT_LEN)
            assert engine.stats().kvstore_hit_tokens == 0 and engine.stats().kvstore_queried_tokens == HIT
        _, cached, from_store, _ = run_one(a, "a-2", p, 32)   # a repeat to A still hits (locally)
        assert (cached, from_store) == (HIT, 0)
        out_b, cached, from_store, _ = run_one(b, "b-1", p, 32)  # and the same model elsewhere, from the kvstore
        assert out_b == out_a and (cached, from_store) == (HIT, HIT)
    finally:
        shared.close()


def test_one_chain_names_a_block_in_the_engine_events_gateway_scheduler_and_kvstore(tokenizer):
    """For one prompt, the hashes the engine caches its blocks under, the KV events
    carry, the gateway sends, the scheduler's prefix index matches and the kvstore
    keys are the same list (no translation between chains anywhere)."""
    engine = LLMEngine(EngineConfig(dtype="float32", max_model_len=2048,
                                    cache=CacheConfig(block_size=BLOCK, num_blocks=32, enable_kv_events=True)))
    p = prompt_of(tokenizer, 4 * BLOCK + 5, "one-chain")   # 4 full blocks; max_tokens 1 computes only the prompt
    shared = Shared(KVStore(memory_bytes=64 << 20), engine)
    try:
        run_one(engine, "r", p, max_tokens=1)
        shared.flush()
        gateway = routing_block_hashes(p, BLOCK, engine.model_id, engine.revision)
        cached = [hash_to_bytes(h) for h in engine.kv_cache_manager.block_pool.cached_block_hash_to_block]
        batcher = KvEventBatcher()
        batcher.add(engine.take_kv_events())
        events, removed = batcher.take()
        stored = shared.served.store.lru_order()
        assert {ns for ns, _ in stored} == {engine.kv_store_fingerprint.namespace}
        assert len(gateway) == 4 and removed == []
        assert cached == events == gateway == [hash_to_bytes(h) for _, h in stored]
        index = PrefixIndex()
        index.stored("e0", events)
        assert index.hit_blocks(gateway) == {"e0": 4}
    finally:
        shared.close()
