"""Scalar value head on the GPTModel trunk (``model.head: value``) for critics and reward models::

    values = (hidden @ weight.T + bias).float()    # hidden [s, b, H], weight [1, H], bias [1] -> [s, b, 1]

It replaces the last stage's ``output_layer``, replicated over TP (verl's ``LinearForLastLayer``):
the final hidden states are the same on every TP rank, so no collective is needed and the grad norm
counts the head once. Under sequence parallelism the values are all-gathered over the sequence and
the head's parameters marked ``sequence_parallel``. Memory: ``H + 1`` parameters; values fp32.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

__all__ = ["ValueHead", "attach_value_head", "sequence_scores"]


class ValueHead(torch.nn.Module):
    """``Linear(H, 1)`` with bias, replicated over TP; forward returns fp32 ``([..., 1], None)`` like
    Megatron's output layer (``weight`` / ``runtime_gather_output`` are accepted and ignored)."""

    def __init__(self, hidden_size: int, *, std: float, seed: int, sequence_parallel: bool,
                 dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        # a dedicated CPU generator: the same head at every TP / PP / DP layout and on every rank
        g = torch.Generator().manual_seed(seed)
        weight = torch.randn(1, hidden_size, generator=g, dtype=torch.float32) * std
        self.weight = torch.nn.Parameter(weight.to(device=device, dtype=dtype))
        self.bias = torch.nn.Parameter(torch.zeros(1, device=device, dtype=dtype))
        self.sequence_parallel = sequence_parallel
        if sequence_parallel:
            self.weight.sequence_parallel = True
            self.bias.sequence_parallel = True

    def forward(self, input_: torch.Tensor, weight: torch.Tensor | None = None,
                runtime_gather_output: bool | None = None) -> tuple[torch.Tensor, None]:
        values = F.linear(input_, self.weight, self.bias).float()
        if self.sequence_parallel:
            from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

            values = gather_from_sequence_parallel_region(values, tensor_parallel_output_grad=False)
        return values, None


VALUE_HEAD_SEED_OFFSET = 7919
"""The head is drawn from ``EngineConfig.seed + VALUE_HEAD_SEED_OFFSET``."""


def attach_value_head(model: torch.nn.Module, cfg) -> None:
    """Replace a last-stage ``GPTModel``'s ``output_layer`` by a freshly initialised :class:`ValueHead`
    (``weight ~ N(0, init_method_std)`` from the config's seed, ``bias = 0``)."""
    ref = model.output_layer.weight
    model.output_layer = ValueHead(
        cfg.model.hidden_size, std=cfg.model.init_method_std, seed=cfg.seed + VALUE_HEAD_SEED_OFFSET,
        sequence_parallel=cfg.parallel.sequence_parallel, dtype=ref.dtype, device=ref.device)


def sequence_scores(per_mb: Sequence[dict[str, torch.Tensor]], micro_batches: Sequence, order: Sequence[int],
                    key: str = "values") -> torch.Tensor:
    """fp32 ``[B]``: ``per_mb[i][key]`` (model layout) at each sequence's last real token, in the
    input batch's order (``order[j]``: batch index of the j-th sequence over the micro-batches)."""
    parts = []
    for outs, mb in zip(per_mb, micro_batches, strict=True):
        inputs = mb.inputs
        flat = outs[key].reshape(-1)
        last = inputs.token_index[inputs.cu_seqlens[1:].to(torch.int64) - 1]
        parts.append(flat.index_select(0, last.to(flat.device)))
    cat = torch.cat(parts)
    out = torch.empty_like(cat)
    out[torch.as_tensor(list(order), dtype=torch.int64, device=cat.device)] = cat
    return out
