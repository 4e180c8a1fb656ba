"""``meshserve.model_files.eos_token_ids``: the EOS ids an executor stops on and the
gateway names (``ModelInfo.eos_token_ids``), from ``config.json`` and
``generation_config.json``, either an id or a list."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from meshserve.model_files import eos_token_ids


@pytest.mark.parametrize("config_eos, generation_eos, want", [
    (2, None, {2}),
    (2, [128001, 128008, 2], {2, 128001, 128008}),  # Llama 3's list, the config's own among them
    ([5, 6], 7, {5, 6, 7}),
    (None, None, set()),
])
def test_eos_ids_join_the_config_and_the_generation_config(tmp_path, config_eos, generation_eos, want):
    if generation_eos is not None:
        (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": generation_eos}))
    assert eos_token_ids(tmp_path, SimpleNamespace(eos_token_id=config_eos)) == frozenset(want)


def test_the_gateway_knows_the_default_models_eos(default_model_files):
    from meshserve.cli.processes import model_info

    tokenizer, info = model_info(str(default_model_files.path))
    assert info.eos_token_ids == frozenset({tokenizer.eos_token_id}) == frozenset({2})
