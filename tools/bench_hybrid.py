"""Benchmark: the Qwen3.5 hybrid (3 Gated DeltaNet : 1 gated attention) against an all-attention
model of the same size, and the train / decode log-prob gap of the hybrid.

    python tools/bench_hybrid.py            # 2k / 8k / 32k tokens; gap: 4 x 512 tokens, fp32 + bf16
    python tools/bench_hybrid.py --quick    # 256 tokens, hidden 64; gap: 2 x 64 tokens (a minute)

Table 1, ``cost``: one ``train_batch`` step on ONE sequence (thd, one micro-batch) of each of
``--lengths`` tokens, one rank, for two models of the same shape (hidden ``--hidden``, ``--layers``
layers, ``--heads`` query heads of ``--head-dim`` channels in ``--groups`` key/value groups,
SwiGLU ``3 * hidden``, vocab ``--vocab``; Qwen3.5 style: attention output gate, zero-centred RMSNorms,
QK-norm, partial RoPE 0.25):

- ``attention``: every layer gated full attention (the engine's SDPA core attention);
- ``hybrid``: ``model.linear_attention`` = GDN (``--gdn-key-heads`` / ``--gdn-value-heads`` heads of
  ``--head-dim``, conv kernel 4, chunks of 64) in layers 1-3 of every 4, gated attention in the 4th;
  the conv and the chunked rule recomputed in the backward (``GDNConfig.recompute``, the default);
- ``hybrid-keep``: the same with ``recompute: false`` (the rule's intermediates kept for backward).

Every row runs in a fresh ``torchrun`` (``--worker``): a warm-up step on a 256-token sequence, then
``--repeats`` steps at the row's length, the last one measured for memory: ``step s`` = median
process CPU time (and wall time; one thread); tokens/s from the CPU time. ``peak MB``: VmHWM - RSS
around the last step with ``MALLOC_MMAP_THRESHOLD_=65536`` (CUDA: ``max_memory_allocated`` above the
allocated bytes); ``saved MB``: the activations autograd saved for backward in that step (distinct
non-parameter storages, ``saved_tensors_hooks``; exact). ``x attention``: hybrid / attention at the
same length; ``ms / 1k tokens``: CPU time per 1024 tokens (flat = linear cost).

Table 2, ``gap``: a tiny random ``Qwen3_5ForCausalLM`` (transformers; ``layer_types`` 3:1, seeded,
``initializer_range`` each of ``--init-stds``) saved to a folder and loaded into the engine through
``model.hf_path``. ``engine``: ``infer_batch`` log-probs of ``--gap-seqs`` random sequences of
``--gap-len`` tokens (chunked delta rule, packed); ``decode``: transformers with a cache, fed one token
at a time (``torch_recurrent_gated_delta_rule`` with the fp32 state, what an inference engine does
while decoding); ``hf chunked``: transformers on the whole sequence (``torch_chunk_gated_delta_rule``).
Each in ``--precision``'s dtype (the engine's ``precision``, the transformers model cast); max and
mean |delta log p| over every predicted token; ``entropy``: the model's mean entropy (nats; log V for
a uniform model), to judge how peaked its predictions are.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time

from bench_common import format_table, machine_header, measured_step, run_torchrun_worker

KINDS = ("attention", "hybrid", "hybrid-keep")
WARMUP_TOKENS = 256


# ---------------------------------------------------------------------------------------------- cost
def _engine_config(kind: str, seq_len: int, args: argparse.Namespace):
    from mcore_engine.config import EngineConfig, GDNConfig, ModelConfig, OptimizerConfig, ParallelConfig

    gdn = None if kind == "attention" else GDNConfig(
        num_key_heads=args.gdn_key_heads, num_value_heads=args.gdn_value_heads, key_head_dim=args.head_dim,
        value_head_dim=args.head_dim, recompute=kind == "hybrid")
    model = ModelConfig(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
                        num_query_groups=args.groups, kv_channels=args.head_dim,
                        ffn_hidden_size=3 * args.hidden, vocab_size=args.vocab,
                        max_sequence_length=max(seq_len, WARMUP_TOKENS),
                        qk_layernorm=True, attention_output_gate=True, zero_centered_norm=True,
                        rotary_percent=0.25, linear_attention=gdn)
    return EngineConfig(model=model, parallel=ParallelConfig(), optimizer=OptimizerConfig(lr=1e-4),
                        precision=args.precision, micro_batch_size=1)


def _sequence(seq_len: int, vocab: int, seed: int):
    import torch
    from tensordict import TensorDict

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (seq_len,), generator=g)
    nested = lambda t: torch.nested.nested_tensor([t], layout=torch.jagged)  # noqa: E731
    return TensorDict({"input_ids": nested(ids), "advantages": nested(torch.randn(seq_len, generator=g)),
                       "loss_mask": nested(torch.ones_like(ids))}, batch_size=[1])


def _loss(outputs, data, ctx):
    mask = data["loss_mask"]
    return (-data["advantages"] * outputs["log_probs"] * mask).sum() / ctx.global_num_tokens, {}


def cost_worker(kind: str, seq_len: int, args: argparse.Namespace) -> dict:
    """One rank: the ``kind`` model's ``train_batch`` on one ``seq_len`` sequence (module docstring)."""
    import torch

    from mcore_engine import MegatronEngine

    engine = MegatronEngine(_engine_config(kind, seq_len, args))
    engine.initialize()
    cuda = torch.cuda.is_available()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    engine.train_batch(_sequence(min(seq_len, WARMUP_TOKENS), args.vocab, 1), _loss)  # warm-up
    batch = _sequence(seq_len, args.vocab, 0)
    wall, cpu = [], []

    def step() -> None:
        sync()
        t, c = time.perf_counter(), time.process_time()
        engine.train_batch(batch, _loss)
        sync()
        wall.append(time.perf_counter() - t)
        cpu.append(time.process_time() - c)

    for _ in range(args.repeats - 1):
        step()
    peak, saved_mb = measured_step(engine, step)
    params = sum(p.numel() for chunk in engine.model for p in chunk.module.parameters())
    return {"kind": kind, "tokens": seq_len, "wall_s": statistics.median(wall),
            "cpu_s": statistics.median(cpu), "peak_mb": peak, "saved_mb": saved_mb, "params": params,
            "device": "cuda" if cuda else "cpu"}


def cost_rows(results: dict[tuple[str, int], dict], lengths: list[int]) -> list[list[str]]:
    """Table 1: per length, the attention row then the hybrid rows with their ratios to attention."""
    rows = []
    for n in lengths:
        base = results[("attention", n)]
        for kind in KINDS:
            r = results[(kind, n)]
            tps = r["tokens"] / r["cpu_s"]
            rows.append([str(n), kind, f"{r['params'] / 1e6:.2f}M", f"{r['cpu_s']:.2f}", f"{r['wall_s']:.2f}",
                         f"{tps:.0f}", f"{tps / (base['tokens'] / base['cpu_s']):.2f}",
                         f"{1024 * 1e3 * r['cpu_s'] / r['tokens']:.0f}",
                         f"{r['peak_mb']:.1f}", f"{r['peak_mb'] / max(base['peak_mb'], 1e-9):.2f}",
                         f"{r['saved_mb']:.1f}", f"{r['saved_mb'] / max(base['saved_mb'], 1e-9):.2f}"])
    return rows


COST_COLUMNS = ["tokens", "model", "params", "step s (cpu)", "step s (wall)", "tokens/s", "x attention",
                "ms / 1k tokens", "peak MB", "x attention", "saved MB", "x attention"]


# ----------------------------------------------------------------------------------------------- gap
def _tiny_qwen35(args: argparse.Namespace, init_std: float):
    """The seeded random fp32 ``Qwen3_5ForCausalLM`` of table 2 (eval mode)."""
    import torch
    import transformers

    torch.manual_seed(args.seed)
    cfg = transformers.Qwen3_5TextConfig(
        vocab_size=args.gap_vocab, hidden_size=args.gap_hidden, intermediate_size=2 * args.gap_hidden,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=args.gap_hidden // 4,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=args.gap_hidden // 4,
        linear_value_head_dim=args.gap_hidden // 4, linear_conv_kernel_dim=4,
        layer_types=["linear_attention"] * 3 + ["full_attention"], max_position_embeddings=args.gap_len,
        initializer_range=init_std, tie_word_embeddings=False, architectures=["Qwen3_5ForCausalLM"])
    return transformers.Qwen3_5ForCausalLM(cfg).eval()


def _label_log_probs(logits, ids):
    """log p(ids[t + 1] | ids[<= t]) from ``logits [B, T, V]``: ``[B, T - 1]`` fp32."""
    return logits[:, :-1].float().log_softmax(-1).gather(-1, ids[:, 1:, None])[..., 0]


def _hf_decode(model, ids):
    """Logits of transformers' cached decode loop, one token at a time (the recurrent rule)."""
    import torch

    cache, out = None, []
    for t in range(ids.shape[1]):
        step = model(ids[:, t:t + 1], cache=cache, use_cache=True)
        cache = step.cache
        out.append(step.logits)
    return torch.cat(out, dim=1)


def gap_worker(precision: str, init_std: float, args: argparse.Namespace) -> dict:
    """One rank: engine (chunked, ``hf_path``) vs transformers decode (recurrent) vs transformers
    chunked, in ``precision`` (module docstring)."""
    import torch
    from tensordict import TensorDict

    from mcore_engine import MegatronEngine
    from mcore_engine.config import EngineConfig
    from mcore_engine.hf import from_hf_config, read_hf_config

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[precision]
    hf = _tiny_qwen35(args, init_std)
    ids = torch.randint(0, args.gap_vocab, (args.gap_seqs, args.gap_len),
                        generator=torch.Generator().manual_seed(args.seed + 1))
    with tempfile.TemporaryDirectory(prefix="bench_hybrid_") as folder:
        hf.save_pretrained(folder)
        model = from_hf_config(read_hf_config(folder), hf_path=folder)
        engine = MegatronEngine(EngineConfig(model=model, precision=precision, forward_only=True,
                                             micro_batch_size=args.gap_seqs))
        engine.initialize()
    batch = TensorDict({"input_ids": ids, "attention_mask": torch.ones_like(ids, dtype=torch.bool)},
                       batch_size=[args.gap_seqs])
    engine_lp = engine.infer_batch(batch)["log_probs"][:, :-1].float().cpu()
    hf = hf.to(dtype)
    with torch.no_grad():
        logits = hf(ids).logits
        chunked_lp, decode_lp = _label_log_probs(logits, ids), _label_log_probs(_hf_decode(hf, ids), ids)
        probs = logits.float().log_softmax(-1)
        entropy = float(-(probs.exp() * probs).sum(-1).mean())

    def gap(a, b) -> list[float]:
        d = (a - b).abs()
        return [float(d.max()), float(d.mean())]

    return {"precision": precision, "init_std": init_std, "engine_decode": gap(engine_lp, decode_lp),
            "hf_decode": gap(chunked_lp, decode_lp), "engine_hf": gap(engine_lp, chunked_lp),
            "mean_log_p": float(decode_lp.mean()), "entropy": entropy, "vocab": args.gap_vocab}


def gap_rows(results: list[dict]) -> list[list[str]]:
    """Table 2: one row per (precision, init std)."""
    rows = []
    for r in results:
        rows.append([r["precision"], f"{r['init_std']:g}", *(f"{v:.1e}" for v in r["engine_decode"]),
                     *(f"{v:.1e}" for v in r["hf_decode"]), *(f"{v:.1e}" for v in r["engine_hf"]),
                     f"{r['mean_log_p']:.2f}", f"{r['entropy']:.2f} / {math.log(r['vocab']):.2f}"])
    return rows


GAP_COLUMNS = ["precision", "init std", "engine vs decode max", "mean", "hf chunked vs decode max", "mean",
               "engine vs hf chunked max", "mean", "mean log p", "entropy / log V"]


# ---------------------------------------------------------------------------------------------- main
def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", default="2048,8192,32768", help="table 1: tokens of the one sequence")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=4, help="attention query heads")
    p.add_argument("--groups", type=int, default=2, help="attention key/value groups")
    p.add_argument("--head-dim", type=int, default=64, help="channels per attention and GDN head")
    p.add_argument("--gdn-key-heads", type=int, default=2)
    p.add_argument("--gdn-value-heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--precision", choices=("fp32", "bf16"), default="fp32", help="table 1's precision")
    p.add_argument("--repeats", type=int, default=1, help="table 1: timed steps per row (the last measured)")
    p.add_argument("--gap-seqs", type=int, default=4)
    p.add_argument("--gap-len", type=int, default=512)
    p.add_argument("--gap-hidden", type=int, default=128)
    p.add_argument("--gap-vocab", type=int, default=1024)
    p.add_argument("--init-stds", default="0.02,0.1", help="table 2: initializer_range of each model")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--only", choices=("cost", "gap"), help="one table only")
    p.add_argument("--quick", action="store_true", help="hidden 64, 256 tokens; gap 2 x 64 tokens")
    p.add_argument("--timeout", type=int, default=1800, help="seconds per configuration")
    p.add_argument("--markdown", action="store_true", help="print the tables as markdown")
    p.add_argument("--worker", nargs=3, metavar=("TABLE", "A", "B"), help=argparse.SUPPRESS)
    return p


QUICK = ["--lengths", "256", "--hidden", "64", "--heads", "2", "--groups", "1", "--head-dim", "32",
         "--gdn-key-heads", "1", "--gdn-value-heads", "2", "--vocab", "1024", "--gap-seqs", "2",
         "--gap-len", "64", "--gap-hidden", "64", "--gap-vocab", "256", "--init-stds", "0.02"]


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--quick" in argv:
        argv = QUICK + argv  # explicit flags after --quick's still win
    args = _parser().parse_args(argv)
    if args.worker:
        table, a, b = args.worker
        result = cost_worker(a, int(b), args) if table == "cost" else gap_worker(a, float(b), args)
        print("RESULT " + json.dumps(result), flush=True)
        from mcore_engine.parallel.platform import destroy_distributed

        destroy_distributed()
        return 0
    passthrough = [a for a in argv if a not in ("--quick", "--markdown")]
    lengths = [int(n) for n in args.lengths.split(",")]
    stds = [float(s) for s in args.init_stds.split(",")]
    run = lambda *w: run_torchrun_worker(__file__, 1, [*passthrough, "--worker", *map(str, w)],  # noqa: E731
                                         args.timeout)
    try:
        cost = {} if args.only == "gap" else {(k, n): run("cost", k, n) for n in lengths for k in KINDS}
        gap = [] if args.only == "cost" else [run("gap", p, s) for s in stds for p in ("fp32", "bf16")]
    except RuntimeError as e:
        print(e, file=sys.stderr)
        return 1
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print("\n".join(machine_header(extra=f", load avg {load:.1f}", packages=("transformers",))))
    if cost:
        print(f"\ncost: one train_batch step on one sequence (thd), one rank, {args.precision}; "
              f"{args.layers} layers, hidden {args.hidden}, {args.heads} heads of {args.head_dim} "
              f"({args.groups} kv groups), SwiGLU {3 * args.hidden}, vocab {args.vocab}; hybrid: GDN "
              f"{args.gdn_key_heads} key / {args.gdn_value_heads} value heads of {args.head_dim} in 3 of 4 "
              f"layers (hybrid-keep: GDNConfig.recompute off); device {next(iter(cost.values()))['device']}; "
              f"median of {args.repeats} step(s), tokens/s from CPU time")
        print(format_table(COST_COLUMNS, cost_rows(cost, lengths), args.markdown, right=not args.markdown))
    if gap:
        print(f"\ngap: |log p engine (chunked) - log p decode (recurrent)|, tiny Qwen3_5ForCausalLM "
              f"(hidden {args.gap_hidden}, 4 layers 3:1, vocab {args.gap_vocab}) via model.hf_path, "
              f"{args.gap_seqs} x {args.gap_len} tokens ({args.gap_seqs * (args.gap_len - 1)} predictions)")
        print(format_table(GAP_COLUMNS, gap_rows(gap), args.markdown, right=not args.markdown))
    return 0


if __name__ == "__main__":
    sys.exit(main())
