"""The ops' one-pass function with its chunk math on the Triton kernels: values and gradients, 1 and 2 ranks.

The ops' own chunk loop, collectives, finalisation and gradient coefficients drive the kernels. With
a dispatch point in the ops (``fused.chunk_backend(device) -> ChunkBackend``) it is forced to the
Triton backend (CPU tensors, interpreter). Without one, ``fused`` calls ``stats.row_max``,
``stats.chunk_stats(stats.shifted(...))`` and ``stats.chunk_grad(stats.shifted(...))`` per chunk and
``TritonStats`` stands in for that module (``shifted`` just defers ``(x, t, m)``). Compared with the
float64 reference from the formulas and with the unpatched torch path.
"""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from mcore_engine_kernels import backward, forward
from mcore_engine_kernels.launch import LaunchConfig

from mcore_engine.ops import fused, vocab_parallel_logits_outputs
from mcore_engine.ops import stats as torch_stats
from tests.ops._cases import Case, case_inputs, shard_of, weighted_sum
from tests.utils import REL_TOL, assert_rel_close, reference_logits_outputs, run_distributed

F32, BF16 = torch.float32, torch.bfloat16
SMALL = LaunchConfig(block_v=64, num_warps=4)

# (case, splits, launch config): odd shapes, padded vocab, every temperature kind, clamp and tail.
CASES = [
    (Case(11, (13,), 300, F32, temperature="1", chunk_size=5, k=5, kl_tail=True), None, None),
    (Case(12, (2, 5), 257, F32, pad=9, temperature="tok", chunk_size=4, clamp=-3.0, kl_tail=True, k=4),
     3, SMALL),
    (Case(13, (1, 9), 211, BF16, temperature="0.7", chunk_size=None, k=3, kl_tail=True), 2, SMALL),
    (Case(14, (7,), 190, BF16, pad=11, temperature="0d", chunk_size=3, clamp=-2.5, k=4), None, None),
]
FLAGS = dict(entropy=True, sum_pi_squared=True)


class TritonStats(SimpleNamespace):
    """``mcore_engine.ops.stats`` with the chunk math on the Triton kernels (everything else delegated)."""

    def __init__(self, splits: int | None, config: LaunchConfig | None):
        super().__init__(splits=splits, config=config, launches=0)

    def __getattr__(self, name):
        return getattr(torch_stats, name)

    def row_max(self, x, t):
        self.launches += 1
        return forward.row_max(x, t, splits=self.splits, config=self.config)

    def shifted(self, x, t, m):
        return SimpleNamespace(x=x, t=t, m=m)  # deferred: the kernels recompute z - m on the fly

    def chunk_stats(self, zm, layout, out, *, label=None, teacher=None):
        self.launches += 1
        return forward.chunk_stats(zm.x, zm.t, zm.m, layout, out, label=label, teacher=teacher,
                                   splits=self.splits, config=self.config)

    def chunk_grad(self, zm, inv_s, a, b, mu, c2, cols, vals):
        self.launches += 1
        out = torch.empty(zm.x.shape, dtype=torch.float32, device=zm.x.device)
        backward.chunk_grad(zm.x, zm.t, zm.m, inv_s, a, b, mu, c2, cols, vals, out,
                            splits=self.splits, config=self.config)
        # ``fused`` divides the returned gradient w.r.t. z by t; the kernel already did.
        t = zm.t
        return out if t is None else out.mul_(t[:, None] if isinstance(t, torch.Tensor) else t)


def _forced_triton_backend(splits: int | None, config: LaunchConfig | None, calls: list[str]):
    """The ops' Triton backend with this test's launch geometry, counting launches."""
    from mcore_engine.ops import backend

    tb = backend.triton_backend()

    def launcher(fn):
        def run(*args, **kwargs):
            calls.append(fn.__name__)
            return fn(*args, **kwargs, splits=splits, config=config)
        return run

    return backend.ChunkBackend("triton", launcher(tb.row_max), launcher(tb.chunk_stats),
                                launcher(tb.chunk_grad), tb.chunk_elements)


@contextlib.contextmanager
def triton_chunk_math(splits: int | None, config: LaunchConfig | None):
    """Run ``fused`` on the kernels: through its dispatch point if it has one, else via ``TritonStats``."""
    if hasattr(fused, "chunk_backend"):
        calls: list[str] = []
        saved, forced = fused.chunk_backend, _forced_triton_backend(splits, config, calls)
        fused.chunk_backend = lambda device: forced
        try:
            yield
        finally:
            fused.chunk_backend = saved
        assert {"row_max", "chunk_stats", "chunk_grad"} <= set(calls), f"kernels not all run: {calls}"
        return
    saved, shim = fused._stats, TritonStats(splits, config)
    fused._stats = shim
    try:
        yield
    finally:
        fused._stats = saved
    chunks = 3  # at least one chunk: row max, statistics, gradient
    assert shim.launches >= chunks, f"the ops did not run the kernels ({shim.launches} launches)"


def _kwargs(case: Case, inp: dict) -> dict:
    return dict(labels=inp["labels"], teacher_ids=inp["teacher_ids"],
                teacher_log_probs=inp["teacher_log_probs"], **FLAGS, kl_tail=case.kl_tail,
                log_prob_min_clamp=case.clamp, temperature=inp["temperature"], vocab_size=inp["vocab_size"])


def _outputs_and_grad(case: Case, inp: dict, rank: int, world: int):
    x = shard_of(inp["full"], rank, case.v_local)
    group = dist.group.WORLD if world > 1 else None
    out = vocab_parallel_logits_outputs(x, **_kwargs(case, inp), group=group, chunk_size=case.chunk_size)
    weighted_sum(out, inp["weights"]).backward()
    return out, x.grad


def _check(case: Case, splits, config, rank: int, world: int) -> None:
    inp = case_inputs(case, world)
    tol = REL_TOL[case.dtype]
    name = f"{case} splits={splits} rank {rank}/{world}"
    full64 = inp["full"].double().requires_grad_()
    ref = reference_logits_outputs(full64, **_kwargs(case, inp))
    (ref_grad,) = torch.autograd.grad(weighted_sum(ref, inp["weights"]), full64)
    ref_grad = ref_grad[..., rank * case.v_local:(rank + 1) * case.v_local]

    torch_out, torch_grad = _outputs_and_grad(case, inp, rank, world)
    with triton_chunk_math(splits, config):
        out, grad = _outputs_and_grad(case, inp, rank, world)
    assert set(out) == set(ref), name
    for key in ref:
        assert_rel_close(out[key], ref[key], tol, f"{name} {key} vs float64")
        assert_rel_close(out[key], torch_out[key], REL_TOL[F32], f"{name} {key} vs torch path")
    assert grad.dtype == case.dtype
    assert_rel_close(grad, ref_grad, tol, f"{name} grad vs float64")
    assert_rel_close(grad, torch_grad, 1e-5 if case.dtype == F32 else 1e-2, f"{name} grad vs torch path")


@pytest.mark.parametrize("entry", CASES, ids=[f"case{c[0].seed}" for c in CASES])
def test_fused_outputs_with_triton_chunk_math_one_rank(entry):
    _check(*entry, rank=0, world=1)


def _two_rank_checks(rank: int, world: int) -> None:
    for entry in CASES[1:2]:  # padded vocab, per-token temperature, clamp, tail, splits
        _check(*entry, rank=rank, world=world)


def test_fused_outputs_with_triton_chunk_math_two_ranks():
    run_distributed(_two_rank_checks, 2)
