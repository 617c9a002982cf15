"""The local spec's expert ``linear_fc2`` when experts have biases (gpt-oss)."""

from __future__ import annotations

from megatron.core.tensor_parallel import RowParallelLinear
from torch import Tensor

__all__ = ["BiasedExpertRowParallelLinear"]


class BiasedExpertRowParallelLinear(RowParallelLinear):
    """Megatron-Core's ``RowParallelLinear`` whose output is a fresh tensor when it returns a bias.

    Megatron's expert ``MLP.forward`` adds the bias in place (``output += bias * probs``). With one
    expert-TP rank the output of ``RowParallelLinear`` is a view returned by the identity reduce
    (a custom autograd Function), and autograd refuses the in-place add. Cost: one copy of the
    expert's ``[tokens, h]`` output.
    """

    def forward(self, input_: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor | None]:
        output, bias = super().forward(input_, *args, **kwargs)
        return (output.clone() if bias is not None else output), bias
