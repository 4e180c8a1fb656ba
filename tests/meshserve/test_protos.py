"""The committed stubs in meshserve/v1 are exactly what protos/ generates."""

from pathlib import Path

from meshserve.gen_protos import ROOT, generate, proto_files


def test_committed_stubs_match_protos(tmp_path: Path):
    generate(tmp_path)
    generated = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*.py*") if p.is_file())
    assert generated, "protoc generated nothing"
    committed = sorted(p.relative_to(ROOT) for p in (ROOT / "meshserve" / "v1").glob("*_pb2*.py*"))
    assert generated == committed
    for rel in generated:
        assert (tmp_path / rel).read_bytes() == (ROOT / rel).read_bytes(), f"{rel} is stale: run make protos"


def test_every_proto_is_versioned_package():
    protos = proto_files()
    assert protos, "no .proto file found"
    for proto in protos:
        text = proto.read_text()
        assert "package meshserve.v1;" in text, proto
