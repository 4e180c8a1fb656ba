"""A Hugging Face model id resolves from the local Hugging Face cache without the
network, as ``HF_HUB_OFFLINE`` would (``--revision`` included): a tiny random Llama
saved into a temporary cache laid out as ``huggingface_hub`` lays it out; the
executor loads it and the gateway serves it under ``--served-model-name`` with a
``--chat-template``."""

from __future__ import annotations

import shutil

import pytest
import torch

from meshserve.model_files import resolve_model

REPO = "test-org/tiny-llama"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture(scope="module")
def hf_cache(tmp_path_factory, default_model_files):
    """``HF_HUB_CACHE`` with ``models--test-org--tiny-llama`` at ``COMMIT`` (branch main),
    its tokenizer the default model's."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    hub = tmp_path_factory.mktemp("hub")
    repo = hub / "models--test-org--tiny-llama"
    snapshot = repo / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=True)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(snapshot)
    for f in default_model_files.path.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, snapshot / f.name)
    return hub


@pytest.fixture
def offline_cache(hf_cache, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hf_cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return hf_cache


def test_model_id_resolves_to_the_cached_snapshot(offline_cache):
    files = resolve_model(REPO)
    assert files.path == offline_cache / "models--test-org--tiny-llama" / "snapshots" / COMMIT
    assert (files.model_id, files.revision) == (REPO, COMMIT)
    assert resolve_model(REPO, revision=COMMIT).path == files.path
    assert resolve_model(REPO, revision="main").revision == COMMIT


@pytest.mark.parametrize("repo,revision", [("test-org/not-cached", None), (REPO, "v2")])
def test_model_not_in_the_cache_is_an_error_naming_the_download(offline_cache, repo, revision):
    with pytest.raises(FileNotFoundError) as err:
        resolve_model(repo, revision=revision)
    assert f"hf download {repo}" in str(err.value) and str(offline_cache) in str(err.value)


def test_revision_of_a_local_folder_is_refused(default_model_files):
    with pytest.raises(ValueError, match="--revision applies to a Hugging Face model id"):
        resolve_model(str(default_model_files.path), revision="main")


def test_gateway_serves_the_cached_model_by_its_served_name_and_template(offline_cache):
    from meshserve.cli.processes import ModelSource, model_info

    tokenizer, info = model_info(ModelSource(REPO, tokenizer=None, chat_template="{% for m in messages %}"
                                             "<{{ m.role }}>{{ m.content }}{% endfor %}",
                                             served_model_names=("tiny",)))
    assert (info.model_id, info.revision, info.names, info.max_model_len) == (REPO, COMMIT, ("tiny",), 256)
    assert tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == "<user>hi"


@pytest.mark.model
def test_executor_loads_the_cached_model_and_matches_transformers(offline_cache):
    from executor.engine.config import BatchSchedulerConfig, CacheConfig, EngineConfig
    from executor.engine.llm_engine import LLMEngine
    from meshserve.sampling import SamplingParams
    from tests.support.reference import HFReference, assert_greedy_matches

    engine = LLMEngine(EngineConfig(model=REPO, revision="main", dtype="float32",
                                    cache=CacheConfig(block_size=16, num_blocks=16),
                                    batch=BatchSchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64)))
    assert (engine.model_id, engine.revision) == (REPO, COMMIT)
    prompt = [1, 100, 2000, 30000, 5]
    outputs = engine.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    assert_greedy_matches(outputs, HFReference(resolve_model(REPO).path).greedy_many([prompt], 8))
