"""Benchmark: peak memory and time of the lm-head outputs' forward+backward: ours, naive and fused.

    python tools/bench.py                      # N=4096 tokens, V_local=32768, fp32, T=0.7, k=32, TP=1,2
    python tools/bench.py --markdown           # the same table as markdown (README)
    python tools/bench.py --quick              # small sizes, seconds (smoke test)
    python tools/bench.py --realistic          # GPU only: N=32768, vocab 152064 / TP, H=4096, bf16, A and E

Configurations: (A) log-probs, (B) + entropy, (C) + sum-pi², (D) top-k KL with ``distillation_only``,
(E) top-k KL + log-probs + entropy. "ours": ``process_lm_head_logits``; "naive": ``tools/bench_naive.py``
(the upstream path); "fused": ``process_lm_head_hidden`` from ``hidden [N, H]`` and the shard
``[V_local, H]``, its time including the lm-head matmuls whose output the logits paths get as input.

Each (configuration, implementation, TP) runs in fresh processes, one per rank (method:
``tools/bench_worker.py``); the table shows the max over ranks. "xL": multiples of this rank's logits
bytes (N x V_local x dtype size; the logits' gradient, 1 xL, is in the logits paths' peaks). Times:
wall (process CPU time). "fused peak" includes the hidden / weight gradients ((N + V_local) x H x
dtype size), "fused work" excludes them. Targets: ours peak <= 1.25 xL, ours <= 0.5 x naive peak in
E, ours time <= 1.0 x naive, fused peak < 0.1 xL (default CPU size). "agree": largest relative
difference to naive over output sums and gradient norms. "OOM": CUDA out of memory.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)

from bench_common import format_table, machine_header, usable_cores  # noqa: E402
from bench_worker import CONFIGS  # noqa: E402

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
MEM_TARGET_X_LOGITS = 1.25
MEM_TARGET_E_RATIO = 0.5
TIME_TARGET_RATIO = 1.0
FUSED_TARGET_X_LOGITS = 0.1
IMPLS = ("ours", "naive", "fused")
REALISTIC = dict(tokens=32768, vocab_global=152064, hidden=4096, dtype="bf16", configs="A,E")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=4096, help="N, tokens per rank")
    p.add_argument("--vocab", type=int, default=32768, help="V_local, vocab shard width per rank")
    p.add_argument("--hidden", type=int, default=256, help="H, hidden size of the fused path's inputs")
    p.add_argument("--dtype", choices=sorted(DTYPE_BYTES), default="fp32")
    p.add_argument("--tp", default=None, help="comma-separated tensor-parallel sizes (default 1,2; on CUDA "
                                               "the sizes that fit the visible GPUs)")
    p.add_argument("--configs", default="A,B,C,D,E", help="comma-separated subset of A,B,C,D,E")
    p.add_argument("--repeats", type=int, default=3, help="timed steps per time process (median)")
    p.add_argument("--k", type=int, default=32, help="teacher top-k")
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--device", default="auto", help="auto | cpu | cuda")
    p.add_argument("--chunk-size", type=int, default=None, help="rows per chunk for ours (default: the ops')")
    p.add_argument("--fused-chunk-size", type=int, default=None,
                   help="rows per chunk for fused (default: the lm-head's)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--quick", action="store_true", help="small sizes (N=256, V_local=2048, H=64), 1 repeat")
    p.add_argument("--realistic", action="store_true",
                   help="GPU only: N=32768, global vocab 152064 (V_local = 152064 / TP), H=4096, bf16, "
                        "configurations A and E")
    p.add_argument("--markdown", action="store_true", help="print the table as markdown")
    p.add_argument("--single-process", action="store_true",
                   help="CPU: time in the memory process (after its memory step; half the process starts, "
                        "times under the memory allocator settings; for smoke tests). Always so on CUDA")
    p.add_argument("--time-env", action="append", default=[], metavar="KEY=VALUE",
                   help="extra environment of the time processes (all implementations), e.g. "
                        "MALLOC_TRIM_THRESHOLD_=268435456 to see the times without glibc trimming churn")
    p.add_argument("--timeout", type=int, default=600, help="seconds per worker process")
    p.add_argument("--moe", action="store_true",
                   help="the mixture-of-experts table instead (tools/bench_moe.py: dense vs MoE at EP=1 / "
                        "EP=2, one train_batch step; --quick applies)")
    p.add_argument("--sp", action="store_true",
                   help="the sequence-parallelism table instead (tools/bench_moe.py --sp: TP=2 with / "
                        "without SP, MoE at TP=2 + SP, one train_batch step; --quick applies)")
    p.add_argument("--deepseek", action="store_true",
                   help="the DeepSeek-V3 row of the MoE table (tools/bench_moe.py --deepseek: MLA, grouped "
                        "sigmoid routing, shared expert vs the Qwen3-MoE of the same active parameters)")
    p.add_argument("--cp", action="store_true",
                   help="the context-parallelism table instead (tools/bench_cp.py: one long sequence at "
                        "CP=1 / CP=2, the SDPA core attention vs Megatron's local attention)")
    p.add_argument("--lora", action="store_true",
                   help="the LoRA table instead (tools/bench_lora.py: rank 8 / 64 vs full fine-tuning: "
                        "grad + optimizer memory, step time, weight-sync bytes)")
    p.add_argument("--selected", action="store_true",
                   help="the selected-rows table instead (tools/bench_selected.py): lm-head + processor "
                        "on every row vs only the response rows (outputs_on_loss_mask_only)")
    p.add_argument("--fractions", default="1,0.5,0.2", help="--selected: response fractions of the tokens")
    args = p.parse_args(argv)
    if args.quick and args.realistic:
        p.error("--quick and --realistic exclude each other")
    args.vocab_global = None
    if args.quick:
        args.tokens, args.vocab, args.hidden, args.repeats = 256, 2048, 64, 1
    if args.realistic:
        args.tokens, args.vocab_global, args.hidden = REALISTIC["tokens"], REALISTIC["vocab_global"], \
            REALISTIC["hidden"]
        args.dtype, args.configs = REALISTIC["dtype"], REALISTIC["configs"]
    try:
        args.fractions = [float(f) for f in args.fractions.split(",")]
    except ValueError:
        p.error(f"--fractions: expected comma-separated numbers, got {args.fractions!r}")
    if any(not 0 < f <= 1 for f in args.fractions):
        p.error("--fractions: each fraction must be in (0, 1]")
    args.configs = [c.strip().upper() for c in args.configs.split(",")]
    bad = [c for c in args.configs if c not in CONFIGS]
    if bad:
        p.error(f"--configs: unknown {bad}, expected a subset of {sorted(CONFIGS)}")
    for name in ("tokens", "vocab", "hidden", "repeats", "k"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1")
    for name in ("chunk_size", "fused_chunk_size"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if any("=" not in kv for kv in args.time_env):
        p.error("--time-env: expected KEY=VALUE")
    args.time_env = dict(kv.split("=", 1) for kv in args.time_env)
    import torch

    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.realistic and args.device != "cuda":
        p.exit(2, "bench.py: --realistic needs a CUDA device: its bf16 logits alone are 32768 x 152064 x 2 B "
                  "= 10 GB per copy and the naive path holds several fp32 copies. On CPU use the defaults "
                  "or --quick.\n")
    n_gpu = torch.cuda.device_count() if args.device == "cuda" else 0
    if args.tp is None:  # NCCL needs one GPU per rank
        args.tp = "1,2" if args.device != "cuda" or n_gpu >= 2 else "1"
    try:
        args.tp = [int(t) for t in args.tp.split(",")]
    except ValueError:
        p.error(f"--tp: expected comma-separated integers, got {args.tp!r}")
    if any(t < 1 for t in args.tp):
        p.error("--tp: sizes must be >= 1")
    if args.device == "cuda" and max(args.tp) > n_gpu:
        p.error(f"--tp {max(args.tp)} needs as many GPUs (NCCL: one per rank), {n_gpu} visible")
    if args.vocab_global is not None and any(args.vocab_global % t for t in args.tp):
        p.error(f"--tp: every size must divide the vocab {args.vocab_global}")
    return args


def vocab_local(args: argparse.Namespace, tp: int) -> int:
    """V_local at this TP size: ``--vocab`` as given, or the realistic global vocab split over TP."""
    return args.vocab if args.vocab_global is None else args.vocab_global // tp


def logits_mb(args: argparse.Namespace, tp: int) -> float:
    """1 xL: the bytes of this rank's logits [N, V_local] in the compute dtype, in MB."""
    return args.tokens * vocab_local(args, tp) * DTYPE_BYTES[args.dtype] / 2**20


def grads_mb(args: argparse.Namespace, tp: int) -> float:
    """The fused path's unavoidable outputs: grad hidden [N, H] + grad weight [V_local, H], in MB."""
    return (args.tokens + vocab_local(args, tp)) * args.hidden * DTYPE_BYTES[args.dtype] / 2**20


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
    if spec["mode"] == "memory" or (spec["mode"] == "both" and spec["device"] == "cpu"):
        # every buffer > 64 KiB its own mmap: RSS tracks live tensors
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


def measure(args: argparse.Namespace, config: str, impl: str, tp: int, **extra) -> dict:
    """Memory and time of one (configuration, implementation, TP), max over ranks: a memory and a time
    process on CPU, one process on CUDA / ``--single-process``; ``{"oom": message}`` on CUDA OOM."""
    spec = dict(impl=impl, config=config, tokens=args.tokens, vocab=vocab_local(args, tp), hidden=args.hidden,
                dtype=args.dtype, tp=tp, k=args.k, temperature=args.temperature, repeats=args.repeats,
                seed=args.seed, device=args.device, chunk_size=args.chunk_size,
                fused_chunk_size=args.fused_chunk_size, **extra)
    if args.device == "cuda" or args.single_process:
        mem = tim = run_workers(dict(spec, mode="both"), args.timeout, args.time_env)
    else:
        mem = run_workers(dict(spec, mode="memory"), args.timeout)
        tim = run_workers(dict(spec, mode="time"), args.timeout, args.time_env)
    oom = [r["oom"] for r in mem + tim if "oom" in r]
    if oom:
        return {"oom": oom[0]}
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


def header(args: argparse.Namespace, load: tuple[float, float]) -> list[str]:
    cores = usable_cores()
    sizes = "; ".join(
        f"TP={tp}: V_local={vocab_local(args, tp)}, logits {logits_mb(args, tp):.0f} MB (1 xL), fused grads "
        f"{grads_mb(args, tp):.0f} MB ({grads_mb(args, tp) / logits_mb(args, tp):.3f} xL)" for tp in args.tp)
    return [
        *machine_header(extra=f"; device {args.device}"),
        f"size per rank: N={args.tokens} tokens, H={args.hidden}, {args.dtype}; {sizes}; "
        f"T={args.temperature}, k={args.k}, repeats={args.repeats}; "
        + ("one thread per rank; " if args.device == "cpu" else "")
        + f"ours chunk_size={args.chunk_size or 'default'}, "
        f"fused chunk_size={args.fused_chunk_size or 'default'}"
        + (f"; time-process env {args.time_env}" if args.time_env else ""),
        "peak = memory above the inputs over one forward+backward (max over ranks), MB and (x logits bytes); "
        "time = median step, wall (process CPU time); the time targets use wall",
        "ours / naive: inputs are the logits [N, V_local] = hidden @ weight.T, built before the step; "
        "their peak includes logits.grad (1 xL). fused: inputs hidden [N, H] + weight [V_local, H], never "
        "the logits; its time includes the lm-head matmuls",
        "fused peak (i) = everything above its inputs, incl. grad hidden + grad weight ((N + V_local) H "
        f"dtype bytes); fused work (ii) = (i) minus those gradients; target (i) < {FUSED_TARGET_X_LOGITS} xL",
        f"load average (1 min) at start / end: {load[0]:.1f} / {load[1]:.1f}"
        + (f"  -- BUSY MACHINE (> {cores} cores): wall times are inflated, compare the cpu figures"
           if args.device == "cpu" and max(load) > cores else ""),
    ]


def _pass(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


def _mb(mb: float, xl: float) -> str:
    return f"{mb:.0f} ({mb / xl:.2f}x)" if mb / xl >= 0.1 else f"{mb:.1f} ({mb / xl:.3f}x)"


def table_rows(args: argparse.Namespace, results: dict) -> list[list[str]]:
    rows = []
    for tp in args.tp:
        xl, grads = logits_mb(args, tp), grads_mb(args, tp)
        for cfg in args.configs:
            res = {impl: results[(cfg, impl, tp)] for impl in IMPLS}
            rows.append([cfg, CONFIGS[cfg]["desc"], str(tp)] + _row_figures(cfg, res, xl, grads))
    return rows


def _row_figures(cfg: str, res: dict[str, dict], xl: float, grads: float) -> list[str]:
    """The measured columns of one (configuration, TP) row; "OOM" / "-" where a run ran out of memory."""
    ok = {impl: "oom" not in r for impl, r in res.items()}
    ours, naive, fused = res["ours"], res["naive"], res["fused"]
    peak = {impl: _mb(r["peak_mb"], xl) if ok[impl] else "OOM" for impl, r in res.items()}
    ms = {impl: f"{r['time_ms']:.0f} ({r['cpu_ms']:.0f})" if ok[impl] else "OOM" for impl, r in res.items()}

    def vs_naive(impl: str, fmt) -> str:
        return fmt(res[impl]) if ok[impl] and ok["naive"] else "-"

    def time_ratio(r: dict) -> str:
        return f"{r['time_ms'] / naive['time_ms']:.2f} ({r['cpu_ms'] / naive['cpu_ms']:.2f})"

    def agree(r: dict) -> str:
        return f"{agreement(r['checks'], naive['checks']):.0e}"

    def mem_ratio(r: dict) -> str:
        return f"{r['peak_mb'] / max(naive['peak_mb'], 1e-9):.2f}"

    def mem_e(r: dict) -> str:
        return _pass(r["peak_mb"] <= MEM_TARGET_E_RATIO * naive["peak_mb"]) if cfg == "E" else "-"

    return [
        peak["ours"], peak["naive"], vs_naive("ours", mem_ratio),
        peak["fused"], _mb(fused["peak_mb"] - grads, xl) if ok["fused"] else "OOM",
        ms["ours"], ms["naive"], ms["fused"], vs_naive("ours", time_ratio), vs_naive("fused", time_ratio),
        _pass(ok["ours"] and ours["peak_mb"] <= MEM_TARGET_X_LOGITS * xl),
        vs_naive("ours", mem_e),
        vs_naive("ours", lambda r: _pass(r["time_ms"] <= TIME_TARGET_RATIO * naive["time_ms"])),
        _pass(ok["fused"] and fused["peak_mb"] < FUSED_TARGET_X_LOGITS * xl),
        vs_naive("ours", agree), vs_naive("fused", agree),
    ]


COLUMNS = ["cfg", "outputs", "TP", "ours peak MB (xL)", "naive peak MB (xL)", "mem ours/naive",
           "fused peak (i) MB (xL)", "fused work (ii) MB (xL)", "ours ms (cpu)", "naive ms (cpu)",
           "fused ms (cpu)", "time ours/naive (cpu)", "time fused/naive (cpu)",
           f"mem<={MEM_TARGET_X_LOGITS}xL", f"E mem<={MEM_TARGET_E_RATIO}x", f"time<={TIME_TARGET_RATIO}x",
           f"fused (i)<{FUSED_TARGET_X_LOGITS}xL", "agree ours", "agree fused"]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    load_start = os.getloadavg()[0]
    if args.lora:
        import bench_lora

        return bench_lora.main(["--quick"] * args.quick + ["--markdown"] * args.markdown)
    if args.cp:
        import bench_cp

        return bench_cp.main(["--quick"] * args.quick + ["--markdown"] * args.markdown)
    if args.moe or args.sp or args.deepseek:
        import bench_moe

        return bench_moe.main(["--quick"] * args.quick + ["--sp"] * args.sp + ["--deepseek"] * args.deepseek)
    if args.selected:
        import bench_selected

        def measure_spec(impl, cfg, tp, fractions, select):
            print(f"[bench] tp={tp} config {cfg} {impl} rows={select or 'all'} ...", file=sys.stderr,
                  flush=True)
            return measure(args, cfg, impl, tp, fractions=fractions, select=select)

        results = bench_selected.measure_all(args, measure_spec)
        prefix = "" if not args.markdown else "- "
        print("\n".join(prefix + line for line in header(args, (load_start, os.getloadavg()[0]))))
        print()
        print(format_table(bench_selected.COLUMNS,
                           bench_selected.table_rows(args, results, logits_mb, grads_mb, _mb), args.markdown))
        return 0
    results = {}
    for tp in args.tp:
        for cfg in args.configs:
            for impl in IMPLS:
                print(f"[bench] tp={tp} config {cfg} {impl} ...", file=sys.stderr, flush=True)
                results[(cfg, impl, tp)] = measure(args, cfg, impl, tp)
    prefix = "" if not args.markdown else "- "
    print("\n".join(prefix + line for line in header(args, (load_start, os.getloadavg()[0]))))
    print()
    print(format_table(COLUMNS, table_rows(args, results), args.markdown))
    return 0


if __name__ == "__main__":
    sys.exit(main())
