"""Running the Triton kernels without a GPU, for the CPU CI: the interpreter, and a fix it needs.

Import this module before any module that defines @triton.jit kernels: the decorator reads
TRITON_INTERPRET as it runs. On a CUDA machine it does nothing (the kernels compile).
"""

from __future__ import annotations

import os

import torch

ON_CUDA = torch.cuda.is_available()

if not ON_CUDA:
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        import triton.runtime.interpreter as _interpreter
    except ImportError:  # the tests importing this skip without triton
        _interpreter = None
    if _interpreter is not None and not getattr(_interpreter, "_pagedserve_patched", False):
        # triton 3.6's interpreter turns a scalar into a Python int with int() of a 1-element
        # array, which numpy >= 2.4 refuses ("only 0-dimensional arrays ..."): it breaks `range`
        # over loaded bounds. Apply the upstream fix (triton-lang/triton#9171) in this process.
        _patch_lang_tensor = _interpreter._patch_lang_tensor

        def _patch_lang_tensor_numpy_2_4(tensor, scope):
            _patch_lang_tensor(tensor, scope)
            scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

        _interpreter._patch_lang_tensor = _patch_lang_tensor_numpy_2_4
        _interpreter._pagedserve_patched = True
