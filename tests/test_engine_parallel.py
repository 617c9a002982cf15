"""MegatronEngine under every parallel layout against one TP=1 / PP=1 / DP=1 run on identical weights.

Launch 1 (one gloo rank) records the reference: initial weights, per-token outputs of ``infer_batch``
and ``train_batch``, the global loss, the grad norm and the weights after one Adam step. Launch 2
(two gloo ranks) replays the same global batch under TP=2, DP=2 (each rank half of the batch; plain
and distributed optimizer), PP=2 (1F1B) and PP=2 x VPP=2 (interleaved; thd with one sequence per
micro-batch, so micro-batch-count invariance is exercised too, and bshd with micro-batches padded to
one shape), every one loaded with the reference weights, and checks all of it at fp32 relative-norm
error 1e-5; a bf16 TP=2 run is held to 2e-2. Under PP=2 and DP=2 a loss function that raises (or
returns a malformed result) on one rank only, and an exception while packing on one DP rank, fail
the step on both ranks promptly, gradients zeroed and parameters untouched.
"""

from __future__ import annotations

import torch

from tests.engine_setup import (
    flat_values,
    full_state,
    load_full_state,
    local_params,
    local_reference,
    make_batch,
    policy_loss,
    tiny_config,
)
from tests.utils import REL_TOL, assert_rel_close, run_distributed

TOL = REL_TOL[torch.float32]
SEED = 11
NUM_SEQS = 6
FLAGS = dict(calculate_entropy=True, temperature=0.7)


def _reference(rank: int, world_size: int, path: str) -> None:
    from mcore_engine.engine import MegatronEngine

    engine = MegatronEngine(tiny_config())
    engine.initialize()
    batch = make_batch(SEED, NUM_SEQS, **FLAGS)
    ref = {"full0": full_state(engine)}
    infer = engine.infer_batch(batch)
    ref["infer_log_probs"] = flat_values(infer["log_probs"])
    out = engine.train_batch(batch, policy_loss)
    ref.update(log_probs=flat_values(out["log_probs"]), entropy=flat_values(out["entropy"]),
               loss=out.get_non_tensor("loss").clone(),
               grad_norm=torch.tensor(out.get_non_tensor("metrics")["grad_norm"], dtype=torch.float64),
               tokens=out.get_non_tensor("metrics")["tokens"],
               seq_id_sum=out.get_non_tensor("metrics")["seq_id_sum"],
               full1=full_state(engine))
    assert out.get_non_tensor("metrics")["update_skipped"] == 0.0
    torch.save(ref, path)


LAYOUTS = [  # name, engine config, split the batch over DP ranks, extra step flags
    ("tp2", dict(tp=2), False, {}),
    ("dp2", dict(), True, {}),
    ("dp2-distributed-optimizer", dict(use_distributed_optimizer=True), True, {}),
    ("pp2-1f1b", dict(pp=2), False, {}),
    ("pp2-vpp2-interleaved", dict(pp=2, vpp=2, micro_batch_size=1), False, {}),
    # 4 + 2 sequences: the second micro-batch gets empty rows and columns to the common shape
    ("pp2-vpp2-interleaved-bshd", dict(pp=2, vpp=2, micro_batch_size=4, data_format="bshd"), False, {}),
    # a token budget; the split is refined to an even number of micro-batches
    ("pp2-vpp2-token-budget", dict(pp=2, vpp=2), False, dict(use_dynamic_bsz=True, max_token_len_per_gpu=25)),
    ("tp2-bf16", dict(tp=2, precision="bf16"), False, {}),
    ("tp2-fused-lm-head", dict(tp=2, fused_lm_head=True), False, {}),
    ("pp2-fused-lm-head", dict(pp=2, fused_lm_head=True), False, {}),
]


def _raises(call, error: type, *needles: str) -> None:
    try:
        call()
    except error as exc:
        assert all(n in str(exc) for n in needles), f"{error.__name__} without {needles}: {exc}"
        return
    raise AssertionError(f"no {error.__name__} ({needles})")


def _assert_failed_cleanly(engine, before, what: str) -> None:
    """Gradients zeroed, parameters untouched, no step."""
    for chunk, params in zip(engine.model, before, strict=True):
        for key, param in chunk.module.named_parameters():
            assert not param.main_grad.any(), f"{what}: {key} gradient not zeroed"
            assert torch.equal(param.detach(), params[key]), f"{what}: {key} changed"


def _pipeline_failures(engine, batch) -> None:
    """PP=2: only the last stage (rank 1) runs the loss; its failure must not leave rank 0 in the
    schedule's p2p receive. Rank 1 re-raises its own error, rank 0 raises one naming rank 1."""
    import torch.distributed as dist

    rank, calls = dist.get_rank(), []

    def broken(outputs, data, ctx):
        calls.append(1)
        if len(calls) == 2:  # the second micro-batch: the first one's backward has already run
            raise KeyError("old_log_probs")
        return policy_loss(outputs, data, ctx)

    def malformed(outputs, data, ctx):
        return float(policy_loss(outputs, data, ctx)[0]), {}

    step, before = engine.global_step, local_params(engine)
    if rank == 1:
        _raises(lambda: engine.train_batch(batch, broken), KeyError, "old_log_probs")
    else:
        _raises(lambda: engine.train_batch(batch, broken), RuntimeError, "failed on rank(s) [1]",
                "old_log_probs")
    _assert_failed_cleanly(engine, before, "pp2: loss raising on the last stage")
    needles = ("floating 0-d tensor",) if rank == 1 else ("failed on rank(s) [1]", "floating 0-d tensor")
    _raises(lambda: engine.forward_backward_batch(batch, malformed), ValueError, *needles)
    _assert_failed_cleanly(engine, before, "pp2: malformed loss result")
    assert engine.global_step == step
    engine.infer_batch(batch)  # the schedule's p2p state is clean


def _data_parallel_failures(engine, batch) -> None:
    """DP=2: a loss raising on DP rank 0 only, and a non-ValueError while packing on DP rank 1 only."""
    from unittest import mock

    import torch.distributed as dist

    import mcore_engine.step as step_module

    rank, before = dist.get_rank(), local_params(engine)

    def broken(outputs, data, ctx):
        if rank == 0:
            raise ValueError("advantages must be finite")
        return policy_loss(outputs, data, ctx)

    needles = ("advantages must be finite",) if rank == 0 else ("failed on rank(s) [0]", "advantages")
    _raises(lambda: engine.train_batch(batch, broken), ValueError, *needles)
    _assert_failed_cleanly(engine, before, "dp2: loss raising on one rank")

    real = step_module.pack_micro_batch

    def pack(mb, **kwargs):
        if rank == 1:
            raise RuntimeError("packing broke")
        return real(mb, **kwargs)

    with mock.patch.object(step_module, "pack_micro_batch", side_effect=pack):
        if rank == 1:
            _raises(lambda: engine.train_batch(batch, policy_loss), RuntimeError, "packing broke")
        else:
            _raises(lambda: engine.train_batch(batch, policy_loss), ValueError, "data-parallel rank(s) [1]",
                    "global rank(s) [1]")
    engine.infer_batch(batch)


FAILURES = {"pp2-1f1b": _pipeline_failures, "dp2": _data_parallel_failures}


def _layouts(rank: int, world_size: int, path: str) -> None:
    from megatron.core import parallel_state

    from mcore_engine.engine import MegatronEngine
    from mcore_engine.platform import destroy_distributed

    ref = torch.load(path, weights_only=False)
    for name, kwargs, split, flags in LAYOUTS:
        tol = REL_TOL[torch.bfloat16] if kwargs.get("precision") == "bf16" else TOL
        engine = MegatronEngine(tiny_config(**kwargs))
        engine.initialize()
        load_full_state(engine, ref["full0"])
        batch = make_batch(SEED, NUM_SEQS, **FLAGS, **flags)
        tokens = torch.tensor([0] + [int(n) for n in batch["input_ids"].offsets().diff()]).cumsum(0)
        rows = slice(0, NUM_SEQS)
        if split:
            dp, dp_rank = (parallel_state.get_data_parallel_world_size(),
                           parallel_state.get_data_parallel_rank())
            per = NUM_SEQS // dp
            rows = slice(dp_rank * per, (dp_rank + 1) * per)
            batch = batch[torch.arange(rows.start, rows.stop)]
        token_rows = slice(int(tokens[rows.start]), int(tokens[rows.stop]))

        infer = engine.infer_batch(batch)
        out = engine.train_batch(batch, policy_loss)
        metrics = out.get_non_tensor("metrics")
        assert_rel_close(torch.tensor(metrics["grad_norm"], dtype=torch.float64), ref["grad_norm"], tol,
                         f"{name}: grad norm")
        # every rank, pipeline stages included, gets the outputs, the loss and the metrics
        assert_rel_close(flat_values(infer["log_probs"]), ref["infer_log_probs"][token_rows], tol,
                         f"{name}: infer_batch log_probs")
        assert_rel_close(flat_values(out["log_probs"]), ref["log_probs"][token_rows], tol,
                         f"{name}: train_batch log_probs")
        assert_rel_close(flat_values(out["entropy"]), ref["entropy"][token_rows], tol, f"{name}: entropy")
        assert_rel_close(out.get_non_tensor("loss"), ref["loss"], tol, f"{name}: global loss")
        assert metrics["tokens"] == ref["tokens"], f"{name}: metric not summed to its global value"
        assert metrics["seq_id_sum"] == ref["seq_id_sum"], f"{name}: seq_ids not global batch indices"
        expected = local_reference(engine, ref["full1"])
        for chunk, (got, want) in enumerate(zip(local_params(engine), expected, strict=True)):
            for key in want:
                assert_rel_close(got[key], want[key], tol, f"{name}: chunk {chunk} {key} after one step")
        if name in FAILURES:
            FAILURES[name](engine, batch)
        del engine
        destroy_distributed()  # the next layout needs new process groups


def test_layouts_match_single_rank(tmp_path):
    path = str(tmp_path / "reference.pt")
    run_distributed(_reference, 1, path)
    run_distributed(_layouts, 2, path)
