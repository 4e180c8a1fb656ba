"""A dropped model frees its weights at once, by reference counting alone.

Each parameter carries its layer's ``weight_loader``. Held as a plain bound method
it made a reference cycle (layer -> parameter -> method -> layer), so a dropped
model's weights stayed in memory until Python's cyclic collector ran, which a
model of few large tensors rarely triggers: the test suite's process grew by a
model's weights (~0.9 GB) per engine it built. These tests run with the cyclic
collector off."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from executor.model_loader import load_model
from executor.models.embedding import VocabParallelEmbedding
from executor.models.linear import (ColumnParallelLinear, MergedColumnParallelLinear, QKVParallelLinear,
                                    RowParallelLinear)
from tests.support.parallel import save_tiny


@pytest.fixture
def no_cyclic_gc():
    gc.collect()
    gc.disable()
    yield
    gc.enable()


LAYERS = {
    "column": lambda: ColumnParallelLinear(4, 6, bias=True),
    "merged-column": lambda: MergedColumnParallelLinear(4, [3, 3]),
    "qkv": lambda: QKVParallelLinear(4, 2, 2, 1),
    "row": lambda: RowParallelLinear(6, 4, bias=True),
    "embedding": lambda: VocabParallelEmbedding(6, 4),
}


@pytest.mark.parametrize("make", LAYERS.values(), ids=LAYERS.keys())
def test_a_layer_is_freed_by_refcount_and_its_kept_parameter_loads_only_while_it_lives(make, no_cyclic_gc):
    layer = make()
    weight = layer.weight
    full = torch.arange(weight.numel(), dtype=torch.float32).reshape(weight.shape)
    if isinstance(layer, (MergedColumnParallelLinear, QKVParallelLinear)):
        shard = 0 if isinstance(layer, MergedColumnParallelLinear) else "q"
        rows = 3 if isinstance(layer, MergedColumnParallelLinear) else layer.q_size
        weight.weight_loader(weight, full[:rows], shard)
        assert torch.equal(weight[:rows], full[:rows])
    else:
        weight.weight_loader(weight, full)
        assert torch.equal(weight, full)

    alive = weakref.ref(layer)
    del layer
    assert alive() is None
    with pytest.raises(ReferenceError, match="no longer exists"):
        weight.weight_loader(weight, full)


def test_a_loaded_and_packed_model_is_freed_by_refcount_alone(tmp_path, no_cyclic_gc):
    """A tiny Llama, loaded with its weights packed for the CPU GEMM: once the last
    reference goes, the model, its parameters and packed weights are gone."""
    path = save_tiny(tmp_path, "llama", 2)
    loaded = load_model(path, dtype="float32")
    model = weakref.ref(loaded.model)
    params = [weakref.ref(p) for p in loaded.model.parameters()]
    assert len(params) > 10
    del loaded
    assert model() is None
    assert [p for p in params if p() is not None] == []
