"""Gradients accumulate across ``forward_backward_batch`` calls until ``zero_grad``, on every layout.

Megatron's grad finalisation (TP sum of sequence-parallel grads, DP reduce-scatter of the distributed
optimizer, the embedding / lm-head sum over PP) is not idempotent, so a naive second pass would
finalise the first pass's gradients twice. Checked on two gloo ranks: a summed loss over the batch in
one call, and over its two halves in two calls, give the same weights after one Adam step; a failing
second call keeps the first call's gradients (and drops its own).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.engine_setup import local_params, make_batch, tiny_config
from tests.utils import run_distributed

NUM_SEQS = 8
LAYOUTS = {  # name: (tiny_config kwargs, sequence parallel, the batch split over DP ranks)
    "tp2_sp": (dict(tp=2), True, False),
    "dp2_distopt": (dict(use_distributed_optimizer=True), False, True),
    "pp2": (dict(pp=2), False, False),
}


def _sum_loss(outputs, data, ctx):
    """A plain sum (no global normalisation): two calls' gradients add up to one call's."""
    loss = -(data["advantages"] * outputs["log_probs"] * data["loss_mask"]).sum()
    return loss, {}


def _failing_loss(outputs, data, ctx):
    raise RuntimeError("boom")


def _engine(kwargs: dict, sp: bool):
    from mcore_engine.engine import MegatronEngine

    cfg = tiny_config(**kwargs)
    cfg = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, sequence_parallel=sp))
    engine = MegatronEngine(cfg)
    engine.initialize()
    engine.zero_grad()
    return engine


def _rows(batch, rows: list[int], split: bool):
    from megatron.core import parallel_state

    if split:
        dp, r = parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank()
        rows = rows[r::dp]
    return batch[torch.tensor(rows)]


def _accumulate(rank: int, world_size: int) -> None:
    from mcore_engine.parallel.platform import destroy_distributed

    batch = make_batch(5, NUM_SEQS, temperature=1.0)
    half = NUM_SEQS // 2
    for name, (kwargs, sp, split) in LAYOUTS.items():
        one = _engine(kwargs, sp)
        one.forward_backward_batch(_rows(batch, list(range(NUM_SEQS)), split), _sum_loss)
        norm_one = one.optimizer_step()

        two = _engine(kwargs, sp)
        two.forward_backward_batch(_rows(batch, list(range(half)), split), _sum_loss)
        with pytest.raises(RuntimeError, match="boom"):
            two.forward_backward_batch(_rows(batch, list(range(half, NUM_SEQS)), split), _failing_loss)
        two.forward_backward_batch(_rows(batch, list(range(half, NUM_SEQS)), split), _sum_loss)
        norm_two = two.optimizer_step()

        assert abs(norm_one - norm_two) <= 1e-5 * norm_one, (name, norm_one, norm_two)
        for a, b in zip(local_params(one), local_params(two), strict=True):
            for key in a:
                err = float((a[key] - b[key]).abs().max())
                assert err <= 1e-6, (name, key, err)
        del one, two
        destroy_distributed()


def test_gradients_accumulate_across_calls_on_every_layout():
    run_distributed(_accumulate, 2)
