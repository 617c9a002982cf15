"""The GPU check script runs end to end (tiny CPU shapes under the interpreter) and prints its table."""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                "tools"))

import gpu_check  # noqa: E402


@pytest.mark.skipif(torch.cuda.is_available(), reason="the smoke mode is for CPU machines")
def test_gpu_check_smoke_prints_table(capsys):
    gpu_check.main(["--smoke"])
    out = capsys.readouterr().out
    for what in ("copy (bf16)", "row_max", "chunk_stats", "chunk_grad", "fused lm-head"):
        assert f"| {what}" in out, out
