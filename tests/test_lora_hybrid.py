"""LoRA (``model.lora``) on the Qwen3.5 hybrid against PEFT + ``transformers``' ``Qwen3_5ForCausalLM``
(tiny random model of ``tests/hf/qwen3_5_models.py``: 3 Gated DeltaNet layers, 1 gated attention).

PEFT's ``get_peft_model`` with random adapters (``init_lora_weights=False``, B scaled down) on every
linear: the GDN's ``in_proj_qkv`` / ``in_proj_z`` / ``in_proj_b`` / ``in_proj_a`` / ``out_proj``, the
gated attention's ``q_proj`` (B's rows per head ``[q_h; gate_h]``) / ``k_proj`` / ``v_proj`` /
``o_proj``, the MLP's; references: PEFT's log-probs, the base model's, two steps of
``torch.optim.AdamW`` on the adapters (fp32).

One launch of two gloo ranks: the engine loads the PEFT folder (``adapter_path``, ``all-linear``) at
TP=1 (DP=2), TP=2 + SP, PP=2 and CP=2: log-probs equal PEFT's, ``adapters_disabled`` the base's, the adapters
after two steps PEFT + AdamW's (1e-4; the GDN rule is chunked differently), the base bit-identical. At
TP=2 the trained adapters go out as a PEFT folder (read back by ``PeftModel.from_pretrained``: the
engine's log-probs), merged into a Hugging Face folder (``export_hf``, read by ``transformers``: the
same) and into an adapters-only checkpoint that a TP=1 engine resumes (the next step
equal to TP=2's).

In the same launch, Qwen3.5-MoE as the Hub holds it: a vision-language folder
(``Qwen3_5MoeForConditionalGeneration``, ``model.language_model.*``, fused 3-D experts) with a PEFT
adapter made on that class (keys ``base_model.model.model.language_model.layers.*``) on the attention,
GDN and shared-expert linears (``mlp.shared_expert.*_proj``; the routed experts take none), at
TP=2 + SP: log-probs equal PEFT's on text inputs, ``adapters_disabled`` the base's, the adapter-only
weight sync carries PEFT's own key names, and after a step the exported PEFT folder, read by
``PeftModel.from_pretrained`` onto ``Qwen3_5MoeForConditionalGeneration``, gives the engine's log-probs.

Then Qwen3-Next (``Qwen3NextForCausalLM``) at TP=2 + SP with PEFT adapters on the attention and GDN
linears, its fused
``in_proj_qkvz`` / ``in_proj_ba`` included (one PEFT ``A`` each, shared by the engine's ``in_proj_qkv`` +
``in_proj_z`` / ``in_proj_b`` + ``in_proj_a``): log-probs equal PEFT's, after two steps the log-probs and
the streamed (fused) adapters equal PEFT + AdamW's, the exported folder read by PEFT gives the engine's,
and its adapters-only checkpoint resumes at TP=1 (the next step equal).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from tensordict import TensorDict

from tests.hf import qwen3_5_models as M
from tests.utils import assert_rel_close, run_distributed

pytest.importorskip("peft", reason="PEFT is installed by `make setup` (the verl extra)")

GDN = ["in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"]
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", *GDN]
RANK, ALPHA, LR, WD = 4, 8.0, 1e-2, 0.01
LENGTHS = [13, 21, 5, 9]
TOL = 1e-4
# name, tp, sequence parallel, pp, cp
LAYOUTS = [("tp1-dp2", 1, False, 1, 1), ("tp2-sp", 2, True, 1, 1), ("pp2", 1, False, 2, 1),
           ("cp2", 1, False, 1, 2)]


def _batch(seed: int = 3) -> TensorDict:
    g = torch.Generator().manual_seed(seed)
    ids = [torch.randint(0, M.VOCAB, (n,), generator=g) for n in LENGTHS]
    adv = [torch.randn(n, generator=g) for n in LENGTHS]
    mask = [(torch.rand(n, generator=g) > 0.2).long() for n in LENGTHS]
    nested = lambda ts: torch.nested.nested_tensor(ts, layout=torch.jagged)  # noqa: E731
    batch = TensorDict({"input_ids": nested(ids), "advantages": nested(adv), "loss_mask": nested(mask)},
                       batch_size=[len(LENGTHS)])
    batch.set_non_tensor("micro_batch_size_per_gpu", 2)
    return batch


def _loss(outputs, data, ctx):
    return (-data["advantages"] * outputs["log_probs"] * data["loss_mask"]).sum() / ctx.global_num_tokens, {}


def _hf_log_probs(model, batch: TensorDict) -> torch.Tensor:
    """Flat next-token log-probs, one sequence at a time (no entry for the last token)."""
    out = []
    for ids in batch["input_ids"].unbind():
        logits = model(ids[None]).logits[0].float()
        out.append(torch.log_softmax(logits, -1)[:-1].gather(-1, ids[1:, None])[:, 0])
    return torch.cat(out)


def _flat(t: torch.Tensor) -> torch.Tensor:
    """Flat values without each sequence's last token."""
    t = torch.cat(t.unbind()) if t.is_nested else t.reshape(-1)
    keep = torch.ones(sum(LENGTHS), dtype=torch.bool)
    keep[torch.tensor(LENGTHS).cumsum(0) - 1] = False
    return t[keep]


@pytest.fixture(scope="module")
def references(tmp_path_factory) -> Path:
    """The base folder, the PEFT folder and the references."""
    root = tmp_path_factory.mktemp("lora_hybrid")
    batch = _batch()
    M.save_tiny_model("qwen3_5", root / "base", seed=11)
    base = M.model_class("qwen3_5").from_pretrained(root / "base", dtype=torch.float32).eval()
    with torch.no_grad():
        base_lp = _hf_log_probs(base, batch)
    peft = _peft_adapter(base, TARGETS, root / "adapter")
    with torch.no_grad():
        lp0 = _hf_log_probs(peft, batch)
    # 3 GDN layers x 5 + 1 attention layer x 4 + 4 MLPs x 3 projections, A and B each
    assert sum("lora_" in n for n, _ in peft.named_parameters()) == 2 * (3 * 5 + 4 + 4 * 3)
    lp2, adapters2 = _train_peft(peft, batch)
    torch.save({"base_lp": base_lp, "lp0": lp0, "lp2": lp2, "adapters2": adapters2}, root / "refs.pt")
    return root


def _train_peft(peft, batch: TensorDict) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Two steps of ``torch.optim.AdamW`` on the adapters (the test's loss): the log-probs and adapters
    after them."""
    from peft import get_peft_model_state_dict

    mask, adv = _flat(batch["loss_mask"]).float(), _flat(batch["advantages"])
    params = [p for n, p in peft.named_parameters() if "lora_" in n]
    opt = torch.optim.AdamW(params, lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=WD)
    for _ in range(2):
        opt.zero_grad()
        (-adv * _hf_log_probs(peft.train(), batch) * mask).sum().div(mask.sum()).backward()
        opt.step()
    with torch.no_grad():
        lp2 = _hf_log_probs(peft.eval(), batch)
    return lp2, {k: v.detach().clone() for k, v in get_peft_model_state_dict(peft).items()}


# PEFT 0.21 takes gate_proj / up_proj / down_proj on Qwen3-Next as the routed experts: not these
NEXT_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "in_proj_qkvz", "in_proj_ba", "out_proj"]


@pytest.fixture(scope="module")
def qwen3_next(references) -> Path:
    """Qwen3-Next (fused GDN projections; layer 1 a dense MLP, the others MoE with a shared expert), its
    PEFT adapter on the attention and GDN linears, the references (base, adapted, two AdamW steps)."""
    root = references / "next"
    batch = _batch()
    M.save_tiny_model("qwen3_next", root / "base", seed=13)
    base = M.model_class("qwen3_next").from_pretrained(root / "base", dtype=torch.float32).eval()
    with torch.no_grad():
        base_lp = _hf_log_probs(base, batch)
    peft = _peft_adapter(base, NEXT_TARGETS, root / "adapter", seed=23).eval()
    adapted = {n.split(".lora_")[0] for n, _ in peft.named_parameters() if "lora_A" in n}
    assert sum(n.endswith(("in_proj_qkvz", "in_proj_ba")) for n in adapted) == 3 * 2
    assert not any(".experts" in n for n in adapted)
    with torch.no_grad():
        lp0 = _hf_log_probs(peft, batch)
    lp2, adapters2 = _train_peft(peft, batch)
    torch.save({"base_lp": base_lp, "lp0": lp0, "lp2": lp2, "adapters2": adapters2}, root / "refs.pt")
    return root


def _peft_adapter(base, targets: list[str], out: Path, seed: int = 21):
    """PEFT's random adapters (B scaled down: the adapted model stays close to the base) saved to ``out``."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    peft = get_peft_model(base, LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0,
                                           target_modules=targets, init_lora_weights=False))
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_B" in name:
                p.mul_(0.1)
    peft.save_pretrained(out)
    return peft


@pytest.fixture(scope="module")
def moe_vl(references) -> Path:
    """The Qwen3.5-MoE vision-language folder (Hub layout: fused experts), its PEFT adapter (made on
    ``Qwen3_5MoeForConditionalGeneration``), the references."""
    root = references / "moe_vl"
    batch = _batch()
    M.save_tiny_model("qwen3_5_moe_vl", root / "base", seed=12, fused_experts=True)
    base = M.model_class("qwen3_5_moe_vl").from_pretrained(root / "base", dtype=torch.float32).eval()
    with torch.no_grad():
        base_lp = _hf_log_probs(base, batch)
    peft = _peft_adapter(base, TARGETS, root / "adapter", seed=22).eval()
    adapted = {n.split(".lora_")[0] for n, _ in peft.named_parameters() if "lora_A" in n}
    assert sum(".mlp.shared_expert." in n for n in adapted) == 4 * 3
    assert not any(".experts" in n for n in adapted)
    with torch.no_grad():
        lp = _hf_log_probs(peft, batch)
    assert (lp - base_lp).abs().max() > 1e-3  # the adapters matter
    torch.save({"base_lp": base_lp, "lp0": lp}, root / "refs.pt")
    return root


def _config(root: Path, tp: int, sp: bool, adapter: bool = True, pp: int = 1, cp: int = 1,
            targets: str | list[str] = "all-linear"):
    from mcore_engine.config import EngineConfig, OptimizerConfig, ParallelConfig
    from mcore_engine.config.lora import LoRAConfig
    from mcore_engine.hf import from_hf_config, read_hf_config

    # the language model alone (vision=None): a vision-language base's tower stays out
    model = from_hf_config(read_hf_config(root / "base"), hf_path=str(root / "base"), vision=None)
    lora = LoRAConfig(rank=RANK, alpha=ALPHA, target_modules=targets,
                      adapter_path=str(root / "adapter") if adapter else None)
    model = dataclasses.replace(model, lora=lora,
                                linear_attention=dataclasses.replace(model.linear_attention, chunk_size=8))
    if model.moe is not None:  # transformers' loss (the reference) has no load-balancing term
        model = dataclasses.replace(model, moe=dataclasses.replace(model.moe, aux_loss_coeff=0.0))
    parallel = ParallelConfig(tensor_model_parallel_size=tp, sequence_parallel=sp,
                              pipeline_model_parallel_size=pp, context_parallel_size=cp)
    return EngineConfig(model=model, parallel=parallel,
                        optimizer=OptimizerConfig(lr=LR, min_lr=0.0, weight_decay=WD, clip_grad=0.0,
                                                  lr_warmup_steps=0, lr_decay_style="constant"))


def _engine(cfg):
    from mcore_engine.engine import MegatronEngine

    engine = MegatronEngine(cfg)
    engine.initialize()
    return engine


def _step(engine, batch) -> tuple[float, dict[str, torch.Tensor]]:
    out = engine.train_batch(batch, _loss)
    assert out.get_non_tensor("metrics")["update_skipped"] == 0.0
    return float(out.get_non_tensor("loss")), dict(engine.per_tensor_generator(adapter_only=True))


def _moe_vl(rank: int, root: Path) -> None:
    """Qwen3.5-MoE vision-language folder, PEFT adapter on attention + GDN, TP=2 + SP (see the module
    docstring)."""
    from safetensors import safe_open

    from mcore_engine.parallel.platform import destroy_distributed

    ref = torch.load(root / "refs.pt", weights_only=False)
    batch = _batch()
    engine = _engine(_config(root, 2, True))
    assert engine.config.model.moe is not None
    lora = {n for c in engine.model for n, _ in c.module.named_parameters() if "lora_" in n}
    assert any(".mlp.shared_experts.linear_fc1.lora_B." in n for n in lora)
    assert not any(".experts." in n and ".shared_experts." not in n for n in lora)
    assert_rel_close(_flat(engine.infer_batch(batch)["log_probs"]), ref["lp0"], TOL, "MoE VL: PEFT")
    with engine.adapters_disabled():
        assert_rel_close(_flat(engine.infer_batch(batch)["log_probs"]), ref["base_lp"], TOL,
                         "MoE VL: adapters disabled == base model")
    synced = dict(engine.per_tensor_generator(adapter_only=True))
    with safe_open(str(root / "adapter" / "adapter_model.safetensors"), framework="pt") as f:
        assert sorted(synced) == sorted(f.keys()), "MoE VL: adapter-only sync names are PEFT's"
        assert all(k.startswith("base_model.model.model.language_model.layers.") for k in synced)
        for key in f.keys():  # not trained yet: the loaded adapters themselves
            assert_rel_close(synced[key], f.get_tensor(key), 1e-6, f"MoE VL: synced {key}")
    _step(engine, batch)
    engine.export_adapter(root / "exported")
    lp = _flat(engine.infer_batch(batch)["log_probs"])
    if rank == 0:
        torch.save(lp, root / "exported-lp.pt")
    del engine
    destroy_distributed()


def _next(rank: int, root: Path) -> None:
    """Qwen3-Next with PEFT's fused GDN adapters, TP=2 + SP (see the module docstring)."""
    from mcore_engine.parallel.platform import destroy_distributed

    ref = torch.load(root / "refs.pt", weights_only=False)
    batch = _batch()
    engine = _engine(_config(root, 2, True, targets=NEXT_TARGETS))
    for c in engine.model:  # in_proj_z's A is in_proj_qkv's, in_proj_a's in_proj_b's
        for layer in c.module.decoder.layers:
            mixer = layer.self_attention
            if hasattr(mixer, "in_proj_qkv"):
                assert mixer.in_proj_z.lora_A["in_proj_z"] is mixer.in_proj_qkv.lora_A["in_proj_qkv"]
                assert mixer.in_proj_a.lora_A["in_proj_a"] is mixer.in_proj_b.lora_A["in_proj_b"]
    assert_rel_close(_flat(engine.infer_batch(batch)["log_probs"]), ref["lp0"], TOL, "Qwen3-Next: PEFT")
    with engine.adapters_disabled():
        assert_rel_close(_flat(engine.infer_batch(batch)["log_probs"]), ref["base_lp"], TOL,
                         "Qwen3-Next: adapters disabled == base model")
    streamed = {}
    for _ in range(2):
        _, streamed = _step(engine, batch)
    assert_rel_close(_flat(engine.infer_batch(batch)["log_probs"]), ref["lp2"], TOL,
                     "Qwen3-Next: log-probs after two steps")
    assert streamed.keys() == ref["adapters2"].keys()
    for key, value in ref["adapters2"].items():
        assert_rel_close(streamed[key], value, TOL, f"Qwen3-Next: {key} after two AdamW steps")
    engine.export_adapter(root / "exported")
    lp = _flat(engine.infer_batch(batch)["log_probs"])
    if rank == 0:
        torch.save(lp, root / "exported-lp.pt")
    engine.save_checkpoint(root / "ckpt")
    want_loss, want = _step(engine, batch)
    del engine
    destroy_distributed()
    # the adapters-only checkpoint (the shared A once per pair) resumed at TP=1: the next step equal
    engine = _engine(_config(root, 1, False, adapter=False, targets=NEXT_TARGETS))
    engine.load_checkpoint(root / "ckpt")
    loss, got = _step(engine, batch)
    assert abs(loss - want_loss) <= TOL * abs(want_loss), (loss, want_loss)
    for key, value in want.items():
        assert_rel_close(got[key], value, TOL, f"Qwen3-Next resumed at TP=1: {key}")
    del engine
    destroy_distributed()


def _layouts(rank: int, world_size: int, root: Path) -> None:
    from mcore_engine.parallel.platform import destroy_distributed

    ref = torch.load(root / "refs.pt", weights_only=False)
    batch = _batch()
    for name, tp, sp, pp, cp in LAYOUTS:
        engine = _engine(_config(root, tp, sp, pp=pp, cp=cp))
        lora = {n for c in engine.model for n, _ in c.module.named_parameters() if "lora_" in n}
        assert any(".self_attention.in_proj_qkv.lora_B." in n for n in lora), name
        # PP=2: stage 0 holds GDN layers 0, 1 only, stage 1 GDN layer 2 and the attention layer 3
        assert any(".self_attention.linear_qkv.lora_B.q" in n for n in lora) == (pp == 1 or rank == 1), name
        base = {n: p.detach().clone() for c in engine.model for n, p in c.module.named_parameters()
                if "lora_" not in n}
        assert_rel_close(_flat(engine.infer_batch(batch)["log_probs"]), ref["lp0"], TOL, f"{name}: PEFT")
        with engine.adapters_disabled():
            assert_rel_close(_flat(engine.infer_batch(batch)["log_probs"]), ref["base_lp"], TOL,
                             f"{name}: adapters disabled == base model")
        streamed = {}
        for _ in range(2):
            _, streamed = _step(engine, batch)
        assert_rel_close(_flat(engine.infer_batch(batch)["log_probs"]), ref["lp2"], TOL,
                         f"{name}: log-probs after two steps")
        assert streamed.keys() == ref["adapters2"].keys(), name
        for key, value in ref["adapters2"].items():
            assert_rel_close(streamed[key], value, TOL, f"{name}: {key} after two AdamW steps")
        assert all(torch.equal(p.detach(), base[n]) for c in engine.model
                   for n, p in c.module.named_parameters() if "lora_" not in n), f"{name}: base changed"
        if tp == 2:
            engine.export_adapter(root / "exported")
            engine.export_hf(root / "merged")
            lp = _flat(engine.infer_batch(batch)["log_probs"])
            if rank == 0:
                torch.save(lp, root / "exported-lp.pt")
            engine.save_checkpoint(root / "ckpt")
            want_loss, want = _step(engine, batch)
        del engine
        destroy_distributed()
    # adapters-only checkpoint of TP=2 (+ SP) resumed at TP=1: the next step equal
    engine = _engine(_config(root, 1, False, adapter=False))
    engine.load_checkpoint(root / "ckpt")
    loss, got = _step(engine, batch)
    assert abs(loss - want_loss) <= TOL * abs(want_loss), (loss, want_loss)
    for key, value in want.items():
        assert_rel_close(got[key], value, TOL, f"resumed at TP=1: {key}")
    del engine
    destroy_distributed()
    _moe_vl(rank, root / "moe_vl")
    _next(rank, root / "next")


def test_lora_hybrid_matches_peft(references, moe_vl, qwen3_next):
    run_distributed(_layouts, 2, references)
    from peft import PeftModel

    batch = _batch()
    config = json.loads((references / "exported" / "adapter_config.json").read_text())
    assert sorted(config["target_modules"]) == sorted(TARGETS)
    base = M.model_class("qwen3_5").from_pretrained(references / "base", dtype=torch.float32).eval()
    peft = PeftModel.from_pretrained(base, references / "exported").eval()
    want = torch.load(references / "exported-lp.pt")
    with torch.no_grad():
        assert_rel_close(_hf_log_probs(peft, batch), want, TOL, "export_adapter -> PeftModel.from_pretrained")
    merged = M.model_class("qwen3_5").from_pretrained(references / "merged", dtype=torch.float32).eval()
    with torch.no_grad():
        assert_rel_close(_hf_log_probs(merged, batch), want, TOL, "export_hf (merged) -> transformers")
    # the MoE vision-language folder's trained adapters, read by PEFT onto the vision-language class
    config = json.loads((moe_vl / "exported" / "adapter_config.json").read_text())
    assert sorted(config["target_modules"]) == sorted(TARGETS)
    base = M.model_class("qwen3_5_moe_vl").from_pretrained(moe_vl / "base", dtype=torch.float32).eval()
    peft = PeftModel.from_pretrained(base, moe_vl / "exported").eval()
    want = torch.load(moe_vl / "exported-lp.pt")
    with torch.no_grad():
        got = _hf_log_probs(peft, batch)
    assert (got - torch.load(moe_vl / "refs.pt")["lp0"]).abs().max() > 1e-4  # the step moved them
    assert_rel_close(got, want, TOL, "MoE VL: export_adapter -> PeftModel.from_pretrained")
    # Qwen3-Next's fused adapters, read back by PEFT
    config = json.loads((qwen3_next / "exported" / "adapter_config.json").read_text())
    assert sorted(config["target_modules"]) == sorted(NEXT_TARGETS)
    base = M.model_class("qwen3_next").from_pretrained(qwen3_next / "base", dtype=torch.float32).eval()
    peft = PeftModel.from_pretrained(base, qwen3_next / "exported").eval()
    with torch.no_grad():
        assert_rel_close(_hf_log_probs(peft, batch), torch.load(qwen3_next / "exported-lp.pt"), TOL,
                         "Qwen3-Next: export_adapter -> PeftModel.from_pretrained")


def test_lora_hybrid_targets_and_refusals(tmp_path):
    from mcore_engine.config import ModelConfig
    from mcore_engine.config.gdn import GDNConfig
    from mcore_engine.config.lora import LoRAConfig
    from mcore_engine.hf import from_hf_config, read_hf_config
    from mcore_engine.hf.peft import (
        check_gdn_family,
        check_shared_expert_family,
        peft_key,
        shared_expert_layers,
    )

    lora = LoRAConfig(rank=2, target_modules="all-linear")
    assert lora.hf_target_modules(hybrid=True) == sorted(TARGETS)
    assert lora.hf_target_modules() == sorted(TARGETS[:7])
    assert LoRAConfig(rank=2, target_modules=["in_proj_qkv", "out_proj"]).targets(hybrid=True) == {
        "in_proj_qkv": {"in_proj_qkv"}, "out_proj": {"out_proj"}}
    # Qwen3-Next's fused tensors name the engine's pairs
    assert LoRAConfig(rank=2, target_modules=["in_proj_qkvz", "in_proj_ba"]).targets(hybrid=True) == {
        "in_proj_qkv": {"in_proj_qkv"}, "in_proj_z": {"in_proj_z"}, "in_proj_b": {"in_proj_b"},
        "in_proj_a": {"in_proj_a"}}
    mlp = ["gate_proj", "up_proj", "down_proj"]
    assert lora.hf_target_modules(hybrid=True, fused_gdn=True) == sorted([*NEXT_TARGETS, *mlp])
    common = dict(num_layers=4, hidden_size=32, num_attention_heads=4, vocab_size=64, max_sequence_length=16)
    with pytest.raises(ValueError, match="target_modules.*'in_proj_z'.*no GDN layers"):
        ModelConfig(**common, lora=dict(rank=2, target_modules=["q_proj", "in_proj_z"]))
    gdn = GDNConfig(num_key_heads=2, num_value_heads=4, key_head_dim=8, value_head_dim=8)
    hybrid = ModelConfig(**common, linear_attention=gdn, attention_output_gate=True,
                         lora=dict(rank=2, target_modules=["in_proj_z"]))
    assert hybrid.lora.targets(hybrid.swiglu, True) == {"in_proj_z": {"in_proj_z"}}
    # Qwen3.5-MoE: every linear (the MLP's: the shared expert's, PEFT's mlp.shared_expert.*); a MoE
    # without a shared expert refuses MLP targets (they would be the routed experts')
    M.save_tiny_model("qwen3_5_moe", tmp_path / "moe")
    moe = from_hf_config(read_hf_config(tmp_path / "moe"), hf_path=str(tmp_path / "moe"))
    fine = dataclasses.replace(moe, lora=LoRAConfig(rank=2, target_modules="all-linear"))
    check_gdn_family(fine)
    assert fine.lora.hf_target_modules(fine.swiglu, True) == sorted(TARGETS)
    assert shared_expert_layers(fine) == [0, 1, 2, 3]
    assert peft_key(1, "down", "B", shared_layers=[1]) == \
        "base_model.model.model.layers.1.mlp.shared_expert.down_proj.lora_B.weight"
    unshared = dataclasses.replace(moe.moe, shared_expert_ffn_hidden_size=None, shared_expert_gate=False)
    with pytest.raises(ValueError, match="MoE model without a shared expert"):
        dataclasses.replace(moe, moe=unshared, lora=LoRAConfig(rank=2, target_modules="all-linear"))
    dataclasses.replace(moe, moe=unshared, lora=LoRAConfig(rank=2, target_modules=["q_proj", "o_proj", *GDN]))
    # Qwen3-Next (fused in_proj_qkvz / in_proj_ba): half a pair or a pair with dropout refused by name
    M.save_tiny_model("qwen3_next", tmp_path / "next")
    model = from_hf_config(read_hf_config(tmp_path / "next"), hf_path=str(tmp_path / "next"))
    for targets in (["in_proj_qkv"], ["in_proj_z", "in_proj_ba"], ["in_proj_a"]):
        with pytest.raises(ValueError, match="lora.target_modules.*without.*Qwen3-Next.*target 'in_proj_"):
            check_gdn_family(dataclasses.replace(model, lora=LoRAConfig(rank=2, target_modules=targets)))
    with pytest.raises(ValueError, match="lora.dropout.*in_proj_qkvz"):
        check_gdn_family(dataclasses.replace(model, lora=LoRAConfig(rank=2, dropout=0.1,
                                                                    target_modules=["in_proj_qkvz"])))
    for targets in (["q_proj", "out_proj"], ["in_proj_qkvz", "in_proj_ba"], NEXT_TARGETS):
        adapted = dataclasses.replace(model, lora=LoRAConfig(rank=2, target_modules=targets))
        check_gdn_family(adapted)
        check_shared_expert_family(adapted)
    # PEFT's gate_proj / up_proj / down_proj on Qwen3-Next are the routed experts: refused
    with pytest.raises(ValueError, match="lora.target_modules.*qwen3_next.*routed experts"):
        check_shared_expert_family(dataclasses.replace(model, lora=LoRAConfig(rank=2, target_modules=mlp)))
    check_shared_expert_family(fine)  # Qwen3.5-MoE: the shared expert, as PEFT
    with pytest.raises(ValueError, match="lora.target_modules.*in_proj_ba.*Qwen3-Next's fused"):
        check_gdn_family(dataclasses.replace(moe, lora=LoRAConfig(rank=2, target_modules=["in_proj_ba"])))


def test_hybrid_adapter_folder_checks(references, tmp_path):
    """The PEFT folder's GDN keys are read for the GDN layers only; a folder whose keys sit on the other
    layer kind, or miss the GDN adapters, is refused naming adapter_path."""
    import shutil

    from safetensors.torch import load_file, save_file

    from mcore_engine.config.lora import LoRAConfig
    from mcore_engine.hf import from_hf_config, read_hf_config
    from mcore_engine.hf.peft import read_adapter
    from mcore_engine.state.adapters import _projection_shapes

    cfg = _config(references, 1, False)
    model = from_hf_config(read_hf_config(references / "base"))
    gdn_layers = [i for i, p in enumerate(model.linear_attention.layer_pattern(model.num_layers)) if p]
    assert gdn_layers == [0, 1, 2]
    ok = LoRAConfig(rank=RANK, alpha=ALPHA, target_modules="all-linear")
    shapes = _projection_shapes(cfg)
    assert shapes["q"] == (2 * 4 * 16, 64) and shapes["in_proj_qkv"] == (2 * 32 + 64, 64)
    adapters = read_adapter(references / "adapter", ok, swiglu=True, num_layers=4, shapes=shapes,
                            gdn_layers=gdn_layers)
    assert len(adapters) == 3 * 5 + 4 + 4 * 3 and (0, "in_proj_qkv") in adapters and (3, "q") in adapters
    with pytest.raises(ValueError, match="adapter_path.*target_modules"):  # a dense reading of it
        read_adapter(references / "adapter", ok, swiglu=True, num_layers=4, shapes=shapes)
    with pytest.raises(ValueError, match="adapter_path.*do not match"):  # GDN layers elsewhere
        read_adapter(references / "adapter", ok, swiglu=True, num_layers=4, shapes=shapes,
                     gdn_layers=[1, 2, 3])
    broken = tmp_path / "broken"
    shutil.copytree(references / "adapter", broken)
    tensors = load_file(str(broken / "adapter_model.safetensors"))
    moved = {k.replace("layers.0.linear_attn.in_proj_z", "layers.0.self_attn.in_proj_z"): v
             for k, v in tensors.items()}
    save_file(moved, str(broken / "adapter_model.safetensors"))
    with pytest.raises(ValueError, match="adapter_path.*unexpected tensor"):
        read_adapter(broken, ok, swiglu=True, num_layers=4, shapes=shapes, gdn_layers=gdn_layers)


def test_vision_language_adapter_folder(references, tmp_path):
    """PEFT on ``Qwen3_5ForConditionalGeneration`` keys the decoder ``model.language_model.layers``: read
    for a vision-language base (every one of the 12 linears), refused against a text base and the
    other way round; an adapter on the vision tower refused by name; LoRA on the folder passes the
    family check."""
    import dataclasses

    from safetensors.torch import load_file, save_file

    from mcore_engine.config.lora import LoRAConfig
    from mcore_engine.hf import from_hf_config, read_hf_config
    from mcore_engine.hf.peft import TEXT_PREFIX, VL_PREFIX, check_gdn_family, decoder_prefix, read_adapter
    from mcore_engine.state.adapters import _projection_shapes

    M.save_tiny_model("qwen3_5_vl", tmp_path / "vl", seed=11)
    assert decoder_prefix(tmp_path / "vl") == VL_PREFIX
    assert decoder_prefix(references / "base") == TEXT_PREFIX
    vl = M.model_class("qwen3_5_vl").from_pretrained(tmp_path / "vl", dtype=torch.float32)
    _peft_adapter(vl, TARGETS, tmp_path / "adapter")
    keys = load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
    assert len(keys) == 2 * (3 * 5 + 4 + 4 * 3)
    assert all(k.startswith("base_model.model.model.language_model.layers.") for k in keys)
    ok = LoRAConfig(rank=RANK, alpha=ALPHA, target_modules="all-linear")
    shapes = _projection_shapes(_config(references, 1, False))  # the text folder's twin: same shapes
    adapters = read_adapter(tmp_path / "adapter", ok, swiglu=True, num_layers=4, shapes=shapes,
                            gdn_layers=[0, 1, 2], prefix=VL_PREFIX)
    key = "base_model.model.model.language_model.layers.0.linear_attn.in_proj_qkv.lora_B.weight"
    assert len(adapters) == 3 * 5 + 4 + 4 * 3 and torch.equal(adapters[(0, "in_proj_qkv")][1], keys[key])
    with pytest.raises(ValueError, match="adapter_path.*language_model.*vision-language.*ForCausalLM"):
        read_adapter(tmp_path / "adapter", ok, swiglu=True, num_layers=4, shapes=shapes, gdn_layers=[0, 1, 2])
    with pytest.raises(ValueError, match="adapter_path.*ForCausalLM model on a base of a vision-language"):
        read_adapter(references / "adapter", ok, swiglu=True, num_layers=4, shapes=shapes,
                     gdn_layers=[0, 1, 2], prefix=VL_PREFIX)
    tower = tmp_path / "tower"
    tower.mkdir()
    (tower / "adapter_config.json").write_text((tmp_path / "adapter" / "adapter_config.json").read_text())
    save_file({**keys, "base_model.model.model.visual.blocks.0.attn.qkv.lora_A.weight": torch.ones(RANK, 16)},
              str(tower / "adapter_model.safetensors"))
    with pytest.raises(ValueError, match="adapter_path.*vision tower"):
        read_adapter(tower, ok, swiglu=True, num_layers=4, shapes=shapes, gdn_layers=[0, 1, 2],
                     prefix=VL_PREFIX)
    model = from_hf_config(read_hf_config(tmp_path / "vl"), hf_path=str(tmp_path / "vl"))
    check_gdn_family(dataclasses.replace(model, lora=LoRAConfig(rank=2, target_modules="all-linear")))
