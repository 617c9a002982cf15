"""The ops' one-pass function with its chunk math on the Triton kernels: values and gradients, 1 and 2 ranks.

The ops' own chunk loop, collectives, finalisation and gradient coefficients drive the kernels: the
ops' one dispatch point (``plan.chunk_backend(device)``, from ``ops/backend.py``) is forced to the
Triton backend (CPU tensors under the interpreter; CUDA tensors on a GPU, where the 2-rank check
all-reduces CUDA tensors over gloo). Compared with the float64 reference from the formulas and with
the torch backend (forced the same way); -inf logits give the torch path's values.
"""

from __future__ import annotations

import contextlib
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from mcore_engine_kernels.launch import LaunchConfig

from mcore_engine.ops import backend, plan, vocab_parallel_logits_outputs
from mcore_engine.ops.lm_head import fused_lm_head_outputs
from tests.kernels.inputs import DEVICE
from tests.ops.cases import Case, case_inputs, shard_of, weighted_sum
from tests.ops.test_fused import check_concentrated_tail
from tests.reference import reference_logits_outputs
from tests.utils import REL_TOL, assert_rel_close, run_distributed

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


def _forced_triton_backend(splits: int | None, config: LaunchConfig | None, calls: list[str]):
    """The ops' Triton backend with this test's launch geometry, counting launches."""
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
    """Run the ops on the kernels through their dispatch point; every kernel must have run."""
    calls: list[str] = []
    forced = _forced_triton_backend(splits, config, calls)
    with mock.patch.object(plan, "chunk_backend", lambda device: forced):
        yield
    assert {"row_max", "chunk_stats", "chunk_grad"} <= set(calls), f"kernels not all run: {calls}"


def torch_chunk_math():
    """Run the ops on the torch backend (the reference), also on a CUDA machine."""
    return mock.patch.object(plan, "chunk_backend", lambda device: backend.TORCH_BACKEND)


def _kwargs(case: Case, inp: dict) -> dict:
    return dict(labels=inp["labels"], teacher_ids=inp["teacher_ids"],
                teacher_log_probs=inp["teacher_log_probs"], **FLAGS, kl_tail=case.kl_tail,
                log_prob_min_clamp=case.clamp, temperature=inp["temperature"], vocab_size=inp["vocab_size"])


def _outputs_and_grad(case: Case, inp: dict, rank: int, world: int):
    """Outputs and logits gradient computed on ``DEVICE`` (CUDA when present), returned on the CPU."""
    x = shard_of(inp["full"], rank, case.v_local).detach().to(DEVICE).requires_grad_()
    kwargs = {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in _kwargs(case, inp).items()}
    group = dist.group.WORLD if world > 1 else None
    out = vocab_parallel_logits_outputs(x, **kwargs, group=group, chunk_size=case.chunk_size)
    out = {k: v.cpu() for k, v in out.items()}
    weighted_sum(out, inp["weights"]).backward()
    return out, x.grad.cpu()


def _check(case: Case, splits, config, rank: int, world: int) -> None:
    inp = case_inputs(case, world)
    tol = REL_TOL[case.dtype]
    name = f"{case} splits={splits} rank {rank}/{world}"
    full64 = inp["full"].double().requires_grad_()
    ref = reference_logits_outputs(full64, **_kwargs(case, inp))
    (ref_grad,) = torch.autograd.grad(weighted_sum(ref, inp["weights"]), full64)
    ref_grad = ref_grad[..., rank * case.v_local:(rank + 1) * case.v_local]

    with torch_chunk_math():
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


def _check_neg_inf_logits(rank: int, world: int) -> None:
    """-inf logits (masked entries, one at a label, one at a teacher id, a whole column of shard 0):
    the kernels floor z - m at ``layout.ZM_FLOOR`` as the torch path does, so values and gradients are
    finite and equal to the torch backend's (a label at -inf has the log-prob ~ -1.8e19 / t)."""
    case = Case(15, (3, 4), 150, F32, temperature="0.7", chunk_size=5, k=4, kl_tail=True)
    inp = case_inputs(case, world)
    full, labels, ids = inp["full"].view(-1, case.v_local * world), inp["labels"].view(-1), inp["teacher_ids"]
    g = torch.Generator().manual_seed(7)
    full.view(-1)[torch.randperm(full.numel(), generator=g)[:40]] = float("-inf")
    full[:, case.v_local - 1] = float("-inf")
    full[0, labels[0]] = float("-inf")
    full[1, ids.view(-1, case.k)[1, 0]] = float("-inf")
    name = f"-inf logits rank {rank}/{world}"
    with torch_chunk_math():
        torch_out, torch_grad = _outputs_and_grad(case, inp, rank, world)
    with triton_chunk_math(3, SMALL):
        out, grad = _outputs_and_grad(case, inp, rank, world)
    assert torch_out["log_probs"].view(-1)[0] < -1e19, "the label at -inf did not get the floored log-prob"
    for key, ref in torch_out.items():
        assert torch.isfinite(ref).all() and torch.isfinite(out[key]).all(), f"{name} {key} not finite"
        assert_rel_close(out[key], ref, REL_TOL[F32], f"{name} {key} vs torch path")
    assert torch.isfinite(grad).all(), f"{name}: non-finite gradient"
    assert_rel_close(grad, torch_grad, REL_TOL[F32], f"{name} grad vs torch path")


def test_neg_inf_logits_match_torch_path_one_rank():
    _check_neg_inf_logits(rank=0, world=1)


def _two_rank_checks(rank: int, world: int) -> None:
    for entry in CASES[1:2]:  # padded vocab, per-token temperature, clamp, tail, splits
        _check(*entry, rank=rank, world=world)
    _check_neg_inf_logits(rank, world)


def test_fused_outputs_with_triton_chunk_math_two_ranks():
    run_distributed(_two_rank_checks, 2)


def test_fused_lm_head_with_triton_chunk_math_matches_torch_backend():
    """The fused lm-head's chunk math through the same dispatch point: outputs and both gradients."""
    g = torch.Generator().manual_seed(21)
    hidden = torch.randn(2, 5, 16, generator=g)
    weight = torch.randn(211, 16, generator=g) / 2
    labels = torch.randint(0, 200, (2, 5), generator=g)
    ids = torch.rand(2, 5, 200, generator=g).argsort(-1)[..., :3]
    tlp = torch.randn(2, 5, 3, generator=g).log_softmax(-1) - 0.2
    t = torch.rand(2, 5, generator=g) + 0.5
    upstream = torch.randn(4, 2, 5, generator=g)
    runs = []
    for be in (backend.TORCH_BACKEND, _forced_triton_backend(2, SMALL, calls := [])):
        h, w = hidden.to(DEVICE).requires_grad_(), weight.to(DEVICE).requires_grad_()
        with mock.patch.object(plan, "chunk_backend", lambda device, be=be: be):
            out = fused_lm_head_outputs(
                h, w, labels=labels.to(DEVICE), teacher_ids=ids.to(DEVICE), teacher_log_probs=tlp.to(DEVICE),
                entropy=True, sum_pi_squared=True, kl_tail=True, temperature=t.to(DEVICE), vocab_size=200,
                chunk_size=4)
        keys = ("log_probs", "entropy", "sum_pi_squared", "distillation_losses")
        sum(((out[k].cpu() * u).sum() for k, u in zip(keys, upstream, strict=True))).backward()
        runs.append(({k: v.detach().cpu() for k, v in out.items()}, h.grad.cpu(), w.grad.cpu()))
    assert {"row_max", "chunk_stats", "chunk_grad"} <= set(calls), f"kernels not all run: {calls}"
    (ref, ref_gh, ref_gw), (got, gh, gw) = runs
    for key in ref:
        assert_rel_close(got[key], ref[key], REL_TOL[F32], f"lm-head {key} vs torch backend")
    assert_rel_close(gh, ref_gh, REL_TOL[F32], "lm-head grad hidden vs torch backend")
    assert_rel_close(gw, ref_gw, REL_TOL[F32], "lm-head grad weight vs torch backend")


def test_concentrated_student_tail_on_the_kernels():
    """q_tail down to 1e-24 with every output: the kernel sets the teacher columns without the tail's
    ~1 / q_tail coefficient (as the torch path does), so their gradient stays exact."""
    with triton_chunk_math(2, SMALL):
        check_concentrated_tail(0, 1, DEVICE)
