"""An exact velocity field for tests: the rectified flow of Gaussian data N(m, s²) per element.

With x_t = (1−t)x_0 + tε, x_0 ~ N(m, s²), ε ~ N(0, 1), each element of x_t is Gaussian with variance
V_t = (1−t)²s² + t², and with d = x_t − (1−t)m:
E[x_0 | x_t] = m + (1−t)s²d/V_t, E[ε | x_t] = t·d/V_t, so v = E[ε − x_0 | x_t] = (t − (1−t)s²)d/V_t − m.
``cond`` shifts the data mean by cond (a (B,) tensor), so conditional and unconditional fields differ.
"""

from __future__ import annotations

import torch
from torch import Tensor


class GaussianFlow(torch.nn.Module):
    def __init__(self, m: float = 1.0, s: float = 0.5):
        super().__init__()
        self.m, self.s = m, s

    def forward(self, x: Tensor, t: Tensor, cond: Tensor) -> Tensor:
        shape = (-1,) + (1,) * (x.dim() - 1)
        t = t.view(shape)
        m = self.m + cond.to(x.dtype).view(shape)
        var = (1 - t) ** 2 * self.s**2 + t**2
        d = x - (1 - t) * m
        return (t - (1 - t) * self.s**2) * d / var - m
