"""Smoke test of the lm-head benchmark (``tools/bench.py``): it runs at a small size and prints the table.

No timing assertions: only that every requested row is there, the figures parse, and ours, the fused
lm-head and the naive upstream path computed the same outputs and gradients (the "agree" columns).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "tools"))

import bench  # noqa: E402
import bench_common  # noqa: E402


def test_parse_args_rejects_bad_input():
    with pytest.raises(SystemExit):
        bench.parse_args(["--configs", "A,Z"])
    with pytest.raises(SystemExit):
        bench.parse_args(["--tokens", "0"])
    with pytest.raises(SystemExit):
        bench.parse_args(["--hidden", "0"])
    with pytest.raises(SystemExit):
        bench.parse_args(["--quick", "--realistic"])
    args = bench.parse_args(["--quick", "--tp", "2", "--configs", "e,a", "--device", "cpu"])
    assert (args.tokens, args.vocab, args.hidden, args.tp, args.configs) == (256, 2048, 64, [2], ["E", "A"])
    assert bench.vocab_local(args, 2) == 2048


def test_realistic_refuses_cpu(capsys):
    with pytest.raises(SystemExit) as exc:
        bench.parse_args(["--realistic", "--device", "cpu"])
    assert exc.value.code == 2 and "needs a CUDA device" in capsys.readouterr().err


def test_realistic_splits_the_vocab_over_tp():
    args = bench.parse_args(["--tp", "1,2", "--device", "cpu"])
    args.vocab_global, args.tokens, args.hidden, args.dtype = 152064, 32768, 4096, "bf16"  # CPU-side preset
    assert [bench.vocab_local(args, tp) for tp in (1, 2)] == [152064, 76032]
    assert bench.logits_mb(args, 2) == 32768 * 76032 * 2 / 2**20
    assert bench.grads_mb(args, 2) == (32768 + 76032) * 4096 * 2 / 2**20


def test_table_formats_targets_and_ratios():
    args = bench.parse_args(["--tokens", "4", "--vocab", "256", "--hidden", "8", "--tp", "1",
                             "--configs", "A,E", "--device", "cpu"])
    checks = [{"log_probs": -3.0, "grad_norm": 2.0, "grad_hidden_norm": 1.0, "grad_weight_norm": 1.0}]
    fused_checks = [{"log_probs": -3.0, "grad_hidden_norm": 1.1, "grad_weight_norm": 1.0}]
    # logits: 4 x 256 x 4 B = 1/256 MB; fused gradients: (4 + 256) x 8 x 4 B = 8320 B
    grads = (4 + 256) * 8 * 4 / 2**20
    results = {
        ("A", "ours", 1): {"peak_mb": 0.005, "time_ms": 2.0, "cpu_ms": 2.0, "checks": checks},
        ("A", "naive", 1): {"peak_mb": 0.01, "time_ms": 1.0, "cpu_ms": 1.0,
                            "checks": [dict(checks[0], log_probs=-3.3)]},
        ("A", "fused", 1): {"peak_mb": grads + 0.0001, "time_ms": 3.0, "cpu_ms": 2.0, "checks": fused_checks},
        ("E", "ours", 1): {"peak_mb": 0.001, "time_ms": 1.0, "cpu_ms": 1.0, "checks": checks},
        ("E", "naive", 1): {"peak_mb": 0.004, "time_ms": 4.0, "cpu_ms": 4.0, "checks": checks},
        ("E", "fused", 1): {"oom": "CUDA out of memory"},
    }
    rows = bench.table_rows(args, results)
    assert len(rows[0]) == len(bench.COLUMNS)
    assert rows[0][5:] == ["0.50", "0 (2.06x)", "0.0 (0.026x)", "2 (2)", "1 (1)", "3 (2)", "2.00 (2.00)",
                           "3.00 (2.00)", "FAIL", "-", "FAIL", "FAIL", "9e-02", "1e-01"]
    assert rows[1][5:] == ["0.25", "OOM", "OOM", "1 (1)", "4 (4)", "OOM", "0.25 (0.25)", "-", "PASS", "PASS",
                           "PASS", "FAIL", "0e+00", "-"]
    md = bench_common.format_table(bench.COLUMNS, rows, markdown=True).splitlines()
    assert md[0].startswith("| cfg |") and md[1].startswith("|---") and len(md) == 4


def test_fused_target_passes_below_a_tenth_of_the_logits():
    args = bench.parse_args(["--tokens", "1024", "--vocab", "4096", "--hidden", "4", "--tp", "1",
                             "--configs", "A", "--device", "cpu"])
    xl = bench.logits_mb(args, 1)  # 16 MB
    res = {"peak_mb": 1.0, "time_ms": 1.0, "cpu_ms": 1.0, "checks": [{}]}
    rows = bench.table_rows(args, {("A", impl, 1): dict(res, peak_mb=peak)
                                   for impl, peak in (("ours", xl), ("naive", 2 * xl), ("fused", 0.09 * xl))})
    assert rows[0][6] == "1.4 (0.090x)" and rows[0][16] == "PASS"


@pytest.mark.slow
def test_bench_quick_runs_and_prints_table():
    """Configuration E on two gloo ranks, each implementation (ours, naive, fused) in fresh processes,
    memory and time in one process per rank (``--single-process``; the naive path imports Megatron-Core)."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, os.path.join(REPO, "tools", "bench.py"), "--quick", "--tp", "2",
                           "--configs", "E", "--markdown", "--device", "cpu", "--single-process"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert any(line.startswith("- machine:") and "cores" in line for line in lines)
    assert any(line.startswith("- versions:") and "megatron-core" in line for line in lines)
    assert any(line.startswith("- load average") for line in lines)
    assert any(line.startswith("- fused peak (i)") for line in lines)
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in lines if line.startswith("| ")]
    assert rows[0] == bench.COLUMNS and [r[0] for r in rows[1:]] == ["E"]
    for row in rows[1:]:
        assert row[2] == "2"
        for col in (3, 4, 6):  # "MB (x.xxx)" peaks: ours, naive, fused (i)
            assert float(row[col].split()[0]) > 0
        for col in (8, 9, 10):  # "ms (cpu ms)"
            assert float(row[col].split()[0]) > 0
        assert all(v in ("PASS", "FAIL", "-") for v in row[13:17])
        assert float(row[17]) < 1e-4, f"ours and naive disagree: {row}"
        assert float(row[18]) < 1e-4, f"fused and naive disagree: {row}"


def test_selected_rows_table_targets():
    import bench_selected

    args = bench.parse_args(["--tokens", "1024", "--vocab", "4096", "--hidden", "4", "--tp", "1", "--configs",
                             "A", "--device", "cpu", "--selected", "--fractions", "1,0.2"])
    assert args.selected and args.fractions == [1.0, 0.2]
    grads = bench.grads_mb(args, 1)
    checks = [{"log_probs@1.0": -3.0, "log_probs@0.2": -1.0}]

    def res(work, cpu):
        return {"peak_mb": grads + work, "time_ms": cpu, "cpu_ms": cpu, "checks": checks}

    results = {}
    for path in bench_selected.PATHS:
        results.update({("A", path, 1, None): res(10.0, 100.0), ("A", path, 1, 1.0): res(10.0, 101.0),
                        ("A", path, 1, 0.2): res(2.0, 23.0 if path == "fused" else 21.0)})
    rows = bench_selected.table_rows(args, results, bench.logits_mb, bench.grads_mb, bench._mb)
    assert [r[3] for r in rows] == ["100%", "20%"] * 2 and len(rows[0]) == len(bench_selected.COLUMNS)
    assert [r[10] for r in rows] == ["PASS", "PASS", "PASS", "FAIL"]  # 0.23 > 1.1 x 0.2
    assert rows[1][6] == "0.20" and rows[1][11] == "0e+00"
    with pytest.raises(SystemExit):
        bench.parse_args(["--selected", "--fractions", "0", "--device", "cpu"])


def test_hybrid_tables_ratios_against_attention():
    import bench_hybrid

    def cost(kind, n, cpu, peak, saved):
        return {"kind": kind, "tokens": n, "cpu_s": cpu, "wall_s": cpu + 1, "peak_mb": peak,
                "saved_mb": saved, "params": 2_500_000}

    results = {("attention", 1024): cost("attention", 1024, 2.0, 100.0, 80.0),
               ("hybrid", 1024): cost("hybrid", 1024, 4.0, 50.0, 20.0),
               ("hybrid-keep", 1024): cost("hybrid-keep", 1024, 1.0, 300.0, 240.0),
               ("attention", 4096): cost("attention", 4096, 16.0, 400.0, 320.0),
               ("hybrid", 4096): cost("hybrid", 4096, 8.0, 200.0, 80.0),
               ("hybrid-keep", 4096): cost("hybrid-keep", 4096, 4.0, 400.0, 320.0)}
    rows = bench_hybrid.cost_rows(results, [1024, 4096])
    assert [r[:2] for r in rows] == [[n, k] for n in ("1024", "4096") for k in ("attention", "hybrid",
                                                                             "hybrid-keep")]
    assert all(len(r) == len(bench_hybrid.COST_COLUMNS) for r in rows)
    # tokens/s from CPU time, x attention, ms / 1k tokens, peak, x, saved, x
    assert rows[1][5:] == ["256", "0.50", "4000", "50.0", "0.50", "20.0", "0.25"]
    assert rows[2][5:] == ["1024", "2.00", "1000", "300.0", "3.00", "240.0", "3.00"]
    assert rows[4][5:] == ["512", "2.00", "2000", "200.0", "0.50", "80.0", "0.25"]
    assert rows[3][6] == rows[3][9] == rows[3][11] == "1.00"

    gap = [{"precision": "bf16", "init_std": 0.02, "engine_decode": [3e-3, 4e-4], "hf_decode": [4e-3, 5e-4],
            "engine_hf": [1e-3, 1e-4], "mean_log_p": -6.95, "entropy": 6.9, "vocab": 1024}]
    assert bench_hybrid.gap_rows(gap) == [["bf16", "0.02", "3.0e-03", "4.0e-04", "4.0e-03", "5.0e-04",
                                           "1.0e-03", "1.0e-04", "-6.95", "6.90 / 6.93"]]


@pytest.mark.slow
def test_bench_hybrid_quick_runs_and_prints_tables():
    """``tools/bench_hybrid.py --quick``: both tables, every figure parses, and the engine's fp32
    log-probs (chunked rule) match transformers' recurrent decode loop (the bf16 gap is only printed)."""
    import bench_hybrid

    env = dict(os.environ, OMP_NUM_THREADS="1")
    script = os.path.join(REPO, "tools", "bench_hybrid.py")
    proc = subprocess.run([sys.executable, script, "--quick", "--markdown"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert any(line.startswith("machine:") and "cores" in line for line in lines)
    assert any(line.startswith("versions:") and "transformers" in line for line in lines)
    tables, previous = [], ""
    for line in lines:
        if line.startswith("| "):
            if not previous.startswith("|"):
                tables.append([])
            tables[-1].append([c.strip() for c in line.strip("|").split("|")])
        previous = line
    cost, gap = tables
    assert cost[0] == bench_hybrid.COST_COLUMNS and gap[0] == bench_hybrid.GAP_COLUMNS
    assert [r[:2] for r in cost[1:]] == [["256", k] for k in ("attention", "hybrid", "hybrid-keep")]
    for row in cost[1:]:
        assert all(float(c) > 0 for c in row[3:9] + row[10:]) and float(row[9]) >= 0, row
    assert [r[:2] for r in gap[1:]] == [["fp32", "0.02"], ["bf16", "0.02"]]
    fp32, bf16 = gap[1], gap[2]
    assert float(fp32[2]) < 1e-4 and float(fp32[4]) < 1e-4, f"fp32 train / decode gap: {fp32}"
    assert 0 <= float(bf16[3]) <= float(bf16[2]) < 0.5, bf16


def test_vlm_rows_plan_and_ratios_against_text():
    import bench_vlm

    images = bench_vlm.parse_images("224:4,448:1,112x224:2")
    assert images == [(224, 224, 4), (448, 448, 1), (112, 224, 2)]
    assert [bench_vlm.visual_tokens(h, w) for h, w, _ in images] == [64, 256, 32]
    with pytest.raises(SystemExit):
        bench_vlm.parse_args(["--images", "100:1"])  # not a multiple of 28
    with pytest.raises(SystemExit):
        bench_vlm.parse_args(["--images", "224:0"])
    with pytest.raises(SystemExit):
        bench_vlm.parse_args(["--images", "224:4", "--text-tokens", "12"])  # 4 start / end pairs + text
    # 224:4 and 448:1 have the same length (128 + 256): one text row for both; 112x224:2 its own
    plan = bench_vlm.row_plan(images, 128)
    assert plan == [("text", 0, False), ("text", 2, False), ("image", 0, False), ("image", 0, True),
                    ("image", 1, False), ("image", 1, True), ("image", 2, False), ("image", 2, True)]

    def res(kind, index, freeze, text, visual, cpu, peak, saved):
        return {"kind": kind, "index": index, "freeze": freeze, "text_tokens": text, "visual_tokens": visual,
                "cpu_s": cpu, "text_cpu_s": {0: 2.0, 2: 1.0}[index] * (1.25 if kind == "image" else 1),
                "wall_s": cpu + 1, "tower_s": 0.0 if kind == "text" else cpu / 4,
                "peak_mb": peak, "saved_mb": saved}

    results = [res("text", 0, False, 1536, 0, 2.0, 100.0, 80.0),
               res("text", 2, False, 768, 0, 1.0, 50.0, 40.0),
               res("image", 0, False, 512, 1024, 3.0, 150.0, 160.0),
               res("image", 0, True, 512, 1024, 2.5, 110.0, 80.0),
               res("image", 2, True, 512, 256, 0.5, 40.0, 20.0)]
    rows = bench_vlm.table_rows(results, images)
    assert all(len(r) == len(bench_vlm.COLUMNS) for r in rows)
    assert [r[:3] for r in rows] == [["text only", "idle", "1536 / 0"], ["text only", "idle", "768 / 0"],
                                     ["4 x 224x224", "trained", "512 / 1024"],
                                     ["4 x 224x224", "frozen", "512 / 1024"],
                                     ["2 x 112x224", "frozen", "512 / 256"]]
    # step s, x text (over the text steps of the row's process), wall, tower fwd, tokens/s, peak, x text,
    # saved, x text (over the text row of that length)
    assert rows[2][3:] == ["3.00", "1.20", "4.00", "0.750", "512", "150.0", "1.50", "160.0", "2.00"]
    assert rows[4][3:] == ["0.50", "0.40", "1.50", "0.125", "1536", "40.0", "0.80", "20.0", "0.50"]
    assert rows[0][4] == rows[0][9] == rows[0][11] == "1.00" and rows[0][6] == "0.000"


@pytest.mark.slow
def test_bench_vlm_quick_runs_and_prints_table():
    """``tools/bench_vlm.py --quick``: the text row and one image configuration trained and frozen,
    every figure parses, the image rows hold visual tokens and the same total as the text row, and the
    frozen tower keeps fewer activations for backward than the trained one."""
    import bench_vlm

    env = dict(os.environ, OMP_NUM_THREADS="1")
    script = os.path.join(REPO, "tools", "bench_vlm.py")
    proc = subprocess.run([sys.executable, script, "--quick", "--markdown"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert any(line.startswith("machine:") and "cores" in line for line in lines)
    assert any(line.startswith("versions:") and "transformers" in line for line in lines)
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in lines if line.startswith("| ")]
    assert rows[0] == bench_vlm.COLUMNS
    text, trained, frozen = rows[1:]
    assert [r[:2] for r in rows[1:]] == [["text only", "idle"], ["1 x 112x112", "trained"],
                                        ["1 x 112x112", "frozen"]]
    counts = [[int(n) for n in r[2].split(" / ")] for r in rows[1:]]
    assert counts[0][1] == 0 and counts[1] == counts[2] and counts[1][1] == 16 * 2  # 2 samples x 16 tokens
    assert sum(counts[0]) == sum(counts[1]), "the text row must hold as many tokens as the image rows"
    for row in rows[1:]:
        assert all(float(c) > 0 for i, c in enumerate(row[3:], 3) if i != 6), row
    assert text[4] == text[9] == text[11] == "1.00"
    assert float(text[6]) == 0 and float(trained[6]) > 0, "the tower runs on image batches only"
    assert float(frozen[10]) < float(trained[10]), f"saved MB: {frozen[10]} frozen, {trained[10]} trained"
