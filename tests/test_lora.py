"""LoRA (``model.lora``) against PEFT on tiny random Llama / Qwen2 (q/k/v bias, tied embeddings) /
Qwen3 (QK-norm) checkpoints.

In-process: PEFT's ``get_peft_model`` with random adapters on every linear (``init_lora_weights=
False``: B is not zero, so the adapters matter), saved as a PEFT folder; the references: the PEFT
model's log-probs, the base model's, and two steps of ``torch.optim.AdamW`` on the adapter
parameters with the engine's loss (token-mean ``-adv * log_prob``), float32.

One launch of two gloo ranks: the engine loads the base from ``model.hf_path`` and the adapters from
``lora.adapter_path`` at TP=1 (DP=2, each rank the whole batch), TP=2, TP=2 + SP, PP=2, DP=2 with
the distributed optimizer and TP=2 with full activation recompute: log-probs equal PEFT's (fp32
1e-5), ``adapters_disabled`` equal the base model's, the adapters after two steps equal PEFT +
AdamW's (1e-5), the base weights bit-identical, no gradient / grad buffer / optimizer state for
them. Checkpoints hold the adapters and their optimizer state only: resumed bit for bit at TP=2 (by
an engine spelling the same adapters and base path otherwise), resharded to PP=2, another base
refused. Then
the exports: ``export_adapter`` read by ``PeftModel.from_pretrained`` and ``export_hf`` (merged) read
by ``transformers`` give the trained engine's log-probs; ``per_tensor_generator(adapter_only=True)``
yields PEFT's keys and values.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from tensordict import TensorDict

from tests.hf.models import VOCAB, save_tiny_model
from tests.utils import assert_rel_close, run_distributed

pytest.importorskip("peft", reason="PEFT is installed by `make setup` (the verl extra)")

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
RANK, ALPHA, LR, WD = 4, 8.0, 1e-2, 0.01
LENGTHS = [7, 12, 5, 9]
TOL = 1e-5
# name, family, tp, pp, sequence parallel, distributed optimizer
LAYOUTS = [("llama-tp1-dp2", "llama", 1, 1, False, False), ("llama-tp2", "llama", 2, 1, False, False),
           ("llama-tp2-sp", "llama", 2, 1, True, False), ("llama-pp2", "llama", 1, 2, False, False),
           ("llama-dp2-distopt", "llama", 1, 1, False, True), ("qwen2-tp2", "qwen2", 2, 1, False, False),
           ("qwen3-tp2-sp", "qwen3", 2, 1, True, False),
           ("llama-tp2-recompute", "llama", 2, 1, False, False)]


def _batch(seed: int = 3) -> TensorDict:
    g = torch.Generator().manual_seed(seed)
    ids = [torch.randint(0, VOCAB, (n,), generator=g) for n in LENGTHS]
    adv = [torch.randn(n, generator=g) for n in LENGTHS]
    mask = [(torch.rand(n, generator=g) > 0.2).long() for n in LENGTHS]
    nested = lambda ts: torch.nested.nested_tensor(ts, layout=torch.jagged)  # noqa: E731
    batch = TensorDict({"input_ids": nested(ids), "advantages": nested(adv), "loss_mask": nested(mask)},
                       batch_size=[len(LENGTHS)])
    batch.set_non_tensor("micro_batch_size_per_gpu", 2)
    return batch


def _loss(outputs, data, ctx):
    mask = data["loss_mask"]
    return (-data["advantages"] * outputs["log_probs"] * mask).sum() / ctx.global_num_tokens, {}


def _hf_log_probs(model, batch: TensorDict) -> torch.Tensor:
    """Flat next-token log-probs of every sequence (no entry for the last token)."""
    out = []
    for ids in batch["input_ids"].unbind():
        logits = model(ids[None]).logits[0].float()
        lp = torch.log_softmax(logits, -1)[:-1].gather(-1, ids[1:, None])[:, 0]
        out.append(lp)
    return torch.cat(out)


def _flat(t: torch.Tensor) -> torch.Tensor:
    """Flat values without each sequence's last token (no next token: the engine's is label 0)."""
    t = torch.cat(t.unbind()) if t.is_nested else t.reshape(-1)
    keep = torch.ones(sum(LENGTHS), dtype=torch.bool)
    keep[torch.tensor(LENGTHS).cumsum(0) - 1] = False
    return t[keep]


def _masks(batch: TensorDict) -> tuple[torch.Tensor, torch.Tensor]:
    """The loss mask and the advantages of every token with a next token, flat."""
    return _flat(batch["loss_mask"]).float(), _flat(batch["advantages"])


@pytest.fixture(scope="module")
def references(tmp_path_factory) -> Path:
    """Base folders, PEFT folders and the references, per family."""
    from peft import LoraConfig, get_peft_model

    root = tmp_path_factory.mktemp("lora")
    batch = _batch()
    mask, adv = _masks(batch)
    refs = {}
    for i, family in enumerate(("llama", "qwen2", "qwen3")):
        base = save_tiny_model(family, root / family, seed=10 + i)
        if family == "llama":  # the same architecture, other weights: an adapter checkpoint refuses it
            save_tiny_model(family, root / "llama-foreign", seed=99)
        with torch.no_grad():
            base_lp = _hf_log_probs(base, batch)
        torch.manual_seed(20 + i)
        peft = get_peft_model(base, LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0,
                                               target_modules=TARGETS, init_lora_weights=False))
        with torch.no_grad():  # B ~ kaiming is large: keep the adapted model close to the base
            for name, p in peft.named_parameters():
                if "lora_B" in name:
                    p.mul_(0.1)
        peft.save_pretrained(root / f"{family}-adapter")
        with torch.no_grad():
            lp0 = _hf_log_probs(peft, batch)
        params = [p for n, p in peft.named_parameters() if "lora_" in n]
        assert all(p.requires_grad for p in params) and len(params) == 2 * len(TARGETS) * 2
        opt = torch.optim.AdamW(params, lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=WD)
        for _ in range(2):
            opt.zero_grad()
            loss = (-adv * _hf_log_probs(peft, batch) * mask).sum() / mask.sum()
            loss.backward()
            opt.step()
        with torch.no_grad():
            lp2 = _hf_log_probs(peft, batch)
        from peft import get_peft_model_state_dict

        adapters2 = {k: v.detach().clone() for k, v in get_peft_model_state_dict(peft).items()}
        refs[family] = {"base_lp": base_lp, "lp0": lp0, "lp2": lp2, "adapters2": adapters2}
    torch.save(refs, root / "refs.pt")
    return root


def _config(root: Path, family: str, tp: int, pp: int, sp: bool, dist_opt: bool):
    from mcore_engine.config import EngineConfig, OptimizerConfig, ParallelConfig
    from mcore_engine.config.lora import LoRAConfig
    from mcore_engine.hf import from_hf_config, read_hf_config

    folder = root / family
    model = from_hf_config(read_hf_config(folder), hf_path=str(folder))
    model = dataclasses.replace(model, lora=LoRAConfig(rank=RANK, alpha=ALPHA, target_modules="all-linear",
                                                       adapter_path=str(root / f"{family}-adapter")))
    parallel = ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                              sequence_parallel=sp)
    return EngineConfig(model=model, parallel=parallel,
                        optimizer=OptimizerConfig(lr=LR, min_lr=0.0, weight_decay=WD, clip_grad=0.0,
                                                  lr_warmup_steps=0, lr_decay_style="constant",
                                                  use_distributed_optimizer=dist_opt))


def _layouts(rank: int, world_size: int, root: Path) -> None:
    from mcore_engine.engine import MegatronEngine
    from mcore_engine.parallel.platform import destroy_distributed

    refs = torch.load(root / "refs.pt", weights_only=False)
    batch = _batch()
    for name, family, tp, pp, sp, dist_opt in LAYOUTS:
        ref = refs[family]
        cfg = _config(root, family, tp, pp, sp, dist_opt)
        if name.endswith("recompute"):  # full recompute from the frozen embedding's output
            cfg = dataclasses.replace(cfg, recompute_granularity="full", recompute_method="uniform",
                                      recompute_num_layers=1)
        engine = MegatronEngine(cfg)
        engine.initialize()
        base = {n: p.detach().clone() for c in engine.model for n, p in c.module.named_parameters()
                if "lora_" not in n}
        adapters = [p for c in engine.model for n, p in c.module.named_parameters() if "lora_" in n]
        # --- frozen base: no gradient, no grad buffer, no optimizer state
        assert all(not p.requires_grad and not hasattr(p, "main_grad")
                   for c in engine.model for n, p in c.module.named_parameters() if "lora_" not in n), name
        assert all(p.requires_grad for p in adapters) and adapters, name
        held = sum(b.grad_data.numel() for c in engine.model for b in c.buffers)  # padded to buckets
        assert sum(p.numel() for p in adapters) <= held < sum(t.numel() for t in base.values()) / 4, \
            f"{name}: grad buffers of {held} elements"

        assert_rel_close(_flat(engine.infer_batch(batch)["log_probs"]), ref["lp0"], TOL,
                         f"{name}: PEFT log-probs")
        with engine.adapters_disabled():
            assert_rel_close(_flat(engine.infer_batch(batch)["log_probs"]), ref["base_lp"], TOL,
                             f"{name}: adapters disabled == base model")
        for _ in range(2):
            out = engine.train_batch(batch, _loss)
            assert out.get_non_tensor("metrics")["update_skipped"] == 0.0, name
        assert_rel_close(_flat(engine.infer_batch(batch)["log_probs"]), ref["lp2"], TOL,
                         f"{name}: log-probs after two steps")
        streamed = dict(engine.per_tensor_generator(adapter_only=True))
        assert streamed.keys() == ref["adapters2"].keys(), name
        for key, value in ref["adapters2"].items():
            assert_rel_close(streamed[key], value, TOL, f"{name}: {key} after two AdamW steps")
        after = {n: p.detach() for c in engine.model for n, p in c.module.named_parameters()
                 if "lora_" not in n}
        assert all(torch.equal(after[n], base[n]) for n in base), f"{name}: base weights changed"
        if name == "llama-tp2":
            engine.export_adapter(root / "exported-adapter")
            engine.export_hf(root / "exported-merged")
            if rank == 0:
                torch.save(_flat(engine.infer_batch(batch)["log_probs"]), root / "exported-lp.pt")
            else:
                engine.infer_batch(batch)
        del engine
        destroy_distributed()
    _checkpoints(root, batch)


def _checkpoints(root: Path, batch: TensorDict) -> None:
    """Adapters + their optimizer state only (a fraction of the base's bytes): bit-identical resume at
    TP=2, resharded to PP=2 (the next step to 1e-5), another base refused naming it."""
    import math

    from safetensors.torch import load_file

    from mcore_engine.engine import MegatronEngine
    from mcore_engine.parallel.platform import destroy_distributed

    def engine_at(tp: int, pp: int, hf_family: str = "llama") -> MegatronEngine:
        cfg = _config(root, "llama", tp, pp, False, False)
        if hf_family != "llama":
            model = dataclasses.replace(cfg.model, hf_path=str(root / hf_family))
            cfg = dataclasses.replace(cfg, model=model)
        engine = MegatronEngine(cfg)
        engine.initialize()
        return engine

    def step(engine) -> tuple[float, dict[str, torch.Tensor]]:
        out = engine.train_batch(batch, _loss)
        return float(out.get_non_tensor("loss")), dict(engine.per_tensor_generator(adapter_only=True))

    engine = engine_at(2, 1)
    step(engine)
    engine.save_checkpoint(root / "ckpt")
    want_loss, want = step(engine)
    del engine
    destroy_distributed()
    from megatron.core import dist_checkpointing

    saved = dist_checkpointing.load_tensors_metadata(str(root / "ckpt"))
    model_keys = [k for k in saved if not k.startswith("optimizer")]
    assert model_keys and all(".lora_A." in k or ".lora_B." in k for k in model_keys), model_keys[:5]
    held = sum(math.prod(t.global_shape) for k, t in saved.items() if k in model_keys)
    base = sum(t.numel() for t in load_file(root / "llama" / "model.safetensors").values())
    assert held < base / 10, f"the checkpoint holds {held} model elements (base {base})"

    # the same adapters spelled otherwise (HF names in another order, the base path with a trailing /)
    cfg = _config(root, "llama", 2, 1, False, False)
    lora = dataclasses.replace(cfg.model.lora, target_modules=list(reversed(TARGETS)))
    model = dataclasses.replace(cfg.model, lora=lora, hf_path=str(root / "llama") + "/")
    same = MegatronEngine(dataclasses.replace(cfg, model=model))
    same.initialize()
    same.load_checkpoint(root / "ckpt")
    loss, got = step(same)
    assert loss == want_loss and all(torch.equal(got[k], want[k]) for k in want), "resume at TP=2"
    del same
    destroy_distributed()
    other = engine_at(1, 2)
    other.load_checkpoint(root / "ckpt")
    loss, got = step(other)
    assert abs(loss - want_loss) <= TOL * abs(want_loss)
    for key, value in want.items():
        assert_rel_close(got[key], value, TOL, f"resumed at PP=2: {key}")
    del other
    destroy_distributed()
    foreign = engine_at(2, 1, hf_family="llama-foreign")
    with pytest.raises(ValueError, match="base_model"):
        foreign.load_checkpoint(root / "ckpt")
    del foreign
    destroy_distributed()


def test_lora_matches_peft_on_every_layout(references):
    run_distributed(_layouts, 2, references)
    # the exports, read by PEFT and transformers
    import transformers
    from peft import PeftModel

    batch = _batch()
    want = torch.load(references / "exported-lp.pt")
    base = transformers.AutoModelForCausalLM.from_pretrained(references / "llama", dtype=torch.float32).eval()
    peft = PeftModel.from_pretrained(base, references / "exported-adapter").eval()
    with torch.no_grad():
        assert_rel_close(_hf_log_probs(peft, batch), want, TOL, "export_adapter -> PeftModel.from_pretrained")
    merged = transformers.AutoModelForCausalLM.from_pretrained(references / "exported-merged",
                                                               dtype=torch.float32).eval()
    with torch.no_grad():
        assert_rel_close(_hf_log_probs(merged, batch), want, TOL, "export_hf (merged) -> transformers")


def test_lora_config_refusals(tmp_path):
    from mcore_engine.config import ModelConfig
    from mcore_engine.config.lora import LoRAConfig
    from mcore_engine.config.moe import MoEConfig

    for kwargs, field in ((dict(rank=0), "rank"), (dict(rank=4, alpha=0.0), "alpha"),
                          (dict(rank=4, dropout=1.0), "dropout"), (dict(rank=4, target_modules=["w1"]), "w1"),
                          (dict(rank=4, target_modules=[]), "target_modules")):
        with pytest.raises(ValueError, match=field):
            LoRAConfig(**kwargs)
    common = dict(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=64, max_sequence_length=16)
    with pytest.raises(ValueError, match="MoE"):
        ModelConfig(**common, moe=MoEConfig(num_experts=4), lora=dict(rank=2, target_modules=["down_proj"]))
    with pytest.raises(ValueError, match="head"):
        ModelConfig(**common, head="value", lora=dict(rank=2))
    with pytest.raises(ValueError, match="adapter_path needs ModelConfig.hf_path"):
        ModelConfig(**common, lora=dict(rank=2, adapter_path=str(tmp_path)))
    assert LoRAConfig(rank=2, target_modules=["linear_qkv", "o_proj"]).targets() == {
        "linear_qkv": {"q", "k", "v"}, "linear_proj": {"o"}}
    from mcore_engine.config import lora as lora_config
    from mcore_engine.layers import lora

    assert lora.LINEAR_PROJECTIONS is lora_config.LINEAR_PROJECTIONS  # one definition


def test_adapter_folder_checks(references, tmp_path):
    """A PEFT folder of another rank / target set / shape is refused naming adapter_path."""
    import json
    import shutil

    from mcore_engine.config.lora import LoRAConfig
    from mcore_engine.hf.peft import read_adapter

    folder = references / "llama-adapter"
    shapes = {"q": (64, 64), "k": (32, 64), "v": (32, 64), "o": (64, 64), "gate": (88, 64), "up": (88, 64),
              "down": (64, 88)}
    ok = LoRAConfig(rank=RANK, alpha=ALPHA, target_modules="all-linear")
    assert len(read_adapter(folder, ok, swiglu=True, num_layers=2, shapes=shapes)) == 2 * len(TARGETS)
    for bad, match in ((dataclasses.replace(ok, rank=8), "r=4"),
                       (dataclasses.replace(ok, alpha=4.0), "lora_alpha"),
                       (dataclasses.replace(ok, target_modules=["q_proj"]), "target_modules")):
        with pytest.raises(ValueError, match=f"adapter_path.*{match}"):
            read_adapter(folder, bad, swiglu=True, num_layers=2, shapes=shapes)
    with pytest.raises(ValueError, match="adapter_path.*do not match"):
        read_adapter(folder, ok, swiglu=True, num_layers=3, shapes=shapes)
    with pytest.raises(ValueError, match="adapter_path.*shapes"):
        read_adapter(folder, ok, swiglu=True, num_layers=2, shapes={**shapes, "q": (32, 64)})
    broken = tmp_path / "broken"
    shutil.copytree(folder, broken)
    config = json.loads((broken / "adapter_config.json").read_text())
    for change in ({"use_dora": True}, {"alpha_pattern": {"down_proj": 24}},
                   {"rank_pattern": {"q_proj": 8}}):
        (broken / "adapter_config.json").write_text(json.dumps({**config, **change}))
        with pytest.raises(ValueError, match=next(iter(change))):
            read_adapter(broken, ok, swiglu=True, num_layers=2, shapes=shapes)
