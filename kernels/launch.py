"""Launch configurations of every kernel (fixed defaults; launchers take ``config=`` / ``splits=``).

Grid ``(c, splits)``: a program streams one row's column split in ``BLOCK_V`` tiles.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import MappingProxyType

import torch


@dataclass(frozen=True, slots=True)
class LaunchConfig:
    """How one kernel is launched: ``block_v`` columns per tile (a power of two), ``num_warps``."""

    block_v: int
    num_warps: int

    def __post_init__(self) -> None:
        if self.block_v < 16 or self.block_v & (self.block_v - 1):
            raise ValueError(f"block_v must be a power of two >= 16, got {self.block_v}")
        if self.num_warps not in (1, 2, 4, 8, 16, 32):
            raise ValueError(f"num_warps must be a power of two in [1, 32], got {self.num_warps}")


# Fixed defaults per kernel (memory-bound streaming; large tiles keep loads wide).
DEFAULT_CONFIGS = MappingProxyType({
    "row_max": LaunchConfig(block_v=4096, num_warps=8),
    "chunk_stats": LaunchConfig(block_v=2048, num_warps=8),
    "chunk_grad": LaunchConfig(block_v=2048, num_warps=8),
})

# Target programs per SM when choosing the number of column splits on CUDA.
PROGRAMS_PER_SM = 4


def get_config(kernel: str) -> LaunchConfig:
    if kernel not in DEFAULT_CONFIGS:
        raise ValueError(f"kernel must be one of {sorted(DEFAULT_CONFIGS)}, got {kernel!r}")
    return DEFAULT_CONFIGS[kernel]


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

