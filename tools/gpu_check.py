"""GPU check of the chunk kernels and the fused lm-head: a few minutes, one markdown table.

    python tools/gpu_check.py [--tests] [--tokens 32768] [--vocab 152064] [--hidden 4096] [--smoke]

Kernels on ``[tokens, vocab]`` bf16 logits (TB/s, fraction of copy bandwidth, vs torch); fused lm-head
fwd + bwd (TFLOP/s over four ``2 N V H`` matmuls, peak memory). ``--smoke``: CPU, ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

import torch
from mcore_engine_kernels.backward import chunk_grad
from mcore_engine_kernels.forward import chunk_stats, row_max
from mcore_engine_kernels.layout import Coefficients, StatLayout

from mcore_engine.ops import stats as ts
from mcore_engine.ops.lm_head import fused_lm_head_outputs


def _timer(device: torch.device) -> Callable[[Callable[[], object], int], float]:
    """Median seconds of ``fn()`` over ``repeats`` runs after one warm-up (CUDA events on GPU)."""

    def run(fn: Callable[[], object], repeats: int) -> float:
        fn()
        times = []
        for _ in range(repeats):
            if device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                torch.cuda.synchronize()
                times.append(start.elapsed_time(end) / 1e3)
            else:
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
        return statistics.median(times)

    return run


def _baselines(timed, device: torch.device, n: int, v: int, h: int, reps: int) -> tuple[float, float, list]:
    """The device's copy bandwidth (B/s, read + write) and bf16 matmul rate (FLOP/s), with table rows."""
    src = torch.empty(max(n * v, 2**20), dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    copy_s = timed(lambda: dst.copy_(src), reps)
    copy_bw = 2 * src.numel() * src.element_size() / copy_s
    mm = min(8192, max(h, 64))
    a = torch.randn(mm, mm, device=device).bfloat16()
    mm_s = timed(lambda: a @ a, reps)
    mm_rate = 2 * mm**3 / mm_s
    rows = [["copy (bf16)", f"{copy_s * 1e3:.2f}", f"{copy_bw / 1e12:.2f} TB/s", "1.00", ""],
            [f"matmul {mm}^3 (bf16)", f"{mm_s * 1e3:.2f}", f"{mm_rate / 1e12:.1f} TFLOP/s", "1.00", ""]]
    return copy_bw, mm_rate, rows


def _kernel_rows(timed, device: torch.device, n: int, v: int, k: int, reps: int, copy_bw: float) -> list:
    """Each kernel on one ``[n, v]`` bf16 chunk: time, achieved TB/s, fraction of copy bandwidth, speed-up."""
    x = (torch.randn(n, v, device=device) * 3).bfloat16()
    t = torch.rand(n, device=device) + 0.5
    ids = torch.randint(0, v, (n, k), device=device)
    labels = torch.randint(0, v, (n,), device=device)
    lay = StatLayout(entropy=True, sum_pi_squared=True, label=True, k=k, tail=True)
    label, teacher = ts.local_columns(labels, 0, v), ts.local_columns(ids, 0, v)
    m = row_max(x, t)
    out = torch.empty(n, lay.width, device=device)
    inv_s = torch.rand(n, device=device)
    a, b, mu, c2, a_tail = (torch.randn(n, device=device) for _ in range(5))
    coef = Coefficients(inv_s=inv_s, a=a, b=b, mu=mu, c2=c2, cols=torch.cat([labels[:, None], ids], 1),
                        vals=torch.randn(n, k + 1, device=device), a_tail=a_tail, tail_cols=ids)
    grad = torch.empty_like(x)
    nbytes = x.numel() * x.element_size()

    def torch_grad():
        gz = ts.chunk_grad(ts.shifted(x, t, m), coef)
        grad.copy_(gz.div_(t[:, None]))

    cases = [
        ("row_max", lambda: row_max(x, t), lambda: ts.row_max(x, t), nbytes),
        (f"chunk_stats (all, k={k}, tail)",
         lambda: chunk_stats(x, t, m, lay, out, label=label, teacher=teacher),
         lambda: ts.chunk_stats(ts.shifted(x, t, m), lay, out, label=label, teacher=teacher), nbytes),
        (f"chunk_grad ({k + 1} points, tail)",
         lambda: chunk_grad(x, t, m, coef, grad),
         torch_grad, 2 * nbytes),
    ]
    rows = []
    for name, fast, ref, moved in cases:
        fast_s, ref_s = timed(fast, reps), timed(ref, reps)
        rows.append([name, f"{fast_s * 1e3:.2f}", f"{moved / fast_s / 1e12:.2f} TB/s",
                     f"{moved / fast_s / copy_bw:.2f}", f"{ref_s / fast_s:.1f}x"])
    return rows


def _lm_head_row(timed, device: torch.device, args: argparse.Namespace, mm_rate: float) -> list:
    """Fused lm-head fwd+bwd (log-probs + entropy, per-token temperature): TFLOP/s and peak memory."""
    n, v, h = args.tokens, args.vocab, args.hidden
    hidden = torch.randn(n, h, device=device).bfloat16().requires_grad_()
    weight = (torch.randn(v, h, device=device) / h**0.5).bfloat16().requires_grad_()
    labels = torch.randint(0, v, (n,), device=device)
    t = torch.rand(n, device=device) + 0.5
    upstream = torch.randn(n, device=device)

    def run():
        res = fused_lm_head_outputs(hidden, weight, labels=labels, entropy=True, temperature=t,
                                    chunk_size=args.lm_head_chunk)
        torch.autograd.backward([res["log_probs"], res["entropy"]], [upstream, upstream])
        hidden.grad = weight.grad = None

    peak = "n/a"
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        run()
        torch.cuda.synchronize()
        peak = f"peak +{(torch.cuda.max_memory_allocated() - base) / (n * v * 2):.2f}x bf16 logits"
    secs = timed(run, max(1, args.repeats // 2))
    flops = 4 * 2 * n * v * h  # forward logits, backward recompute, grad hidden, grad weight
    return [f"fused lm-head fwd+bwd (H={h}, chunk {args.lm_head_chunk})", f"{secs * 1e3:.1f}",
            f"{flops / secs / 1e12:.1f} TFLOP/s", f"{flops / secs / mm_rate:.2f}", peak]


def _rows(args: argparse.Namespace, device: torch.device) -> list[list[str]]:
    timed = _timer(device)
    torch.manual_seed(0)
    copy_bw, mm_rate, rows = _baselines(timed, device, args.tokens, args.vocab, args.hidden, args.repeats)
    rows += _kernel_rows(timed, device, args.tokens, args.vocab, args.k, args.repeats, copy_bw)
    rows.append(_lm_head_row(timed, device, args, mm_rate))
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=32768)
    p.add_argument("--vocab", type=int, default=152064)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--k", type=int, default=32)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--lm-head-chunk", type=int, default=2048, help="rows per chunk of the fused lm-head")
    p.add_argument("--tests", action="store_true", help="run pytest tests/kernels on the GPU first")
    p.add_argument("--smoke", action="store_true", help="tiny CPU shapes under the interpreter")
    args = p.parse_args(argv)
    if args.smoke:
        if os.environ.get("TRITON_INTERPRET") != "1":
            sys.exit("--smoke needs TRITON_INTERPRET=1 in the environment (set before Triton is imported)")
        args.tokens, args.vocab, args.hidden, args.k, args.repeats, args.lm_head_chunk = 8, 300, 16, 4, 1, 4
        device = torch.device("cpu")
    elif not torch.cuda.is_available():
        sys.exit("no CUDA device: use --smoke for a CPU wiring check")
    else:
        device = torch.device("cuda")
    if args.tests:
        subprocess.run([sys.executable, "-m", "pytest", "-q", "tests/kernels"], check=True)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (interpreter smoke)"
    print(f"## Kernel GPU check: {name}, {datetime.date.today()}, torch {torch.__version__}, "
          f"N={args.tokens}, V={args.vocab}, bf16\n")
    print("| what | ms | achieved | of device peak | vs torch path |")
    print("|---|---|---|---|---|")
    for row in _rows(args, device):
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
