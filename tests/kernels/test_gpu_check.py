"""The GPU check script runs end to end (tiny CPU shapes under the interpreter) and prints its table."""

from __future__ import annotations

import pytest
import torch
from mcore_engine_kernels import gpu_check


@pytest.mark.skipif(torch.cuda.is_available(), reason="the smoke mode is for CPU machines")
def test_gpu_check_smoke_prints_table(capsys):
    gpu_check.main(["--smoke"])
    out = capsys.readouterr().out
    for what in ("copy (bf16)", "row_max", "chunk_stats", "chunk_grad", "fused lm-head"):
        assert f"| {what}" in out, out
