"""The value head (``model.head: value``): a critic at TP=2 / PP=2 / DP=2 against one rank, values
against ``transformers``' ``*ForTokenClassification``, and the clipped value loss.

Launch 1 (one gloo rank) records the references on the tiny GPT (values, scores, the value loss at
two micro-batch splits, two Adam steps) and checks the Hugging Face parity at TP=1; launch 2 (two
ranks) replays them at TP=2, PP=2 (1F1B) and DP=2 on identical weights (fp32, relative 1e-5) and
checks the parity at TP=2. The value loss itself is checked in-process against float64.
"""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch
from tensordict import TensorDict

from tests.engine_setup import (
    flat_values,
    full_state,
    load_full_state,
    local_params,
    make_batch,
)
from tests.parallel_setup import after_steps, same_tensors
from tests.utils import REL_TOL, assert_rel_close, run_distributed

TOL = REL_TOL[torch.float32]
HF_TOL = 1e-4
SEED = 5
NUM_SEQS = 6
CLIP = 0.05  # small: some tokens clip after the first step
FAMILIES = ("llama", "qwen2", "qwen3")


def value_config(**kwargs):
    from mcore_engine.config import OptimizerConfig
    from tests.engine_setup import tiny_config

    cfg = tiny_config(adam_eps=OptimizerConfig.adam_eps, **kwargs)
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, head="value"))


def critic_batch(seed: int, num_seqs: int = NUM_SEQS, **flags) -> TensorDict:
    """``make_batch`` plus per-token rollout ``values`` and ``returns`` (verl's critic keys)."""
    batch = make_batch(seed, num_seqs, **flags)
    g = torch.Generator().manual_seed(seed + 1)
    lengths = [int(n) for n in batch["input_ids"].offsets().diff()]
    for key, scale in (("values", 0.3), ("returns", 1.0)):
        batch.set(key, torch.nested.nested_tensor([scale * torch.randn(n, generator=g) for n in lengths],
                                                  layout=torch.jagged))
    return batch


def _loss():
    from mcore_engine.losses import ppo_value_loss

    return ppo_value_loss(cliprange_value=CLIP, loss_agg_mode="seq-mean-token-mean")


def _train_two_steps(engine, batch) -> dict:
    rec = {}
    for i in range(2):
        out = engine.train_batch(batch, _loss())
        m = out.get_non_tensor("metrics")
        assert m["update_skipped"] == 0.0
        rec[f"loss{i}"] = out.get_non_tensor("loss").clone()
        rec[f"grad_norm{i}"] = torch.tensor(m["grad_norm"], dtype=torch.float64)
        rec[f"vf_clipfrac{i}"] = torch.tensor(m["vf_clipfrac"], dtype=torch.float64)
        rec[f"values{i}"] = flat_values(out["values"])
        if i == 0:  # the first step's (clipped) gradients, per model chunk
            rec["grads"] = [{k: p.main_grad.detach().clone() for k, p in chunk.module.named_parameters()}
                            for chunk in engine.model]
    return rec


# ----------------------------------------------------------------------------- Hugging Face side
def _save_token_classification(family: str, path: str, causal_path: str) -> None:
    """A tiny causal LM (``tests.hf.models``) and the same trunk as ``*ForTokenClassification`` with
    one label and a random ``score`` (weight and bias)."""
    import transformers

    from tests.hf.models import hf_config, save_tiny_model

    causal = save_tiny_model(family, causal_path, seed=3)
    config = hf_config(family, num_labels=1)
    config.architectures = [config.architectures[0].replace("ForCausalLM", "ForTokenClassification")]
    cls = getattr(transformers, config.architectures[0])
    model = cls(config).eval()
    missing, _ = model.load_state_dict(causal.state_dict(), strict=False)
    assert set(missing) == {"score.weight", "score.bias"}, missing
    torch.manual_seed(4)
    with torch.no_grad():
        model.score.weight.copy_(0.3 * torch.randn_like(model.score.weight))
        model.score.bias.fill_(0.25)
    model.save_pretrained(path)


def _hf_values(path: str, ids: list[torch.Tensor]) -> list[torch.Tensor]:
    import transformers

    model = transformers.AutoModelForTokenClassification.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return [model(input_ids=x[None]).logits[0, :, 0] for x in ids]


def _hf_ids() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(77)
    return [torch.randint(0, 250, (n,), generator=g) for n in (5, 17, 9, 2, 12)]


def _hf_engine(path: str, tp: int = 1):
    from mcore_engine import EngineConfig, MegatronEngine
    from mcore_engine.hf import from_hf_config, read_hf_config

    model = dataclasses.asdict(from_hf_config(read_hf_config(path), hf_path=path))
    engine = MegatronEngine(EngineConfig.from_dict({
        "model": model, "parallel": {"tensor_model_parallel_size": tp}, "seed": 9, "micro_batch_size": 2}))
    engine.initialize()
    return engine


def _check_hf(root: str, tp: int) -> None:
    """Values and scores of each family's ``*ForTokenClassification`` folder vs transformers; export
    round trip; a causal-LM folder gives the same trunk and a seeded head identical at any TP."""
    import torch.distributed as dist

    from mcore_engine.parallel.platform import destroy_distributed
    from tests.hf.models import load_folder

    ids = _hf_ids()
    for family in FAMILIES:
        folder = os.path.join(root, f"{family}-tc")
        expected = _hf_values(folder, ids)
        engine = _hf_engine(folder, tp)
        assert engine.config.model.head == "value"
        jagged = torch.nested.nested_tensor(ids, layout=torch.jagged)
        out = engine.infer_batch(TensorDict({"input_ids": jagged}, batch_size=[len(ids)]))
        for i, (got, want) in enumerate(zip(out["values"].unbind(), expected, strict=True)):
            assert_rel_close(got, want, HF_TOL, f"{family} tp={tp}: values of sequence {i} vs transformers")
        assert_rel_close(out["scores"], torch.stack([v[-1] for v in expected]), HF_TOL, f"{family}: scores")
        export = os.path.join(root, f"{family}-export-tp{tp}")
        engine.export_hf(export)
        del engine
        destroy_distributed()
        if dist.get_rank() == 0:
            config = json.loads(open(os.path.join(export, "config.json")).read())
            assert config["architectures"][0].endswith("ForTokenClassification") and config["num_labels"] == 1
            src, dst = load_folder(folder), load_folder(export)
            assert sorted(src) == sorted(dst), sorted(set(src) ^ set(dst))
            for name in src:
                assert torch.equal(src[name], dst[name]), f"{family}: exported {name} differs"
            assert_rel_close(torch.cat(_hf_values(export, ids)), torch.cat(expected), HF_TOL, "re-import")
    # causal LM folder -> value trunk with a fresh head (seeded: the same at TP=1 and TP=2)
    from mcore_engine import EngineConfig, MegatronEngine
    from mcore_engine.hf import from_hf_config, read_hf_config

    causal = os.path.join(root, "qwen2-causal")
    assert from_hf_config(read_hf_config(causal)).head == "lm"
    model = dataclasses.asdict(from_hf_config(read_hf_config(causal), hf_path=causal, head="value"))
    engine = MegatronEngine(EngineConfig.from_dict(
        {"model": model, "parallel": {"tensor_model_parallel_size": tp}, "seed": 9}))
    engine.initialize()
    tensors = {name: t.clone() for name, t in engine.per_tensor_generator()}
    del engine
    destroy_distributed()
    src = load_folder(causal)
    assert set(tensors) == (set(src) - {"lm_head.weight"}) | {"score.weight", "score.bias"}
    for name, t in tensors.items():
        if name in src:
            assert torch.equal(t, src[name]), f"causal trunk {name} differs"
    assert not tensors["score.bias"].any() and tensors["score.weight"].std() > 0
    ref = os.path.join(root, "fresh_score.pt")
    if tp == 1 and dist.get_rank() == 0:
        torch.save(tensors["score.weight"], ref)
    elif tp > 1:
        assert torch.equal(tensors["score.weight"], torch.load(ref)), "seeded head differs across TP"


# ----------------------------------------------------------------------------- launches
def _reference(rank: int, world_size: int, root: str) -> None:
    from mcore_engine.engine import MegatronEngine
    from mcore_engine.parallel.platform import destroy_distributed

    engine = MegatronEngine(value_config())
    engine.initialize()
    batch = critic_batch(SEED)
    ref = {"full0": full_state(engine)}
    infer = engine.infer_batch(batch)
    ref["values"], ref["scores"] = flat_values(infer["values"]), infer["scores"]
    ends = batch["input_ids"].offsets()[1:] - 1
    assert torch.equal(ref["scores"], ref["values"][ends]), "scores are the values at the last tokens"
    # micro-batch split invariance of the global value loss (forward only, same weights)
    losses = [engine.forward_backward_batch(critic_batch(SEED, micro_batch_size_per_gpu=m), _loss(),
                                            forward_only=True).get_non_tensor("loss") for m in (1, 4, 6)]
    for m, loss in zip((4, 6), losses[1:], strict=True):
        assert_rel_close(loss, losses[0], TOL, f"value loss with {m} sequences per micro-batch")
    ref.update(_train_two_steps(engine, batch))
    assert ref["vf_clipfrac1"] > 0, "the clip never engaged"
    ref["full2"] = full_state(engine)
    torch.save(ref, os.path.join(root, "ref.pt"))
    del engine
    destroy_distributed()
    for family in FAMILIES:
        causal = os.path.join(root, f"{family}-causal" if family == "qwen2" else f"{family}-causal-unused")
        _save_token_classification(family, os.path.join(root, f"{family}-tc"), causal)
    _check_hf(root, tp=1)


LAYOUTS = [("tp2", dict(tp=2), False), ("pp2", dict(pp=2), False), ("dp2", dict(), True)]


def _layouts(rank: int, world_size: int, root: str) -> None:
    from megatron.core import parallel_state

    from mcore_engine.engine import MegatronEngine
    from mcore_engine.parallel.platform import destroy_distributed

    ref = torch.load(os.path.join(root, "ref.pt"), weights_only=False)
    for name, kwargs, split in LAYOUTS:
        engine = MegatronEngine(value_config(**kwargs))
        engine.initialize()
        load_full_state(engine, ref["full0"])
        batch = critic_batch(SEED)
        tokens = torch.tensor([0] + [int(n) for n in batch["input_ids"].offsets().diff()]).cumsum(0)
        rows = slice(0, NUM_SEQS)
        if split:
            per = NUM_SEQS // parallel_state.get_data_parallel_world_size()
            r = parallel_state.get_data_parallel_rank()
            rows = slice(r * per, (r + 1) * per)
            batch = batch[torch.arange(rows.start, rows.stop)]
        tok = slice(int(tokens[rows.start]), int(tokens[rows.stop]))
        infer = engine.infer_batch(batch)
        assert_rel_close(flat_values(infer["values"]), ref["values"][tok], TOL, f"{name}: values")
        assert_rel_close(infer["scores"], ref["scores"][rows], TOL, f"{name}: scores")
        got = _train_two_steps(engine, batch)
        for i in range(2):
            tol = after_steps(TOL, i)
            assert_rel_close(got[f"loss{i}"], ref[f"loss{i}"], tol, f"{name}: value loss, step {i}")
            assert_rel_close(got[f"grad_norm{i}"], ref[f"grad_norm{i}"], tol, f"{name}: grad norm, step {i}")
            assert_rel_close(got[f"vf_clipfrac{i}"], ref[f"vf_clipfrac{i}"], tol, f"{name}: vf_clipfrac {i}")
            assert_rel_close(got[f"values{i}"], ref[f"values{i}"][tok], tol, f"{name}: values, step {i}")
        same_tensors(f"{name}: weights after two steps", engine, local_params(engine), ref["full2"],
                     steps_from=ref["grads"][0])
        if name == "tp2":  # the head is replicated: bit-identical on both TP ranks
            import torch.distributed as dist

            layer = engine.model[0].module.output_layer
            head = torch.cat([p.detach().reshape(-1) for p in layer.parameters()])
            peers = [torch.empty_like(head) for _ in range(2)]
            dist.all_gather(peers, head)
            assert torch.equal(peers[0], peers[1]), "value head differs between TP ranks"
        del engine
        destroy_distributed()
    _check_hf(root, tp=2)


@pytest.mark.slow
def test_critic_layouts_and_transformers_parity(tmp_path):
    run_distributed(_reference, 1, str(tmp_path))
    run_distributed(_layouts, 2, str(tmp_path))


# ----------------------------------------------------------------------------- the loss, in-process
def _value_loss_reference(v, old, ret, mask, seq, clip, mode, num_tokens, num_seqs):
    v, old, ret, mask = (t.double() for t in (v, old, ret, mask))
    clipped = v.clamp(old - clip, old + clip)
    per = torch.maximum((v - ret) ** 2, (clipped - ret) ** 2)
    if mode == "token-mean":
        agg = (per * mask).sum() / num_tokens
    elif mode == "seq-mean-token-sum":
        agg = (per * mask).sum() / num_seqs
    else:
        agg = sum((per * mask)[seq == s].sum() / mask[seq == s].sum().clamp_min(1)
                  for s in seq.unique()) / num_seqs
    frac = (((clipped - ret) ** 2 > (v - ret) ** 2).double() * mask).sum() / num_tokens
    return 0.5 * agg, frac


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
def test_value_loss_matches_float64_and_is_split_invariant(mode):
    from mcore_engine.losses import LossContext, value_loss

    g = torch.Generator().manual_seed(0)
    n = 37
    v = torch.randn(n, generator=g, requires_grad=True)
    old, ret = v.detach() + 0.3 * torch.randn(n, generator=g), torch.randn(n, generator=g)
    mask = (torch.rand(n, generator=g) > 0.3).float()
    seq = torch.repeat_interleave(torch.arange(5), torch.tensor([9, 3, 11, 6, 8]))
    ctx = LossContext.from_counts(mask.sum(), 5)
    loss, metrics = value_loss(v, old, ret, mask, seq, ctx, cliprange_value=0.2, loss_agg_mode=mode)
    vd = v.detach().double().requires_grad_()
    want, frac = _value_loss_reference(vd, old, ret, mask, seq, 0.2, mode, mask.sum(), 5)
    assert_rel_close(loss, want, TOL, f"{mode}: loss")
    assert 0 < float(frac) < 1 and abs(metrics["vf_clipfrac"] - frac) < 1e-6
    loss.backward()
    want.backward()
    assert_rel_close(v.grad, vd.grad, TOL, f"{mode}: gradient")
    # split at sequence boundaries (micro-batches / DP ranks): the contributions sum to the loss
    parts = [slice(0, 12), slice(12, 23), slice(23, n)]
    total = sum(value_loss(v[p], old[p], ret[p], mask[p], seq[p], ctx, cliprange_value=0.2,
                           loss_agg_mode=mode)[0] for p in parts)
    assert_rel_close(total, loss, TOL, f"{mode}: split invariance")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_value_clipfrac_matches_verl_on_and_near_the_bounds(dtype):
    """verl's ``compute_value_loss`` on the same inputs: the loss and ``vf_clipfrac`` agree, with
    predictions exactly on the bounds, one ulp inside / outside them, and far out. In-range
    predictions are never counted as clipped (rounding ``old + (v - old).clamp`` used to count them)."""
    from verl.trainer.ppo.core_algos import compute_value_loss

    from mcore_engine.losses import LossContext, value_loss

    g = torch.Generator().manual_seed(7)
    n, clip = 203, 0.2
    old = torch.randn(n, generator=g, dtype=torch.float64).to(dtype)
    old[::2] *= 0.01  # |old| << |v - old|: ``old + (v - old)`` rounds away from ``v``
    lo, hi = old - clip, old + clip
    kind = torch.arange(n) % 10  # 0-4: on / one ulp around the bounds, 5: far out, 6-9: in range
    inf = torch.tensor(float("inf"), dtype=dtype)
    inner = old + (0.15 * torch.randn(n, generator=g, dtype=dtype)).clamp(-0.18, 0.18)
    v = torch.where(kind == 0, hi, torch.where(kind == 1, lo, inner))
    v = torch.where(kind == 2, torch.nextafter(hi, -inf), v)   # one ulp inside
    v = torch.where(kind == 3, torch.nextafter(hi, inf), v)    # one ulp outside
    v = torch.where(kind == 4, torch.nextafter(lo, inf), v)
    v = torch.where(kind == 5, old + 3.0 * torch.randn(n, generator=g, dtype=dtype), v)  # far out
    ret = old + torch.randn(n, generator=g, dtype=dtype)
    mask = (torch.rand(n, generator=g) > 0.2).to(dtype)
    ctx = LossContext.from_counts(mask.sum(), 1)
    loss, metrics = value_loss(v, old, ret, mask, None, ctx, cliprange_value=clip)
    want, want_frac = compute_value_loss(v[None], ret[None], old[None], mask[None], clip, "token-mean")
    assert float(want_frac) > 0, "nothing clipped: the case is vacuous"
    torch.testing.assert_close(loss.double(), want.double(), rtol=1e-12, atol=0)
    assert float(metrics["vf_clipfrac"]) == pytest.approx(float(want_frac), abs=1e-7)
    inside = (v >= lo) & (v <= hi)
    assert torch.equal(v.clamp(lo, hi)[inside], v[inside]), "in-range predictions must stay bit-exact"
    # nothing out of range: no clip at all, exactly 0 (rounding once reported 1e-4 in fp32)
    inner = old + (0.15 * torch.randn(n, generator=g, dtype=dtype)).clamp(-0.18, 0.18)
    v_in = torch.where(kind % 2 == 0, torch.nextafter(hi, -inf), torch.nextafter(lo, inf))
    v_in = torch.where(kind >= 6, inner, v_in)  # one ulp inside either bound, or well inside
    mask = torch.ones_like(old)
    _, metrics = value_loss(v_in, old, ret, mask, None, LossContext.from_counts(mask.sum(), 1),
                            cliprange_value=clip)
    assert float(metrics["vf_clipfrac"]) == 0.0


def test_value_loss_refusals():
    from mcore_engine.losses import LossContext, ppo_value_loss, value_loss

    ctx = LossContext.from_counts(3, 1)
    x = torch.zeros(3)
    with pytest.raises(ValueError, match="cliprange_value"):
        ppo_value_loss(cliprange_value=-1.0)
    with pytest.raises(ValueError, match="loss_agg_mode"):
        ppo_value_loss(loss_agg_mode="mean")
    with pytest.raises(ValueError, match="returns must have the shape"):
        value_loss(x, x, torch.zeros(4), x, None, ctx)
    with pytest.raises(ValueError, match="'returns'"):
        ppo_value_loss()({"values": x}, {"values": x, "loss_mask": x}, ctx)


def test_head_config_validation():
    from mcore_engine.config import ModelConfig

    base = dict(num_layers=2, hidden_size=8, num_attention_heads=2, vocab_size=10, max_sequence_length=8)
    with pytest.raises(ValueError, match="ModelConfig.head"):
        ModelConfig(**base, head="reward")
    with pytest.raises(ValueError, match="fused_lm_head"):
        ModelConfig(**base, head="value", fused_lm_head=True)
    assert ModelConfig(**base, head="value", tie_word_embeddings=True).head == "value"
