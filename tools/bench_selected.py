"""The selected-rows table of ``tools/bench.py --selected``: one training step's lm-head + processor
from hidden states ``[N, H]`` and the lm-head shard ``[V_local, H]``, on every row ("full") or only on
the response rows (``outputs_on_loss_mask_only``: ``RowSelection`` gathers them before the lm-head and
scatters the outputs back into zeros), for response fractions f (the last f of every 512-token block).

Paths: "logits" forms ``h @ weight.T`` inside the step and runs ``process_lm_head_logits``; "fused"
runs ``process_lm_head_hidden`` (never the logits). Work memory = peak above the inputs minus the
gradients of hidden and weight ((N + V_local) H dtype bytes, which a training step accumulates into
preallocated buffers whatever the rows). Target: selected / full <= 1.1 f for work memory and CPU time.
"agree": largest relative difference of the output sums over the response rows, selected vs full.
"""

from __future__ import annotations

PATHS = {"logits": "head", "fused": "fused-head"}
TARGET_SLACK = 1.1
COLUMNS = ["cfg", "path", "TP", "response", "full work MB (xL)", "selected work MB (xL)", "mem sel/full",
           "full ms (cpu)", "selected ms (cpu)", "time sel/full (cpu)", f"<= {TARGET_SLACK} x response",
           "agree"]


def measure_all(args, measure_spec) -> dict:
    """``measure_spec(impl, cfg, tp, fractions, select)`` for every row of the table."""
    results = {}
    for tp in args.tp:
        for cfg in args.configs:
            for path, impl in PATHS.items():
                results[(cfg, path, tp, None)] = measure_spec(impl, cfg, tp, args.fractions, None)
                for f in args.fractions:
                    results[(cfg, path, tp, f)] = measure_spec(impl, cfg, tp, args.fractions, f)
    return results


def _agree(full: list[dict], sel: list[dict], f: float) -> float:
    worst = 0.0
    for a, b in zip(sel, full, strict=True):
        for key in (k for k in b if k.endswith(f"@{f}")):
            worst = max(worst, abs(a[key] - b[key]) / max(abs(b[key]), 1e-30))
    return worst


def table_rows(args, results: dict, logits_mb, grads_mb, describe) -> list[list[str]]:
    rows = []
    for tp in args.tp:
        xl, grads = logits_mb(args, tp), grads_mb(args, tp)
        for cfg in args.configs:
            for path in PATHS:
                full = results[(cfg, path, tp, None)]
                for f in args.fractions:
                    sel = results[(cfg, path, tp, f)]
                    if "oom" in full or "oom" in sel:
                        rows.append([cfg, path, str(tp), f"{f:.0%}"] + ["OOM"] * (len(COLUMNS) - 4))
                        continue
                    work_full, work_sel = full["peak_mb"] - grads, sel["peak_mb"] - grads
                    mem, cpu = work_sel / max(work_full, 1e-9), sel["cpu_ms"] / full["cpu_ms"]
                    rows.append([
                        cfg, path, str(tp), f"{f:.0%}", describe(work_full, xl), describe(work_sel, xl),
                        f"{mem:.2f}", f"{full['time_ms']:.0f} ({full['cpu_ms']:.0f})",
                        f"{sel['time_ms']:.0f} ({sel['cpu_ms']:.0f})",
                        f"{sel['time_ms'] / full['time_ms']:.2f} ({cpu:.2f})",
                        "PASS" if max(mem, cpu) <= TARGET_SLACK * f else "FAIL",
                        f"{_agree(full['checks'], sel['checks'], f):.0e}"])
    return rows
