"""Paged attention: the per-step metadata, the backend interface, the backends and their
registry by name, and the layer a model holds."""

from executor.attention.backend import AttentionBackend, KVCache
from executor.attention.layer import Attention
from executor.attention.metadata import AttentionMetadata, build_attention_metadata
from executor.attention.registry import available_backends, get_backend, resolve_backend_name

__all__ = [
    "Attention",
    "AttentionBackend",
    "AttentionMetadata",
    "KVCache",
    "available_backends",
    "build_attention_metadata",
    "get_backend",
    "resolve_backend_name",
]
