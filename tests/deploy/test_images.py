"""What the images carry, read from the files the Dockerfiles install: the wheel
`pip install .` builds holds the CPU kernels' C/C++ sources (each kernel compiles its
own at first start), the CPU image has the compilers to build them, and Triton's
cache is under the writable /cache, not the read-only home /app."""

import shutil
import sys
import zipfile
from pathlib import Path

import pytest

from tests.support.deploy import DEPLOY, ROOT, run

PACKAGES = ("meshserve", "gateway", "scheduler", "executor", "kvstore")


def kernel_sources() -> set[str]:
    return {p.relative_to(ROOT).as_posix() for pattern in ("*.c", "*.cpp") for p in (ROOT / "executor").rglob(pattern)}


def test_the_wheel_ships_every_kernel_source(tmp_path):
    """Builds the wheel (no dependencies, no isolation: about 2 s) from a copy of the
    sources, as the images' `pip install --no-deps .` does."""
    src = tmp_path / "src"
    for name in PACKAGES:
        shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    done = run(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
               str(tmp_path / "dist"), ".", cwd=src)
    assert done.returncode == 0, done.stdout + done.stderr
    (wheel,) = (tmp_path / "dist").glob("meshserve-*.whl")
    shipped = {n for n in zipfile.ZipFile(wheel).namelist() if n.endswith((".c", ".cpp"))}
    assert kernel_sources() == {"executor/attention/cpu_paged_attention.c",
                                "executor/attention/cpu_prefill_attention.c", "executor/models/cpu_decoder_stack.c",
                                "executor/models/cpu_fused.c",
                                "executor/models/cpu_gemm.c", "executor/models/cpu_gemm_amx.c",
                                "executor/models/cpu_gemm_bf16.c",
                                "executor/models/cpu_ops.cpp"}
    assert shipped == kernel_sources()


def test_the_cpu_image_installs_the_kernels_compilers():
    lines = (DEPLOY / "Dockerfile").read_text().splitlines()
    install = next(line for line in lines if "apt-get install" in line)
    assert install.split("--no-install-recommends")[1].split("\\")[0].split() == ["gcc", "g++", "ninja-build"]
    assert lines[lines.index(next(line for line in lines if "apt-get update" in line)) - 1] \
        == "# hadolint ignore=DL3008"


def image_env(dockerfile: str) -> dict[str, str]:
    """Every ``ENV key=value`` of a Dockerfile (continuation lines joined)."""
    text = (DEPLOY / dockerfile).read_text().replace("\\\n", " ")
    return dict(pair.split("=", 1) for line in text.splitlines() if line.startswith("ENV ")
                for pair in line.split()[1:])


@pytest.mark.parametrize("dockerfile", ["Dockerfile", "Dockerfile.cuda"])
def test_the_images_keep_tritons_cache_in_the_writable_cache_volume(dockerfile):
    """Triton's default is $HOME/.triton/cache, and HOME is /app: read-only under Kubernetes'
    readOnlyRootFilesystem. TRITON_CACHE_DIR is Triton 3.6's knob (triton.knobs.cache.dir)."""
    env = image_env(dockerfile)
    assert env["MESHSERVE_CACHE_DIR"] == "/cache" and env["TRITON_CACHE_DIR"] == "/cache/triton"
    assert "VOLUME /cache" in (DEPLOY / dockerfile).read_text().splitlines()
    knobs = pytest.importorskip("triton.knobs")
    assert "TRITON_CACHE_DIR" in Path(knobs.__file__).read_text()
