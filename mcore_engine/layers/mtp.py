"""Multi-token prediction modules (DeepSeek-V3's MTP) in the GPTModel: Megatron-Core's
``MultiTokenPredictionBlock``, run by the engine instead of by ``GPTModel._postprocess``.

Module ``k = 1..D`` (all on the last pipeline stage, as Megatron-Core 0.16 places them), at position
``t`` of a sequence, with ``h^0`` the trunk's final (normed) hidden states and the trunk's embedding
``emb`` and output layer ``W`` shared::

    h^k_t = final_layernorm_k(Layer_k(eh_proj_k(cat(enorm_k(emb(x_{t+k})), hnorm_k(h^{k-1}_t)))))
    logits^k_t = W h^k_t                                                 # predicts x_{t+k+1}

(ids rolled within each sequence, 0 past its end; the normed ``h^k`` feeds module ``k + 1``).
``Layer_k`` is the decoder's last layer spec. :class:`MTPGPTModel` runs the block only when the
engine arms it (training passes with ``mtp_loss_scaling_factor > 0``) and keeps ``h^1 .. h^D`` for
the engine's loss (:mod:`mcore_engine.step.mtp`); it returns what the plain GPTModel returns. Memory
when armed: the block's ``[(1 + D) s, b, H]`` output plus each module's layer activations.
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group

from mcore_engine.layers.norm import with_torch_norms

__all__ = ["MTPGPTModel", "arm_mtp", "freeze_untrained_mtp", "mtp_block_spec", "pop_mtp_hidden"]


def mtp_block_spec(config: TransformerConfig, decoder_spec: Any, vp_stage: int | None, *, te: bool):
    """Megatron's MTP block spec for this (virtual) stage, ``None`` where no MTP module lives (every
    stage but the last). Its transformer layer is the decoder's last layer spec; local specs get the
    engine's :class:`~mcore_engine.layers.norm.TorchNorm` for ``enorm`` / ``hnorm`` / the final norm."""
    if not config.mtp_num_layers:
        return None
    spec = get_gpt_mtp_block_spec(config, decoder_spec, use_transformer_engine=te, vp_stage=vp_stage)
    return spec if spec is None or te else with_torch_norms(spec)


class MTPGPTModel(GPTModel):
    """``GPTModel`` whose MTP block runs only when armed (:func:`arm_mtp`); the trunk's outputs are
    those of the same model without MTP modules, armed or not. The engine passes neither ``labels``
    nor an inference context."""

    mtp_armed: bool = False
    mtp_hidden: list[torch.Tensor] | None = None

    def _postprocess(self, hidden_states: torch.Tensor, **kw: Any) -> torch.Tensor:
        if kw.get("labels") is not None or kw.get("inference_context") is not None:
            raise ValueError("MTPGPTModel returns logits: labels and inference_context are not supported")
        armed, self.mtp_armed = self.mtp_armed, False
        if armed and self.mtp_process:
            names = ("attention_mask", "rotary_pos_emb", "rotary_pos_cos", "rotary_pos_sin",
                     "packed_seq_params", "sequence_len_offset", "padding_mask")  # padding_mask: >= 0.17
            stacked = self.mtp(input_ids=kw["input_ids"], position_ids=kw["position_ids"],
                               hidden_states=hidden_states, embedding=self.embedding,
                               **{k: kw[k] for k in names if k in kw}, **(kw.get("extra_block_kwargs") or {}))
            self.mtp_hidden = list(torch.chunk(stacked, 1 + self.config.mtp_num_layers, dim=0)[1:])
        if not self.post_process:
            return hidden_states
        tied = self.share_embeddings_and_output_weights
        weight = self.shared_embedding_or_output_weight() if tied else None
        logits, _ = self.output_layer(hidden_states, weight=weight,
                                      runtime_gather_output=kw.get("runtime_gather_output"))
        return logits.transpose(0, 1).contiguous()

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        # GPTModel ties the MTP stage's embedding copy with metadata["dp_cp_group"], which it never fills
        return super().sharded_state_dict(prefix, sharded_offsets, ensure_metadata_has_dp_cp_group(metadata))


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    while hasattr(model, "module"):
        model = model.module
    return model


def arm_mtp(model: torch.nn.Module, armed: bool = True) -> None:
    """Whether the next forward of this (wrapped) chunk runs its MTP modules, if it has any."""
    gpt = _unwrap(model)
    if getattr(gpt, "mtp_process", False):
        gpt.mtp_armed = armed
        gpt.mtp_hidden = None


def pop_mtp_hidden(model: torch.nn.Module) -> list[torch.Tensor] | None:
    """The MTP modules' hidden states ``[h^1 .. h^D]`` (``[s, b, H]`` each, this rank's sequence share
    under sequence / context parallelism) of the last armed forward, handed over once; else None."""
    gpt = _unwrap(model)
    if not getattr(gpt, "mtp_process", False):
        return None
    hidden, gpt.mtp_hidden = gpt.mtp_hidden, None
    return hidden


def freeze_untrained_mtp(model: torch.nn.Module, scaling_factor: float) -> None:
    """With ``scaling_factor == 0`` the MTP modules never run: no gradient, no optimizer state."""
    if scaling_factor == 0 and getattr(model, "mtp_process", False):
        model.mtp.requires_grad_(False)
