"""The tenants and served name of the HTTP tests' mesh (``tests/mesh/http``): tenant
``a`` and ``b`` with one key each, tenant ``quota`` whose KV quota is one block,
the model served as ``smol``."""

from __future__ import annotations

import textwrap
from pathlib import Path

KEY_A, KEY_B, KEY_QUOTA = "key-a", "key-b", "key-quota"
SERVED = "smol"


def write_tenants(path: Path) -> Path:
    """Writes the tenants file at ``path`` and returns it."""
    path.write_text(textwrap.dedent(f"""
        [[tenants]]
        name = "a"
        api_keys = ["{KEY_A}"]
        [[tenants]]
        name = "b"
        api_keys = ["{KEY_B}"]
        [[tenants]]
        name = "quota"
        api_keys = ["{KEY_QUOTA}"]
        kv_quota_blocks = 1
    """))
    return path
