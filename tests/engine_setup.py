"""Shared pieces of the engine tests (a helper, not collected): a tiny config, batches, losses, and
one TP=1 / PP=1 state dict moved onto any TP / PP / VPP / EP layout, so layouts compare on identical
weights.

Megatron's CPU initialisation makes TP shards contiguous slices of one master weight, which is not
the TP=1 model for the SwiGLU ``linear_fc1`` (TP=1 stores ``[gate; up]``, TP rank r needs
``[gate_r; up_r]``), and pipeline stages seed differently: every layout loads the reference weights
through :func:`load_full_state`.
"""

from __future__ import annotations

import torch
from tensordict import TensorDict

VOCAB = 250


def tiny_config(*, tp: int = 1, pp: int = 1, vpp: int | None = None, data_format: str = "thd",
                micro_batch_size: int = 2, precision: str = "fp32", seed: int = 1234,
                use_distributed_optimizer: bool = False, clip_grad: float = 1.0, lr: float = 1e-3,
                fused_lm_head: bool = False, adam_eps: float | None = None):
    """A 4-layer GQA / SwiGLU / QKV-bias GPT with a padded vocab (250 -> 256), fp32, no warm-up,
    the production ``adam_eps`` unless given (weights after Adam steps on different layouts or paths
    compare through ``tests.compare``)."""
    from mcore_engine.config import EngineConfig, ModelConfig, OptimizerConfig, ParallelConfig

    if adam_eps is None:
        adam_eps = OptimizerConfig.adam_eps

    return EngineConfig(
        model=ModelConfig(num_layers=4, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                          ffn_hidden_size=96, vocab_size=VOCAB, max_sequence_length=64, swiglu=True,
                          add_qkv_bias=True, normalization="RMSNorm", init_method_std=0.05,
                          fused_lm_head=fused_lm_head),
        parallel=ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                virtual_pipeline_model_parallel_size=vpp),
        optimizer=OptimizerConfig(lr=lr, min_lr=0.0, weight_decay=0.01, clip_grad=clip_grad,
                                  lr_warmup_steps=0, lr_decay_style="constant", adam_eps=adam_eps,
                                  use_distributed_optimizer=use_distributed_optimizer),
        precision=precision, seed=seed, micro_batch_size=micro_batch_size, data_format=data_format,
        logits_chunk_size=7)


def _nested(rows: list[torch.Tensor]) -> torch.Tensor:
    return torch.nested.nested_tensor(rows, layout=torch.jagged)


def make_batch(seed: int, num_seqs: int = 6, *, min_len: int = 3, max_len: int = 17,
               teacher_k: int | None = None, lengths: list[int] | None = None, **flags) -> TensorDict:
    """Jagged batch: ``input_ids``, ``advantages``, ``loss_mask`` (a few zeros), optional teacher
    top-k (``teacher_ids`` distinct ids, ``teacher_logprobs`` < 0), and the given non-tensor flags.
    ``lengths`` (one per sequence) overrides the random ones."""
    g = torch.Generator().manual_seed(seed)
    if lengths is None:
        lengths = torch.randint(min_len, max_len + 1, (num_seqs,), generator=g).tolist()
    num_seqs = len(lengths)
    fields = {
        "input_ids": [torch.randint(0, VOCAB, (n,), generator=g) for n in lengths],
        "advantages": [torch.randn(n, generator=g) for n in lengths],
        "loss_mask": [(torch.rand(n, generator=g) > 0.15).to(torch.int64) for n in lengths],
    }
    if teacher_k is not None:
        fields["teacher_ids"] = [
            torch.stack([torch.randperm(VOCAB, generator=g)[:teacher_k] for _ in range(n)]) for n in lengths]
        fields["teacher_logprobs"] = [torch.log_softmax(torch.randn(n, teacher_k, generator=g), -1) - 0.5
                                      for n in lengths]
    batch = TensorDict({k: _nested(v) for k, v in fields.items()}, batch_size=[num_seqs])
    for key, value in flags.items():
        batch.set_non_tensor(key, value)
    return batch


def to_padded(batch: TensorDict) -> TensorDict:
    """The same sequences as a right-padded ``[B, S]`` batch with ``attention_mask`` (flags kept)."""
    lengths = [int(n) for n in batch["input_ids"].offsets().diff()]
    size, width = len(lengths), max(lengths)
    out = TensorDict({}, batch_size=[size])
    for key in batch.keys():
        value = batch.get(key)
        if isinstance(value, torch.Tensor) and value.is_nested:
            rows = value.unbind()
            padded = rows[0].new_zeros((size, width, *rows[0].shape[1:]))
            for i, row in enumerate(rows):
                padded[i, : row.shape[0]] = row
            out.set(key, padded)
        elif isinstance(value, torch.Tensor):
            out.set(key, value)
        else:
            out.set_non_tensor(key, batch.get_non_tensor(key))
    mask = torch.zeros(size, width, dtype=torch.bool)
    for i, n in enumerate(lengths):
        mask[i, :n] = True
    out.set("attention_mask", mask)
    return out


def policy_loss(outputs: dict, data, ctx):
    """Token-mean of ``-adv * log_prob + 0.05 * entropy`` (entropy when present), as a contribution.

    Metrics (contributions, so the engine's sums are global): ``tokens`` (loss tokens) and
    ``seq_id_sum`` (sum of ``seq_ids`` over loss tokens: checks that ids index the GLOBAL batch)."""
    mask = data["loss_mask"]
    per_token = -data["advantages"] * outputs["log_probs"]
    if "entropy" in outputs:
        per_token = per_token + 0.05 * outputs["entropy"]
    loss = (per_token * mask).sum() / ctx.global_num_tokens
    return loss, {"tokens": mask.sum().detach(), "seq_id_sum": (data["seq_ids"].float() * mask).sum()}


def distill_loss(outputs: dict, data, ctx):
    """Token-mean of the top-k distillation loss, as a contribution."""
    mask = data["loss_mask"]
    return (outputs["distillation_losses"] * mask).sum() / ctx.global_num_tokens, {}


def flat_values(t: torch.Tensor) -> torch.Tensor:
    """Real-token values of a jagged nested output ``[B, j]`` as one ``[N]`` tensor."""
    return torch.cat(t.unbind()) if t.is_nested else t.reshape(-1)


# ----------------------------------------------------------------------------- weights across layouts
def full_state(engine) -> dict[str, torch.Tensor]:
    """Clone of the parameters of a TP=1, PP=1 engine (the reference layout)."""
    (chunk,) = engine.model
    state = chunk.module.state_dict()
    return {k: v.detach().clone() for k, v in state.items() if isinstance(v, torch.Tensor)}


def _global_key(module, key: str) -> str:
    """Local parameter name -> the TP=1 / PP=1 / EP=1 name (global layer and expert indices)."""
    parts = key.split(".")
    if parts[:2] == ["decoder", "layers"]:
        parts[2] = str(module.decoder.layers[int(parts[2])].layer_number - 1)
    if "local_experts" in parts:
        from megatron.core import parallel_state

        i = parts.index("local_experts") + 1
        per_rank = module.config.num_moe_experts // parallel_state.get_expert_model_parallel_world_size()
        parts[i] = str(int(parts[i]) + parallel_state.get_expert_model_parallel_rank() * per_rank)
    return ".".join(parts)


def _shard(full: torch.Tensor, key: str, param, gdn=None) -> torch.Tensor:
    """This rank's TP slice of ``full`` (an expert's weights: its expert-TP slice; a GDN layer's
    ``in_proj_qkv`` / ``conv1d``: the slice of each of its q, k, v blocks, ``gdn`` its config)."""
    from megatron.core import parallel_state

    if not getattr(param, "tensor_model_parallel", False):
        return full
    expert = "local_experts" in key
    size = (parallel_state.get_expert_tensor_parallel_world_size() if expert
            else parallel_state.get_tensor_model_parallel_world_size())
    if size == 1:
        return full
    rank = (parallel_state.get_expert_tensor_parallel_rank() if expert
            else parallel_state.get_tensor_model_parallel_rank())
    if key.endswith("linear_fc1.weight"):  # SwiGLU: [gate; up] -> [gate_r; up_r]
        return torch.cat([half.chunk(size, 0)[rank] for half in full.chunk(2, 0)])
    if key.endswith(("in_proj_qkv.weight", "conv1d.weight")):  # [q; k; v] -> [q_r; k_r; v_r]
        blocks = full.split([gdn.key_dim, gdn.key_dim, gdn.value_dim])
        return torch.cat([block.chunk(size, 0)[rank] for block in blocks])
    return full.chunk(size, param.partition_dim)[rank]


def local_reference(engine, full: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
    """``full`` cut to this rank's layout: one dict per model chunk, keyed like its state dict."""
    gdn = engine.config.model.linear_attention
    return [{key: _shard(full[_global_key(chunk.module, key)], key, p, gdn)
             for key, p in chunk.module.named_parameters()} for chunk in engine.model]


def load_full_state(engine, full: dict[str, torch.Tensor]) -> None:
    """Load the TP=1 / PP=1 state ``full`` into any layout (and refresh the optimizer's main params)."""
    for chunk, local in zip(engine.model, local_reference(engine, full), strict=True):
        state = chunk.module.state_dict()
        state.update({k: v.to(state[k].dtype) for k, v in local.items()})
        chunk.module.load_state_dict(state, strict=True)
    engine.optimizer.reload_model_params()


def local_params(engine) -> list[dict[str, torch.Tensor]]:
    """This rank's parameters, one dict per model chunk."""
    return [{k: v.detach().clone() for k, v in chunk.module.named_parameters()} for chunk in engine.model]


def engine_snapshot(engine, *, counters: bool = False) -> list[torch.Tensor]:
    """Clones of this rank's parameters, the optimizer's main params and its tensor state (sorted keys),
    with ``counters`` then ``[global_step, lr_scheduler.num_steps]``; compare with ``assert_identical``."""
    from mcore_engine.step.optimizer import sub_optimizers

    out = [p.detach().clone() for chunk in engine.model for p in chunk.module.parameters()]
    for sub in sub_optimizers(engine.optimizer):
        out += [p.detach().clone() for g in sub.optimizer.param_groups for p in g["params"]]
        out += [s[k].clone() for s in sub.optimizer.state.values() for k in sorted(s)
                if torch.is_tensor(s[k])]
    if counters:
        out.append(torch.tensor([engine.global_step, engine.lr_scheduler.num_steps]))
    return out


def main_grads(engine) -> dict[str, torch.Tensor]:
    """Clones of this rank's DDP main gradients, keyed ``"{chunk}.{name}"``."""
    return {f"{i}.{k}": p.main_grad.detach().clone() for i, chunk in enumerate(engine.model)
            for k, p in chunk.module.named_parameters()}


def check_router_replay(name: str, engine, batch, tol: float | None = None) -> None:
    """Router replay on this layout: the recorded routing reproduces infer_batch, and a replayed
    forward-backward gives the recorded routing's loss and gradients, bit for bit (or, with ``tol``,
    the routing bit for bit and the rest to that relative error)."""
    from tests.utils import assert_rel_close

    def same(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
        if tol is None:
            assert torch.equal(got, want), f"{name}: replayed {what}"
        else:
            assert_rel_close(got, want, tol, f"{name}: replayed {what}")

    recorded = engine.infer_batch(batch)
    replay = batch.clone()
    replay.set("routed_experts", recorded["routed_experts"])
    again = engine.infer_batch(replay)
    assert torch.equal(flat_values(again["routed_experts"]), flat_values(recorded["routed_experts"])), \
        f"{name}: replayed routed_experts"
    same(flat_values(again["log_probs"]), flat_values(recorded["log_probs"]), "log_probs")
    engine.zero_grad()
    free = engine.forward_backward_batch(batch, policy_loss).get_non_tensor("loss").clone()
    free_grads = main_grads(engine)
    engine.zero_grad()
    replayed = engine.forward_backward_batch(replay, policy_loss).get_non_tensor("loss").clone()
    same(replayed, free, "loss")
    for key, value in main_grads(engine).items():
        same(value, free_grads[key], f"gradient of {key}")
    engine.zero_grad()
