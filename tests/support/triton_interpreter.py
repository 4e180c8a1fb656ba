"""Triton's interpreter on a CPU (``TRITON_INTERPRET=1``) under numpy >= 2.4.

Imports only numpy and triton (``tests/gpu_check.sh`` runs its users with ``--noconftest``).
"""

from __future__ import annotations


def patch_for_numpy_2_4() -> None:
    """numpy >= 2.4 refuses ``int()`` of a 1-element array, which triton 3.6's interpreter
    does for loop bounds (triton-lang/triton#9171, fixed upstream by #9172): applies that
    fix, once. Call it after ``import triton`` with ``TRITON_INTERPRET=1``."""
    import numpy as np
    import triton.runtime.interpreter as interpreter

    if np.lib.NumpyVersion(np.__version__) < "2.4.0" or getattr(interpreter, "_meshserve_np24", False):
        return
    patch_lang_tensor = interpreter._patch_lang_tensor

    def patch_lang_tensor_np24(tensor, scope):
        patch_lang_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    interpreter._patch_lang_tensor = patch_lang_tensor_np24
    interpreter._meshserve_np24 = True
