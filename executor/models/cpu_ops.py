"""The C kernels (attention, fused norm/rotary/SiLU, the float32 GEMM) as C++ torch
operators (``cpu_ops.cpp``, namespace ``meshserve_cpu``), for the ``torch.compile``'d
decode step (``executor.worker.compiled_decode``).

Why: the compiled graph saves the Python between the ops, ~19 ms of a SmolLM2-135M
decode step on one AVX2 core, but a Python custom op (``cpu_fused``'s and
``cpu_kernel``'s ``meshserve::*``) costs ~20 µs more a call than the eager path's
``ctypes`` call, 150 calls a step, which used that saving up (0.95-1.02x). The same
kernels as C++ operators are reached from the graph through the dispatcher with no
Python: 1.04-1.09x at 32 decodes and 1.15-1.18x at one (``reports/cpu-speed/compile.md``).

Build: ``torch.utils.cpp_extension`` (the C++ compiler, ninja and torch's headers;
about 25 s on one core) into ``$MESHSERVE_CACHE_DIR/kernels/cpu_ops-<hash>/``, named by
a hash of the source and torch's version, so a later start loads it. The operators
call the kernels of the libraries ``cpu_fused.load()`` and ``cpu_kernel.load()`` built
(their addresses go to ``set_kernels``), so the numbers are the eager path's, bit for
bit. Where it cannot be built ``load`` logs why and returns False, and the compiled
step calls the Python custom ops instead. ``MESHSERVE_CPU_OPS=0`` turns it off.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import subprocess
import threading
from pathlib import Path

import torch

from executor.attention import cpu_kernel
from executor.models import cpu_fused, cpu_gemm
from meshserve.model_files import cache_dir

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_ops.cpp")
_lock = threading.Lock()
_loaded: dict[str, bool] = {}


def _address(fn) -> int:
    return ctypes.cast(fn, ctypes.c_void_p).value


def _register_fakes() -> None:
    """Output shapes for tracing (the operators' outputs are new contiguous tensors)."""
    fakes = {
        "rms_norm": lambda x, weight, eps: torch.empty_like(x),
        "add_rms_norm": lambda x, residual, weight, eps: torch.empty_like(residual),
        "rotary_": lambda x, cos, sin: None,
        "silu_mul": lambda gate_up: gate_up.new_empty(gate_up.shape[0], gate_up.shape[1] // 2),
        "padded_decode_attention": lambda q, *rest: q.new_empty(q.shape),
        "panel_linear": lambda x, packed, out_features: x.new_empty(*x.shape[:-1], out_features),
    }
    for name, fake in fakes.items():
        torch.library.register_fake(f"meshserve_cpu::{name}")(fake)


def load() -> bool:
    """Builds (or loads) the operators and points them at the C kernels; False where
    they cannot be (no kernels, no C++ toolchain, a failed build, ``MESHSERVE_CPU_OPS=0``).
    Once per process."""
    with _lock:
        if "ok" in _loaded:
            return _loaded["ok"]
        ok = False
        fused, attention = cpu_fused.load(), cpu_kernel.load()
        if os.environ.get("MESHSERVE_CPU_OPS", "1") == "0":
            log.info("C++ operators off (MESHSERVE_CPU_OPS=0): the compiled decode step calls Python custom ops")
        elif fused is not None and attention is not None:
            try:
                from torch.utils.cpp_extension import load as build

                key = hashlib.sha256((SOURCE.read_text() + torch.__version__).encode()).hexdigest()[:16]
                directory = cache_dir() / "kernels" / f"cpu_ops-{key}"
                directory.mkdir(parents=True, exist_ok=True)
                build(name=f"meshserve_cpu_ops_{key}", sources=[str(SOURCE)], build_directory=str(directory),
                      is_python_module=False, extra_cflags=["-O2"], verbose=False)
                torch.ops.meshserve_cpu.set_kernels(_address(fused.add_rms_norm), _address(fused.rotary_inplace),
                                                    _address(fused.silu_mul), _address(attention), fused.lanes)
                if (gemm := cpu_gemm.load()) is not None:  # panel_linear: only for weights it packed
                    torch.ops.meshserve_cpu.set_gemm(_address(gemm.packed_gemm))
                _register_fakes()
                ok = True
            except (OSError, RuntimeError, ImportError, subprocess.SubprocessError) as err:
                log.warning("the C++ operators could not be built (%s): the compiled decode step calls Python "
                            "custom ops", err)
        _loaded["ok"] = ok
        return ok
