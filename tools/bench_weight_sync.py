"""Benchmark: time and peak extra memory of a full weight export, per tensor vs in buckets.

    python tools/bench_weight_sync.py                 # Llama-like H=512, 4 layers, vocab 32000, fp32, TP=1
    python tools/bench_weight_sync.py --tp 1 2        # TP=1 and TP=2 (2 gloo ranks)
    python tools/bench_weight_sync.py --quick         # tiny model, seconds (smoke test)

Rows: "per-tensor" consumes ``iter_hf_tensors``; "bucketed N" ``iter_weight_buckets`` with
``bucket_bytes`` N, each bucket split by ``unflatten_bucket``; "cat N" the naive ``torch.cat`` of the
held tensors' flattened copies. Every row runs in fresh gloo processes (one per TP rank) that build a
random model, export once as a warm-up, then measure: peak extra memory ``VmHWM - VmRSS`` above the
model (``MALLOC_MMAP_THRESHOLD_=65536``; CUDA: ``max_memory_allocated``) and median wall (CPU) time
of ``--repeats`` exports, max over ranks. "buffer": the sender's bucket buffer; "largest": the
largest HF tensor; "msgs": items received.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import socket
import statistics
import subprocess
import sys
import time

from bench_common import machine_header, proc_status_mib

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MIB = 2**20


def _model_dict(args: argparse.Namespace) -> dict:
    return dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=args.vocab,
                hidden_size=args.hidden, intermediate_size=args.ffn, num_hidden_layers=args.layers,
                num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                max_position_embeddings=256, rms_norm_eps=1e-6, rope_theta=10000.0,
                tie_word_embeddings=False, torch_dtype="float32")


def _export(chunks, cfg, mode: str, bucket_bytes: int) -> int:
    """One full export as the consumer sees it; returns the number of items received."""
    import torch

    from mcore_engine.hf import iter_hf_tensors
    from mcore_engine.weight_sync import iter_weight_buckets, unflatten_bucket

    count = 0
    if mode == "per-tensor":
        for _name, _t in iter_hf_tensors(chunks, cfg):
            count += 1
    elif mode == "bucketed":
        for bucket, meta in iter_weight_buckets(chunks, cfg, bucket_bytes):
            unflatten_bucket(bucket, meta)
            count += 1
    else:  # cat: hold the tensors of a bucket, then one torch.cat of their flattened copies
        held, size, flat = [], 0, None
        for _name, t in iter_hf_tensors(chunks, cfg):
            if held and size + t.nbytes > bucket_bytes:
                flat = torch.cat([x.reshape(-1) for x in held])
                held, size, count = [], 0, count + 1
            held.append(t)
            size += t.nbytes
        flat = torch.cat([x.reshape(-1) for x in held])
        count += 1
        del flat
    return count


def worker(spec: dict) -> dict:
    import torch

    from mcore_engine.config import EngineConfig, ParallelConfig
    from mcore_engine.hf import from_hf_config
    from mcore_engine.hf.mapping import hf_shapes
    from mcore_engine.model.build import build_model_chunks
    from mcore_engine.parallel.platform import init_distributed
    from mcore_engine.weight_sync import plan_buckets

    torch.set_num_threads(1)
    cfg = EngineConfig(model=from_hf_config(spec["model"]),
                       parallel=ParallelConfig(tensor_model_parallel_size=spec["tp"]), precision="fp32")
    init_distributed(cfg.parallel, seed=0)
    chunks = build_model_chunks(cfg)
    cuda = torch.cuda.is_available()
    with torch.no_grad():
        for p in (p for c in chunks for p in c.parameters()):
            p.normal_(0, 0.02)  # touch every parameter page
    mode, bucket_bytes = spec["mode"], spec["bucket_bytes"]
    _export(chunks, cfg, mode, bucket_bytes)  # warm-up: lazy imports, group set-up
    gc.collect()
    if cuda:
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        msgs = _export(chunks, cfg, mode, bucket_bytes)
        torch.cuda.synchronize()
        peak = (torch.cuda.max_memory_allocated() - base) / MIB
    else:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        base = proc_status_mib("VmRSS")
        msgs = _export(chunks, cfg, mode, bucket_bytes)
        peak = proc_status_mib("VmHWM") - base
    times, cpu_times = [], []
    for _ in range(spec["repeats"]):
        start, cpu_start = time.perf_counter(), time.process_time()
        _export(chunks, cfg, mode, bucket_bytes)
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        cpu_times.append(time.process_time() - cpu_start)
    shapes = hf_shapes(cfg.model)
    plan = plan_buckets(shapes, torch.float32, bucket_bytes or 1)
    buffer = max((m.nbytes for m in plan if len(m.names) > 1), default=0) if mode == "bucketed" else 0
    largest = max(m.nbytes for m in plan_buckets(shapes, torch.float32, 1))
    return {"peak_mib": peak, "time_s": statistics.median(times), "cpu_s": statistics.median(cpu_times),
            "msgs": msgs, "buffer_mib": buffer / MIB,
            "largest_mib": largest / MIB, "total_mib": sum(m.nbytes for m in plan) / MIB}


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(spec: dict, timeout: int) -> dict:
    """One row: ``spec['tp']`` fresh rank processes; the max over ranks of each figure."""
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), WORLD_SIZE=str(spec["tp"]),
               OMP_NUM_THREADS="1", MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0",
               PYTHONPATH=os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])))
    procs = [subprocess.Popen([sys.executable, __file__, "--worker", json.dumps(spec)], cwd=REPO,
                              env=env | {"RANK": str(r), "LOCAL_RANK": str(r)}, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in range(spec["tp"])]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=timeout)
        if p.returncode != 0:
            raise RuntimeError(f"worker failed ({p.returncode}):\n{err[-3000:]}")
        results.append(json.loads(out.strip().splitlines()[-1]))
    return {k: max(r[k] for r in results) for k in results[0]}


def header(args: argparse.Namespace) -> list[str]:
    import torch

    device = "CUDA" if torch.cuda.is_available() else "CPU (gloo)"
    return [*machine_header(extra=f"; device {device}", packages=("transformers",)),
            f"model: Llama H={args.hidden}, {args.layers} layers, ffn {args.ffn}, heads {args.heads}/"
            f"{args.kv_heads}, vocab {args.vocab}, untied, fp32; repeats {args.repeats}; "
            "peak = VmHWM - VmRSS above the model (malloc mmap threshold 64 KiB)"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--tp", type=int, nargs="+", default=[1])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--ffn", type=int, default=1408)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--bucket-mib", type=float, nargs="+", default=[4, 32, 256])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--timeout", type=int, default=600)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))), flush=True)
        return
    if args.quick:
        args.hidden, args.layers, args.ffn, args.vocab, args.repeats = 64, 2, 88, 256, 1
        args.bucket_mib = [1 / 64, 1]
    model = _model_dict(args)
    print("\n".join(header(args)))
    rows = [("per-tensor", 0)] + [(m, int(b * MIB)) for b in args.bucket_mib for m in ("bucketed", "cat")]
    print(f"{'TP':>2} {'mode':<16} {'msgs':>5} {'time s':>8} {'x per-t':>7} {'cpu s':>7} {'peak MiB':>9} "
          f"{'buffer':>7} {'largest':>7} {'model':>7}")
    for tp in args.tp:
        base_time = None
        for mode, bucket_bytes in rows:
            r = run(dict(model=model, tp=tp, mode=mode, bucket_bytes=bucket_bytes, repeats=args.repeats),
                     args.timeout)
            base_time = base_time or r["time_s"]
            label = mode if mode == "per-tensor" else f"{mode} {bucket_bytes / MIB:.3g}M"
            print(f"{tp:>2} {label:<16} {r['msgs']:>5} {r['time_s']:>8.4f} {r['time_s'] / base_time:>7.2f} "
                  f"{r['cpu_s']:>7.4f} {r['peak_mib']:>9.1f} {r['buffer_mib']:>7.1f} "
                  f"{r['largest_mib']:>7.1f} {r['total_mib']:>7.1f}", flush=True)


if __name__ == "__main__":
    main()
