"""The embedded corpus: a seeded sparse Markov chain over the vocabulary (nothing downloaded)::

    successors[i] = torch.randperm(V, generator=g)[:branching]        # [V, b] int64
    weights = w / w.sum(),  w = arange(1, b + 1) ** -zipf_exponent      # [b], the same for every row
    x_0 ~ uniform(V);  x_{t+1} = successors[x_t, j],  j ~ weights

Entropy rate (a perfect model's cross-entropy): ``H(weights)``. Memory: ``V * b`` int64.
"""

from __future__ import annotations

import math

import torch

__all__ = ["MarkovCorpus"]


class MarkovCorpus:
    def __init__(self, vocab_size: int, *, branching: int, zipf_exponent: float, seed: int) -> None:
        if not isinstance(vocab_size, int) or vocab_size < 2:
            raise ValueError(f"vocab_size must be an int >= 2, got {vocab_size!r}")
        if not isinstance(branching, int) or not 1 <= branching <= vocab_size:
            raise ValueError(f"branching must be an int in [1, vocab_size={vocab_size}], got {branching!r}")
        if zipf_exponent < 0:
            raise ValueError(f"zipf_exponent must be >= 0, got {zipf_exponent!r}")
        g = torch.Generator().manual_seed(seed)
        weights = torch.arange(1, branching + 1, dtype=torch.float64) ** -float(zipf_exponent)
        self.vocab_size = vocab_size
        self.weights = weights / weights.sum()
        """float64 ``[b]``: probability of the j-th successor (the same for every token)."""
        self.successors = torch.stack([torch.randperm(vocab_size, generator=g)[:branching]
                                       for _ in range(vocab_size)])
        """int64 ``[V, b]``: the successors of every token, distinct within a row."""

    def sample(self, num_sequences: int, length: int, generator: torch.Generator) -> torch.Tensor:
        """int64 ``[num_sequences, length]``: chains started uniformly at random."""
        if num_sequences < 1 or length < 1:
            raise ValueError(f"num_sequences and length must be >= 1, got {num_sequences} and {length}")
        tokens = torch.empty(num_sequences, length, dtype=torch.int64)
        tokens[:, 0] = torch.randint(0, self.vocab_size, (num_sequences,), generator=generator)
        if length > 1:
            choice = torch.multinomial(self.weights, num_sequences * (length - 1), replacement=True,
                                       generator=generator).view(num_sequences, length - 1)
            for t in range(1, length):
                tokens[:, t] = self.successors[tokens[:, t - 1], choice[:, t - 1]]
        return tokens

    def transition_matrix(self) -> torch.Tensor:
        """float64 ``[V, V]`` dense table (row i: distribution of the token after i). O(V^2) memory."""
        table = torch.zeros(self.vocab_size, self.vocab_size, dtype=torch.float64)
        return table.scatter_(1, self.successors, self.weights.expand_as(self.successors).contiguous())

    def entropy_rate(self) -> float:
        """Nats per token, ``-(weights * weights.log()).sum()``: the floor of a perfect model."""
        w = self.weights[self.weights > 0]
        return float(-(w * w.log()).sum())

    @property
    def uniform_entropy(self) -> float:
        """``log(V)``: the cross-entropy of a uniform guess."""
        return math.log(self.vocab_size)
