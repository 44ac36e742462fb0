"""Fused GPU kernels (Triton), shipped as ``specheads.kernels``.

Each kernel has an exact PyTorch reference in the library and a dispatcher choosing between them;
Triton is imported lazily, so this package imports on a CPU-only machine.
"""
