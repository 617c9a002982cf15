"""Definitions shared by the ops' torch path and the Triton kernels (imports neither, nor Triton).

With ``z = x / t`` in fp32, ``m`` the global row max and ``e = exp(z - m)``, a chunk's packed per-row
statistics (one SUM all-reduce over the shards)::

    col_sum_e    S = sum_j e_j                       (always, column 0)
    col_sum_ez   A = sum_j e_j (z_j - m)             (entropy)
    col_sum_e2   B = sum_j e_j ** 2                  (sum_pi_squared)
    col_label    z_y - m                             (label; 0 where y is on another shard)
    col_teacher  z_i - m, k columns                  (teacher ids; 0 off-shard)
    col_tail     T = sum_{j not a teacher id} e_j    (tail)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Floor of z - m: exp(-2**64) == 0 in fp32, so a -inf logit adds exactly 0 to every sum and gradient
# (no 0 * -inf), and stays far from overflow when backward scales z - mu by a coefficient.
ZM_FLOOR = -(2.0**64)
# Floor of the tail masses p_tail, q_tail inside the log of the tail term p log(p / q).
TAIL_EPS = 1e-20


@dataclass(frozen=True, slots=True)
class StatLayout:
    """Which statistics a pass computes and their columns in the ``[c, width]`` buffer."""

    entropy: bool
    sum_pi_squared: bool
    label: bool
    k: int  # number of teacher ids (0: no distillation)
    tail: bool

    col_sum_e = 0

    @property
    def col_sum_ez(self) -> int:
        return 1

    @property
    def col_sum_e2(self) -> int:
        return 1 + self.entropy

    @property
    def col_label(self) -> int:
        return self.col_sum_e2 + self.sum_pi_squared

    @property
    def col_teacher(self) -> int:
        return self.col_label + self.label

    @property
    def col_tail(self) -> int:
        return self.col_teacher + self.k

    @property
    def width(self) -> int:
        return self.col_tail + self.tail


@dataclass(frozen=True, slots=True)
class Coefficients:
    """Per-row terms of one chunk's gradient w.r.t. ``z`` (fp32 ``[c]``; None: absent)::

        p = exp(z - m) * inv_s
        g = p * (a + a_tail * [j not in tail_cols] + b * (z - m - mu) + c2 * p);  g[row, cols] += vals

    ``cols``/``vals`` ``[c, n]``, ``tail_cols [c, k]`` (-1: none): local columns (global ids in the ops).
    """

    inv_s: torch.Tensor
    a: torch.Tensor
    b: torch.Tensor | None = None
    mu: torch.Tensor | None = None
    c2: torch.Tensor | None = None
    cols: torch.Tensor | None = None
    vals: torch.Tensor | None = None
    a_tail: torch.Tensor | None = None
    tail_cols: torch.Tensor | None = None
