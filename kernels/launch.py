"""Launch configurations of every kernel in this package, in one place (a fixed default; tuning opt-in).

Every kernel streams rows of a logits chunk ``[c, V]`` in ``BLOCK_V``-wide column tiles. A program
owns one row and one contiguous column range (a "split"); the grid is ``(c, splits)``. A chunk of
a few rows of a 150k-wide vocab would otherwise leave most of a GPU idle, so ``splits`` grows until
there are about ``PROGRAMS_PER_SM`` programs per streaming multiprocessor. Partial results of the
splits are combined by the launchers in torch (``O(c * splits)`` numbers, deterministic).

Opt-in tuning: :func:`tune` times candidate configs of one kernel on the caller's real inputs and
installs the fastest with :func:`set_config`; nothing tunes itself behind the caller's back.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class LaunchConfig:
    """How one kernel is launched.

    block_v:   columns per tile (a power of two); each program holds a few fp32 ``[block_v]`` tiles.
    num_warps: warps per program.
    """

    block_v: int
    num_warps: int

    def __post_init__(self) -> None:
        if self.block_v < 16 or self.block_v & (self.block_v - 1):
            raise ValueError(f"block_v must be a power of two >= 16, got {self.block_v}")
        if self.num_warps not in (1, 2, 4, 8, 16, 32):
            raise ValueError(f"num_warps must be a power of two in [1, 32], got {self.num_warps}")


# Fixed defaults per kernel (memory-bound streaming; large tiles keep loads wide).
DEFAULT_CONFIGS: dict[str, LaunchConfig] = {
    "row_max": LaunchConfig(block_v=4096, num_warps=8),
    "chunk_stats": LaunchConfig(block_v=2048, num_warps=8),
    "chunk_grad": LaunchConfig(block_v=2048, num_warps=8),
}
_configs: dict[str, LaunchConfig] = dict(DEFAULT_CONFIGS)

# Target programs per SM when choosing the number of column splits on CUDA.
PROGRAMS_PER_SM = 4


def get_config(kernel: str) -> LaunchConfig:
    """The launch config in use for ``kernel`` (one of ``DEFAULT_CONFIGS``)."""
    if kernel not in _configs:
        raise ValueError(f"kernel must be one of {sorted(_configs)}, got {kernel!r}")
    return _configs[kernel]


def set_config(kernel: str, config: LaunchConfig | None) -> None:
    """Use ``config`` for ``kernel`` from now on (None restores the default)."""
    get_config(kernel)
    _configs[kernel] = DEFAULT_CONFIGS[kernel] if config is None else config


def num_splits(rows: int, cols: int, block_v: int, device: torch.device) -> int:
    """Column splits per row: 1 off CUDA; on CUDA enough for ``PROGRAMS_PER_SM`` programs per SM."""
    tiles = max(1, math.ceil(cols / block_v))
    if device.type != "cuda" or rows == 0:
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(tiles, math.ceil(PROGRAMS_PER_SM * sms / rows)))


def split_cols(cols: int, splits: int, block_v: int) -> int:
    """Columns per split: ``cols / splits`` rounded up to whole tiles (>= one tile)."""
    return max(1, math.ceil(math.ceil(cols / splits) / block_v)) * block_v


def tune(kernel: str, run: Callable[[LaunchConfig], object],
         candidates: Sequence[LaunchConfig]) -> LaunchConfig:
    """Opt-in: time ``run(config)`` for each candidate (CUDA, ``triton.testing.do_bench``), install the best.

    ``run`` launches the kernel on representative inputs with the given config (every launcher takes
    ``config=``). Returns the chosen config.
    """
    from triton.testing import do_bench

    if not candidates:
        raise ValueError("candidates must hold at least one LaunchConfig")
    get_config(kernel)
    best = min(candidates, key=lambda cfg: do_bench(lambda: run(cfg)))
    set_config(kernel, best)
    return best
