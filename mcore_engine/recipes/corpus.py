"""The embedded corpus: a seeded sparse Markov chain over the vocabulary (nothing downloaded).

Token ``i`` is followed by one of ``branching`` successors (a seeded random subset of the vocab)
with Zipf probabilities; every other transition has probability 0::

    succ = torch.randperm(V, generator=g)[:branching]          # per row i
    P[i, succ] = w / w.sum(),  w = arange(1, branching + 1) ** -zipf_exponent
    x_0 ~ uniform(V);  x_{t+1} ~ P[x_t]

A model that learns the chain reaches a next-token cross-entropy of ``entropy_rate`` nats (the
floor); an untrained one sits near ``log(V)``. Memory: the dense ``[V, V]`` float64 table.
"""

from __future__ import annotations

import math

import torch

__all__ = ["MarkovCorpus"]


class MarkovCorpus:
    """Sequences from a fixed sparse Markov chain; see the module docstring."""

    def __init__(self, vocab_size: int, *, branching: int, zipf_exponent: float, seed: int) -> None:
        if not isinstance(vocab_size, int) or vocab_size < 2:
            raise ValueError(f"vocab_size must be an int >= 2, got {vocab_size!r}")
        if not isinstance(branching, int) or not 1 <= branching <= vocab_size:
            raise ValueError(f"branching must be an int in [1, vocab_size={vocab_size}], got {branching!r}")
        if zipf_exponent < 0:
            raise ValueError(f"zipf_exponent must be >= 0, got {zipf_exponent!r}")
        g = torch.Generator().manual_seed(seed)
        weights = torch.arange(1, branching + 1, dtype=torch.float64) ** -float(zipf_exponent)
        weights = weights / weights.sum()
        table = torch.zeros(vocab_size, vocab_size, dtype=torch.float64)
        for i in range(vocab_size):
            table[i, torch.randperm(vocab_size, generator=g)[:branching]] = weights
        self.vocab_size = vocab_size
        self.transitions = table
        """float64 ``[V, V]``: row i is the distribution of the token after token i."""

    def sample(self, num_sequences: int, length: int, generator: torch.Generator) -> torch.Tensor:
        """int64 ``[num_sequences, length]``: chains started uniformly at random."""
        if num_sequences < 1 or length < 1:
            raise ValueError(f"num_sequences and length must be >= 1, got {num_sequences} and {length}")
        tokens = torch.empty(num_sequences, length, dtype=torch.int64)
        tokens[:, 0] = torch.randint(0, self.vocab_size, (num_sequences,), generator=generator)
        for t in range(1, length):
            rows = self.transitions[tokens[:, t - 1]]
            tokens[:, t] = torch.multinomial(rows, 1, generator=generator)[:, 0]
        return tokens

    def stationary_distribution(self, iterations: int = 1000) -> torch.Tensor:
        """float64 ``[V]``: ``pi = pi @ P`` by power iteration from the uniform start."""
        pi = torch.full((self.vocab_size,), 1.0 / self.vocab_size, dtype=torch.float64)
        for _ in range(iterations):
            pi = pi @ self.transitions
        return pi

    def entropy_rate(self) -> float:
        """Nats per token: ``sum_i pi_i H(P[i])``, the cross-entropy floor of a perfect model."""
        p = self.transitions
        row_entropy = -(p * p.clamp_min(1e-300).log()).sum(-1)
        return float(self.stationary_distribution() @ row_entropy)

    @property
    def uniform_entropy(self) -> float:
        """``log(V)``: the cross-entropy of a uniform guess."""
        return math.log(self.vocab_size)
