"""The GRPO recipe's toy task, "count up": each response token is the previous token + 1 (mod V).

Prompt ``x [P]`` uniform over the vocabulary, response ``y [R]``, ``y_0 := x[P - 1]``::

    reward = mean_{i=1..R} [ y_i == (y_{i-1} + 1) mod V ]          # in [0, 1], partial credit per step

A uniform policy scores ``1 / V`` on average; the successor map ``y_i = y_{i-1} + 1 mod V`` scores 1.
Each step is judged on its own (a wrong token restarts the count from itself): a dense signal for
the one function to learn. A prompt-blind 2-cycle ``c, c + 1, c, ...`` scores about 1/2, a local
optimum a too large learning rate collapses into (seen at lr 1e-2 in ``configs/grpo_tiny_tp2.yaml``).
Rule-based, computed on the host (int64), no model.
"""

from __future__ import annotations

import torch

__all__ = ["sample_prompts", "successor_reward"]


def sample_prompts(num_prompts: int, prompt_len: int, vocab_size: int,
                   generator: torch.Generator) -> torch.Tensor:
    """int64 ``[num_prompts, prompt_len]`` uniform over ``[0, vocab_size)``."""
    if num_prompts < 1 or prompt_len < 1 or vocab_size < 2:
        raise ValueError(f"num_prompts, prompt_len must be >= 1 and vocab_size >= 2, got {num_prompts}, "
                         f"{prompt_len}, {vocab_size}")
    return torch.randint(0, vocab_size, (num_prompts, prompt_len), generator=generator)


def successor_reward(sequences: torch.Tensor, prompt_len: int, vocab_size: int) -> torch.Tensor:
    """float32 ``[B]`` in ``[0, 1]`` (module docstring) of int64 ``sequences [B, P + R]``, ``R >= 1``."""
    if sequences.dim() != 2 or sequences.dtype != torch.int64:
        raise ValueError(f"sequences must be int64 [B, S], got {sequences.dtype} {tuple(sequences.shape)}")
    if not 1 <= prompt_len < sequences.shape[1]:
        raise ValueError(f"prompt_len must be in [1, S={sequences.shape[1]}) (at least one response "
                         f"token), got {prompt_len}")
    tail = sequences[:, prompt_len - 1:]                          # [B, R + 1]: y_0 .. y_R
    hits = tail[:, 1:] == torch.remainder(tail[:, :-1] + 1, vocab_size)
    return hits.float().mean(dim=1)
