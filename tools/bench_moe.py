"""Benchmark: tokens/s and peak memory of one ``train_batch`` step, MoE vs dense, EP=1 vs EP=2;
with ``--sp``, TP=2 with and without sequence parallelism.

    python tools/bench_moe.py              # hidden 256, 4 layers, 8 experts top-2, 2 ranks
    python tools/bench_moe.py --quick      # hidden 64 (seconds)
    python tools/bench_moe.py --sp         # dense TP=2, dense TP=2 + SP, MoE TP=2 + SP (EP=2, ETP=1)
    python tools/bench_moe.py --deepseek   # a DeepSeek-V3-style model vs the Qwen3-MoE of moe-ep1

Configurations (one setup factory each, ``_engine_config``), all on the same ranks (default 2,
gloo on CPU / NCCL on CUDA) and batch (``--seqs`` sequences of ``--seq-len`` tokens per rank, one
``bshd`` micro-batch: the CPU ``thd`` attention's ``[heads, t, t]`` scores of the whole pack would
dominate the memory):

- ``dense``: SwiGLU FFN of width ``k * F``, the active parameters per token of the MoE model;
- ``moe-ep1``: ``E`` experts of width ``F``, top-``k``, every layer MoE, each rank all experts (DP);
- ``moe-ep2``: the same model, experts split over two expert-parallel ranks (alltoall dispatcher);
- ``--deepseek``: ``moe-ep1`` (Qwen3-MoE style: GQA with QK-norm, softmax top-k) against
  ``deepseek-v3`` of the same active parameters per token: multi-latent attention (q LoRA rank
  ``3h/8``, kv LoRA rank ``h/2``, 16 + 16 query / key and 32 value channels a head: the GQA's
  attention weights within 2%), the first layer dense (width ``k * F``), then ``2E`` experts of width
  ``F / 2`` with sigmoid scores, expert bias and grouped top-``k`` (4 groups, 2 per token) plus one
  shared expert of width ``F / 2 * k``; both EP=1;
- ``--sp``: ``dense-tp2`` (TP=2, the same batch on both ranks), ``dense-tp2-sp`` (+ sequence
  parallelism), ``moe-tp2-sp`` (the MoE model at TP=2 + SP, experts EP=2 x expert-TP 1).

Every configuration runs in a fresh ``torchrun`` (``--worker``): one warm-up step, then the median
wall time and process CPU time of ``--repeats`` steps (ranks aligned by a barrier); tokens/s = the
distinct tokens of the step (TP ranks share theirs) / wall time. Peak memory (CPU): the worker runs
with ``MALLOC_MMAP_THRESHOLD_=65536`` so RSS tracks live bytes; VmHWM is reset before the last step,
peak = VmHWM - RSS before it, max over ranks (CUDA: ``max_memory_allocated`` above the allocated
bytes). ``saved MB``: the activations autograd saved for backward in that step (distinct storages
that are not parameters, from ``saved_tensors_hooks``; exact on any device), max over ranks.
``params/rank`` counts the parameters a rank holds (EP=2: half the experts).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

from bench_common import format_table, machine_header, measured_step, run_torchrun_worker

KINDS = ("dense", "moe-ep1", "moe-ep2")
SP_KINDS = ("dense-tp2", "dense-tp2-sp", "moe-tp2-sp")
DEEPSEEK_KINDS = ("moe-ep1", "deepseek-v3")


def _engine_config(kind: str, args: argparse.Namespace):
    from mcore_engine.config import EngineConfig, ModelConfig, OptimizerConfig, ParallelConfig
    from mcore_engine.config.moe import MoEConfig

    h, f, k = args.hidden, args.expert_ffn, args.topk
    if kind == "deepseek-v3":
        return _deepseek_config(args)
    moe = None if kind.startswith("dense") else MoEConfig(num_experts=args.experts, router_topk=k,
                                                          ffn_hidden_size=f, aux_loss_coeff=1e-3)
    tp, sp = (2 if "tp2" in kind else 1), kind.endswith("-sp")
    model = ModelConfig(num_layers=args.layers, hidden_size=h, num_attention_heads=max(tp, h // 32),
                        num_query_groups=max(tp, h // 64), ffn_hidden_size=k * f, vocab_size=args.vocab,
                        max_sequence_length=args.seq_len, qk_layernorm=True, moe=moe)
    ep = 2 if kind in ("moe-ep2", "moe-tp2-sp") else 1
    parallel = ParallelConfig(tensor_model_parallel_size=tp, sequence_parallel=sp,
                              expert_model_parallel_size=ep,
                              expert_tensor_parallel_size=1 if moe is not None and tp > 1 else None)
    return EngineConfig(model=model, parallel=parallel, optimizer=OptimizerConfig(lr=1e-4),
                        precision=args.precision, micro_batch_size=args.seqs, data_format="bshd")


def _deepseek_config(args: argparse.Namespace):
    """``--deepseek``'s DeepSeek-V3-style model (see the module docstring)."""
    from mcore_engine.config import EngineConfig, ModelConfig, OptimizerConfig, ParallelConfig
    from mcore_engine.config.mla import MLAConfig
    from mcore_engine.config.moe import MoEConfig

    h, f, k = args.hidden, args.expert_ffn, args.topk
    moe = MoEConfig(num_experts=2 * args.experts, router_topk=k, ffn_hidden_size=f // 2,
                    shared_expert_ffn_hidden_size=f // 2 * k, layer_freq=[0] + [1] * (args.layers - 1),
                    router_score_function="sigmoid", router_expert_bias=True, router_num_groups=4,
                    router_group_topk=2, router_topk_scaling_factor=2.5, aux_loss_type="none")
    mla = MLAConfig(q_lora_rank=3 * h // 8, kv_lora_rank=h // 2, qk_head_dim=16, qk_pos_emb_head_dim=16,
                    v_head_dim=32)
    model = ModelConfig(num_layers=args.layers, hidden_size=h, num_attention_heads=max(1, h // 32),
                        ffn_hidden_size=k * f, vocab_size=args.vocab, max_sequence_length=args.seq_len,
                        mla=mla, moe=moe)
    return EngineConfig(model=model, parallel=ParallelConfig(), optimizer=OptimizerConfig(lr=1e-4),
                        precision=args.precision, micro_batch_size=args.seqs, data_format="bshd")


def _active_ffn(m) -> int:
    """FFN parameters one token uses: a dense layer's, or its ``k`` experts' plus the shared expert's."""
    if m.moe is None:
        return 3 * m.hidden_size * m.ffn_size * m.num_layers
    moe = m.moe
    routed = moe.router_topk * (moe.ffn_hidden_size or m.ffn_size) + (moe.shared_expert_ffn_hidden_size or 0)
    return sum(3 * m.hidden_size * (routed if is_moe else m.ffn_size)
               for is_moe in moe.layer_pattern(m.num_layers))


def _active_params(engine) -> int:
    """Parameters one token uses: all of the model's but the experts it is not routed to (EP=1)."""
    m = engine.config.model
    total = sum(p.numel() for chunk in engine.model for p in chunk.module.parameters())
    if m.moe is None:
        return total
    per_expert = 3 * m.hidden_size * (m.moe.ffn_hidden_size or m.ffn_size)
    moe_layers = sum(m.moe.layer_pattern(m.num_layers))
    return total - moe_layers * (m.moe.num_experts - m.moe.router_topk) * per_expert


def _batch(args: argparse.Namespace, rank: int):
    import torch
    from tensordict import TensorDict

    g = torch.Generator().manual_seed(rank)
    rows = [torch.randint(0, args.vocab, (args.seq_len,), generator=g) for _ in range(args.seqs)]
    nested = lambda ts: torch.nested.nested_tensor(ts, layout=torch.jagged)  # noqa: E731
    return TensorDict({"input_ids": nested(rows), "advantages": nested([torch.randn(len(r), generator=g)
                                                                       for r in rows]),
                       "loss_mask": nested([torch.ones_like(r) for r in rows])}, batch_size=[len(rows)])


def _loss(outputs, data, ctx):
    mask = data["loss_mask"]
    return (-data["advantages"] * outputs["log_probs"] * mask).sum() / ctx.global_num_tokens, {}


def worker(kind: str, args: argparse.Namespace) -> dict | None:
    import torch
    import torch.distributed as dist

    from mcore_engine import MegatronEngine

    engine = MegatronEngine(_engine_config(kind, args))
    engine.initialize()
    from megatron.core import parallel_state

    rank, world = dist.get_rank(), dist.get_world_size()
    batch = _batch(args, parallel_state.get_data_parallel_rank())  # TP ranks share the sequences
    cuda = torch.cuda.is_available()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    engine.train_batch(batch, _loss)  # warm-up
    wall, cpu = [], []
    for _ in range(args.repeats):
        dist.barrier()
        sync()
        t, c = time.perf_counter(), time.process_time()
        engine.train_batch(batch, _loss)
        sync()
        wall.append(time.perf_counter() - t)
        cpu.append(time.process_time() - c)
    dist.barrier()
    peak, saved_mb = measured_step(engine, lambda: engine.train_batch(batch, _loss))
    figures = torch.tensor([peak, statistics.median(wall), statistics.median(cpu), saved_mb],
                           dtype=torch.float64)
    figures = figures.to("cuda") if cuda else figures
    dist.all_reduce(figures, op=dist.ReduceOp.MAX)
    held = sum(p.numel() for chunk in engine.model for p in chunk.module.parameters())
    if rank != 0:
        return None
    dp = world // engine.config.parallel.tensor_model_parallel_size
    ep1 = engine.config.parallel.expert_model_parallel_size == 1
    return {"kind": kind, "world": world, "tokens": dp * args.seqs * args.seq_len,
            "active": _active_params(engine) if ep1 else None,
            "peak_mb": float(figures[0]), "wall_s": float(figures[1]), "cpu_s": float(figures[2]),
            "saved_mb": float(figures[3]), "params_rank": held,
            "active_ffn": _active_ffn(engine.config.model),
            "device": "cuda" if cuda else "cpu"}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--experts", type=int, default=8, help="E")
    p.add_argument("--topk", type=int, default=2, help="k")
    p.add_argument("--expert-ffn", type=int, default=256, help="F, one expert's FFN width")
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--seqs", type=int, default=8, help="sequences per rank (one micro-batch)")
    p.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--nproc", type=int, default=2, help="ranks (EP=2 needs an even number)")
    p.add_argument("--quick", action="store_true", help="hidden 64, expert FFN 64, 64 tokens x 4 sequences")
    p.add_argument("--timeout", type=int, default=900, help="seconds per configuration")
    p.add_argument("--sp", action="store_true", help="TP=2 with / without sequence parallelism instead")
    p.add_argument("--deepseek", action="store_true",
                   help="a DeepSeek-V3-style model vs the Qwen3-MoE of the same active parameters")
    p.add_argument("--worker", choices=KINDS + SP_KINDS + DEEPSEEK_KINDS[1:], help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.quick:
        args.hidden, args.expert_ffn, args.seq_len, args.seqs, args.vocab = 64, 64, 64, 4, 1024
    if args.worker:
        result = worker(args.worker, args)
        if result is not None:
            print("RESULT " + json.dumps(result), flush=True)
        from mcore_engine.parallel.platform import destroy_distributed

        destroy_distributed()
        return 0
    passthrough = [a for a in (argv if argv is not None else sys.argv[1:]) if a != "--quick"]
    if args.quick:
        passthrough += ["--hidden", "64", "--expert-ffn", "64", "--seq-len", "64", "--seqs", "4",
                        "--vocab", "1024"]
    results = {}
    for kind in SP_KINDS if args.sp else DEEPSEEK_KINDS if args.deepseek else KINDS:
        try:
            results[kind] = run_torchrun_worker(__file__, args.nproc, [*passthrough, "--worker", kind],
                                                args.timeout)
        except RuntimeError as e:
            print(e, file=sys.stderr)
            return 1
    base_kind = next(iter(results))
    base = results[base_kind]
    columns = ["config", "params/rank", "active FFN params", "active params", "tokens/step", "step s (wall)",
               "step s (cpu)", "tokens/s", f"x {base_kind}", "peak MB", f"x {base_kind}", "saved MB",
               f"x {base_kind}"]
    rows = []
    for kind, r in results.items():
        tps = r["tokens"] / r["wall_s"]
        rows.append([kind, f"{r['params_rank'] / 1e6:.2f}M", f"{r['active_ffn'] / 1e6:.2f}M",
                     "-" if r["active"] is None else f"{r['active'] / 1e6:.2f}M",
                     str(r["tokens"]),
                     f"{r['wall_s']:.3f}", f"{r['cpu_s']:.3f}", f"{tps:.0f}",
                     f"{tps / (base['tokens'] / base['wall_s']):.2f}", f"{r['peak_mb']:.1f}",
                     f"{r['peak_mb'] / max(base['peak_mb'], 1e-9):.2f}", f"{r['saved_mb']:.1f}",
                     f"{r['saved_mb'] / max(base['saved_mb'], 1e-9):.2f}"])
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print("\n".join(machine_header(extra=f", load avg {load:.1f}")))
    print(f"device: {base['device']}, {base['world']} ranks; model: {args.layers} layers, "
          f"hidden {args.hidden}, vocab {args.vocab}, {args.precision}; MoE: E={args.experts}, "
          f"top-{args.topk}, expert FFN {args.expert_ffn} (dense FFN {args.topk * args.expert_ffn}); "
          f"{args.seqs} x {args.seq_len} tokens per rank; median of {args.repeats} steps")
    print(format_table(columns, rows, right=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
