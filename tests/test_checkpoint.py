"""Checkpoints (Megatron-Core ``dist_checkpointing``): resharded resume, atomic writes, bad folders refused.

Two launches, engines built from the same initial weights ``W0`` (a TP=1 model cut to each layout)
and the same global batches (each DP rank takes its rows). The checkpoint is written after step 1;
the reference is an engine at the load's layout that ran steps 1 and 2 itself; the loaded engine's
step 2 matches it to 1e-6 (fp32: loss, grad norm, every parameter after the step), bit for bit when
the layout is unchanged (and the RNG streams are restored then). "To 1e-6": loss and grad norm;
the parameters tensor by tensor through ``tests.compare`` to the fp32 budget 1e-5, the entries
whose Adam step step 1's gradients do not pin down (production ``adam_eps``) bounded by 2 x lr per
step instead (measured worst: the QKV biases, 4.7e-6 under ``ATEN_CPU_CAPABILITY=avx2``).
The vocab (250) is padded to a multiple of ``VOCAB_MULTIPLE`` x TP: 300 rows at TP=1, 400 at TP=2,
so every TP change also changes the padded vocab (W0's padding rows are zero beyond TP=1's 300).

- two ranks: DP=2 -> TP=2 (TP 1 -> 2), DP=2 -> PP=2 (PP 1 -> 2), DP=2 distributed optimizer ->
  TP=2 distributed optimizer; same layout bit-identical (TP=2; DP=2 with the distributed optimizer);
  bf16 (fp32 main weights): TP=2 same layout bit-identical; DP=2 -> TP=2 with the distributed
  optimizer loads the saved bf16 weights re-cut bit for bit, and its step 2 matches: loss and grad
  norm to the bf16 budget ``REL_TOL[bfloat16]``, each parameter to ``tests.compare.bf16_budget`` from
  the fp32 run of that layout (the zero-initialised QKV biases are two Adam updates whose near-zero
  gradients follow step 1's bf16 rounding: their budget is large, ~1);
  a checkpoint of another model of the same shapes (``model.rotary_base`` named), one without its
  marker, with a storage file missing or truncated: ``ValueError`` on both ranks, engine untouched.
- one rank: TP=2 -> TP=1, DP=2 -> DP=1 with the distributed optimizer; a checkpoint saved before the
  first step resets the Adam state; the folder protocol (overwrite leaves one folder, a folder that
  is not a checkpoint is never replaced, a crashed save's leftovers are ignored, a save that crashed
  between its renames loads the previous checkpoint with a warning); the in-memory state dict
  restores the next step bit for bit and refuses a state of other chunks or shapes.
- no launch: only the vocab rows of vocab-padded tensors may differ from the checkpoint's.
"""

from __future__ import annotations

import copy
import os
import shutil

import pytest
import torch
from tensordict import TensorDict

from tests.engine_setup import (
    VOCAB,
    engine_snapshot,
    full_state,
    load_full_state,
    local_params,
    local_reference,
    make_batch,
    policy_loss,
    tiny_config,
)
from tests.utils import REL_TOL, assert_identical, assert_rel_close, run_distributed

TOL = 1e-6
ROWS = 6
VOCAB_MULTIPLE = 100
VOCAB_PADDED = ("embedding.word_embeddings.weight", "output_layer.weight")


def _batch(seed: int) -> TensorDict:
    """This DP rank's rows of the global batch ``seed`` (``ROWS`` sequences)."""
    from megatron.core import parallel_state

    full = make_batch(seed, ROWS, calculate_entropy=True, temperature=0.9)
    dp, r = parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank()
    rows = slice(r * ROWS // dp, (r + 1) * ROWS // dp)
    keys = [k for k in full.keys() if isinstance(full.get(k), torch.Tensor)]
    out = TensorDict({k: torch.nested.nested_tensor(list(full.get(k).unbind())[rows], layout=torch.jagged)
                      for k in keys}, batch_size=[rows.stop - rows.start])
    for key in ("calculate_entropy", "temperature"):
        out.set_non_tensor(key, full.get_non_tensor(key))
    return out


def _engine(weights, seed: int = 1234, **kwargs):
    """An engine of ``tiny_config(**kwargs)`` padding the vocab to ``VOCAB_MULTIPLE`` x TP, holding
    ``weights`` (TP=1, their vocab rows zero-padded to this TP's size) when given."""
    from mcore_engine.engine import MegatronEngine

    config = tiny_config(seed=seed, **kwargs)
    config.model.make_vocab_size_divisible_by = VOCAB_MULTIPLE
    engine = MegatronEngine(config)
    engine.initialize()
    if weights is not None:
        load_full_state(engine, _padded(weights, kwargs.get("tp", 1)))
    return engine


def _padded(weights: dict, tp: int) -> dict:
    """TP=1 ``weights`` with their vocab rows zero-padded to TP's padded vocab."""
    from mcore_engine.model.build import padded_vocab_size

    rows = padded_vocab_size(VOCAB, VOCAB_MULTIPLE, tp)
    return {k: torch.cat([w, w.new_zeros(rows - len(w), *w.shape[1:])]) if k in VOCAB_PADDED else w
            for k, w in weights.items()}


def _step(engine, seed: int) -> dict:
    """Loss, grad norm, this step's (clipped) gradients and the parameters after it, per model chunk."""
    out = engine.train_batch(_batch(seed), policy_loss)
    grads = [{k: p.main_grad.detach().float().clone() for k, p in chunk.module.named_parameters()}
             for chunk in engine.model]
    engine.lr_scheduler_step()
    return {"loss": out.get_non_tensor("loss").clone(), "norm": out.get_non_tensor("metrics")["grad_norm"],
            "grads": grads, "params": local_params(engine)}


def _same_step(got: dict, want: dict, what: str, exact: bool = False, first: dict | None = None,
               fp32: dict | None = None) -> None:
    """``want``'s loss, grad norm and parameters after the step: bit for bit (``exact``), else tensor by
    tensor through ``tests.compare``. fp32: ``first`` is the reference's step 1 (the step the resumed
    engine ran on another layout): loss and grad norm to ``TOL``, the parameters after both steps to
    ``FP32`` with the entries step 1's gradients do not pin down bounded (``AdamSteps``). bf16:
    ``fp32`` is the fp32 reference's step at this layout (per-tensor budgets ``bf16_budget``)."""
    from tests.compare import FP32, AdamSteps, Attention, assert_tensors_close, bf16_budget

    if exact:
        assert (got["loss"], got["norm"]) == (want["loss"], want["norm"]), f"{what}: loss / grad norm"
        flat = [[t for chunk in step["params"] for t in chunk.values()] for step in (got, want)]
        assert_identical(*flat, f"{what}: parameters not bit-identical")
        return
    tol = TOL if fp32 is None else REL_TOL[torch.bfloat16]
    assert_rel_close(got["loss"], want["loss"], tol, f"{what}: loss")
    assert abs(got["norm"] - want["norm"]) <= tol * want["norm"], \
        f"{what}: grad norm {got['norm']} vs {want['norm']}"
    attn = Attention.of(tiny_config().model)
    if fp32 is None:
        opt = tiny_config().optimizer
        assert_tensors_close(f"{what}: parameters after the step", got["params"], want["params"], attn=attn,
                             grads=False, tol=FP32, adam=AdamSteps(first["grads"], opt.lr, opt.adam_eps, 2))
    else:
        assert_tensors_close(f"{what}: parameters after the step", got["params"], want["params"], attn=attn,
                             grads=False, tol=bf16_budget(want["params"], fp32["params"]))


def _reference(weights, **kwargs) -> tuple[dict, dict]:
    """Steps 1 and 2 of a never-saved engine at this layout (from ``weights``)."""
    engine = _engine(weights, **kwargs)
    return _step(engine, 1), _step(engine, 2)


def _resumed(path: str, **kwargs) -> dict:
    engine = _engine(None, seed=99, **kwargs)  # other weights until the load
    engine.load_checkpoint(path)
    assert engine.global_step == 1, f"{path}: global_step {engine.global_step}"
    return _step(engine, 2)


def _refused(engine, path: str, needle: str) -> None:
    before = engine_snapshot(engine, counters=True)
    with pytest.raises(ValueError, match=needle):
        engine.load_checkpoint(path)
    assert_identical(engine_snapshot(engine, counters=True), before, f"refused {path}: engine changed")


# ------------------------------------------------------------------ two ranks
def _two_ranks(rank: int, world_size: int, tmp: str) -> None:
    import torch.distributed as dist

    from mcore_engine.parallel.platform import destroy_distributed

    # --- sources at DP=2: plain and distributed optimizer; the latter also resumes in place ---
    src = _engine(None)
    weights = full_state(src)
    if rank == 0:
        torch.save(weights, f"{tmp}/w0.pt")
    _step(src, 1)
    src.save_checkpoint(f"{tmp}/dp2")
    src_do = _engine(weights, use_distributed_optimizer=True)
    _step(src_do, 1)
    src_do.save_checkpoint(f"{tmp}/dp2-do")
    draw = torch.rand(4)
    want = _step(src_do, 2)
    fresh = _engine(None, seed=99, use_distributed_optimizer=True)
    fresh.load_checkpoint(f"{tmp}/dp2-do")
    assert torch.equal(torch.rand(4), draw), "RNG not restored at an unchanged layout"
    _same_step(_step(fresh, 2), want, "DP=2 distributed optimizer, same layout", exact=True)
    src_bf16 = _engine(weights, precision="bf16", use_distributed_optimizer=True)
    _step(src_bf16, 1)
    src_bf16.save_checkpoint(f"{tmp}/dp2-do-bf16")
    saved_bf16 = full_state(src_bf16)

    # --- TP=2 targets ---
    destroy_distributed()
    ref = _engine(weights, tp=2)
    first = _step(ref, 1)
    ref.save_checkpoint(f"{tmp}/tp2")
    want = _step(ref, 2)
    _same_step(_resumed(f"{tmp}/dp2", tp=2), want, "TP 1 -> 2", first=first)
    _same_step(_resumed(f"{tmp}/tp2", tp=2), want, "TP=2, same layout", exact=True)
    first, fp32 = _reference(weights, tp=2, use_distributed_optimizer=True)
    _same_step(_resumed(f"{tmp}/dp2-do", tp=2, use_distributed_optimizer=True), fp32,
               "DP 2 -> 1 distributed optimizer, TP 1 -> 2", first=first)
    bf16 = dict(tp=2, precision="bf16")
    ref_bf16 = _engine(weights, **bf16)
    _step(ref_bf16, 1)
    ref_bf16.save_checkpoint(f"{tmp}/tp2-bf16")
    _same_step(_resumed(f"{tmp}/tp2-bf16", **bf16), _step(ref_bf16, 2), "bf16 TP=2, same layout", exact=True)
    resumed = _engine(None, seed=99, **bf16, use_distributed_optimizer=True)
    resumed.load_checkpoint(f"{tmp}/dp2-do-bf16")
    (got,), (cut,) = local_params(resumed), local_reference(resumed, _padded(saved_bf16, 2))
    assert_identical(list(got.values()), [cut[k] for k in got], "bf16 TP 1 -> 2: weights not re-cut exactly")
    _same_step(_step(resumed, 2), _reference(weights, **bf16, use_distributed_optimizer=True)[1],
               "bf16 DP 2 -> 1 distributed optimizer, TP 1 -> 2", fp32=fp32)

    # --- refused: another model of the same shapes, no marker, storage missing or truncated ---
    if rank == 0:
        for name in ("no_marker", "missing", "truncated", "torn_common"):
            shutil.copytree(f"{tmp}/tp2", f"{tmp}/{name}")
        os.remove(f"{tmp}/no_marker/mcore_engine.json")
        os.remove(f"{tmp}/missing/__1_0.distcp")
        with open(f"{tmp}/truncated/__0_0.distcp", "r+b") as f:
            f.truncate(100)
        _tear_common(f"{tmp}/torn_common")
    dist.barrier()
    other = _engine(None, seed=99, tp=2)
    other.config.model.rotary_base = 5000
    _refused(other, f"{tmp}/tp2", "model.rotary_base")
    other.config.model.rotary_base = ref.config.model.rotary_base
    _refused(other, f"{tmp}/no_marker", "torn or incomplete")
    _refused(other, f"{tmp}/missing", r"torn: storage file __1_0.distcp missing")
    _refused(other, f"{tmp}/truncated", r"torn: storage file __0_0.distcp")
    _refused(other, f"{tmp}/nothing", "not a checkpoint folder")
    _refused(other, f"{tmp}/torn_common", "torn: unreadable metadata")
    _refused(other, f"{tmp}/dp2-do", "use_distributed_optimizer=True")  # optimizer kinds differ

    # --- PP=2 target ---
    destroy_distributed()
    first, want = _reference(weights, pp=2)
    _same_step(_resumed(f"{tmp}/dp2", pp=2), want, "PP 1 -> 2", first=first)


def _tear_common(folder: str) -> None:
    """Damage the checkpoint's plain entries: ``common.pt`` (Megatron-Core < 0.19) is cut in half, the
    DCP object ``common_state`` that replaces it from 0.19 is zeroed in its storage file."""
    if os.path.exists(f"{folder}/common.pt"):
        with open(f"{folder}/common.pt", "r+b") as f:
            f.truncate(os.path.getsize(f"{folder}/common.pt") // 2)
        return
    from torch.distributed.checkpoint import FileSystemReader

    storage = FileSystemReader(folder).read_metadata().storage_data
    (info,) = [v for k, v in storage.items() if k.fqn.startswith("common_state")]
    with open(f"{folder}/{info.relative_path}", "r+b") as f:
        f.seek(info.offset)
        f.write(bytes(info.length))


# ------------------------------------------------------------------ one rank
def _one_rank(rank: int, world_size: int, tmp: str) -> None:
    weights = torch.load(f"{tmp}/w0.pt")
    first, want = _reference(weights)
    _same_step(_resumed(f"{tmp}/tp2"), want, "TP 2 -> 1", first=first)
    first, want = _reference(weights, use_distributed_optimizer=True)
    _same_step(_resumed(f"{tmp}/dp2-do", use_distributed_optimizer=True), want,
               "DP 2 -> 1 distributed optimizer", first=first)

    # a checkpoint of a never-stepped engine: loading it clears the Adam state
    engine = _engine(weights)
    path = f"{tmp}/proto/ckpt"
    engine.save_checkpoint(path)
    first = _step(engine, 1)
    engine.load_checkpoint(path)
    assert engine.global_step == 0
    _same_step(_step(engine, 1), first, "resume from a never-stepped checkpoint", exact=True)

    # the folder protocol
    state = engine_snapshot(engine, counters=True)
    engine.save_checkpoint(path)  # overwrite
    assert sorted(os.listdir(f"{tmp}/proto")) == ["ckpt"], "temporary or old folders left behind"
    os.makedirs(path + ".tmp")  # a save that died before its rename: ignored, then cleaned up
    open(path + ".tmp/__0_0.distcp", "w").close()
    _step(engine, 2)
    engine.load_checkpoint(path)
    assert_identical(engine_snapshot(engine, counters=True), state, "reload over a crashed save's leftovers")
    os.rename(path, path + ".old")  # a save that crashed between its two renames
    with pytest.warns(RuntimeWarning, match="interrupted between its renames"):
        engine.load_checkpoint(path)
    engine.save_checkpoint(path)
    assert sorted(os.listdir(f"{tmp}/proto")) == ["ckpt"]

    # in memory, this layout: state_dict -> a step -> load_state_dict restores all, the step repeats
    saved, before = copy.deepcopy(engine.state_dict()), engine_snapshot(engine, counters=True)
    again = _step(engine, 3)
    engine.load_state_dict(saved)
    assert_identical(engine_snapshot(engine, counters=True), before, "load_state_dict")
    _same_step(_step(engine, 3), again, "the step after load_state_dict", exact=True)
    with pytest.raises(ValueError, match="2 model chunks, engine has 1"):
        engine.check_state_dict({**saved, "model": saved["model"] * 2})
    emb = "embedding.word_embeddings.weight"
    shrunk = [{k: v[:1] if k == emb else v for k, v in saved["model"][0].items()}]
    with pytest.raises(ValueError, match="model chunk 0 differs"):
        engine.load_state_dict({**saved, "model": shrunk})
    saved["optimizer"][0]["main_params"] = saved["optimizer"][0]["main_params"][1:]
    with pytest.raises(ValueError, match="optimizer parameter shapes differ"):
        engine.check_state_dict(saved)

    user = f"{tmp}/proto/results"
    os.makedirs(user)
    with open(f"{user}/notes.txt", "w") as f:
        f.write("precious")
    with pytest.raises(ValueError, match="not an mcore-engine checkpoint"):
        engine.save_checkpoint(user)
    assert os.listdir(user) == ["notes.txt"] and not os.path.exists(user + ".tmp")


def test_resharded_resume_and_bad_checkpoints(tmp_path):
    run_distributed(_two_ranks, 2, str(tmp_path))
    run_distributed(_one_rank, 1, str(tmp_path))


def test_only_vocab_rows_may_differ():
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    from mcore_engine.state.checkpoint_checks import check_tensors

    def tensors(rows: int, cols: int = 8, other: int = 8) -> dict:
        out = {}
        for name, shape, vocab in (("emb", (rows, cols), True), ("w", (other, cols), False)):
            for key in (name, f"optimizer.state.exp_avg.{name}", f"optimizer.state.exp_avg_sq.{name}"):
                param = torch.zeros(shape, requires_grad=True)  # a parameter: Adam moments expected
                out[key] = ShardedTensor.from_rank_offsets(key, param, replica_id=0)
                out[key].allow_shape_mismatch = vocab
        return out

    saved = tensors(300)
    check_tensors("ckpt", {k: tensors(400)[k] for k in ("emb", "w")}, saved, True)
    with pytest.raises(ValueError, match=r"3 tensors; first: \['emb shape \(300, 8\) vs \(400, 4\)"):
        check_tensors("ckpt", {k: tensors(400, cols=4)[k] for k in ("emb",)}, saved, True)
    with pytest.raises(ValueError, match=r"w shape \(8, 8\) vs \(9, 8\)"):
        check_tensors("ckpt", {k: tensors(300, other=9)[k] for k in ("w",)}, saved, False)
