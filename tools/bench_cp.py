"""Benchmark: context parallelism on one long sequence, and the SDPA core attention against
Megatron's local attention.

    python tools/bench_cp.py            # 8192 tokens, CP=1 vs CP=2; attention at 1k / 2k / 4k tokens
    python tools/bench_cp.py --quick    # 1024 tokens; attention at 256 / 512 (seconds)

Table 1, ``cp``: one ``train_batch`` step on ONE sequence of ``--seq-len`` tokens (thd), the same
model at CP=1 (one rank) and CP=2 (two ranks, each holding two of the four chunks).
Table 2, ``attention``: the same step at CP=1 for each of ``--attn-lengths`` with
``model.core_attention`` ``sdpa`` (the engine's) and ``local`` (Megatron's ``DotProductAttention``,
which keeps ``[b, heads, s, s]`` scores and probabilities for backward).

Every configuration runs in a fresh ``torchrun`` (``--worker``): one warm-up step, then the median
wall time of ``--repeats`` steps. ``saved MB``: the activations autograd saved for backward in a
step (distinct non-parameter storages, ``saved_tensors_hooks``; exact), max over ranks. ``peak MB``
(CPU): VmHWM - RSS around the last step with ``MALLOC_MMAP_THRESHOLD_=65536``, max over ranks
(CUDA: ``max_memory_allocated`` above the allocated bytes).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

from bench_common import format_table, machine_header, measured_step, run_torchrun_worker


def _engine_config(cp: int, attention: str, seq_len: int, args: argparse.Namespace):
    from mcore_engine.config import EngineConfig, ModelConfig, OptimizerConfig, ParallelConfig

    h = args.hidden
    model = ModelConfig(num_layers=args.layers, hidden_size=h, num_attention_heads=h // 32,
                        num_query_groups=max(1, h // 64), ffn_hidden_size=3 * h, vocab_size=args.vocab,
                        max_sequence_length=seq_len, core_attention=attention)
    return EngineConfig(model=model, parallel=ParallelConfig(context_parallel_size=cp),
                        optimizer=OptimizerConfig(lr=1e-4), precision=args.precision, micro_batch_size=1)


def _loss(outputs, data, ctx):
    mask = data["loss_mask"]
    return (-data["advantages"] * outputs["log_probs"] * mask).sum() / ctx.global_num_tokens, {}


def worker(cp: int, attention: str, seq_len: int, args: argparse.Namespace) -> dict | None:
    import torch
    import torch.distributed as dist
    from tensordict import TensorDict

    from mcore_engine import MegatronEngine

    engine = MegatronEngine(_engine_config(cp, attention, seq_len, args))
    engine.initialize()
    g = torch.Generator().manual_seed(0)  # every CP rank gets the same sequence
    ids = torch.randint(0, args.vocab, (seq_len,), generator=g)
    nested = lambda t: torch.nested.nested_tensor([t], layout=torch.jagged)  # noqa: E731
    batch = TensorDict({"input_ids": nested(ids), "advantages": nested(torch.randn(seq_len, generator=g)),
                        "loss_mask": nested(torch.ones_like(ids))}, batch_size=[1])
    cuda = torch.cuda.is_available()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    engine.train_batch(batch, _loss)  # warm-up
    wall = []
    for _ in range(args.repeats):
        dist.barrier()
        sync()
        t = time.perf_counter()
        engine.train_batch(batch, _loss)
        sync()
        wall.append(time.perf_counter() - t)
    dist.barrier()
    peak, saved_mb = measured_step(engine, lambda: engine.train_batch(batch, _loss))
    figures = torch.tensor([peak, statistics.median(wall), saved_mb], dtype=torch.float64)
    figures = figures.to("cuda") if cuda else figures
    dist.all_reduce(figures, op=dist.ReduceOp.MAX)
    if dist.get_rank() != 0:
        return None
    return {"peak_mb": float(figures[0]), "wall_s": float(figures[1]), "saved_mb": float(figures[2]),
            "device": "cuda" if cuda else "cpu"}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--seq-len", type=int, default=8192, help="table 1: the one sequence's length")
    p.add_argument("--attn-lengths", default="1024,2048,4096", help="table 2: sequence lengths")
    p.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--quick", action="store_true", help="1024 tokens; attention at 256 / 512")
    p.add_argument("--timeout", type=int, default=1800, help="seconds per configuration")
    p.add_argument("--markdown", action="store_true", help="print the tables as markdown")
    p.add_argument("--worker", nargs=3, metavar=("CP", "ATTENTION", "SEQ_LEN"), help=argparse.SUPPRESS)
    return p


def _run(cp: int, attention: str, seq_len: int, argv: list[str], timeout: int) -> dict:
    return run_torchrun_worker(__file__, cp, [*argv, "--worker", str(cp), attention, str(seq_len)], timeout)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parser().parse_args(argv)
    if args.quick:
        args.seq_len, args.attn_lengths = 1024, "256,512"
    if args.worker:
        cp, attention, seq_len = int(args.worker[0]), args.worker[1], int(args.worker[2])
        result = worker(cp, attention, seq_len, args)
        if result is not None:
            print("RESULT " + json.dumps(result), flush=True)
        from mcore_engine.parallel.platform import destroy_distributed

        destroy_distributed()
        return 0
    passthrough = [a for a in argv if a not in ("--quick", "--markdown")]
    passthrough += ["--seq-len", str(args.seq_len), "--attn-lengths", args.attn_lengths] if args.quick else []
    cp_runs = {cp: _run(cp, "sdpa", args.seq_len, passthrough, args.timeout) for cp in (1, 2)}
    lengths = [int(n) for n in args.attn_lengths.split(",")]
    attn_runs = {(n, a): _run(1, a, n, passthrough, args.timeout) for n in lengths for a in ("local", "sdpa")}

    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print("\n".join(machine_header(extra=f", load avg {load:.1f}")))
    print(f"device: {cp_runs[1]['device']}; model: {args.layers} layers, hidden {args.hidden}, "
          f"{args.hidden // 32} heads, vocab {args.vocab}, {args.precision}; "
          f"median of {args.repeats} step(s)")
    base = cp_runs[1]
    rows = [[f"CP={cp}", str(cp), f"{r['saved_mb']:.1f}", f"{r['saved_mb'] / base['saved_mb']:.2f}",
             f"{r['peak_mb']:.1f}", f"{r['peak_mb'] / max(base['peak_mb'], 1e-9):.2f}", f"{r['wall_s']:.2f}",
             f"{r['wall_s'] / base['wall_s']:.2f}"] for cp, r in cp_runs.items()]
    print(f"\ncontext parallelism: one sequence of {args.seq_len} tokens, per rank")
    print(format_table(["config", "ranks", "saved MB", "x CP=1", "peak MB", "x CP=1", "step s", "x CP=1"],
                       rows, args.markdown, right=not args.markdown))
    rows = []
    for n in lengths:
        local = attn_runs[(n, "local")]
        for a in ("local", "sdpa"):
            r = attn_runs[(n, a)]
            rows.append([str(n), a, f"{r['saved_mb']:.1f}", f"{r['saved_mb'] / local['saved_mb']:.2f}",
                         f"{r['peak_mb']:.1f}", f"{r['wall_s']:.2f}", f"{r['wall_s'] / local['wall_s']:.2f}"])
    print("\ncore attention at CP=1: one sequence, one rank")
    print(format_table(["tokens", "core_attention", "saved MB", "x local", "peak MB", "step s", "x local"],
                       rows, args.markdown, right=not args.markdown))
    return 0


if __name__ == "__main__":
    sys.exit(main())
