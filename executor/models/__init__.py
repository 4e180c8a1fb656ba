"""Our model implementations, chosen by the checkpoint's ``architectures`` entry
(or its ``model_type`` when ``architectures`` is missing, as in GGUF conversions)."""

from __future__ import annotations

from torch import nn

from executor.models.llama import LlamaForCausalLM

# transformers architecture name -> our class (the Llama family shares one).
MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
}
_BY_MODEL_TYPE = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM"}


def model_class(hf_config) -> type[nn.Module]:
    """Our class for the first supported name in the config's ``architectures``, else
    for its ``model_type``.

    Raises:
        ValueError: the architecture is not supported.
    """
    names = list(getattr(hf_config, "architectures", None) or [])
    names.append(_BY_MODEL_TYPE.get(getattr(hf_config, "model_type", ""), ""))
    for name in names:
        if name in MODEL_REGISTRY:
            return MODEL_REGISTRY[name]
    raise ValueError(f"unsupported model: architectures {names[:-1]}, model_type "
                     f"{getattr(hf_config, 'model_type', None)!r}; supported: {', '.join(MODEL_REGISTRY)}")


__all__ = ["MODEL_REGISTRY", "LlamaForCausalLM", "model_class"]
