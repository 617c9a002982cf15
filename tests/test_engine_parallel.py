"""MegatronEngine under every parallel layout against one TP=1 / PP=1 / DP=1 run on identical weights.

Launch 1 (one gloo rank) records the references; launch 2 (two gloo ranks) replays them.

Loaded weights: TP=2, DP=2 (each rank half of the batch; plain and distributed optimizer), PP=2
(1F1B), PP=2 x VPP=2 (interleaved; thd with one sequence per micro-batch, bshd with micro-batches
padded to one shape, a token budget), fused lm-head under TP=2 and PP=2: per-token outputs, global
loss, grad norm at fp32 relative-norm error 1e-5 (bf16 TP=2: 2e-2), and the weights after one Adam
step (production ``adam_eps``) tensor by tensor through ``tests.compare`` (bf16: per-tensor budgets
from a one-rank bf16 step).
Under PP=2 and DP=2 a loss function failing (or malformed) on one rank, and an exception while
packing on one DP rank, fail the step on both ranks, gradients zeroed, parameters untouched.

Hugging Face weights (second half of the file): TP=2, PP=2 and DP=2 import one exported folder and
replay inference, two training steps, a bit-identical resume and malformed batches.
"""

from __future__ import annotations

import math
import os
from functools import partial

import torch
from tensordict import TensorDict

from tests.compare import bf16_budget
from tests.engine_setup import (
    flat_values,
    full_state,
    load_full_state,
    local_params,
    make_batch,
    policy_loss,
    tiny_config,
)
from tests.parallel_setup import same_tensors
from tests.utils import REL_TOL, assert_rel_close, rel_err, run_distributed

TOL = REL_TOL[torch.float32]
SEED = 11
NUM_SEQS = 6
FLAGS = dict(calculate_entropy=True, temperature=0.7)


def config(**kwargs):
    """``tests.engine_setup.tiny_config`` with the production ``adam_eps``."""
    from mcore_engine.config import OptimizerConfig

    return tiny_config(adam_eps=OptimizerConfig.adam_eps, **kwargs)


def _reference(rank: int, world_size: int, path: str) -> None:
    from mcore_engine.engine import MegatronEngine
    from mcore_engine.parallel.platform import destroy_distributed

    engine = MegatronEngine(config())
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
               full1=full_state(engine),
               grads={k: p.main_grad.detach().clone() for k, p in engine.model[0].module.named_parameters()})
    assert out.get_non_tensor("metrics")["update_skipped"] == 0.0
    del engine
    destroy_distributed()
    # the bf16 layout's per-tensor budgets: the same step in bf16 on one rank against fp32
    engine = MegatronEngine(config(precision="bf16"))
    engine.initialize()
    load_full_state(engine, ref["full0"])
    engine.train_batch(batch, policy_loss)
    ref["bf16_budget"] = bf16_budget(full_state(engine), ref["full1"])
    del engine
    destroy_distributed()
    ref["hf"] = _hf_reference(os.path.dirname(path))
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

    import mcore_engine.step.prepare as step_module

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
    from mcore_engine.parallel.platform import destroy_distributed

    ref = torch.load(path, weights_only=False)
    for name, kwargs, split, flags in LAYOUTS:
        tol = REL_TOL[torch.bfloat16] if kwargs.get("precision") == "bf16" else TOL
        engine = MegatronEngine(config(**kwargs))
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
        if kwargs.get("precision") == "bf16":
            same_tensors(f"{name}: weights after one step", engine, local_params(engine), ref["full1"],
                         tol=ref["bf16_budget"])
        else:
            same_tensors(f"{name}: weights after one step", engine, local_params(engine), ref["full1"],
                         steps_from=ref["grads"], steps=1)
        if name in FAILURES:
            FAILURES[name](engine, batch)
        del engine
        destroy_distributed()  # the next layout needs new process groups
    for mode in ("tp2", "pp2", "dp2"):
        _hf_layout(mode, os.path.dirname(path), ref["hf"])
        destroy_distributed()


# ====================================================================== Hugging Face weights, two steps
# Launch 1 also exports a seeded TP=1 engine with ``export_hf``, re-imports it through
# ``model.hf_path`` (bit-identical round trip on the true-vocab rows) and records the sequence of
# ``_hf_steps``; launch 2 replays it under TP=2, PP=2 and DP=2 (uneven halves: 4 + 2 sequences),
# each importing the same folder and splitting into micro-batches its own way. Checked at fp32
# relative error 1e-5: infer_batch outputs (jagged, per-sample temperature; left-padded, teacher
# top-k), loss / grad norm / metrics / outputs of two train_batch steps (an own loss with a
# seq-mean term, then distillation_ppo_loss; a cosine lr step after each), log-probs after each
# step. Bit-identical: a checkpoint saved after step 1 and loaded into a fresh engine gives step 2.
# Malformed batches raise ValueError with parameters, step and lr unchanged (one bad DP rank
# included); NaN / +inf teacher_logprobs are refused by name, -inf (a zero probability) accepted;
# non-finite gradients skip the update.
HF_VOCAB, HF_MAX_LEN, HF_K = 250, 48, 5  # vocab padded to 256: padded ids exist in every layout
HF_MODEL = dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=160,
                vocab_size=HF_VOCAB, max_sequence_length=HF_MAX_LEN, rotary_base=10000,
                normalization="RMSNorm", norm_epsilon=1e-6, swiglu=True, tie_word_embeddings=False,
                add_qkv_bias=True, make_vocab_size_divisible_by=128, init_method_std=0.05)
HF_LAYOUTS = {"ref": (1, 1), "tp2": (2, 1), "pp2": (1, 2), "dp2": (1, 1)}
HF_MICRO = {"ref": {"micro_batch_size_per_gpu": 6}, "tp2": {"micro_batch_size_per_gpu": 2},
            "pp2": {"micro_batch_size_per_gpu": 2},
            "dp2": {"use_dynamic_bsz": True, "max_token_len_per_gpu": 40}}
HF_DP_CUT = [0, 4, 6]
INFER_FLAGS = {"calculate_entropy": True, "calculate_sum_pi_squared": True}
INFER_KEYS = ("log_probs", "entropy", "sum_pi_squared")
DISTILL_KEYS = ("log_probs", "entropy", "distillation_losses", "student_mass", "teacher_mass")
TRAIN_FLAGS = {"calculate_entropy": True, "distillation_use_topk": True}


def _hf_engine(mode: str, hf_path: str | None):
    from mcore_engine import EngineConfig, MegatronEngine

    tp, pp = HF_LAYOUTS[mode]
    engine = MegatronEngine(EngineConfig.from_dict({
        "model": {**HF_MODEL, "hf_path": hf_path},
        "parallel": {"tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp},
        "optimizer": {"lr": 2e-3, "min_lr": 1e-4, "weight_decay": 0.01, "clip_grad": 1.0,
                      "lr_warmup_steps": 0, "lr_decay_style": "cosine", "lr_decay_steps": 10},
        "precision": "fp32", "seed": 7, "micro_batch_size": 3, "data_format": "thd"}))
    engine.initialize()
    return engine


def _hf_batches() -> dict:
    """Plain-tensor descriptions of the global batches (identical in every process)."""
    g = torch.Generator().manual_seed(2024)
    lengths = [5, 17, 9, 2, 12, 30]

    def ids(n):
        return torch.randint(0, HF_VOCAB, (n,), generator=g)

    def teacher(n):
        lp, tid = torch.log_softmax(torch.randn(n, HF_VOCAB, generator=g) * 2, -1).topk(HF_K, dim=-1)
        return tid, lp

    infer_jagged = {"ids": [ids(n) for n in lengths], "teacher": [teacher(n) for n in lengths],
                    "temperature": torch.tensor([0.7, 1.0, 1.3, 0.9, 2.0, 1.1])}
    plen, width = [11, 4, 16, 7, 3, 9], 18  # left-padded, row 1 right-padded
    pad_ids = torch.zeros(len(plen), width, dtype=torch.int64)
    mask = torch.zeros(len(plen), width, dtype=torch.bool)
    t_ids = torch.zeros(len(plen), width, HF_K, dtype=torch.int64)
    t_lp = torch.full((len(plen), width, HF_K), -30.0)
    for r, n in enumerate(plen):
        cols = slice(width - n, width) if r != 1 else slice(0, n)
        pad_ids[r, cols], mask[r, cols] = ids(n), True
        t_ids[r, cols], t_lp[r, cols] = teacher(n)
    infer_padded = {"input_ids": pad_ids, "attention_mask": mask, "teacher_ids": t_ids,
                    "teacher_logprobs": t_lp}
    train = []
    for _ in range(2):
        tl = [int(x) for x in torch.randint(3, 40, (len(lengths),), generator=g)]
        train.append({"ids": [ids(n) for n in tl], "teacher": [teacher(n) for n in tl],
                      "loss_mask": [(torch.rand(n, generator=g) > 0.2).float() for n in tl],
                      "advantages": [torch.randn(n, generator=g) for n in tl],
                      "temperature": torch.rand(len(lengths), generator=g) + 0.6})
    return {"infer_jagged": infer_jagged, "infer_padded": infer_padded, "train": train}


def _jagged(rows: list[torch.Tensor]) -> torch.Tensor:
    return torch.nested.nested_tensor(rows, layout=torch.jagged)


def _jagged_batch(desc: dict, rows: slice, *, teacher: bool, flags: dict) -> TensorDict:
    ids = desc["ids"][rows]
    td = TensorDict({"input_ids": _jagged(ids), "temperature": desc["temperature"][rows].clone()},
                    batch_size=[len(ids)])
    if teacher:
        td["teacher_ids"] = _jagged([t for t, _ in desc["teacher"][rows]])
        td["teacher_logprobs"] = _jagged([lp for _, lp in desc["teacher"][rows]])
    for key in ("loss_mask", "advantages"):
        if key in desc:
            td[key] = _jagged(desc[key][rows])
    for k, v in flags.items():
        td.set_non_tensor(k, v)
    return td


def _padded_batch(desc: dict, rows: slice, flags: dict) -> TensorDict:
    td = TensorDict({k: v[rows].clone() for k, v in desc.items()},
                    batch_size=[desc["input_ids"][rows].shape[0]])
    for k, v in flags.items():
        td.set_non_tensor(k, v)
    return td


def _values(out: TensorDict, keys, mask=None) -> dict[str, torch.Tensor]:
    """Per-token outputs -> flat fp64 real-token values (jagged: values(); padded: masked)."""
    return {k: (out[k].values() if out[k].is_nested else out[k][mask]).detach().double().reshape(-1)
            for k in keys if k in out.keys()}


def _own_loss(outputs, data, ctx):
    """Token-mean policy gradient + top-k KL + entropy bonus, plus a seq-mean-token-mean KL term
    (``seq_ids`` / ``global_num_seqs`` across micro-batches and DP)."""
    mask = data["loss_mask"].to(torch.float32)
    lp, adv = outputs["log_probs"], data["advantages"].to(torch.float32)
    token_term = ((-adv * lp + 0.5 * outputs["distillation_losses"] - 0.01 * outputs["entropy"]) * mask
                  ).sum() / ctx.global_num_tokens
    seq = data["seq_ids"].long()
    n = int(seq.max()) + 1
    per_seq_tok = torch.zeros(n).index_add_(0, seq, mask)
    per_seq = torch.zeros(n).index_add_(0, seq, outputs["distillation_losses"] * mask)
    present = per_seq_tok > 0
    seq_term = (per_seq[present] / per_seq_tok[present]).sum() / ctx.global_num_seqs
    return token_term + 0.3 * seq_term, {
        "token_term": token_term.detach(), "seq_term": seq_term.detach(),
        "entropy_mean": ((outputs["entropy"] * mask).sum() / ctx.global_num_tokens).detach()}


def _ppo_loss():
    from mcore_engine.losses import distillation_ppo_loss

    return distillation_ppo_loss(distillation_loss_coef=0.7, loss_agg_mode="seq-mean-token-mean")


def _params(engine) -> list[torch.Tensor]:
    return [p.detach().clone() for chunk in engine.model for p in chunk.parameters()]


def _bit_equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def _hf_steps(engine, descs: dict, rows: slice, micro: dict, ckpt: str | None = None) -> dict:
    """The measured sequence (the same for the reference and every layout); ``ckpt``: save there
    right after step 1's lr step."""
    res = {"infer_jagged": _values(engine.infer_batch(_jagged_batch(
        descs["infer_jagged"], rows, teacher=False, flags={**INFER_FLAGS, **micro})), INFER_KEYS)}
    out = engine.infer_batch(_padded_batch(descs["infer_padded"], rows, {
        "temperature": 0.8, "calculate_entropy": True, "distillation_use_topk": True, **micro}))
    res["infer_padded"] = _values(out, DISTILL_KEYS, descs["infer_padded"]["attention_mask"][rows])
    for i, (desc, loss_fn) in enumerate(zip(descs["train"], (_own_loss, _ppo_loss()), strict=True), 1):
        batch = _jagged_batch(desc, rows, teacher=True, flags={**TRAIN_FLAGS, **micro})
        out = engine.train_batch(batch, loss_fn)
        res[f"train{i}"] = {"loss": float(out.get_non_tensor("loss")),
                            "metrics": dict(out.get_non_tensor("metrics")),
                            "outputs": _values(out, DISTILL_KEYS)}
        engine.lr_scheduler_step()
        if i == 1 and ckpt is not None:
            engine.save_checkpoint(ckpt)
        res[f"after{i}"] = _values(engine.infer_batch(_jagged_batch(
            descs["infer_jagged"], rows, teacher=False, flags={**INFER_FLAGS, **micro})), INFER_KEYS)
    return res


def _hf_reference(workdir: str) -> dict:
    seeded = _hf_engine("ref", None)
    hf = os.path.join(workdir, "hf")
    seeded.export_hf(hf)
    engine = _hf_engine("ref", hf)
    # Hugging Face has no padded vocab rows (ids 250..255): compare the true-vocab rows
    true_rows = [p[:HF_VOCAB] if p.shape[0] == 256 else p for p in _params(seeded)]
    assert _bit_equal(true_rows, [p[:HF_VOCAB] if p.shape[0] == 256 else p for p in _params(engine)]), \
        "export_hf -> model.hf_path round trip is not bit-identical"
    del seeded
    return _hf_steps(engine, _hf_batches(), slice(None), HF_MICRO["ref"])


def _reference_slice(ref: dict, descs: dict, name: str, key: str, rows: slice, dp: bool) -> torch.Tensor:
    """The reference's flat token values of ``name``/``key``, cut to this rank's sequences under DP."""
    want = ref[name]["outputs"][key] if name.startswith("train") else ref[name][key]
    if not dp:
        return want
    if name == "infer_padded":
        lens = descs["infer_padded"]["attention_mask"].sum(1).tolist()
    else:
        infer = name.startswith(("infer", "after"))
        desc = descs["infer_jagged"] if infer else descs["train"][int(name[-1]) - 1]
        lens = [len(x) for x in desc["ids"]]
    starts = [0]
    for n in lens:
        starts.append(starts[-1] + n)
    return torch.cat([want[starts[i]:starts[i + 1]] for i in list(range(len(lens)))[rows]])


def _compare_with_reference(mode: str, ref: dict, res: dict, descs: dict, rows: slice, dp: bool) -> None:
    def close(got, want, what):
        assert_rel_close(torch.as_tensor(got, dtype=torch.float64).reshape(-1),
                         torch.as_tensor(want, dtype=torch.float64).reshape(-1), TOL, f"{mode}: {what}")

    for name in ("infer_jagged", "infer_padded", "after1", "after2"):
        assert res[name].keys() == ref[name].keys(), f"{mode}: {name} keys {sorted(res[name])}"
        for key, got in res[name].items():
            close(got, _reference_slice(ref, descs, name, key, rows, dp), f"{name} {key}")
    for i in (1, 2):
        r, w = res[f"train{i}"], ref[f"train{i}"]
        close(r["loss"], w["loss"], f"train{i} loss")
        close(r["metrics"]["grad_norm"], w["metrics"]["grad_norm"], f"train{i} grad norm")
        keys = sorted(set(w["metrics"]) - {"grad_norm", "lr", "update_skipped"})
        assert set(keys) <= r["metrics"].keys(), f"{mode}: train{i} metrics {sorted(r['metrics'])}"
        assert r["metrics"]["update_skipped"] == 0.0 and r["metrics"]["lr"] == w["metrics"]["lr"], \
            f"{mode}: train{i} lr {r['metrics']['lr']} vs {w['metrics']['lr']}, " \
            f"skipped {r['metrics']['update_skipped']}"
        for key in keys:
            close(r["metrics"][key], w["metrics"][key], f"train{i} metric {key}")
        assert r["outputs"].keys() == w["outputs"].keys(), f"{mode}: train{i} outputs {sorted(r['outputs'])}"
        for key, got in r["outputs"].items():
            close(got, _reference_slice(ref, descs, f"train{i}", key, rows, dp), f"train{i} {key}")
    moved = rel_err(ref["after1"]["log_probs"], ref["infer_jagged"]["log_probs"])
    assert moved > 100 * TOL, f"the reference step moved the log-probs by only {moved:.3e}"


def _with_values(nt: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    return torch.nested.nested_tensor_from_jagged(values, nt.offsets())


def _bad_batches(descs: dict, rows: slice, micro: dict) -> dict[str, TensorDict]:
    """Malformed train batches, one defect each."""
    desc = descs["train"][0]

    def good():
        return _jagged_batch(desc, rows, teacher=True, flags={**TRAIN_FLAGS, **micro})

    def edited(key, index, value):
        b = good()
        v = b[key].values().clone()
        v[index] = value
        return b.set(key, _with_values(b[key], v))

    bad = {"id_eq_vocab": edited("input_ids", 3, HF_VOCAB),  # inside the padded vocab, outside the true one
           "id_negative": edited("input_ids", -1, -1),
           "teacher_id_out_of_vocab": edited("teacher_ids", (0, 2), HF_VOCAB + 3),
           "teacher_logprobs_nan": edited("teacher_logprobs", (5, 1), float("nan")),
           "teacher_logprobs_pos_inf": edited("teacher_logprobs", (2, 0), float("inf"))}
    b = good()
    del b["teacher_logprobs"]
    bad["missing_teacher_logprobs"] = b
    b = good()
    del b["input_ids"]
    bad["missing_input_ids"] = b
    b = good()
    lp = b["teacher_logprobs"].values()[:, : HF_K - 1].clone()
    bad["teacher_wrong_k"] = b.set("teacher_logprobs", _with_values(b["teacher_logprobs"], lp))
    long_desc = {k: list(v) if isinstance(v, list) else v for k, v in desc.items()}
    first = list(range(len(desc["ids"])))[rows][0]
    g = torch.Generator().manual_seed(5)
    long_desc["ids"][first] = torch.randint(0, HF_VOCAB, (HF_MAX_LEN + 1,), generator=g)
    long_desc["teacher"][first] = (torch.randint(0, HF_VOCAB, (HF_MAX_LEN + 1, HF_K), generator=g),
                                   torch.randn(HF_MAX_LEN + 1, HF_K, generator=g) - 3)
    long_desc["loss_mask"][first] = torch.ones(HF_MAX_LEN + 1)
    long_desc["advantages"][first] = torch.ones(HF_MAX_LEN + 1)
    bad["too_long"] = _jagged_batch(long_desc, rows, teacher=True, flags={**TRAIN_FLAGS, **micro})
    b = good()
    b["temperature"] = torch.zeros(b.batch_size[0])
    bad["temperature_zero"] = b
    b = good()
    b.set_non_tensor("micro_batch_size_per_gpu", 0)
    bad["micro_batch_zero"] = b
    return bad


NEEDLES = {"teacher_logprobs_nan": "teacher_logprobs", "teacher_logprobs_pos_inf": "teacher_logprobs",
           "teacher_id_out_of_vocab": "teacher_ids", "id_eq_vocab": "input_ids",
           "too_long": "max_sequence_length"}


def _check_bad_batches(mode: str, engine, descs: dict, rows: slice, micro: dict, dp: bool) -> None:
    import torch.distributed as dist

    bad = _bad_batches(descs, rows, micro)
    for name, batch in bad.items():
        before, step, lr = _params(engine), engine.global_step, engine.optimizer.param_groups[0]["lr"]
        calls = [partial(engine.train_batch, batch, _own_loss)]
        if name.startswith(("teacher_logprobs", "id_eq")):  # inference refuses them too
            calls.append(partial(engine.infer_batch, batch))
        for call in calls:
            _raises(call, ValueError, NEEDLES.get(name, ""))
        assert _bit_equal(before, _params(engine)) and engine.global_step == step, \
            f"{mode}: bad {name} changed state"
        assert engine.optimizer.param_groups[0]["lr"] == lr, f"{mode}: bad {name} changed the lr"
    if dp:  # a bad batch on one data-parallel rank only: both ranks raise, nobody hangs
        good = _jagged_batch(descs["train"][0], rows, teacher=True, flags={**TRAIN_FLAGS, **micro})
        before, step = _params(engine), engine.global_step
        _raises(partial(engine.train_batch, bad["id_eq_vocab"] if dist.get_rank() == 1 else good, _own_loss),
                ValueError)
        assert _bit_equal(before, _params(engine)) and engine.global_step == step, f"{mode}: one bad DP rank"
    # -inf teacher log-probs (a zero teacher probability) are valid: a finite step
    good = _jagged_batch(descs["train"][0], rows, teacher=True, flags={**TRAIN_FLAGS, **micro})
    lp = good["teacher_logprobs"].values().clone()
    lp[::3, -1] = float("-inf")
    good.set("teacher_logprobs", _with_values(good["teacher_logprobs"], lp))
    out = engine.train_batch(good, _own_loss)
    what = f"{mode}: -inf teacher log-probs"
    assert math.isfinite(float(out.get_non_tensor("loss"))), f"{what} gave a non-finite loss"
    assert out.get_non_tensor("metrics")["update_skipped"] == 0.0, f"{what} skipped the step"
    assert torch.isfinite(out["distillation_losses"].values()).all(), f"{what}: non-finite KL"

    def nan_loss(outputs, data, ctx):  # non-finite gradients: update skipped on every rank
        loss, metrics = _own_loss(outputs, data, ctx)
        return loss * float("nan"), metrics

    before, step, skipped = _params(engine), engine.global_step, engine.num_skipped_steps
    batch = _jagged_batch(descs["train"][0], rows, teacher=True, flags={**TRAIN_FLAGS, **micro})
    metrics = engine.train_batch(batch, nan_loss).get_non_tensor("metrics")
    assert _bit_equal(before, _params(engine)) and engine.global_step == step, \
        f"{mode}: skipped step changed state"
    assert metrics["update_skipped"] == 1.0 and engine.num_skipped_steps == skipped + 1, \
        f"{mode}: update_skipped={metrics['update_skipped']}, grad_norm={metrics['grad_norm']}"


def _hf_layout(mode: str, workdir: str, ref: dict) -> None:
    import torch.distributed as dist

    descs, dp, micro = _hf_batches(), mode == "dp2", HF_MICRO[mode]
    rank = dist.get_rank()
    rows = slice(HF_DP_CUT[rank], HF_DP_CUT[rank + 1]) if dp else slice(None)
    hf, ckpt = os.path.join(workdir, "hf"), os.path.join(workdir, f"ckpt_{mode}")
    engine = _hf_engine(mode, hf)
    res = _hf_steps(engine, descs, rows, micro, ckpt=ckpt)
    params_after2 = _params(engine)
    _compare_with_reference(mode, ref, res, descs, rows, dp)
    del engine

    fresh = _hf_engine(mode, hf)  # initial weights -> step-1 checkpoint -> step 2 as uninterrupted
    fresh.load_checkpoint(ckpt)
    assert fresh.global_step == 1, f"{mode}: global_step after load {fresh.global_step}"
    batch = _jagged_batch(descs["train"][1], rows, teacher=True, flags={**TRAIN_FLAGS, **micro})
    out = fresh.train_batch(batch, _ppo_loss())
    metrics, want = out.get_non_tensor("metrics"), res["train2"]
    assert float(out.get_non_tensor("loss")) == want["loss"], f"{mode}: resumed loss not bit-identical"
    for key in ("grad_norm", "lr"):
        assert metrics[key] == want["metrics"][key], \
            f"{mode}: resumed {key} {metrics[key]!r} vs {want['metrics'][key]!r}"
    fresh.lr_scheduler_step()
    assert _bit_equal(_params(fresh), params_after2), f"{mode}: resumed parameters not bit-identical"
    after = fresh.infer_batch(_jagged_batch(descs["infer_jagged"], rows, teacher=False,
                                            flags={**INFER_FLAGS, **micro}))
    assert torch.equal(_values(after, ("log_probs",))["log_probs"], res["after2"]["log_probs"]), \
        f"{mode}: resumed next log-probs not bit-identical"
    _check_bad_batches(mode, fresh, descs, rows, micro, dp)


def test_layouts_match_single_rank(tmp_path):
    path = str(tmp_path / "reference.pt")
    run_distributed(_reference, 1, path)
    run_distributed(_layouts, 2, path)
