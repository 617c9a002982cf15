"""Independent end-to-end check of ``MegatronEngine`` under TP=2, PP=2 and DP=2 against TP=1.

Run (the test ``tests/test_engine_verify.py`` does exactly this)::

    torchrun --standalone --nproc_per_node=1 tools/verify_engine.py --mode ref --workdir W
    torchrun --standalone --nproc_per_node=2 tools/verify_engine.py --mode tp2 --workdir W   # also pp2, dp2

``ref`` (one rank, TP=1) builds a seeded engine, writes it as a Hugging Face folder with
``engine.export_hf`` (``W/hf``), re-imports it through ``model.hf_path`` (bit-identical round trip
checked), and records, on batches written here (jagged and left-padded ``input_ids``, per-sample
temperature tensors, teacher top-k, per-token advantages), the per-token outputs of ``infer_batch``,
the loss / grad norm / metrics of two ``train_batch`` steps and the log-probs after each step
(``W/ref.pt``). Every other mode starts from the same weights (``model.hf_path = W/hf``), runs the
same global batches (DP=2: each rank its contiguous half) and writes ``W/<mode>.json``:
``{check_name: {"ok": bool, "detail": str}}``. Checks (fp32, relative error ``||a-b|| / ||b||``):

    infer_*      per-token outputs of infer_batch vs TP=1                    <= 1e-5
    train1_* / train2_*   loss, grad norm, metrics vs TP=1                   <= 1e-5
    after1_logprobs / after2_logprobs   log-probs after each step vs TP=1     <= 1e-5
    resume_*     save after step 1 -> fresh engine -> load -> step 2: loss, grad norm, parameters and
                 the next log-probs bit-identical to the uninterrupted run
    bad_*        malformed batches raise ValueError and leave parameters, optimizer step and the
                 checkpointable state bit-identical

Nothing here reads the engine's internals beyond the public attributes ``model`` (parameters, for
the bit-identity checks), ``global_step`` and the API of ``shared/API.md``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import traceback

import torch
import torch.distributed as dist
from tensordict import TensorDict

from mcore_engine import EngineConfig, MegatronEngine

VOCAB = 250          # padded to 256 by Megatron: padded ids exist in every layout
MAX_LEN = 48
K = 5
REL_TOL = 1e-5

MODEL = dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=160,
             vocab_size=VOCAB, max_sequence_length=MAX_LEN, rotary_base=10000, normalization="RMSNorm",
             norm_epsilon=1e-6, swiglu=True, tie_word_embeddings=False, add_qkv_bias=True,
             make_vocab_size_divisible_by=128, init_method_std=0.05)
LAYOUTS = {"ref": (1, 1), "tp2": (2, 1), "pp2": (1, 2), "dp2": (1, 1)}


def make_config(mode: str, hf_path: str | None) -> EngineConfig:
    tp, pp = LAYOUTS[mode]
    return EngineConfig.from_dict({
        "model": {**MODEL, "hf_path": hf_path},
        "parallel": {"tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp},
        "optimizer": {"lr": 2e-3, "min_lr": 1e-4, "weight_decay": 0.01, "clip_grad": 1.0,
                      "lr_warmup_steps": 0, "lr_decay_style": "cosine", "lr_decay_steps": 10},
        "precision": "fp32", "seed": 7, "micro_batch_size": 3, "data_format": "thd"})


# ---------------------------------------------------------------------------------------- batches
def _jagged(rows: list[torch.Tensor]) -> torch.Tensor:
    return torch.nested.nested_tensor(rows, layout=torch.jagged)


def make_global_batches() -> dict[str, dict]:
    """Plain-tensor descriptions of the global batches (built identically in every process)."""
    g = torch.Generator().manual_seed(2024)
    lengths = [5, 17, 9, 2, 12, 30]
    b = len(lengths)

    def ids(n):
        return torch.randint(0, VOCAB, (n,), generator=g)

    def teacher(n):
        logits = torch.randn(n, VOCAB, generator=g) * 2
        lp, tid = torch.log_softmax(logits, -1).topk(K, dim=-1)
        return tid, lp

    seqs = [ids(n) for n in lengths]
    teach = [teacher(n) for n in lengths]
    infer_jagged = {"ids": seqs, "temperature": torch.tensor([0.7, 1.0, 1.3, 0.9, 2.0, 1.1]),
                    "teacher": teach}
    # left-padded batch (+ a right-padded row), teacher top-k, scalar temperature
    plen = [11, 4, 16, 7, 3, 9]
    S = 18
    pad_ids = torch.zeros(len(plen), S, dtype=torch.int64)
    mask = torch.zeros(len(plen), S, dtype=torch.bool)
    t_ids = torch.zeros(len(plen), S, K, dtype=torch.int64)
    t_lp = torch.full((len(plen), S, K), -30.0)
    for r, n in enumerate(plen):
        sl = slice(S - n, S) if r != 1 else slice(0, n)
        pad_ids[r, sl] = ids(n)
        mask[r, sl] = True
        t_ids[r, sl], t_lp[r, sl] = teacher(n)
    infer_padded = {"input_ids": pad_ids, "attention_mask": mask, "teacher_ids": t_ids,
                    "teacher_logprobs": t_lp}
    train = []
    for _ in range(2):
        tl = [int(x) for x in torch.randint(3, 40, (b,), generator=g)]
        train.append({
            "ids": [ids(n) for n in tl], "teacher": [teacher(n) for n in tl],
            "loss_mask": [(torch.rand(n, generator=g) > 0.2).float() for n in tl],
            "advantages": [torch.randn(n, generator=g) for n in tl],
            "temperature": torch.rand(b, generator=g) + 0.6})
    return {"infer_jagged": infer_jagged, "infer_padded": infer_padded, "train": train}


def jagged_batch(desc: dict, rows: slice, *, teacher: bool, extra: dict | None = None) -> TensorDict:
    ids = desc["ids"][rows]
    td = TensorDict({"input_ids": _jagged(ids), "temperature": desc["temperature"][rows].clone()},
                    batch_size=[len(ids)])
    if teacher:
        td["teacher_ids"] = _jagged([t for t, _ in desc["teacher"][rows]])
        td["teacher_logprobs"] = _jagged([lp for _, lp in desc["teacher"][rows]])
    for key in ("loss_mask", "advantages"):
        if key in desc:
            td[key] = _jagged(desc[key][rows])
    for k, v in (extra or {}).items():
        td.set_non_tensor(k, v)
    return td


def padded_batch(desc: dict, rows: slice, extra: dict) -> TensorDict:
    td = TensorDict({k: v[rows].clone() for k, v in desc.items()},
                    batch_size=[desc["input_ids"][rows].shape[0]])
    for k, v in extra.items():
        td.set_non_tensor(k, v)
    return td


def flat(t: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Per-token output -> flat fp64 token values (jagged: values(); padded: real tokens)."""
    if t.is_nested:
        return t.values().detach().double().reshape(-1)
    return t[mask].detach().double().reshape(-1)


# ---------------------------------------------------------------------------------------- loss
def my_loss(outputs, data, ctx):
    """Own loss (INTERFACES.md contract): token-mean policy-gradient + top-k KL + entropy bonus, plus a
    seq-mean-token-mean KL term (exercises ``seq_ids`` / ``global_num_seqs`` across micro-batches and DP)."""
    mask = data["loss_mask"].to(torch.float32)
    lp, adv = outputs["log_probs"], data["advantages"].to(torch.float32)
    tok = (-adv * lp + 0.5 * outputs["distillation_losses"] - 0.01 * outputs["entropy"]) * mask
    token_term = tok.sum() / ctx.global_num_tokens
    seq = data["seq_ids"].long()
    n = int(seq.max()) + 1
    per_seq_tok = torch.zeros(n, dtype=torch.float32).index_add_(0, seq, mask)
    per_seq = torch.zeros(n, dtype=torch.float32).index_add_(0, seq, outputs["distillation_losses"] * mask)
    present = per_seq_tok > 0
    seq_term = (per_seq[present] / per_seq_tok[present]).sum() / ctx.global_num_seqs
    loss = token_term + 0.3 * seq_term
    return loss, {"token_term": token_term.detach(), "seq_term": seq_term.detach(),
                  "entropy_mean": ((outputs["entropy"] * mask).sum() / ctx.global_num_tokens).detach()}


def ppo_loss():
    from mcore_engine.losses import distillation_ppo_loss

    return distillation_ppo_loss(distillation_loss_coef=0.7, loss_agg_mode="seq-mean-token-mean")


# ---------------------------------------------------------------------------------------- helpers
def params(engine) -> list[torch.Tensor]:
    return [p.detach().clone() for chunk in engine.model for p in chunk.parameters()]


def bit_equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a = torch.as_tensor(a, dtype=torch.float64).reshape(-1)
    b = torch.as_tensor(b, dtype=torch.float64).reshape(-1)
    if a.shape != b.shape:
        return math.inf
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


class Checks:
    def __init__(self):
        self.results: dict[str, dict] = {}

    def add(self, name: str, ok: bool, detail: str) -> None:
        # every rank must agree: a check passes only if it passes on every rank
        flag = torch.tensor([0 if ok else 1])
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        ok_all = not bool(flag.item())
        if name in self.results:
            raise RuntimeError(f"duplicate check {name}")
        self.results[name] = {"ok": ok_all, "detail": f"rank{dist.get_rank()}: {detail}"}
        if dist.get_rank() == 0:
            print(f"[{'PASS' if ok_all else 'FAIL'}] {name}: {detail}", flush=True)

    def close(self, name: str, got, want, tol: float = REL_TOL) -> float:
        err = rel(got, want)
        self.add(name, err <= tol, f"rel err {err:.3e} (tol {tol:g})")
        return err

    def guarded(self, name: str, fn) -> None:
        """Run ``fn``; an unexpected exception fails check ``name`` instead of aborting the run."""
        try:
            fn()
        except Exception as exc:  # record and continue: one failing area must not hide the others
            traceback.print_exc()
            self.add(name, False, f"raised {type(exc).__name__}: {exc}")


def output_values(out: TensorDict, keys, mask=None) -> dict[str, torch.Tensor]:
    return {k: flat(out[k], mask) for k in keys if k in out.keys()}


INFER_FLAGS = {"calculate_entropy": True, "calculate_sum_pi_squared": True}
INFER_KEYS = ("log_probs", "entropy", "sum_pi_squared")
DISTILL_KEYS = ("log_probs", "entropy", "distillation_losses", "student_mass", "teacher_mass")


def run_steps(engine, descs, rows: slice, micro: dict) -> dict:
    """The measured sequence, identical for the reference and every layout (``micro``: micro-batching
    flags, chosen differently per layout so the outputs must not depend on them)."""
    res = {}
    out = engine.infer_batch(jagged_batch(descs["infer_jagged"], rows, teacher=False,
                                          extra={**INFER_FLAGS, **micro}))
    res["infer_jagged"] = output_values(out, INFER_KEYS)
    pmask = descs["infer_padded"]["attention_mask"][rows]
    out = engine.infer_batch(padded_batch(descs["infer_padded"], rows, {
        "temperature": 0.8, "calculate_entropy": True, "distillation_use_topk": True, **micro}))
    res["infer_padded"] = output_values(out, DISTILL_KEYS, pmask)
    for i, (desc, loss_fn) in enumerate(zip(descs["train"], (my_loss, ppo_loss()), strict=True), 1):
        flags = {"calculate_entropy": True, "distillation_use_topk": True, **micro}
        out = engine.train_batch(jagged_batch(desc, rows, teacher=True, extra=flags), loss_fn)
        metrics = dict(out.get_non_tensor("metrics"))
        res[f"train{i}"] = {"loss": float(out.get_non_tensor("loss")), "metrics": metrics,
                            "outputs": output_values(out, DISTILL_KEYS)}
        engine.lr_scheduler_step()
        after = engine.infer_batch(jagged_batch(descs["infer_jagged"], rows, teacher=False,
                                                extra={**INFER_FLAGS, **micro}))
        res[f"after{i}"] = output_values(after, INFER_KEYS)
    return res


# ---------------------------------------------------------------------------------------- modes
def run_ref(workdir: str) -> None:
    from mcore_engine.hf import export_hf  # noqa: F401  (public route checked to exist)

    descs = make_global_batches()
    seeded = MegatronEngine(make_config("ref", None))
    seeded.initialize()
    hf = os.path.join(workdir, "hf")
    seeded.export_hf(hf)
    engine = MegatronEngine(make_config("ref", hf))
    engine.initialize()
    # Hugging Face has no padded vocab rows (ids 250..255): compare the true-vocab rows only
    padded = 256
    roundtrip = bit_equal([p[:VOCAB] if p.shape[0] == padded else p for p in params(seeded)],
                          [p[:VOCAB] if p.shape[0] == padded else p for p in params(engine)])
    del seeded
    res = run_steps(engine, descs, slice(None), {"micro_batch_size_per_gpu": 6})
    res["roundtrip_bit_identical"] = roundtrip
    torch.save(res, os.path.join(workdir, "ref.pt"))
    print(f"ref: hf round trip bit-identical={roundtrip}; train1 loss {res['train1']['loss']:.6f} "
          f"grad_norm {res['train1']['metrics']['grad_norm']:.6f}; train2 loss {res['train2']['loss']:.6f} "
          f"grad_norm {res['train2']['metrics']['grad_norm']:.6f}", flush=True)


def compare_step(checks: Checks, ref: dict, res: dict, rows: slice, dp: bool, ref_descs) -> None:
    def slice_ref(name, key):
        want = ref[name]["outputs"][key] if name.startswith("train") else ref[name][key]
        if not dp:
            return want
        # DP: this rank's contiguous sequences -> cut the reference's flat token values
        if name == "infer_padded":
            mask = ref_descs["infer_padded"]["attention_mask"]
            lens = mask.sum(1).tolist()
        else:
            desc = ref_descs["infer_jagged"] if name.startswith(("infer", "after")) else \
                ref_descs["train"][int(name[-1]) - 1]
            lens = [len(x) for x in desc["ids"]]
        starts = [0]
        for n in lens:
            starts.append(starts[-1] + n)
        idx = list(range(len(lens)))[rows]
        return torch.cat([want[starts[i]:starts[i + 1]] for i in idx])

    for name in ("infer_jagged", "infer_padded", "after1", "after2"):
        for key, got in res[name].items():
            checks.close(f"{name}_{key}", got, slice_ref(name, key))
    for i in (1, 2):
        r, w = res[f"train{i}"], ref[f"train{i}"]
        checks.close(f"train{i}_loss", r["loss"], w["loss"])
        checks.close(f"train{i}_grad_norm", r["metrics"]["grad_norm"], w["metrics"]["grad_norm"])
        keys = sorted(set(w["metrics"]) - {"grad_norm", "lr", "update_skipped"})
        missing = [k for k in keys if k not in r["metrics"]]
        checks.add(f"train{i}_metric_keys", not missing and r["metrics"]["update_skipped"] == 0.0
                   and r["metrics"]["lr"] == w["metrics"]["lr"],
                   f"missing {missing}, lr {r['metrics']['lr']} vs {w['metrics']['lr']}, "
                   f"skipped {r['metrics']['update_skipped']}")
        errs = {k: rel(r["metrics"][k], w["metrics"][k]) for k in keys if k not in missing}
        worst = max(errs.values(), default=0.0)
        checks.add(f"train{i}_metrics", worst <= REL_TOL, f"worst rel err {worst:.3e} over {sorted(errs)}")
        for key, got in r["outputs"].items():
            checks.close(f"train{i}_{key}", got, slice_ref(f"train{i}", key))
    # the step must have moved the weights (else after-step checks would be vacuous)
    moved = rel(ref["after1"]["log_probs"], ref["infer_jagged"]["log_probs"])
    checks.add("step_changes_logprobs", moved > 100 * REL_TOL, f"ref log-probs moved by rel {moved:.3e}")


def _with_values(nt: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """A jagged tensor with ``nt``'s offsets and new ``values``."""
    return torch.nested.nested_tensor_from_jagged(values, nt.offsets())


def bad_batches(descs, rows: slice, micro: dict) -> dict[str, TensorDict]:
    """Malformed batches (each one defect) for ``train_batch``."""
    desc = descs["train"][0]
    flags = {"calculate_entropy": True, "distillation_use_topk": True, **micro}

    def good():
        return jagged_batch(desc, rows, teacher=True, extra=flags)

    bad = {}
    b = good()
    v = b["input_ids"].values().clone()
    v[3] = VOCAB  # inside the padded vocab (256), outside the true one
    bad["id_eq_vocab"] = b.set("input_ids", _with_values(b["input_ids"], v))
    b = good()
    v = b["input_ids"].values().clone()
    v[-1] = -1
    bad["id_negative"] = b.set("input_ids", _with_values(b["input_ids"], v))
    b = good()
    v = b["teacher_ids"].values().clone()
    v[0, 2] = VOCAB + 3
    bad["teacher_id_out_of_vocab"] = b.set("teacher_ids", _with_values(b["teacher_ids"], v))
    b = good()
    del b["teacher_logprobs"]
    bad["missing_teacher_logprobs"] = b
    b = good()
    del b["input_ids"]
    bad["missing_input_ids"] = b
    b = good()
    lp = b["teacher_logprobs"].values()[:, : K - 1].clone()
    bad["teacher_wrong_k"] = b.set("teacher_logprobs", _with_values(b["teacher_logprobs"], lp))
    n = b.batch_size[0]
    long_desc = {**desc, "ids": list(desc["ids"]), "teacher": list(desc["teacher"]),
                 "loss_mask": list(desc["loss_mask"]), "advantages": list(desc["advantages"])}
    first = list(range(len(desc["ids"])))[rows][0]
    g = torch.Generator().manual_seed(5)
    long_desc["ids"][first] = torch.randint(0, VOCAB, (MAX_LEN + 1,), generator=g)
    long_desc["teacher"][first] = (torch.randint(0, VOCAB, (MAX_LEN + 1, K), generator=g),
                                   torch.randn(MAX_LEN + 1, K, generator=g) - 3)
    long_desc["loss_mask"][first] = torch.ones(MAX_LEN + 1)
    long_desc["advantages"][first] = torch.ones(MAX_LEN + 1)
    bad["too_long"] = jagged_batch(long_desc, rows, teacher=True, extra=flags)
    b = good()
    b["temperature"] = torch.zeros(n)
    bad["temperature_zero"] = b
    b = good()
    b.set_non_tensor("micro_batch_size_per_gpu", 0)
    bad["micro_batch_zero"] = b
    return bad


def check_bad_batches(checks: Checks, engine, descs, rows: slice, micro: dict, dp: bool) -> None:
    loss = my_loss
    for name, batch in bad_batches(descs, rows, micro).items():
        before, step = params(engine), engine.global_step
        try:
            engine.train_batch(batch, loss)
            raised = "no error"
        except ValueError as exc:
            raised = f"ValueError: {str(exc)[:90]}"
        except Exception as exc:  # wrong error type
            raised = f"{type(exc).__name__}: {str(exc)[:90]}"
        same = bit_equal(before, params(engine)) and engine.global_step == step
        checks.add(f"bad_{name}", raised.startswith("ValueError") and same,
                   f"{raised}; params/step unchanged={same}")
    # infer_batch rejects too
    batch = bad_batches(descs, rows, micro)["id_eq_vocab"]
    try:
        engine.infer_batch(batch)
        raised = "no error"
    except ValueError as exc:
        raised = f"ValueError: {str(exc)[:90]}"
    checks.add("bad_infer_id_eq_vocab", raised.startswith("ValueError"), raised)
    if dp:  # bad batch on ONE data-parallel rank only: both ranks must raise, nobody hangs
        good = jagged_batch(descs["train"][0], rows, teacher=True,
                            extra={"calculate_entropy": True, "distillation_use_topk": True, **micro})
        batch = bad_batches(descs, rows, micro)["id_eq_vocab"] if dist.get_rank() == 1 else good
        before, step = params(engine), engine.global_step
        try:
            engine.train_batch(batch, loss)
            raised = "no error"
        except ValueError as exc:
            raised = f"ValueError: {str(exc)[:90]}"
        same = bit_equal(before, params(engine)) and engine.global_step == step
        checks.add("bad_one_dp_rank_only", raised.startswith("ValueError") and same,
                   f"{raised}; params/step unchanged={same}")


def run_layout(mode: str, workdir: str) -> None:
    checks = Checks()
    descs = make_global_batches()
    ref = torch.load(os.path.join(workdir, "ref.pt"), weights_only=False)
    hf = os.path.join(workdir, "hf")
    rank = int(os.environ["RANK"])
    dp = mode == "dp2"
    n = len(descs["infer_jagged"]["ids"])
    # DP: uneven contiguous halves (rank 0 holds 4 sequences, rank 1 holds 2) -> different token and
    # micro-batch counts per rank, seq_ids offsets that matter
    cut = [0, 4, n]
    rows = slice(cut[rank], cut[rank + 1]) if dp else slice(None)
    # a different micro-batching per layout: results must not depend on it
    micro = {"tp2": {"micro_batch_size_per_gpu": 2}, "pp2": {"micro_batch_size_per_gpu": 2},
             "dp2": {"use_dynamic_bsz": True, "max_token_len_per_gpu": 40}}[mode]
    engine = MegatronEngine(make_config(mode, hf))
    engine.initialize()
    checks.add("hf_roundtrip_bit_identical", bool(ref["roundtrip_bit_identical"]),
               "TP=1 export_hf -> model.hf_path import (true-vocab rows)")

    res = {}

    def steps():
        res.update(run_steps_with_checkpoint(engine, descs, rows, micro, workdir, mode))
    checks.guarded("run_steps", steps)
    if res:
        checks.guarded("compare", lambda: compare_step(checks, ref, res, rows, dp, descs))
        resumed = []
        checks.guarded("resume", lambda: resumed.append(
            check_resume(checks, mode, hf, descs, rows, micro, workdir, res)))
        # bad batches on an engine that has optimizer state (after the resumed step)
        if resumed:
            checks.guarded("bad_batches",
                           lambda: check_bad_batches(checks, resumed[0], descs, rows, micro, dp))
            checks.guarded("bad_batches_trained", lambda: _bad_after(checks, resumed[0], descs, rows, micro))
    if dist.get_rank() == 0:
        with open(os.path.join(workdir, f"{mode}.json"), "w") as f:
            json.dump(checks.results, f, indent=1)


def run_steps_with_checkpoint(engine, descs, rows, micro, workdir, mode) -> dict:
    """``run_steps``, plus: a checkpoint right after step 1 (+ lr step) and the full parameters after
    step 2, for the resume check."""
    res = {}
    ckpt = os.path.join(workdir, f"ckpt_{mode}")
    orig = engine.lr_scheduler_step

    def lr_step_and_save():
        lr = orig()
        if engine.global_step == 1 and "ckpt_saved" not in res:
            engine.save_checkpoint(ckpt)
            res["ckpt_saved"] = True
        return lr

    engine.lr_scheduler_step = lr_step_and_save  # hook on the instance: runs after step 1's lr step
    try:
        res.update(run_steps(engine, descs, rows, micro))
    finally:
        del engine.lr_scheduler_step
    res["params_after2"] = params(engine)
    res["global_step"] = engine.global_step
    return res


def check_resume(checks: Checks, mode, hf, descs, rows, micro, workdir, res) -> MegatronEngine:
    """Fresh engine (initial weights) -> load the step-1 checkpoint -> step 2 exactly as the
    uninterrupted run did it (infer, train, lr step, infer)."""
    fresh = MegatronEngine(make_config(mode, hf))
    fresh.initialize()
    fresh.load_checkpoint(os.path.join(workdir, f"ckpt_{mode}"))
    checks.add("resume_global_step", fresh.global_step == 1, f"global_step after load {fresh.global_step}")
    flags = {"calculate_entropy": True, "distillation_use_topk": True, **micro}
    out = fresh.train_batch(jagged_batch(descs["train"][1], rows, teacher=True, extra=flags), ppo_loss())
    m = out.get_non_tensor("metrics")
    want = res["train2"]
    loss = float(out.get_non_tensor("loss"))
    checks.add("resume_loss_bit_identical", loss == want["loss"], f"{loss!r} vs {want['loss']!r}")
    checks.add("resume_grad_norm_bit_identical", m["grad_norm"] == want["metrics"]["grad_norm"],
               f"{m['grad_norm']!r} vs {want['metrics']['grad_norm']!r}")
    checks.add("resume_lr_identical", m["lr"] == want["metrics"]["lr"],
               f"{m['lr']!r} vs {want['metrics']['lr']!r}")
    fresh.lr_scheduler_step()
    same = bit_equal(params(fresh), res["params_after2"])
    checks.add("resume_params_bit_identical", same, f"parameters after step 2 bit-identical={same}")
    after = fresh.infer_batch(jagged_batch(descs["infer_jagged"], rows, teacher=False,
                                           extra={**INFER_FLAGS, **micro}))
    got = flat(after["log_probs"])
    checks.add("resume_next_logprobs_bit_identical", torch.equal(got, res["after2"]["log_probs"]),
               f"max abs diff {float((got - res['after2']['log_probs']).abs().max()):.3e}")
    return fresh


def _bad_after(checks: Checks, engine, descs, rows, micro) -> None:
    batch = bad_batches(descs, rows, micro)["teacher_wrong_k"]
    before, step, lr = params(engine), engine.global_step, engine.optimizer.param_groups[0]["lr"]
    try:
        engine.train_batch(batch, ppo_loss())
        raised = "no error"
    except ValueError as exc:
        raised = f"ValueError: {str(exc)[:90]}"
    same = bit_equal(before, params(engine)) and engine.global_step == step \
        and engine.optimizer.param_groups[0]["lr"] == lr
    checks.add("bad_after_training_teacher_wrong_k", raised.startswith("ValueError") and same,
               f"{raised}; unchanged={same}")

    # non-finite gradients: the step is skipped, parameters and step counter unchanged, on every rank
    def nan_loss(outputs, data, ctx):
        loss, metrics = my_loss(outputs, data, ctx)
        return loss * float("nan"), metrics

    good = jagged_batch(descs["train"][0], rows, teacher=True,
                        extra={"calculate_entropy": True, "distillation_use_topk": True, **micro})
    before, step, skipped = params(engine), engine.global_step, engine.num_skipped_steps
    out = engine.train_batch(good, nan_loss)
    m = out.get_non_tensor("metrics")
    same = bit_equal(before, params(engine)) and engine.global_step == step
    checks.add("nonfinite_grad_step_skipped", same and m["update_skipped"] == 1.0
               and engine.num_skipped_steps == skipped + 1,
               f"update_skipped={m['update_skipped']}, grad_norm={m['grad_norm']}, unchanged={same}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mode", choices=sorted(LAYOUTS), required=True)
    parser.add_argument("--workdir", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    os.makedirs(args.workdir, exist_ok=True)
    if args.mode == "ref":
        run_ref(args.workdir)
    else:
        run_layout(args.mode, args.workdir)
    if dist.is_initialized():
        dist.barrier()


if __name__ == "__main__":
    main()
