"""Triton forward statistics (``row_max``, ``chunk_stats``) vs float64 definitions and the ops' torch path."""

from __future__ import annotations

import pytest
import torch
from mcore_engine_kernels.forward import chunk_stats, row_max
from mcore_engine_kernels.launch import LaunchConfig
from mcore_engine_kernels.layout import StatLayout

from mcore_engine.ops import stats as torch_stats
from tests.kernels.inputs import (
    BF16,
    DEVICE,
    F16,
    F32,
    chunk_inputs,
    reference_stats64,
    temperature_rows,
)
from tests.utils import assert_rel_close

SMALL = LaunchConfig(block_v=128, num_warps=4)  # many tiles per row, so splits and tile edges are exercised

# (seed, dtype, temperature, rows, v_local, v_valid, offset, layout flags, splits, config)


def _flags(entropy: bool, sum_pi_squared: bool, label: bool, k: int, tail: bool) -> dict:
    return dict(entropy=entropy, sum_pi_squared=sum_pi_squared, label=label, k=k, tail=tail)


CASES = [
    (1, F32, "none", 37, 1000, 1000, 0, _flags(True, True, True, 6, True), None, None),
    (2, F32, "rows", 17, 1000, 953, 1000, _flags(True, True, True, 5, True), 5, SMALL),
    (3, BF16, "float", 29, 517, 517, 517, _flags(True, False, True, 4, False), 3, SMALL),
    (4, BF16, "rows", 23, 700, 650, 0, _flags(False, True, False, 3, True), None, None),
    (5, F16, "float", 19, 333, 333, 333, _flags(False, False, True, 0, False), 2, SMALL),
]


@pytest.mark.parametrize("case", CASES, ids=[f"case{c[0]}" for c in CASES])
def test_chunk_stats_matches_float64_and_torch_path(case):
    seed, dtype, tkind, rows, v_local, v_valid, offset, flags, splits, cfg = case
    vocab = offset + v_valid + 211  # ids also fall on shards before and after this one
    inp = chunk_inputs(seed, rows, v_local, v_valid, dtype, max(flags["k"], 1), offset, vocab)
    x, labels, ids = inp["x"], inp["labels"], inp["ids"][:, :flags["k"]]
    t = temperature_rows(tkind, rows, inp["gen"])
    x_before = inp["full"].clone()

    # --- row max: bit-identical to the torch path ---
    m = row_max(x, t, splits=splits, config=cfg)
    assert torch.equal(m, torch_stats.row_max(x, t)), "row_max differs from ops.stats.row_max"

    # A global max from "another shard" can exceed the local one: shift it so the stats see m > max.
    m = m + 0.375
    layout = StatLayout(**flags)
    label = torch_stats.local_columns(labels, offset, v_valid) if layout.label else None
    teacher = torch_stats.local_columns(ids, offset, v_valid) if layout.k else None
    out = torch.full((rows + 2, layout.width), float("nan"), device=DEVICE)[1:-1]  # a row slice, poisoned
    chunk_stats(x, t, m, layout, out, label=label, teacher=teacher, splits=splits, config=cfg)
    assert torch.isfinite(out).all(), "some statistic was not written"
    assert torch.equal(inp["full"], x_before), "chunk_stats modified its input"

    ref = reference_stats64(x, t, m, labels, ids, offset)
    torch_out = torch.empty_like(out)
    torch_stats.chunk_stats(torch_stats.shifted(x, t, m), layout, torch_out, label=label, teacher=teacher)
    cols = {"S": layout.col_sum_e}
    if layout.entropy:
        cols["A"] = layout.col_sum_ez
    if layout.sum_pi_squared:
        cols["B"] = layout.col_sum_e2
    if layout.label:
        cols["y"] = layout.col_label
    if layout.tail:
        cols["tail"] = layout.col_tail
    for name, col in cols.items():
        assert_rel_close(out[:, col], ref[name].float(), 1e-5, f"{name} vs float64")
        assert_rel_close(out[:, col], torch_out[:, col], 1e-5, f"{name} vs torch path")
    if layout.k:
        teacher = slice(layout.col_teacher, layout.col_tail)
        assert_rel_close(out[:, teacher], ref["teacher"].float(), 1e-5, "teacher z - m")
        assert torch.equal(out[:, teacher], torch_out[:, teacher])


def test_empty_rows_and_fully_padded_shard():
    layout = StatLayout(entropy=True, sum_pi_squared=True, label=True, k=2, tail=True)
    x = torch.randn(0, 50, device=DEVICE)
    assert row_max(x, None).shape == (0,)
    out = torch.empty(0, layout.width, device=DEVICE)
    none = torch.empty(0, dtype=torch.long, device=DEVICE)
    chunk_stats(x, None, torch.empty(0, device=DEVICE), layout, out,
                label=(none, none.bool()), teacher=(none.view(0, 2), none.view(0, 2).bool()))
    # A shard that holds only padded ids: V_valid = 0 -> max -inf, every statistic 0.
    full = torch.randn(4, 50, device=DEVICE)
    x = full[:, :0]
    assert torch.equal(row_max(x, 0.7), torch.full((4,), float("-inf"), device=DEVICE))
    ids = torch.randint(0, 100, (4, 2), device=DEVICE)
    out = torch.full((4, layout.width), float("nan"), device=DEVICE)
    chunk_stats(x, 0.7, torch.zeros(4, device=DEVICE), layout, out,
                label=torch_stats.local_columns(ids[:, 0], 100, 0),
                teacher=torch_stats.local_columns(ids, 100, 0))
    assert torch.equal(out, torch.zeros_like(out))


def test_bad_input_raises_value_error_naming_argument():
    layout = StatLayout(entropy=True, sum_pi_squared=False, label=False, k=0, tail=False)
    x = torch.randn(5, 40, device=DEVICE)
    m = torch.zeros(5, device=DEVICE)
    with pytest.raises(ValueError, match="x must be"):
        row_max(torch.randint(0, 3, (5, 40), device=DEVICE), None)
    with pytest.raises(ValueError, match="t must be"):
        row_max(x, torch.ones(4, device=DEVICE))
    with pytest.raises(ValueError, match="m must be"):
        chunk_stats(x, None, m[:4], layout, torch.empty(5, layout.width, device=DEVICE))
    with pytest.raises(ValueError, match="out must be"):
        chunk_stats(x, None, m, layout, torch.empty(5, layout.width + 1, device=DEVICE))
