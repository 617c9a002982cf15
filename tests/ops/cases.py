"""Seeded inputs shared by the ops and processor tests: full logits, their shard, labels, teacher top-k."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Case:
    """One input configuration; every rank rebuilds the same FULL tensors from ``seed``."""

    seed: int
    lead: tuple[int, ...]  # logits.shape[:-1]: (N,), (1, T) or (B, S)
    v_local: int
    dtype: torch.dtype = torch.float32
    pad: int = 0  # vocab_size = v_local * world - pad
    temperature: str = "1"  # "1", "0.7", "0d", "tok"
    chunk_size: int | None = None
    k: int = 4
    clamp: float | None = None
    kl_tail: bool = False


def case_inputs(case: Case, world: int) -> dict:
    """Full float logits (in ``case.dtype``), labels, teacher ids/log-probs, temperature, upstream grads."""
    g = torch.Generator().manual_seed(case.seed)
    v = case.v_local * world
    vocab_size = v - case.pad
    full = (torch.randn(case.lead + (v,), generator=g, dtype=torch.float64) * 2.5).to(case.dtype)
    labels = torch.randint(0, vocab_size, case.lead, generator=g)
    ids = torch.rand(case.lead + (vocab_size,), generator=g).argsort(-1)[..., :case.k]
    # Teacher mass < 1 so the tail bucket is non-trivial.
    tlp = torch.randn(case.lead + (case.k,), generator=g).log_softmax(-1) + math.log(0.85)
    if case.seed % 2:  # a teacher slot with probability 0 (log-prob -inf) in the first token
        tlp.view(-1, case.k)[0, -1] = float("-inf")
    temperature = {"1": 1.0, "0.7": 0.7, "0d": torch.tensor(1.3),
                   "tok": torch.rand(case.lead, generator=g) + 0.5}[case.temperature]
    weights = {key: torch.randn(case.lead, generator=g, dtype=torch.float64)
               for key in ("log_probs", "entropy", "sum_pi_squared", "distillation_losses")}
    return dict(full=full, labels=labels, teacher_ids=ids, teacher_log_probs=tlp, temperature=temperature,
                weights=weights, vocab_size=vocab_size if case.pad else None)


def shard_of(full: torch.Tensor, rank: int, v_local: int) -> torch.Tensor:
    """This rank's vocab shard as a fresh leaf that requires grad."""
    return full[..., rank * v_local:(rank + 1) * v_local].clone().requires_grad_()


def weighted_sum(outputs: dict[str, torch.Tensor], weights: dict[str, torch.Tensor]) -> torch.Tensor:
    """sum over differentiable outputs of (out * w): a scalar whose grad uses a random upstream grad."""
    total = torch.zeros((), dtype=torch.float64)
    for key, w in weights.items():
        if key in outputs:
            total = total + (outputs[key].double() * w).sum()
    return total
