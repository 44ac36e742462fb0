"""A dispatch watch for the attention tests: the largest tensor any op returns, and the ops called."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class LargestTensor(TorchDispatchMode):
    """Records the largest tensor (elements) any op returns, and the names of the ops called."""

    def __init__(self):
        super().__init__()
        self.largest, self.ops = 0, set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops.add(func.overloadpacket.__name__)
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out
