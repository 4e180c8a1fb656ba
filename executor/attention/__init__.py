"""Paged attention: the per-step metadata, the backend interface and registry, the
torch reference backend, and the layer a model holds."""

from executor.attention.backend import AttentionBackend, KVCache, available_backends, get_backend, register_backend
from executor.attention.layer import Attention
from executor.attention.metadata import AttentionMetadata, build_attention_metadata

__all__ = [
    "Attention",
    "AttentionBackend",
    "AttentionMetadata",
    "KVCache",
    "available_backends",
    "build_attention_metadata",
    "get_backend",
    "register_backend",
]
