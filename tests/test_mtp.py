"""Multi-token prediction (``model.mtp_num_layers``, ``model.mtp_loss_scaling_factor``).

The reference: a float64 GPT in plain torch on the engine's own (Megatron-named) weights, per
sequence: the trunk, then module k on ``cat(enorm(emb(x_{t+k})), hnorm(h^{k-1}_t)) @ eh_proj^T``, its
transformer layer and final norm, the shared output layer; objective ``token-mean NLL + f * mean_k
sum_t mask[t+k] * CE_k(x_{t+k+1}) / N``. Against it, on a packed (thd) batch with a loss mask, 1- and
3-token sequences and three micro-batches: the loss, the ``mtp_loss`` metric and every gradient
(trunk and MTP modules) at one rank in fp32 (1e-5) and bf16 (2e-2), D = 2 and D = 1 (bshd), the
fused lm-head, full activation recompute (uniform, bshd; block), and on two gloo ranks at TP = 2,
TP = 2 + SP, PP = 2 (plus a checkpoint round trip), CP = 2 and DP = 2 (fp32 1e-5). One micro-batch
gives the loss and gradients of three (the global token count); verl's per-micro-batch loss
convention the same ``mtp_loss``. Inference and forward-only passes never run the modules.
``mtp_loss_scaling_factor = 0``: inference and two train steps bit-identical to the model without
MTP modules on the same trunk weights (one rank and PP = 2), the MTP parameters untouched, without
gradient or optimizer state. An MoE model's MTP layer (MoE) routes freely: router replay covers the
decoder's layers and reproduces the pass.

Hugging Face: tiny GLM-4.5 and DeepSeek-V3 (MLA) folders with an MTP module in DeepSeek's layout
against ``transformers``' own ``MtpModel``, the export round trip, and the refusals (bad folders,
config combinations Megatron-Core's MTP does not support), each ``ValueError`` naming the field or
tensor.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from tests.engine_setup import (
    flat_values,
    full_state,
    load_full_state,
    local_reference,
    make_batch,
    tiny_config,
)
from tests.utils import assert_rel_close, run_distributed

LENGTHS = [9, 3, 14, 1, 7, 11]
SCALE = 0.3
FP32_TOL = 1e-5
BF16_TOL = 2e-2


def mtp_config(*, mtp: int = 2, scale: float = SCALE, tp: int = 1, pp: int = 1, cp: int = 1, sp: bool = False,
               precision: str = "fp32", data_format: str = "thd", fused: bool = False):
    """The tiny GPT of ``tests.engine_setup`` with 2 layers and ``mtp`` MTP modules."""
    cfg = tiny_config(tp=tp, pp=pp, precision=precision, data_format=data_format, micro_batch_size=2,
                      fused_lm_head=fused)
    model = dataclasses.replace(cfg.model, num_layers=2, mtp_num_layers=mtp, mtp_loss_scaling_factor=scale)
    parallel = dataclasses.replace(cfg.parallel, context_parallel_size=cp, sequence_parallel=sp)
    return dataclasses.replace(cfg, model=model, parallel=parallel)


def mtp_batch(seed: int = 5, **flags):
    return make_batch(seed, lengths=LENGTHS, **flags)


def nll(outputs, data, ctx):
    """Token-mean negative log-likelihood, as a contribution."""
    return -(outputs["log_probs"] * data["loss_mask"]).sum() / ctx.global_num_tokens, {}


# ----------------------------------------------------------------------------------- float64 reference
def _rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope(x, cos, sin):
    x1, x2 = x.chunk(2, -1)
    return x * cos + torch.cat([-x2, x1], -1) * sin


def _layer(w, p, x, cos, sin, cfg):
    """Megatron's local-spec layer: fused per-group ``[q, k, v]`` rows, SwiGLU ``[gate; up]``."""
    m = cfg.model
    n, heads, groups = x.shape[0], m.num_attention_heads, m.query_groups
    d, per = m.hidden_size // heads, heads // groups
    a = _rms(x, w[p + "input_layernorm.weight"], m.norm_epsilon)
    qkv = a @ w[p + "self_attention.linear_qkv.weight"].T + w[p + "self_attention.linear_qkv.bias"]
    qkv = qkv.view(n, groups, (per + 2) * d)
    q, k, v = qkv.split([per * d, d, d], -1)
    q = _rope(q.reshape(n, heads, d), cos, sin)
    k = _rope(k, cos, sin).repeat_interleave(per, 1)
    v = v.repeat_interleave(per, 1)
    scores = torch.einsum("thd,uhd->htu", q, k) / math.sqrt(d)
    scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    attn = torch.einsum("htu,uhd->thd", scores.softmax(-1), v).reshape(n, heads * d)
    x = x + attn @ w[p + "self_attention.linear_proj.weight"].T
    gate, up = (_rms(x, w[p + "pre_mlp_layernorm.weight"], m.norm_epsilon) @ w[p + "mlp.linear_fc1.weight"].T
                ).chunk(2, -1)
    return x + (torch.nn.functional.silu(gate) * up) @ w[p + "mlp.linear_fc2.weight"].T


def reference_objective(w: dict[str, torch.Tensor], batch, cfg) -> tuple[torch.Tensor, torch.Tensor]:
    """``(NLL / N + f * mtp_loss, mtp_loss)`` in float64 from the TP=1 state ``w`` (float64 leaves)."""
    m = cfg.model
    eps, vocab, depth = m.norm_epsilon, m.vocab_size, m.mtp_num_layers
    emb, out = w["embedding.word_embeddings.weight"], w["output_layer.weight"][:vocab]
    d = m.hidden_size // m.num_attention_heads
    inv_freq = 1.0 / (m.rotary_base ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    ids_all, masks = batch["input_ids"].unbind(), batch["loss_mask"].unbind()
    num_tokens = sum(float(mk[:-1].sum()) for mk in masks)
    main = torch.zeros((), dtype=torch.float64)
    mtp = torch.zeros((), dtype=torch.float64)
    for ids, user_mask in zip(ids_all, masks, strict=True):
        n = ids.numel()
        freqs = torch.outer(torch.arange(n, dtype=torch.float32), inv_freq).double()
        cos, sin = torch.cat([freqs, freqs], -1).cos()[:, None], torch.cat([freqs, freqs], -1).sin()[:, None]
        labels = torch.cat([ids[1:], ids.new_zeros(1)])
        mask = user_mask.double() * (torch.arange(n) < n - 1)
        h = emb[ids]
        for i in range(m.num_layers):
            h = _layer(w, f"decoder.layers.{i}.", h, cos, sin, cfg)
        h = _rms(h, w["decoder.final_layernorm.weight"], eps)
        main = main - ((h @ out.T).log_softmax(-1).gather(-1, labels[:, None])[:, 0] * mask).sum()
        for k in range(1, depth + 1):
            p = f"mtp.layers.{k - 1}."
            shifted = torch.cat([ids[k:], ids.new_zeros(min(k, n))])            # x_{t+k}, 0 past the end
            e = _rms(emb[shifted], w[p + "enorm.weight"], eps)
            z = torch.cat([e, _rms(h, w[p + "hnorm.weight"], eps)], -1) @ w[p + "eh_proj.weight"].T
            layer = next(a for a in ("transformer_layer.", "mtp_model_layer.")  # Megatron-Core 0.16 / 0.19
                         if p + a + "input_layernorm.weight" in w)
            h = _layer(w, p + layer, z, cos, sin, cfg)
            h = _rms(h, w[p + "final_layernorm.weight"], eps)
            target = torch.cat([labels[k:], labels.new_zeros(min(k, n))])     # x_{t+k+1}
            mask_k = torch.cat([mask[k:], mask.new_zeros(min(k, n))])
            log_probs = (h @ out.T).log_softmax(-1).gather(-1, target[:, None])[:, 0]
            mtp = mtp - (log_probs * mask_k).sum()
    mtp_loss = mtp / (depth * num_tokens)
    return main / num_tokens + m.mtp_loss_scaling_factor * mtp_loss, mtp_loss


def reference_grads(state: dict[str, torch.Tensor], batch, cfg):
    """Float64 objective, ``mtp_loss`` and the gradient of every parameter of ``state``."""
    leaves = {k: v.double().requires_grad_() for k, v in state.items()}
    objective, mtp_loss = reference_objective(leaves, batch, cfg)
    objective.backward()
    return objective.detach(), mtp_loss.detach(), {k: v.grad for k, v in leaves.items()}


def engine_grads(engine, batch, loss=nll):
    """One forward-backward: loss, metrics and this rank's main gradients per chunk."""
    engine.zero_grad()
    out = engine.forward_backward_batch(batch, loss)
    grads = [{k: p.main_grad.detach().double().clone() for k, p in chunk.module.named_parameters()
              if p.requires_grad} for chunk in engine.model]
    return out.get_non_tensor("loss"), out.get_non_tensor("metrics"), grads


def check_against_reference(name: str, engine, ref, batch, tol: float) -> None:
    objective, mtp_loss, grads = ref
    loss, metrics, got = engine_grads(engine, batch)
    assert_rel_close(torch.tensor(metrics["mtp_loss"]), mtp_loss, tol, f"{name}: mtp_loss")
    assert_rel_close(loss.double(), objective, tol, f"{name}: loss")
    want = local_reference(engine, grads)
    names = [k for chunk in got for k in chunk]
    assert any(".mtp." in f".{k}" for k in names) == engine.model[-1].module.post_process, names
    for chunk_got, chunk_want in zip(got, want, strict=True):
        for key, value in chunk_got.items():
            assert_rel_close(value, chunk_want[key].double(), tol, f"{name}: gradient of {key}")


def check_modules_run_in_training_only(engine, batch) -> None:
    """Inference and forward-only passes never run the MTP block; a training pass runs it once per
    micro-batch."""
    calls = []
    hook = engine.model[0].module.mtp.register_forward_hook(lambda *args: calls.append(1))
    try:
        out = engine.infer_batch(batch)
        engine.forward_backward_batch(batch, nll, forward_only=True)
        assert not calls and "mtp_loss" not in out.get_non_tensor("metrics")
        engine.forward_backward_batch(batch, nll)
        assert len(calls) == 3  # micro-batches
    finally:
        hook.remove()
    engine.zero_grad()


# ------------------------------------------------------------------------------------------ one rank
def _one_rank(rank: int, world_size: int, path: str) -> None:
    from mcore_engine.engine import MegatronEngine
    from mcore_engine.parallel.platform import destroy_distributed

    saved = {}
    for name, kwargs, tol in (("fp32", {}, FP32_TOL), ("bf16", dict(precision="bf16"), BF16_TOL),
                              ("D=1-bshd", dict(mtp=1, data_format="bshd"), FP32_TOL),
                              ("fused-lm-head", dict(fused=True), FP32_TOL),
                              ("recompute-bshd", dict(data_format="bshd", recompute="uniform"), FP32_TOL),
                              ("recompute-block", dict(recompute="block"), FP32_TOL)):
        recompute = kwargs.pop("recompute", None)
        cfg = mtp_config(**kwargs)
        if recompute is not None:  # full recompute; Megatron-Core recomputes MTP modules under "uniform"
            cfg = dataclasses.replace(cfg, recompute_granularity="full", recompute_method=recompute,
                                      recompute_num_layers=1)
        engine = MegatronEngine(cfg)
        engine.initialize()
        state = full_state(engine)
        batch = mtp_batch(micro_batch_size_per_gpu=2)
        ref = reference_grads(state, batch, cfg)
        check_against_reference(name, engine, ref, batch, tol)
        if name == "fp32":
            saved = {"state": state, "ref": ref}
            # one micro-batch: the loss and gradients of three (normalised by the global token count)
            loss, metrics, grads = engine_grads(engine, mtp_batch(micro_batch_size_per_gpu=len(LENGTHS)))
            assert_rel_close(loss.double(), ref[0], FP32_TOL, "one micro-batch: loss")
            for key, value in grads[0].items():
                assert_rel_close(value, ref[2][key], FP32_TOL, f"one micro-batch: gradient of {key}")
            check_modules_run_in_training_only(engine, batch)
            # verl's per-micro-batch loss convention: the same mtp_loss among the summed metrics
            out = engine.forward_backward_batch(batch, lambda model_output, data, ctx: (
                (model_output["log_probs"] * 0).values().sum(), {}), loss_convention="micro_batch")
            assert_rel_close(torch.tensor(out.get_non_tensor("metrics")["mtp_loss"]), ref[1], FP32_TOL,
                             "micro_batch convention: mtp_loss")
            engine.zero_grad()
            with pytest.raises(ValueError, match="'mtp_loss' clashes"):
                engine.forward_backward_batch(batch, lambda o, d, c: (nll(o, d, c)[0], {"mtp_loss": 1.0}))
        del engine
        destroy_distributed()
    check_untrained_mtp_is_inert(saved["state"])
    check_moe_routing()
    torch.save(saved, path)


def check_moe_routing() -> None:
    """An MoE model's MTP layer (MoE, as its last layer) routes freely: ``routed_experts`` and router
    replay cover the decoder's MoE layers only, and replaying the recorded routing reproduces the
    pass, MTP loss included."""
    from mcore_engine.engine import MegatronEngine
    from mcore_engine.parallel.platform import destroy_distributed
    from tests.engine_setup import check_router_replay
    from tests.parallel_setup import config

    cfg = config("moe")
    engine = MegatronEngine(dataclasses.replace(cfg, model=dataclasses.replace(
        cfg.model, mtp_num_layers=1, mtp_loss_scaling_factor=SCALE)))
    engine.initialize()
    mtp = engine.model[0].module.mtp
    assert any(n.endswith("mlp.router.weight") for n, _ in mtp.named_parameters())
    assert len(engine._moe.chunk_routers[0]) == 3  # the decoder's MoE layers
    check_router_replay("moe with MTP", engine, make_batch(3, 4))
    assert "mtp_loss" in engine.train_batch(make_batch(4, 4), nll).get_non_tensor("metrics")
    del engine
    destroy_distributed()


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("mtp") / "ref.pt")
    run_distributed(_one_rank, 1, path)
    return path


# ------------------------------------------------------------------------------------------ two ranks
LAYOUTS = [("tp2", dict(tp=2)), ("tp2-sp", dict(tp=2, sp=True)), ("pp2", dict(pp=2)), ("cp2", dict(cp=2)),
           ("dp2", {})]


def _two_ranks(rank: int, world_size: int, path: str) -> None:
    from mcore_engine.engine import MegatronEngine
    from mcore_engine.parallel.platform import destroy_distributed

    saved = torch.load(path, weights_only=False)
    for name, kwargs in LAYOUTS:
        engine = MegatronEngine(mtp_config(**kwargs))
        engine.initialize()
        load_full_state(engine, saved["state"])
        batch = mtp_batch(micro_batch_size_per_gpu=2)
        if name == "dp2":  # each rank half the sequences; the loss and gradients are the global ones
            half = len(LENGTHS) // 2
            batch = batch[torch.arange(rank * half, (rank + 1) * half)]
        check_against_reference(name, engine, saved["ref"], batch, FP32_TOL)
        if name == "pp2":  # the MTP stage's embedding copy is tied in the checkpoint
            check_checkpoint(engine, path + ".ckpt")
        del engine
        destroy_distributed()
    check_untrained_mtp_is_inert(saved["state"], pp=2)


def check_checkpoint(engine, path: str) -> None:
    """Save, train a step, load: the saved parameters (MTP modules included) come back bit for bit."""
    engine.save_checkpoint(path)
    saved = [p.detach().clone() for chunk in engine.model for p in chunk.module.parameters()]
    engine.train_batch(mtp_batch(micro_batch_size_per_gpu=2), nll)
    engine.load_checkpoint(path)
    now = [p.detach() for chunk in engine.model for p in chunk.module.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(now, saved, strict=True)), "parameters after load_checkpoint"


def _untrained_run(state, *, mtp: int, pp: int) -> dict:
    """Inference and two train steps with ``mtp`` modules and ``mtp_loss_scaling_factor = 0``."""
    from mcore_engine.engine import MegatronEngine
    from mcore_engine.parallel.platform import destroy_distributed

    engine = MegatronEngine(mtp_config(mtp=mtp, scale=0.0, pp=pp))
    engine.initialize()
    load_full_state(engine, state)
    named = [(k, p) for chunk in engine.model for k, p in chunk.module.named_parameters()]
    modules = {k: p for k, p in named if k.startswith("mtp.")}
    assert bool(modules) == (mtp > 0 and engine.model[-1].module.post_process)
    before = {k: p.detach().clone() for k, p in modules.items()}
    trained = {id(p) for g in engine.optimizer.param_groups for p in g["params"]}
    got = {"infer": flat_values(engine.infer_batch(mtp_batch())["log_probs"]), "steps": []}
    for seed in (5, 6):
        out = engine.train_batch(mtp_batch(seed, micro_batch_size_per_gpu=2), nll)
        metrics = out.get_non_tensor("metrics")
        assert "mtp_loss" not in metrics
        got["steps"].append((out.get_non_tensor("loss"), metrics["grad_norm"], flat_values(out["log_probs"])))
    for key, p in modules.items():  # frozen: no gradient, no optimizer state, unchanged
        assert not p.requires_grad and getattr(p, "main_grad", None) is None and id(p) not in trained, key
        assert torch.equal(p, before[key]), key
    got["params"] = {k: p.detach().clone() for k, p in named if not k.startswith("mtp.")}
    del engine
    destroy_distributed()
    return got


def check_untrained_mtp_is_inert(state, pp: int = 1) -> None:
    """``mtp_loss_scaling_factor = 0``: bit for bit the model without MTP modules."""
    plain, with_mtp = _untrained_run(state, mtp=0, pp=pp), _untrained_run(state, mtp=1, pp=pp)
    assert torch.equal(with_mtp["infer"], plain["infer"]), f"pp={pp}: inference"
    for i, (a, b) in enumerate(zip(with_mtp["steps"], plain["steps"], strict=True)):
        assert torch.equal(a[0], b[0]) and a[1] == b[1] and torch.equal(a[2], b[2]), f"pp={pp}: step {i}"
    assert with_mtp["params"].keys() == plain["params"].keys() or pp > 1
    for key, value in plain["params"].items():
        assert torch.equal(with_mtp["params"][key], value), f"pp={pp}: {key} after two steps"


def test_mtp_loss_and_gradients_match_float64_reference(one_rank):
    """One rank (fp32, bf16, D = 1 bshd; one vs three micro-batches) ran in the fixture; here TP = 2,
    TP = 2 + SP, PP = 2 and CP = 2 against the same reference."""
    run_distributed(_two_ranks, 2, one_rank)


# ------------------------------------------------------------------------------- Hugging Face folders
HF_MODELS = {"glm": dict(tp=2, sp=True), "ds_qlora": dict(pp=2)}  # folder -> the layout that loads it
HF_LAYERS = 2  # one dense, one MoE decoder layer; the MTP module is model.layers.2 (MoE)


def save_mtp_folder(name: str, path, seed: int = 0) -> None:
    """A tiny DeepSeek-V3 / GLM-4.5 folder as ``save_pretrained`` writes it, with one MTP module as
    DeepSeek-V3 stores it: decoder layer ``L`` (written by ``transformers`` from a model with one more
    layer), ``enorm`` / ``hnorm`` / ``eh_proj`` / ``shared_head.norm`` (random) and the copies
    ``embed_tokens`` / ``shared_head.head``; ``config.json``: ``num_nextn_predict_layers`` 1."""
    import json

    from safetensors.torch import load_file, save_file

    from tests.hf.deepseek_models import save_tiny_model

    save_tiny_model(name, path, seed=seed, num_hidden_layers=HF_LAYERS + 1)
    tensors = load_file(path / "model.safetensors")
    g = torch.Generator().manual_seed(seed + 7)
    h = tensors["model.embed_tokens.weight"].shape[1]
    p = f"model.layers.{HF_LAYERS}."
    tensors.update({p + "enorm.weight": 1 + 0.3 * torch.randn(h, generator=g),
                    p + "hnorm.weight": 1 + 0.3 * torch.randn(h, generator=g),
                    p + "eh_proj.weight": 0.2 * torch.randn(h, 2 * h, generator=g),
                    p + "shared_head.norm.weight": 1 + 0.3 * torch.randn(h, generator=g),
                    p + "embed_tokens.weight": tensors["model.embed_tokens.weight"].clone(),
                    p + "shared_head.head.weight": tensors["lm_head.weight"].clone()})
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "num_hidden_layers": HF_LAYERS,
                                                  "num_nextn_predict_layers": 1}))


def hf_objective(path, batch, scale: float) -> tuple[float, float]:
    """``transformers``' float64 ``(NLL / N + scale * mtp_loss, mtp_loss)``: the causal LM's final hidden
    states into its own ``MtpModel`` (which reads the folder's MTP module by DeepSeek's names)."""
    import transformers
    from transformers.modeling_layers import MtpModel

    main = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64,
                                                             experts_implementation="eager").eval()
    # MtpModel finds the module by the causal LM's ignore patterns (layer 61 / 46 / 92 of the real models)
    main._keys_to_ignore_on_load_unexpected = [rf"model\.layers\.{HF_LAYERS}\..*"]
    mtp = MtpModel.from_pretrained(main).eval()
    nll_sum = mtp_sum = num_tokens = 0.0
    with torch.no_grad():
        for ids, user_mask in zip(batch["input_ids"].unbind(), batch["loss_mask"].unbind(), strict=True):
            n = ids.numel()
            positions = torch.arange(n)[None]
            h = main.model(input_ids=ids[None], position_ids=positions).last_hidden_state
            labels = torch.cat([ids[1:], ids.new_zeros(1)])
            mask = user_mask.double() * (torch.arange(n) < n - 1)
            nll_sum -= float((main.lm_head(h)[0].log_softmax(-1)[torch.arange(n), labels] * mask).sum())
            h1 = mtp.forward_layer(0, h, positions, None, input_ids=labels[None])      # x_{t+1}
            log_probs = mtp._project_to_logits(h1)[0].log_softmax(-1)
            target, mask_1 = torch.cat([labels[1:], labels[:1] * 0]), torch.cat([mask[1:], mask[:1] * 0])
            mtp_sum -= float((log_probs[torch.arange(n), target] * mask_1).sum())
            num_tokens += float(mask.sum())
    return nll_sum / num_tokens + scale * mtp_sum / num_tokens, mtp_sum / num_tokens


BROKEN = {"missing": ("model.layers.2.eh_proj.weight", None),
          "misshaped": ("model.layers.2.hnorm.weight", (65,)),
          "copy-misshaped": ("model.layers.2.embed_tokens.weight", (250, 63)),
          "no-mtp-tensors": ("model.layers.2.", "drop")}  # num_nextn_predict_layers without its module


def save_broken_folders(root) -> None:
    """The DeepSeek-V3 folder with one MTP tensor dropped or mis-shaped, per ``BROKEN``."""
    import shutil

    from safetensors.torch import load_file, save_file

    tensors = load_file(root / "ds_qlora" / "model.safetensors")
    for case, (name, shape) in BROKEN.items():
        (root / case).mkdir()
        shutil.copy(root / "ds_qlora" / "config.json", root / case / "config.json")
        broken = dict(tensors)
        if shape is None:
            del broken[name]
        elif shape == "drop":
            broken = {k: v for k, v in broken.items() if not k.startswith(name)}
        else:
            broken[name] = torch.zeros(shape)
        save_file(broken, root / case / "model.safetensors", metadata={"format": "pt"})


def _hf_layouts(rank: int, world_size: int, root, refs: dict) -> None:
    from mcore_engine.engine import MegatronEngine
    from mcore_engine.hf import from_hf_config, load_hf_weights, read_hf_config
    from mcore_engine.parallel.platform import destroy_distributed

    for name, layout in [*HF_MODELS.items(), ("glm-without-mtp", {})]:
        folder = root / name.removesuffix("-without-mtp")
        model = dataclasses.replace(from_hf_config(read_hf_config(folder)), hf_path=str(folder),
                                    mtp_loss_scaling_factor=SCALE)
        assert model.mtp_num_layers == 1, name
        if name.endswith("-without-mtp"):  # the folder's module is ignored, as transformers does
            model = dataclasses.replace(model, mtp_num_layers=0, mtp_loss_scaling_factor=0.0)
        cfg = mtp_config(**layout)
        cfg = dataclasses.replace(cfg, model=model)
        engine = MegatronEngine(cfg)
        engine.initialize()
        if name in refs:
            loss, metrics, _ = engine_grads(engine, mtp_batch(micro_batch_size_per_gpu=2))
            assert_rel_close(torch.tensor(metrics["mtp_loss"]), torch.tensor(refs[name][1]), FP32_TOL,
                             f"{name}: mtp_loss vs transformers' MtpModel")
            assert_rel_close(loss.double(), torch.tensor(refs[name][0]), FP32_TOL, f"{name}: loss")
        engine.export_hf(root / f"export_{name}")
        # a bucketed weight sync carries the same stream, the MTP modules' copies included
        from mcore_engine.weight_sync import unflatten_bucket

        streamed = {n: t.clone() for n, t in engine.per_tensor_generator()}
        synced = {n: v.clone() for bucket, meta in engine.bucketed_weight_generator(2**14)
                  for n, v in unflatten_bucket(bucket, meta).items()}
        assert list(synced) == list(streamed), name
        assert all(torch.equal(synced[n], t) for n, t in streamed.items()), name
        if name == "ds_qlora":  # a bad folder changes nothing
            before = [p.detach().clone() for chunk in engine.model for p in chunk.module.parameters()]
            for case, (tensor, _) in BROKEN.items():
                with pytest.raises(ValueError, match=tensor.replace(".", r"\.")):
                    load_hf_weights(engine.model, root / case, cfg)
            after = [p.detach() for chunk in engine.model for p in chunk.module.parameters()]
            assert all(torch.equal(a, b) for a, b in zip(after, before, strict=True))
        del engine
        destroy_distributed()


@pytest.fixture(scope="module")
def hf_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("mtp_hf")
    for i, name in enumerate(HF_MODELS):
        save_mtp_folder(name, root / name, seed=i)
    save_broken_folders(root)
    return root


def test_mtp_from_hugging_face_and_back(hf_root):
    """GLM-4.5 (TP = 2 + SP) and DeepSeek-V3 with MLA (PP = 2) folders with one MTP module: the loss
    and ``mtp_loss`` equal ``transformers``' (its causal LM and ``MtpModel``, float64; 1e-5); the export
    is the folder, tensor for tensor (the copies included); with ``mtp_num_layers = 0`` the module is
    ignored on import and absent from the export; a missing or mis-shaped MTP tensor is a ValueError
    naming it and leaves the model unchanged."""
    import json

    from tests.hf.models import load_folder

    refs = {name: hf_objective(hf_root / name, mtp_batch(), SCALE) for name in HF_MODELS}
    run_distributed(_hf_layouts, 2, hf_root, refs)
    for name in [*HF_MODELS, "glm-without-mtp"]:
        source = load_folder(hf_root / name.removesuffix("-without-mtp"))
        exported = load_folder(hf_root / f"export_{name}")
        config = json.loads((hf_root / f"export_{name}" / "config.json").read_text())
        if name.endswith("-without-mtp"):
            source = {k: v for k, v in source.items() if not k.startswith(f"model.layers.{HF_LAYERS}.")}
        assert config["num_nextn_predict_layers"] == (0 if name.endswith("-without-mtp") else 1), name
        assert sorted(exported) == sorted(source), (name, sorted(set(exported) ^ set(source)))
        for key, value in source.items():
            assert torch.equal(exported[key], value), f"{name}: {key}"


# ----------------------------------------------------------------------------------------- bad input
def _config_with(**changes):
    from mcore_engine.config import EngineConfig

    d = mtp_config().to_dict()
    for key, value in changes.items():
        if isinstance(value, dict):
            d[key] = {**d[key], **value}
        else:
            d[key] = value
    return EngineConfig.from_dict(d)


FULL_RECOMPUTE = dict(recompute_granularity="full", recompute_method="uniform")


@pytest.mark.parametrize("changes,field", [
    (dict(model=dict(mtp_num_layers=-1)), "ModelConfig.mtp_num_layers"),
    (dict(model=dict(mtp_num_layers=True)), "ModelConfig.mtp_num_layers"),
    (dict(model=dict(mtp_loss_scaling_factor=float("nan"))), "ModelConfig.mtp_loss_scaling_factor"),
    (dict(model=dict(mtp_loss_scaling_factor=-0.1)), "ModelConfig.mtp_loss_scaling_factor"),
    (dict(model=dict(mtp_num_layers=0)), "ModelConfig.mtp_loss_scaling_factor > 0 needs"),
    (dict(model=dict(head="value")), "ModelConfig.head='lm'"),
    (dict(model=dict(tie_word_embeddings=True), parallel=dict(pipeline_model_parallel_size=2)),
     "ParallelConfig.pipeline_model_parallel_size == 1"),
    (dict(model=dict(lora=dict(rank=4))), "ModelConfig.lora"),
    (dict(**FULL_RECOMPUTE, recompute_num_layers=1), "EngineConfig.data_format='bshd'"),
    (dict(**FULL_RECOMPUTE, recompute_num_layers=2, data_format="bshd"), "recompute_num_layers=1"),
])
def test_mtp_config_refusals(changes, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.").replace("(", r"\(")):
        _config_with(**changes)


def test_mtp_config_accepts():
    """What Megatron-Core's MTP supports, and untrained modules with what it does not train."""
    _config_with(model=dict(tie_word_embeddings=True))                                    # tied at PP = 1
    _config_with(**FULL_RECOMPUTE, recompute_num_layers=1, data_format="bshd")
    _config_with(recompute_granularity="full", recompute_method="block")                  # MTP not recomputed
    _config_with(model=dict(lora=dict(rank=4), mtp_loss_scaling_factor=0.0))
    _config_with(**FULL_RECOMPUTE, recompute_num_layers=2, model=dict(mtp_loss_scaling_factor=0.0))
