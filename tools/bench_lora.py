"""Benchmark: LoRA (rank 8 and 64, all linears) against full fine-tuning on one rank.

    python tools/bench_lora.py            # hidden 768, 8 layers, 4 x 256 tokens
    python tools/bench_lora.py --quick    # hidden 256, 4 layers (seconds)

Per configuration, in a fresh ``torchrun`` (``--worker``): the bytes the gradients (DDP grad
buffers) and the optimizer (fp32 main weights + Adam moments) hold, exact from the tensors
(``HostOffloader.device_bytes``); the median wall time of ``--repeats`` ``train_batch`` steps after a
warm-up; the weight sync an inference engine would receive: ``per_tensor_generator()`` (the merged
model in Hugging Face names) and ``per_tensor_generator(adapter_only=True)`` (the adapters in PEFT
names): bytes and the time to stream them.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

from bench_common import format_table, machine_header, run_torchrun_worker

KINDS = ("full", "lora-r8", "lora-r64")


def _engine_config(kind: str, args: argparse.Namespace):
    from mcore_engine.config import EngineConfig, ModelConfig, OptimizerConfig
    from mcore_engine.config.lora import LoRAConfig

    h = args.hidden
    lora = None if kind == "full" else LoRAConfig(rank=int(kind.split("-r")[1]), alpha=16.0,
                                                  target_modules="all-linear")
    model = ModelConfig(num_layers=args.layers, hidden_size=h, num_attention_heads=h // 64,
                        num_query_groups=max(1, h // 256), ffn_hidden_size=int(h * 8 / 3) // 64 * 64,
                        vocab_size=args.vocab, max_sequence_length=args.seq_len, lora=lora)
    return EngineConfig(model=model, optimizer=OptimizerConfig(lr=1e-4), precision=args.precision,
                        micro_batch_size=args.seqs)


def _loss(outputs, data, ctx):
    mask = data["loss_mask"]
    return (-data["advantages"] * outputs["log_probs"] * mask).sum() / ctx.global_num_tokens, {}


def worker(kind: str, args: argparse.Namespace) -> dict:
    import torch
    from tensordict import TensorDict

    from mcore_engine import MegatronEngine

    engine = MegatronEngine(_engine_config(kind, args))
    engine.initialize()
    g = torch.Generator().manual_seed(0)
    rows = [torch.randint(0, args.vocab, (args.seq_len,), generator=g) for _ in range(args.seqs)]
    nested = lambda ts: torch.nested.nested_tensor(ts, layout=torch.jagged)  # noqa: E731
    batch = TensorDict({"input_ids": nested(rows), "advantages": nested([torch.randn(len(r), generator=g)
                                                                       for r in rows]),
                        "loss_mask": nested([torch.ones_like(r) for r in rows])}, batch_size=[len(rows)])
    engine.train_batch(batch, _loss)  # warm-up (and the optimizer state)
    wall = []
    for _ in range(args.repeats):
        t = time.perf_counter()
        engine.train_batch(batch, _loss)
        wall.append(time.perf_counter() - t)
    held = engine._offloader.device_bytes()
    sync = {}
    for name, adapter_only in (("merged", False), ("adapters", True)):
        if adapter_only and kind == "full":
            continue
        t = time.perf_counter()
        nbytes = sum(tensor.numel() * tensor.element_size()
                     for _, tensor in engine.per_tensor_generator(adapter_only=adapter_only))
        sync[name] = {"bytes": nbytes, "s": time.perf_counter() - t}
    trainable = sum(p.numel() for chunk in engine.model for p in chunk.module.parameters() if p.requires_grad)
    total = sum(p.numel() for chunk in engine.model for p in chunk.module.parameters())
    return {"kind": kind, "step_s": statistics.median(wall), "grads": held["grads"],
            "optimizer": held["optimizer"], "sync": sync, "trainable": trainable, "total": total}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--seqs", type=int, default=4)
    p.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--quick", action="store_true", help="hidden 256, 4 layers, 2 x 128 tokens")
    p.add_argument("--markdown", action="store_true")
    p.add_argument("--timeout", type=int, default=1800)
    p.add_argument("--worker", choices=KINDS, help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parser().parse_args(argv)
    if args.quick:
        args.hidden, args.layers, args.seq_len, args.seqs = 256, 4, 128, 2
    if args.worker:
        result = worker(args.worker, args)
        print("RESULT " + json.dumps(result), flush=True)
        from mcore_engine.parallel.platform import destroy_distributed

        destroy_distributed()
        return 0
    passthrough = [a for a in argv if a not in ("--quick", "--markdown")]
    if args.quick:
        passthrough += ["--hidden", "256", "--layers", "4", "--seq-len", "128", "--seqs", "2"]
    results = {}
    for kind in KINDS:
        try:
            results[kind] = run_torchrun_worker(__file__, 1, [*passthrough, "--worker", kind], args.timeout,
                                                track_memory=False)
        except RuntimeError as e:
            print(e, file=sys.stderr)
            return 1
    full = results["full"]
    mb = 2**20
    rows = []
    for kind, r in results.items():
        merged, adapters = r["sync"]["merged"], r["sync"].get("adapters")
        rows.append([kind, f"{r['trainable'] / 1e6:.2f}M / {r['total'] / 1e6:.1f}M",
                     f"{(r['grads'] + r['optimizer']) / mb:.1f}",
                     f"{(r['grads'] + r['optimizer']) / (full['grads'] + full['optimizer']):.3f}",
                     f"{r['step_s']:.2f}", f"{r['step_s'] / full['step_s']:.2f}",
                     f"{merged['bytes'] / mb:.1f} MB, {merged['s']:.2f} s",
                     "-" if adapters is None else f"{adapters['bytes'] / mb:.2f} MB, {adapters['s']:.2f} s",
                     "-" if adapters is None else f"{adapters['bytes'] / merged['bytes']:.4f}"])
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print("\n".join(machine_header(extra=f", load avg {load:.1f}")))
    print(f"one rank; model: {args.layers} layers, hidden {args.hidden}, vocab {args.vocab}, "
          f"{args.precision}; {args.seqs} x {args.seq_len} tokens; LoRA on all linears (alpha 16); "
          f"median of {args.repeats} steps")
    print(format_table(["config", "trainable / total params", "grads + optimizer MB", "x full", "step s",
                        "x full", "sync merged", "sync adapters only", "adapters / merged"],
                       rows, args.markdown, right=not args.markdown))
    return 0


if __name__ == "__main__":
    sys.exit(main())
