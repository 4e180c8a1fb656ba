"""Hugging Face model ids resolved from the local Hugging Face cache, never the network.

``meshserve --model Org/Name`` (optionally ``--revision``) finds the snapshot folder
that ``huggingface_hub`` (``hf download``, ``transformers``' ``from_pretrained``)
left in the cache (``$HF_HUB_CACHE``, else ``$HF_HOME/hub``, else
``~/.cache/huggingface/hub``), as ``HF_HUB_OFFLINE=1`` would: a model that is not
there is an error naming the command that downloads it, not a download.

The cache layout (``huggingface_hub``'s)::

    models--Org--Name/refs/main           the commit hash "main" points at
    models--Org--Name/snapshots/<commit>/ config.json, *.safetensors, tokenizer files
"""

from __future__ import annotations

import re
from pathlib import Path

_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def looks_like_repo_id(name: str) -> bool:
    """True for ``Org/Name`` (one slash, Hub characters) that is not an existing path."""
    return bool(_REPO_ID.match(name)) and not Path(name).expanduser().exists()


def cached_snapshot(repo_id: str, revision: str | None = None) -> tuple[Path, str]:
    """The snapshot folder of ``repo_id`` at ``revision`` (a branch, tag or commit hash;
    None: ``main``) in the local Hugging Face cache, and its commit hash.

    Raises:
        FileNotFoundError: the cache holds no such model or revision (the message
            names the cache folder and the command that downloads it).
    """
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        path = Path(snapshot_download(repo_id, revision=revision, local_files_only=True))
    except (LocalEntryNotFoundError, FileNotFoundError, ValueError) as exc:
        from huggingface_hub import constants

        at = f" at revision {revision!r}" if revision else ""
        raise FileNotFoundError(
            f"model {repo_id!r}{at} is not in the local Hugging Face cache ({constants.HF_HUB_CACHE}); meshserve "
            f"never downloads: fetch it first with `hf download {repo_id}"
            f"{' --revision ' + revision if revision else ''}`") from exc
    return path, path.name
