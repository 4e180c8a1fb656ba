"""Linear layers on CPU with the weight packed once, at load time (oneDNN).

``F.linear`` on CPU calls MKL's ``sgemm``, which copies the weight into its
blocked panel layout on every call; on this project's AVX2 hosts that copy takes
about as long as the arithmetic at decode batch sizes (8-64 rows). oneDNN can
reorder the weight once into its own blocked layout and reuse it: on SmolLM2-135M
on one AVX2 core, 15-30% faster on the projections at 8-256 rows and about 2x on
the 49152-row LM head, within ±10% at 1 and 512 rows (``meshserve.bench.ceiling``).
It is also batch-invariant: a row's result does not depend on how many rows are
in the batch (MKL's does below 4 rows), so the projections no longer round a
request differently when it runs alone. (Attention still may: torch's CPU flash
kernel rounds a batch of one differently from a larger one, in the last bit.)

The ops are ``torch.ops.mkldnn._reorder_linear_weight`` and
``_linear_pointwise``, the ones inductor's CPU weight-prepacking pass emits.
They are private, so ``pack`` checks them on the weight it packs and returns
``None`` whenever they are missing, fail or disagree with ``F.linear``; the layer
then keeps calling ``F.linear``. The packed copy is held next to the plain
weight (which the loaders, the tied embedding and ``state_dict`` keep using):
it costs the weights' size once more in memory.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

_PACK_BATCH_HINT = 32
"""Rows oneDNN tunes the packed layout for; any number of rows works."""


def _ops_available() -> bool:
    mkldnn = torch.ops.mkldnn
    return (torch.backends.mkldnn.is_available() and hasattr(mkldnn, "_reorder_linear_weight")
            and hasattr(mkldnn, "_linear_pointwise"))


def pack(weight: torch.Tensor) -> torch.Tensor | None:
    """The oneDNN-packed copy of ``weight`` ``(out, in)``, or ``None`` where the plain
    ``F.linear`` must be used: not a CPU float32/bfloat16 matrix, oneDNN missing or
    unable to pack it (bfloat16 needs AVX-512 or AVX-NE-CONVERT), or a probe product
    that disagrees with ``F.linear``."""
    if weight.device.type != "cpu" or weight.dim() != 2 or weight.dtype not in (torch.float32, torch.bfloat16):
        return None
    if not _ops_available():
        return None
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), _PACK_BATCH_HINT)
        probe = torch.randn(3, weight.shape[1], generator=torch.Generator().manual_seed(0)).to(weight.dtype)
        got = linear(probe, weight, None, packed).float()
    except RuntimeError as err:  # e.g. bfloat16 without AVX-512: oneDNN refuses
        log.debug("oneDNN cannot pack a %s %s weight (%s); using F.linear", tuple(weight.shape), weight.dtype, err)
        return None
    want = F.linear(probe, weight).float()
    tol = 1e-4 if weight.dtype == torch.float32 else 2e-2
    if not torch.allclose(got, want, rtol=tol, atol=tol * float(want.abs().max())):
        log.warning("oneDNN packed linear disagrees with F.linear on a %s weight; using F.linear", tuple(weight.shape))
        return None
    return packed


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
           packed: torch.Tensor | None) -> torch.Tensor:
    """``x W^T + b``: ``x`` ``(num_tokens, in)`` → ``(num_tokens, out)``, through ``packed``
    (from ``pack(weight)``) when there is one, else ``F.linear``."""
    if packed is None:
        return F.linear(x, weight, bias)
    if torch.compiler.is_compiling():
        # traced by torch.compile (executor.worker.compiled_decode): inductor's own lowering
        # of this op wants the weight frozen into the graph; called as the aten op instead
        with torch.fx.traceback.annotate({"fallback_to_eager": True}):
            return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    return torch.ops.mkldnn._linear_pointwise.default(x, packed, bias, "none", [], "")
