"""Tiny random-init models of the architectures the engine serves (Llama with tied
embeddings and llama3 rope, Llama with biases, Qwen2, Mistral with a sliding window),
saved with ``save_pretrained`` for the loader."""

from __future__ import annotations

import torch

KINDS = ("llama-tied-llama3-rope", "llama-bias", "qwen2", "mistral-sliding-window")

COMMON = dict(vocab_size=512, hidden_size=96, intermediate_size=128, num_hidden_layers=2, num_attention_heads=6,
              num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.15, eos_token_id=2)
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 32}


def tiny_config(kind: str):
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    if kind == "llama-tied-llama3-rope":
        return LlamaConfig(**COMMON, tie_word_embeddings=True, rope_parameters=LLAMA3_ROPE)
    if kind == "llama-bias":
        return LlamaConfig(**COMMON, attention_bias=True, mlp_bias=True, tie_word_embeddings=False)
    if kind == "qwen2":
        return Qwen2Config(**COMMON, tie_word_embeddings=False)
    if kind == "mistral-sliding-window":
        return MistralConfig(**{**COMMON, "head_dim": 16}, sliding_window=96, tie_word_embeddings=False)
    raise ValueError(kind)


def save_tiny(kind: str, path) -> None:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(kind), dtype=torch.float32)
    with torch.no_grad():  # random biases (zero-initialised by default) so they matter
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.5)
    model.save_pretrained(path)
