"""Benchmark: peak memory and time of forward+backward over the lm-head logits, ours vs the naive path.

    python tools/bench.py                      # N=4096 tokens, V_local=32768, fp32, T=0.7, k=32, TP=1,2
    python tools/bench.py --markdown           # the same table as markdown (README)
    python tools/bench.py --quick              # small sizes, seconds (smoke test)

Configurations (flags of ``process_lm_head_logits``): (A) log-probs, (B) + entropy, (C) + sum-pi²,
(D) top-k KL with ``distillation_only``, (E) top-k KL + log-probs + entropy. "ours" is
``mcore_engine.processor.process_lm_head_logits``; "naive" is ``tools/bench_naive.py``, the upstream
path (whole-tensor fp32 upcast + temperature division, Megatron-Core ``vocab_parallel_cross_entropy``
on a clone, softmax-saving entropy, sum-pi² by plain autograd, probability-saving top-k KL).

Method (details in ``tools/bench_worker.py``): every (configuration, implementation, TP) runs in
FRESH processes, one per TP rank (gloo on CPU, NCCL on CUDA), twice. Memory process: one
forward+backward; CPU: VmHWM - VmRSS above the inputs, started with
``MALLOC_MMAP_THRESHOLD_=65536 MALLOC_TRIM_THRESHOLD_=0`` so RSS tracks live buffers; CUDA:
``max_memory_allocated`` above the inputs. Time process (allocator as users have it): median of
``--repeats`` steps after a warm-up step. Per-rank figures; the
table shows the max over ranks. "xL" is a multiple of this rank's logits bytes
(tokens x V_local x dtype size); the gradient of the logits (1 xL) is part of every peak.
Times show wall and, in parentheses, the process's CPU time (robust on a shared machine).
Targets (PASS/FAIL columns): ours peak <= 1.25 xL in every configuration, ours <= 0.5 x naive peak
in E, ours time <= 1.0 x naive.
The "agree" column is the largest relative difference between ours and naive over the sums of the
outputs and the gradient norm (a check that both compute the same thing).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import subprocess
import sys
from importlib import metadata

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)

from bench_worker import CONFIGS  # noqa: E402

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
MEM_TARGET_X_LOGITS = 1.25
MEM_TARGET_E_RATIO = 0.5
TIME_TARGET_RATIO = 1.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=4096, help="N, tokens per rank")
    p.add_argument("--vocab", type=int, default=32768, help="V_local, vocab shard width per rank")
    p.add_argument("--dtype", choices=sorted(DTYPE_BYTES), default="fp32")
    p.add_argument("--tp", default="1,2", help="comma-separated tensor-parallel sizes")
    p.add_argument("--configs", default="A,B,C,D,E", help="comma-separated subset of A,B,C,D,E")
    p.add_argument("--repeats", type=int, default=3, help="timed steps per time process (median)")
    p.add_argument("--k", type=int, default=32, help="teacher top-k")
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--device", default="auto", help="auto | cpu | cuda")
    p.add_argument("--chunk-size", type=int, default=None, help="rows per chunk for ours (default: the ops')")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--quick", action="store_true", help="small sizes (N=256, V_local=2048), 1 repeat")
    p.add_argument("--markdown", action="store_true", help="print the table as markdown")
    p.add_argument("--time-env", action="append", default=[], metavar="KEY=VALUE",
                   help="extra environment of the time processes (both implementations), e.g. "
                        "MALLOC_TRIM_THRESHOLD_=268435456 to see the times without glibc trimming churn")
    p.add_argument("--timeout", type=int, default=600, help="seconds per worker process")
    args = p.parse_args(argv)
    if args.quick:
        args.tokens, args.vocab, args.repeats = 256, 2048, 1
    args.tp = [int(t) for t in args.tp.split(",")]
    args.configs = [c.strip().upper() for c in args.configs.split(",")]
    bad = [c for c in args.configs if c not in CONFIGS]
    if bad:
        p.error(f"--configs: unknown {bad}, expected a subset of {sorted(CONFIGS)}")
    for name in ("tokens", "vocab", "repeats", "k"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1")
    if any(t < 1 for t in args.tp):
        p.error("--tp: sizes must be >= 1")
    if any("=" not in kv for kv in args.time_env):
        p.error("--time-env: expected KEY=VALUE")
    args.time_env = dict(kv.split("=", 1) for kv in args.time_env)
    if args.device == "auto":
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    return args


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_workers(spec: dict, timeout: int, extra_env: dict[str, str] | None = None) -> list[dict]:
    """Start ``spec['tp']`` fresh worker processes (one per rank); return their JSON results."""
    path = os.pathsep.join(filter(None, [HERE, os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), WORLD_SIZE=str(spec["tp"]),
               OMP_NUM_THREADS="1", PYTHONPATH=path)
    for key in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_"):
        env.pop(key, None)
    if spec["mode"] == "memory":  # every buffer > 64 KiB its own mmap: RSS tracks live tensors
        env.update(MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0")
    env.update(extra_env or {})
    procs = [subprocess.Popen([sys.executable, os.path.join(HERE, "bench_worker.py"), json.dumps(spec)],
                              env=dict(env, RANK=str(r)), cwd=REPO, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in range(spec["tp"])]
    results, errors = [], []
    for r, proc in enumerate(procs):
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for other in procs:
                other.kill()
            out, err = proc.communicate()
            errors.append(f"rank {r}: timed out after {timeout} s")
            continue
        if proc.returncode != 0:
            errors.append(f"rank {r}: exit {proc.returncode}\n{err[-3000:]}")
            continue
        results.append(json.loads(out.strip().splitlines()[-1]))
    if errors:
        what = f"{spec['impl']} {spec['config']} tp={spec['tp']} {spec['mode']}"
        raise RuntimeError(f"{what}: " + "\n".join(errors))
    return results


def measure(args: argparse.Namespace, config: str, impl: str, tp: int) -> dict:
    """Memory and time of one (configuration, implementation, TP) in fresh processes; max over ranks."""
    spec = dict(impl=impl, config=config, tokens=args.tokens, vocab=args.vocab, dtype=args.dtype, tp=tp,
                k=args.k, temperature=args.temperature, repeats=args.repeats, seed=args.seed,
                device=args.device, chunk_size=args.chunk_size)
    mem = run_workers(dict(spec, mode="memory"), args.timeout)
    tim = run_workers(dict(spec, mode="time"), args.timeout, args.time_env)
    mem = sorted(mem, key=lambda r: r["rank"])
    return {"peak_mb": max(r["peak_mb"] for r in mem), "time_ms": max(r["time_ms"] for r in tim),
            "cpu_ms": max(r["cpu_ms"] for r in tim), "checks": [r["checks"] for r in mem]}


def agreement(ours: list[dict], naive: list[dict]) -> float:
    """Largest relative difference of the per-rank output sums and gradient norms."""
    worst = 0.0
    for a, b in zip(ours, naive, strict=True):
        for key in b.keys() & a.keys():
            worst = max(worst, abs(a[key] - b[key]) / max(abs(b[key]), 1e-30))
    return worst


def _proc_field(path: str, key: str) -> str | None:
    """The value of the first ``key: value`` line of a /proc file, or None."""
    try:
        with open(path) as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith(key)), None)
    except OSError:
        return None


def header(args: argparse.Namespace, load: tuple[float, float]) -> list[str]:
    import torch

    cpu = _proc_field("/proc/cpuinfo", "model name") or platform.processor() or "unknown"
    mem_kb = _proc_field("/proc/meminfo", "MemTotal")
    mem_gib = int(mem_kb.split()[0]) / 2**20 if mem_kb else float("nan")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    gpu = f", GPU {torch.cuda.get_device_name(0)}" if args.device == "cuda" else ""
    try:
        mcore = metadata.version("megatron-core")
    except metadata.PackageNotFoundError:
        mcore = "not installed"
    logits_mb = args.tokens * args.vocab * DTYPE_BYTES[args.dtype] / 2**20
    return [
        f"machine: {cores} cores ({cpu}), {mem_gib:.1f} GiB RAM{gpu}; device {args.device}",
        f"versions: python {platform.python_version()}, torch {torch.__version__}, megatron-core {mcore}",
        f"size per rank: N={args.tokens} tokens x V_local={args.vocab} {args.dtype} logits = "
        f"{logits_mb:.0f} MB (1 xL); T={args.temperature}, k={args.k}, repeats={args.repeats}; "
        f"one thread per rank; ours chunk_size={args.chunk_size or 'default'}"
        + (f"; time-process env {args.time_env}" if args.time_env else ""),
        "peak = memory above the inputs over one forward+backward (max over ranks); time = median step, "
        "wall (process CPU time); the time target uses wall",
        f"load average (1 min) at start / end: {load[0]:.1f} / {load[1]:.1f}"
        + (f"  -- BUSY MACHINE (> {cores} cores): wall times are inflated, compare the cpu figures"
           if max(load) > cores else ""),
    ]


def _pass(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


def table_rows(args: argparse.Namespace, results: dict) -> list[list[str]]:
    logits_mb = args.tokens * args.vocab * DTYPE_BYTES[args.dtype] / 2**20
    rows = []
    for tp in args.tp:
        for cfg in args.configs:
            ours, naive = results[(cfg, "ours", tp)], results[(cfg, "naive", tp)]
            mem_ratio = ours["peak_mb"] / max(naive["peak_mb"], 1e-9)
            time_ratio = ours["time_ms"] / naive["time_ms"]
            rows.append([
                cfg, CONFIGS[cfg]["desc"], str(tp),
                f"{ours['peak_mb']:.0f} ({ours['peak_mb'] / logits_mb:.2f}x)",
                f"{naive['peak_mb']:.0f} ({naive['peak_mb'] / logits_mb:.2f}x)", f"{mem_ratio:.2f}",
                f"{ours['time_ms']:.0f} ({ours['cpu_ms']:.0f})",
                f"{naive['time_ms']:.0f} ({naive['cpu_ms']:.0f})",
                f"{time_ratio:.2f} ({ours['cpu_ms'] / naive['cpu_ms']:.2f})",
                _pass(ours["peak_mb"] <= MEM_TARGET_X_LOGITS * logits_mb),
                _pass(mem_ratio <= MEM_TARGET_E_RATIO) if cfg == "E" else "-",
                _pass(time_ratio <= TIME_TARGET_RATIO),
                f"{agreement(ours['checks'], naive['checks']):.0e}",
            ])
    return rows


COLUMNS = ["cfg", "outputs", "TP", "ours peak MB (xL)", "naive peak MB (xL)", "mem ours/naive",
           "ours ms (cpu)", "naive ms (cpu)", "time ours/naive (cpu)", f"mem<={MEM_TARGET_X_LOGITS}xL",
           f"E mem<={MEM_TARGET_E_RATIO}x", f"time<={TIME_TARGET_RATIO}x", "agree"]


def format_table(rows: list[list[str]], markdown: bool) -> str:
    if markdown:
        lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "|".join("---" for _ in COLUMNS) + "|"]
        return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])
    widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(COLUMNS)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return "\n".join([fmt.format(*COLUMNS), fmt.format(*("-" * w for w in widths))]
                     + [fmt.format(*r) for r in rows])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    load_start = os.getloadavg()[0]
    results = {}
    for tp in args.tp:
        for cfg in args.configs:
            for impl in ("ours", "naive"):
                print(f"[bench] tp={tp} config {cfg} {impl} ...", file=sys.stderr, flush=True)
                results[(cfg, impl, tp)] = measure(args, cfg, impl, tp)
    prefix = "" if not args.markdown else "- "
    print("\n".join(prefix + line for line in header(args, (load_start, os.getloadavg()[0]))))
    print()
    print(format_table(table_rows(args, results), args.markdown))
    return 0


if __name__ == "__main__":
    sys.exit(main())
