"""Benchmark: the engine's core attention (``SDPACoreAttention``) with a sliding window of 128 keys
(and gpt-oss' attention sinks) against full causal attention, forward + backward on one sequence.

    python tools/bench_attention_window.py            # 4096 and 16384 tokens, 5 repeats (~3 minutes)
    python tools/bench_attention_window.py --quick    # 1024 and 4096 tokens, 1 repeat (seconds)

One sequence (``bshd``, batch 1) of ``--lengths`` tokens, ``--heads`` query heads of 64 in
``--heads / 2`` key/value groups, fp32, one rank, no process group. Rows: **full** (vanilla causal:
one SDPA call), **full + sinks** (``softmax_type = "learnable"``: the block kernel over the whole
prefix), **window 128 + sinks** (gpt-oss' sliding layers: query blocks against the band of keys).
``ms`` = the median wall time of ``--repeats`` forward + backward passes after one warm-up (the
calling thread only, ``OMP_NUM_THREADS`` as set, 1 by default); ``ms / 1k tokens`` flat = linear cost.
``saved MB`` = the activations autograd keeps for backward (distinct storages, ``saved_tensors_hooks``;
exact). Every configuration runs in a fresh process (``--worker``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from bench_common import REPO, SavedActivations, format_table, machine_header

CONFIGS = {"full": (None, False), "full + sinks": (None, True), "window 128 + sinks": (128, True)}


def worker(name: str, tokens: int, args: argparse.Namespace) -> dict:
    """Time and saved bytes of one configuration, in this process."""
    import torch
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.enums import AttnMaskType

    from mcore_engine.layers.attention import SDPACoreAttention

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    window, sinks = CONFIGS[name]
    d, h = 64, args.heads
    config = TransformerConfig(num_layers=1, hidden_size=h * d, num_attention_heads=h,
                               num_query_groups=h // 2, kv_channels=d, use_cpu_initialization=True,
                               attention_dropout=0.0,
                               softmax_type="learnable" if sinks else "vanilla",
                               window_size=None if window is None else (window - 1, 0))
    module = SDPACoreAttention(config, 1, AttnMaskType.causal, "self")
    g = torch.Generator().manual_seed(0)
    q = torch.randn(tokens, 1, h, d, generator=g).requires_grad_()
    k, v = (torch.randn(tokens, 1, h // 2, d, generator=g).requires_grad_() for _ in range(2))
    grad = torch.randn(tokens, 1, h * d, generator=g)

    def step() -> None:
        module(q, k, v, None).backward(grad)

    step()  # warm-up
    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    with SavedActivations(module.parameters()) as saved:
        out = module(q, k, v, None)
    del out
    return {"ms": 1e3 * statistics.median(times), "saved_mb": saved.mb}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=None)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="1k / 4k tokens, one repeat")
    parser.add_argument("--markdown", action="store_true")
    parser.add_argument("--worker", nargs=2, metavar=("CONFIG", "TOKENS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print("RESULT " + json.dumps(worker(args.worker[0], int(args.worker[1]), args)))
        return
    lengths = args.lengths or ([1024, 4096] if args.quick else [4096, 16384])
    repeats = 1 if args.quick else args.repeats
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    rows = []
    for tokens in lengths:
        base = None
        for name in CONFIGS:
            cmd = [sys.executable, os.path.abspath(__file__), "--worker", name, str(tokens),
                   "--heads", str(args.heads), "--repeats", str(repeats)]
            out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
            line = next((ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")), None)
            if line is None:
                raise RuntimeError(f"{name} at {tokens} tokens failed:\n{out.stderr[-3000:]}")
            r = json.loads(line[len("RESULT "):])
            base = base or r
            rows.append([str(tokens), name, f"{r['ms']:.1f}", f"{r['ms'] / base['ms']:.3f}",
                         f"{r['ms'] * 1024 / tokens:.1f}", f"{r['saved_mb']:.2f}",
                         f"{r['saved_mb'] / base['saved_mb']:.2f}"])
    threads = env["OMP_NUM_THREADS"]
    print("\n".join(machine_header(f", {threads} thread(s), load average {os.getloadavg()[0]:.1f}")))
    print(f"SDPACoreAttention forward + backward, 1 sequence, {args.heads} heads of 64 "
          f"(GQA {args.heads // 2} groups), fp32, median of {repeats}")
    columns = ["tokens", "attention", "ms", "x full", "ms / 1k tokens", "saved MB", "x full"]
    print(format_table(columns, rows, args.markdown))


if __name__ == "__main__":
    main()
