"""Benchmark: device memory released by ``engine.offload()`` and the time of offload + onload.

    python tools/bench_offload.py            # tiny, small, medium GPT; fp32 and bf16
    python tools/bench_offload.py --quick    # tiny only (seconds)

Each configuration runs in a fresh single-rank process: build the engine, one ``train_batch``, then
``--repeats`` rounds of ``offload()`` / ``onload()``, timed separately (median). Device bytes: CUDA
``memory_allocated()`` before and after offload; CPU ``HostOffloader.device_bytes`` per part. The
worker asserts every part's storages are 0 bytes while offloaded.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from bench_common import format_table, machine_header

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# name: (layers, hidden, heads, query groups, ffn, vocab)
CONFIGS = {"tiny": (4, 64, 4, 2, 96, 250), "small": (8, 512, 8, 4, 1408, 32000),
           "medium": (12, 1024, 16, 8, 2816, 32000)}


def _engine(name: str, precision: str):
    from mcore_engine import EngineConfig, MegatronEngine
    from mcore_engine.config import ModelConfig, OptimizerConfig, ParallelConfig

    layers, hidden, heads, groups, ffn, vocab = CONFIGS[name]
    cfg = EngineConfig(
        model=ModelConfig(num_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                          num_query_groups=groups, ffn_hidden_size=ffn, vocab_size=vocab,
                          max_sequence_length=128, add_qkv_bias=True),
        parallel=ParallelConfig(), optimizer=OptimizerConfig(lr=1e-4, lr_warmup_steps=0),
        precision=precision, micro_batch_size=2)
    engine = MegatronEngine(cfg)
    engine.initialize()
    return engine, vocab


def _batch(vocab: int):
    import torch
    from tensordict import TensorDict

    g = torch.Generator().manual_seed(0)
    rows = [torch.randint(0, vocab, (n,), generator=g) for n in (32, 24, 40, 16)]
    nested = lambda ts: torch.nested.nested_tensor(ts, layout=torch.jagged)  # noqa: E731
    return TensorDict({"input_ids": nested(rows), "advantages": nested([torch.randn(len(r)) for r in rows]),
                       "loss_mask": nested([torch.ones_like(r) for r in rows])}, batch_size=[len(rows)])


def _loss(outputs, data, ctx):
    mask = data["loss_mask"]
    return (-data["advantages"] * outputs["log_probs"] * mask).sum() / ctx.global_num_tokens, {}


def worker(name: str, precision: str, repeats: int) -> dict:
    import torch

    engine, vocab = _engine(name, precision)
    engine.train_batch(_batch(vocab), _loss)
    cuda = torch.cuda.is_available()
    held = engine._offloader.device_bytes
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    before_parts = held()
    before = torch.cuda.memory_allocated() if cuda else sum(before_parts.values())
    offload_s, onload_s, after = [], [], None
    for _ in range(repeats):
        sync()
        t = time.perf_counter()
        engine.offload()
        sync()
        offload_s.append(time.perf_counter() - t)
        parts = held()
        assert all(v == 0 for v in parts.values()), parts
        after = torch.cuda.memory_allocated() if cuda else sum(parts.values())
        t = time.perf_counter()
        engine.onload()
        sync()
        onload_s.append(time.perf_counter() - t)
    params = sum(p.numel() for chunk in engine.model for p in chunk.module.parameters())
    return {"config": name, "precision": precision, "params": params, "before": before, "after": after,
            "parts": before_parts, "offload_s": statistics.median(offload_s),
            "onload_s": statistics.median(onload_s), "device": "cuda" if cuda else "cpu"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny configuration only")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--worker", nargs=2, metavar=("CONFIG", "PRECISION"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print("RESULT " + json.dumps(worker(*args.worker, args.repeats)), flush=True)
        return 0
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    results = []
    for name in (["tiny"] if args.quick else list(CONFIGS)):
        for precision in ("fp32", "bf16"):
            out = subprocess.run([sys.executable, __file__, "--worker", name, precision,
                                  "--repeats", str(args.repeats)], env=env, capture_output=True, text=True,
                                 check=False)
            line = next((ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")), None)
            if line is None:
                print(out.stdout[-2000:], out.stderr[-4000:], file=sys.stderr)
                return 1
            results.append(json.loads(line[len("RESULT "):]))
    mb = 2.0 ** 20
    columns = ["config", "prec", "params", "params MB", "grads MB", "optim MB", "held before MB",
               "held after MB", "released", "offload s", "onload s", "GB/s (off+on)"]
    rows = []
    for r in results:
        moved = sum(r["parts"].values())
        rows.append([r["config"], r["precision"], f"{r['params'] / 1e6:.1f}M",
                     *(f"{r['parts'][p] / mb:.1f}" for p in ("params", "grads", "optimizer")),
                     f"{r['before'] / mb:.1f}", f"{r['after'] / mb:.1f}",
                     f"{1 - r['after'] / r['before']:.1%}" if r["before"] else "-",
                     f"{r['offload_s']:.4f}", f"{r['onload_s']:.4f}",
                     f"{2 * moved / 1e9 / (r['offload_s'] + r['onload_s']):.2f}"])
    print("\n".join(machine_header()))
    print(f"device: {results[0]['device']}; bytes on CUDA: memory_allocated, "
          "on CPU: the parts' storage sizes")
    print(format_table(columns, rows, right=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
