"""Smoke test of the logits benchmark (``tools/bench.py``): it runs at a small size and prints the table.

No timing assertions: only that every requested row is there, the figures parse, and ours and the
naive upstream path computed the same outputs and gradients (the table's "agree" column).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "tools"))

import bench  # noqa: E402


def test_parse_args_rejects_bad_input():
    with pytest.raises(SystemExit):
        bench.parse_args(["--configs", "A,Z"])
    with pytest.raises(SystemExit):
        bench.parse_args(["--tokens", "0"])
    args = bench.parse_args(["--quick", "--tp", "2", "--configs", "e,a", "--device", "cpu"])
    assert (args.tokens, args.vocab, args.tp, args.configs) == (256, 2048, [2], ["E", "A"])


def test_table_formats_targets_and_ratios():
    args = bench.parse_args(["--tokens", "4", "--vocab", "256", "--tp", "1", "--configs", "A,E",
                             "--device", "cpu"])
    checks = [{"log_probs": -3.0, "grad_norm": 2.0}]
    results = {
        ("A", "ours", 1): {"peak_mb": 0.005, "time_ms": 2.0, "cpu_ms": 2.0, "checks": checks},
        ("A", "naive", 1): {"peak_mb": 0.01, "time_ms": 1.0, "cpu_ms": 1.0,
                            "checks": [{"log_probs": -3.3, "grad_norm": 2.0}]},
        ("E", "ours", 1): {"peak_mb": 0.001, "time_ms": 1.0, "cpu_ms": 1.0, "checks": checks},
        ("E", "naive", 1): {"peak_mb": 0.004, "time_ms": 4.0, "cpu_ms": 4.0, "checks": checks},
    }
    rows = bench.table_rows(args, results)  # logits: 4 x 256 x 4 B = 1/256 MB
    assert rows[0][5:] == ["0.50", "2 (2)", "1 (1)", "2.00 (2.00)", "FAIL", "-", "FAIL", "9e-02"]
    assert rows[1][5:] == ["0.25", "1 (1)", "4 (4)", "0.25 (0.25)", "PASS", "PASS", "PASS", "0e+00"]
    md = bench.format_table(rows, markdown=True).splitlines()
    assert md[0].startswith("| cfg |") and md[1].startswith("|---") and len(md) == 4


@pytest.mark.slow
def test_bench_quick_runs_and_prints_table():
    """Configuration E on two gloo ranks, each implementation in fresh processes (~20 s on an idle
    2-core machine: the naive path imports Megatron-Core)."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, os.path.join(REPO, "tools", "bench.py"), "--quick", "--tp", "2",
                           "--configs", "E", "--markdown", "--device", "cpu"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert any(line.startswith("- machine:") and "cores" in line for line in lines)
    assert any(line.startswith("- versions:") and "megatron-core" in line for line in lines)
    assert any(line.startswith("- load average") for line in lines)
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in lines if line.startswith("| ")]
    assert rows[0][0] == "cfg" and [r[0] for r in rows[1:]] == ["E"]
    for row in rows[1:]:
        assert row[2] == "2"
        for col in (3, 4):  # "MB (x.xxx)" peaks
            assert float(row[col].split()[0]) > 0
        assert float(row[6].split()[0]) > 0 and float(row[7].split()[0]) > 0
        assert all(v in ("PASS", "FAIL", "-") for v in row[9:12])
        assert float(row[12]) < 1e-4, f"ours and naive disagree: {row}"
