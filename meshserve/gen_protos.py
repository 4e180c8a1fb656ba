"""Regenerates the committed gRPC stubs in ``meshserve/v1/`` from ``protos/``.

Run ``python -m meshserve.gen_protos`` (or ``make protos``) after editing a
``.proto``; ``tests/meshserve/test_protos.py`` fails when the committed stubs differ.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "protos"


def proto_files() -> list[Path]:
    """All ``.proto`` sources, sorted, as paths under ``protos/``."""
    return sorted(PROTO_DIR.rglob("*.proto"))


def generate(out_dir: Path) -> None:
    """Writes ``*_pb2.py``, ``*_pb2.pyi`` and ``*_pb2_grpc.py`` under ``out_dir``.

    Raises:
        RuntimeError: protoc reported an error.
    """
    import grpc_tools
    from grpc_tools import protoc

    include = Path(grpc_tools.__file__).parent / "_proto"
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_DIR}",
        f"-I{include}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *[str(p.relative_to(PROTO_DIR)) for p in proto_files()],
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed: {' '.join(args)}")


def main() -> int:
    generate(ROOT)
    (ROOT / "meshserve" / "v1" / "__init__.py").touch()
    return 0


if __name__ == "__main__":
    sys.exit(main())
