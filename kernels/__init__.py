"""Fused GPU kernels (Triton), shipped as ``specheads.kernels``.

Each kernel has an exact PyTorch reference in the library and a dispatcher choosing between them;
Triton is imported lazily, so this package imports on a CPU-only machine.

- ``verify_greedy.verify_greedy_triton``: batched greedy tree verification
  (reference and dispatcher: ``specheads.decoding.batched_verify.verify_greedy_batched``).
- ``tree_sampling.verify_tree_sampling_triton``: batched target-only tree walk with explicit
  uniforms (dispatcher: ``specheads.decoding.batched_verify.verify_tree_sampling_batched``).

Kernels run on CUDA tensors, or on CPU tensors under the Triton interpreter (``TRITON_INTERPRET=1``
set before the kernel modules are first imported), which is how the unit tests check them.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys

if __name__ == "kernels":
    # Imported as a top-level `kernels`: a clone's root is on sys.path (`python -m` run in it) and the
    # name asked for is Hugging Face's `kernels` package, which transformers imports. Hand the import
    # over to an installed one: the import statement returns whatever sys.modules holds at the end.
    _root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    _elsewhere = [p for p in sys.path if os.path.abspath(p or os.curdir) != _root]
    _spec = importlib.machinery.PathFinder.find_spec("kernels", _elsewhere)
    if _spec is not None and _spec.loader is not None:
        _module = importlib.util.module_from_spec(_spec)
        sys.modules["kernels"] = _module
        _spec.loader.exec_module(_module)

INSTALL_HINT = "pip install triton  (or: pip install 'specheads[kernels]')"


def require_triton():
    """-> (triton, triton.language); a clear ImportError naming the install when Triton is missing."""
    try:
        import triton
        import triton.language as tl
    except ImportError as e:
        raise ImportError(f"specheads.kernels needs Triton, which is not installed: {INSTALL_HINT}") from e
    return triton, tl


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def interpreting() -> bool:
    """True when Triton kernels run in the CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on")


def check_device(*tensors, where: str) -> None:
    """Kernels need CUDA tensors, or CPU tensors under the interpreter."""
    for t in tensors:
        if not (t.is_cuda or interpreting()):
            raise RuntimeError(f"{where}: Triton kernels need CUDA tensors (got {t.device}); on CPU set "
                               f"TRITON_INTERPRET=1 before importing specheads.kernels, or use backend='torch'")
