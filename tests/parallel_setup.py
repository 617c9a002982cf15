"""Shared pieces of the layout-equivalence tests (sequence and context parallelism; a helper, not
collected): the tiny dense / MoE / critic configs, their batches, the steps each layout runs and the
comparison against the one-rank reference."""

from __future__ import annotations

import dataclasses

import torch

from tests.engine_setup import flat_values, local_reference, make_batch, policy_loss, tiny_config
from tests.utils import REL_TOL, assert_rel_close

TOL = REL_TOL[torch.float32]
SEED = 23
NUM_SEQS = 6
FLAGS = dict(calculate_entropy=True, temperature=0.8)
MOE = dict(num_experts=4, router_topk=2, ffn_hidden_size=32, aux_loss_coeff=0.01, z_loss_coeff=1e-3,
           layer_freq=[0, 1, 1, 1])
# Qwen3.5's hybrid: GDN layers 0-2, gated full attention at 3; chunks of 8 tokens (sequences 3..17 long)
GDN = dict(num_key_heads=2, num_value_heads=4, key_head_dim=16, value_head_dim=16, chunk_size=8)
HYBRID = dict(qk_layernorm=True, add_qkv_bias=False, kv_channels=16, attention_output_gate=True,
              zero_centered_norm=True, rotary_percent=0.25)
# gpt-oss: biases everywhere, sinks, a 4-token window on layers 0 and 2, YaRN, the clamped SwiGLU MoE
GPT_OSS = dict(add_bias_linear=True, attention_sinks=True, sliding_window=4,
               sliding_window_pattern=[1, 0, 1, 0], glu_activation="quick_gelu",
               glu_linear_offset=1.0, glu_clamp=7.0, kv_channels=16)
GPT_OSS_YARN = dict(factor=4.0, original_max_position_embeddings=16, beta_fast=32.0, beta_slow=1.0,
                    truncate=False)


def config(model: str, *, tp: int = 1, pp: int = 1, vpp: int | None = None, ep: int = 1,
           etp: int | None = None, sp: bool = False, cp: int = 1, data_format: str = "thd",
           fused_lm_head: bool = False, precision: str = "fp32", dispatcher: str = "alltoall",
           micro_batch_size: int = 2):
    """The tiny GPT of ``tests.engine_setup`` as ``model`` ``"dense"``, ``"moe"`` (with QK-norm),
    ``"value"``, ``"hybrid"`` (Qwen3.5: 3 GDN layers, 1 gated attention), ``"hybrid-moe"`` (its MoE
    with a gated shared expert) or ``"gpt-oss"`` (every layer MoE), with the production ``adam_eps``."""
    from mcore_engine.config import GDNConfig, OptimizerConfig, YaRNConfig
    from mcore_engine.config.moe import MoEConfig

    cfg = tiny_config(tp=tp, pp=pp, vpp=vpp, data_format=data_format, micro_batch_size=micro_batch_size,
                      fused_lm_head=fused_lm_head, precision=precision, lr=3e-3,
                      adam_eps=OptimizerConfig.adam_eps)  # production
    m = cfg.model
    if model == "moe":
        m = dataclasses.replace(m, qk_layernorm=True, moe=MoEConfig(**MOE, token_dispatcher=dispatcher))
    elif model == "value":
        m = dataclasses.replace(m, head="value")
    elif model.startswith("hybrid"):
        moe = None if model == "hybrid" else MoEConfig(
            **{**MOE, "layer_freq": 1}, token_dispatcher=dispatcher, shared_expert_ffn_hidden_size=24,
            shared_expert_gate=True)
        m = dataclasses.replace(m, **HYBRID, linear_attention=GDNConfig(**GDN), moe=moe)
    elif model == "gpt-oss":
        m = dataclasses.replace(m, **GPT_OSS, add_qkv_bias=False, yarn=YaRNConfig(**GPT_OSS_YARN),
                                moe=MoEConfig(**{**MOE, "layer_freq": 1}, token_dispatcher=dispatcher))
    parallel = dataclasses.replace(cfg.parallel, sequence_parallel=sp, expert_model_parallel_size=ep,
                                   expert_tensor_parallel_size=etp, context_parallel_size=cp)
    return dataclasses.replace(cfg, model=m, parallel=parallel)


def trained_like(engine, seed: int = 0) -> None:
    """Give a hybrid model's fresh weights a trained model's regime: every GDN layer's ``A_log`` to
    ``log(uniform(0.05, 1))`` (per-token decays ``exp(g)`` of about 0.3-0.97), every zero-centred norm
    weight to ``N(0, 0.1)``. At the initialisation's ``A = uniform(1, 16)`` the state forgets nearly
    everything each token, and ``A_log`` / ``dt_bias`` get gradients of ~1e-6 made of cancelling
    terms that fp32 rounding alone moves by 1e-4 - 1e-3 relative (measured: chunk size 8 vs 16 on one
    rank; < 1e-6 here). Norm weights at 0 end two Adam steps at about +-2 lr, where bf16 noise flips
    signs: no layout comparison can see anything there."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for chunk in engine.model:
            for name, p in chunk.module.named_parameters():
                if name.endswith("A_log"):
                    p.copy_(torch.empty(p.shape).uniform_(0.05, 1.0, generator=g).log())
                elif "layernorm" in name and engine.config.model.zero_centered_norm:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    engine.optimizer.reload_model_params()


def batches(lengths: list[list[int]] | None = None, **extra) -> list:
    """Two batches of random lengths (3..17), or of ``lengths[i]``; ``extra`` for ``make_batch``."""
    if lengths is None:
        return [make_batch(SEED + i, NUM_SEQS, **FLAGS, **extra) for i in range(2)]
    return [make_batch(SEED + i, lengths=n, **FLAGS, **extra) for i, n in enumerate(lengths)]


OUTPUT_KEYS = {"dense": ("log_probs", "entropy"), "moe": ("log_probs", "entropy"), "value": ("values",),
               "hybrid": ("log_probs", "entropy"), "hybrid-moe": ("log_probs", "entropy"),
               "distill": ("log_probs", "distillation_losses", "student_mass")}


def distill_policy_loss(outputs: dict, data, ctx):
    """The policy loss plus the top-k distillation loss, as contributions."""
    loss, metrics = policy_loss(outputs, data, ctx)
    return loss + (outputs["distillation_losses"] * data["loss_mask"]).sum() / ctx.global_num_tokens, metrics


def run_steps(engine, model: str, select: bool = False, data: list | None = None) -> dict:
    """Inference, then two train steps: outputs (flat, real tokens), loss, grad norm, metrics, and
    the first step's gradients and the weights after it per model chunk. ``model="distill"``: the
    dense model with the teacher's top-k (``data`` must carry it) and the distillation loss added."""
    keys = OUTPUT_KEYS[model]
    flags = {"value": {"calculate_entropy": False},
             "distill": {"distillation_use_topk": True}}.get(model, {})
    loss_fn = {"value": value_loss, "distill": distill_policy_loss}.get(model, policy_loss)
    got: dict = {"steps": []}
    data = batches() if data is None else data
    for batch in data:
        for key, value in {**flags, "outputs_on_loss_mask_only": select}.items():
            batch.set_non_tensor(key, value)
    infer = engine.infer_batch(data[0])
    got["infer"] = {k: flat_values(infer[k]) for k in keys}
    if model.endswith("moe"):
        got["routed_experts"] = flat_values(infer["routed_experts"])
    for batch in data:
        out = engine.train_batch(batch, loss_fn)
        if "grads" not in got:  # the first step's gradients (clipped in place, as on every layout)
            got["grads"] = [{k: p.main_grad.detach().float().clone()
                             for k, p in chunk.module.named_parameters()} for chunk in engine.model]
            got["weights1"] = [{k: p.detach().float().clone() for k, p in chunk.module.named_parameters()}
                               for chunk in engine.model]
        engine.lr_scheduler_step()
        metrics = out.get_non_tensor("metrics")
        got["steps"].append({"loss": out.get_non_tensor("loss").clone(),
                             "grad_norm": torch.tensor(metrics["grad_norm"], dtype=torch.float64),
                             "outputs": {k: flat_values(out[k]) for k in keys},
                             "moe": {k: v for k, v in metrics.items() if k.startswith("moe/")}})
        assert metrics["update_skipped"] == 0.0
    return got


def value_loss(outputs: dict, data, ctx):
    """Token-mean squared error of the values against the advantages, as a contribution."""
    mask = data["loss_mask"]
    loss = (((outputs["values"] - data["advantages"]) ** 2) * mask).sum() / ctx.global_num_tokens
    return loss, {}


def after_steps(tol: float, steps: int) -> float:
    """The fp32 budget of a quantity computed after ``steps`` Adam steps: ``TOL`` on the loaded weights,
    ``tests.compare.FP32_TWO_STEPS`` once a step has left the entries it cannot pin down ~lr apart
    (measured: the critic's values after one step at TP=2 + SP, 1.03e-5); other budgets as given."""
    from tests.compare import FP32_TWO_STEPS

    return FP32_TWO_STEPS if tol == TOL and steps > 0 else tol


def compare(name: str, got: dict, ref: dict, select: bool, tol: float, data) -> None:
    masks = []
    for b in data:  # selected rows: the packed loss mask (each sequence's last token dropped)
        mask = flat_values(b["loss_mask"]).bool()
        mask[b["input_ids"].offsets()[1:] - 1] = False
        masks.append(mask)

    def same(a: torch.Tensor, b: torch.Tensor, what: str, mask: torch.Tensor) -> None:
        if select:
            a, b = a[mask], b[mask]
        assert_rel_close(a, b, tol, f"{name}: {what}")

    for key, value in ref["infer"].items():
        same(got["infer"][key], value, f"infer {key}", masks[0])
    if "routed_experts" in ref:  # every token's top-k experts in every MoE layer, as at TP=1
        assert torch.equal(got["routed_experts"], ref["routed_experts"]), f"{name}: routed_experts"
    for i, (g, r) in enumerate(zip(got["steps"], ref["steps"], strict=True)):
        tol = after_steps(tol, i)
        assert_rel_close(g["loss"], r["loss"], tol, f"{name}: step {i} loss")
        assert_rel_close(g["grad_norm"], r["grad_norm"], tol, f"{name}: step {i} grad norm")
        for key, value in r["outputs"].items():
            same(g["outputs"][key], value, f"step {i} {key}", masks[i])
        assert g["moe"].keys() == r["moe"].keys(), f"{name}: router metrics {sorted(g['moe'])}"
        for key, value in r["moe"].items():
            assert abs(g["moe"][key] - value) <= tol * max(abs(value), 1e-6), \
                f"{name}: step {i} {key} {g['moe'][key]} vs {value}"


def same_tensors(what: str, engine, got: list[dict], want: dict, *, tol: float | dict | None = None,
                 steps_from: dict | None = None, steps: int = 2) -> None:
    """This rank's gradients or weights ``got`` (one dict per model chunk) against the TP=1 / PP=1
    tensors ``want`` cut to this layout, tensor by tensor (:func:`tests.compare.assert_tensors_close`).
    A per-tensor ``tol`` (:func:`tests.compare.bf16_budget`) is keyed by the reference's names.
    Weights after ``steps`` steps: ``steps_from`` are the reference's first-step gradients (fp32: the
    entries whose Adam step they do not pin down are bounded, not compared); gradients: ``None``.
    ``tol`` ``None``: fp32 1e-5, weights after two steps ``FP32_TWO_STEPS``."""
    from tests.compare import FP32, FP32_TWO_STEPS, AdamSteps, Attention, assert_tensors_close
    from tests.engine_setup import _global_key

    adam = None
    if tol is None:
        tol = FP32 if steps_from is None or steps == 1 else FP32_TWO_STEPS
    if isinstance(tol, dict):
        tol = [{k: tol[_global_key(chunk.module, k)] for k in chunk_got}
               for chunk, chunk_got in zip(engine.model, got, strict=True)]
    elif steps_from is not None:
        opt = engine.config.optimizer
        adam = AdamSteps(local_reference(engine, steps_from), opt.lr, opt.adam_eps, steps)
    assert_tensors_close(what, got, local_reference(engine, want), attn=Attention.of(engine.config.model),
                         grads=steps_from is None, tol=tol, adam=adam)


def check_layout_tensors(name: str, engine, got: dict, ref: dict, bf16: bool) -> None:
    """A layout's step-1 gradients, weights after step 1 (fp32 only) and after two steps against
    the reference's (:func:`same_tensors`; ``bf16``: the reference's per-tensor ``bf16_budget``)."""
    budget = ref["bf16_budget"] if bf16 else {"grads": None, "full2": None}
    same_tensors(f"{name}: gradients of step 1", engine, got["grads"], ref["grads"][0], tol=budget["grads"])
    if budget["full2"] is None:
        same_tensors(f"{name}: weights after step 1", engine, got["weights1"], ref["weights1"][0],
                     steps_from=ref["grads"][0], steps=1)
    weights = [{k: p.detach().float() for k, p in chunk.module.named_parameters()} for chunk in engine.model]
    same_tensors(f"{name}: weights after 2 steps", engine, weights, ref["full2"], tol=budget["full2"],
                 steps_from=ref["grads"][0])
