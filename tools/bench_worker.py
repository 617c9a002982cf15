"""One benchmark measurement in a fresh process: ``python tools/bench_worker.py '<json spec>'``.

The spec (from ``tools/bench.py``) holds ``impl`` ("ours" | "naive" | "fused"), ``config`` (a key of
``CONFIGS``), ``tokens``, ``vocab`` (V_local), ``hidden``, ``dtype``, ``tp``, ``k``, ``temperature``,
``mode`` ("memory" | "time" | "both"), ``repeats``, ``seed``, ``chunk_size``, ``fused_chunk_size``; the
rank comes from torchrun's environment. The result is the last stdout line, a JSON object.

One step: ``torch.autograd.backward(f(inputs), upstream_grads)`` on bit-identical inputs
(:func:`make_inputs`); output sums and hidden / weight gradient norms then check the three
implementations against each other.

Memory (one step): CPU: VmHWM after the step - VmRSS after the inputs (``clear_refs`` reset), in a
process started with ``MALLOC_MMAP_THRESHOLD_=65536 MALLOC_TRIM_THRESHOLD_=0`` so every buffer over
64 KiB is its own mmap and RSS tracks live tensors; CUDA: ``max_memory_allocated`` above the inputs
(``{"oom": message}`` on OOM). Time: one warm-up step, then the medians over ``repeats`` steps of
the wall time (CUDA synchronised, ranks aligned by a barrier) and of the process CPU time
(``process_time``, robust on a busy machine).
"""

from __future__ import annotations

import gc
import json
import math
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
from bench_common import proc_status_mib

CONFIGS: dict[str, dict] = {
    "A": dict(desc="log-probs", calculate_entropy=False, calculate_sum_pi_squared=False,
              distillation_use_topk=False, distillation_only=False),
    "B": dict(desc="+ entropy", calculate_entropy=True, calculate_sum_pi_squared=False,
              distillation_use_topk=False, distillation_only=False),
    "C": dict(desc="+ sum-pi^2", calculate_entropy=True, calculate_sum_pi_squared=True,
              distillation_use_topk=False, distillation_only=False),
    "D": dict(desc="top-k KL, distillation_only", calculate_entropy=False, calculate_sum_pi_squared=False,
              distillation_use_topk=True, distillation_only=True),
    "E": dict(desc="top-k KL + log-probs + entropy", calculate_entropy=True, calculate_sum_pi_squared=False,
              distillation_use_topk=True, distillation_only=False),
}
GRAD_KEYS = ("log_probs", "entropy", "sum_pi_squared", "distillation_losses")
# The lm-head + processor of one training step from hidden states, on every row ("full") or only on
# the rows of a response mask (``RowSelection``, as ``outputs_on_loss_mask_only`` runs it): "head"
# forms the logits ``h @ weight.T`` inside the step, "fused-head" never does.
HEAD_IMPLS = ("head", "fused-head")
RESPONSE_BLOCK = 512
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def make_inputs(spec: dict, rank: int, device: torch.device) -> dict[str, torch.Tensor]:
    """Seeded inputs of one rank: ``hidden [N, H]`` (replicated) and this rank's ``weight [V_local, H]``
    (logits ~ N(0, 4)), requiring grad for the fused path; the logits paths get ``logits = hidden @
    weight.T`` (requiring grad, built outside the measured step). Labels, teacher ids / log-probs
    ``[N, k]`` and upstream gradients are the same on every rank."""
    n, v_local, k, tp, h = spec["tokens"], spec["vocab"], spec["k"], spec["tp"], spec["hidden"]
    v_global = v_local * tp
    dtype = DTYPES[spec["dtype"]]
    shared = torch.Generator(device=device).manual_seed(spec["seed"])
    own = torch.Generator(device=device).manual_seed(spec["seed"] * 1009 + rank + 1)
    hidden = torch.randn(n, h, generator=shared, device=device).to(dtype)
    weight = torch.randn(v_local, h, generator=own, device=device).mul_(2.0 / math.sqrt(h)).to(dtype)
    labels = torch.randint(0, v_global, (n,), generator=shared, device=device)
    perm = torch.randperm(v_global, generator=shared, device=device)
    offset = torch.randint(0, v_global, (n, 1), generator=shared, device=device)
    teacher_ids = perm[(offset + torch.arange(k, device=device)) % v_global]
    teacher_log_probs = (torch.log_softmax(2.0 * torch.randn(n, k, generator=shared, device=device), -1)
                         + math.log(0.9))
    grads = {key: torch.randn(n, generator=shared, device=device) for key in GRAD_KEYS}
    inputs = dict(hidden=hidden, weight=weight, labels=labels, teacher_ids=teacher_ids,
                  teacher_log_probs=teacher_log_probs, **{"grad_" + key: g for key, g in grads.items()})
    if spec["impl"] in HEAD_IMPLS:  # response masks: the last f of every block of RESPONSE_BLOCK tokens
        block = min(RESPONSE_BLOCK, n)
        pos = torch.arange(n, device=device) % block
        inputs["masks"] = {f: pos >= block - round(f * block) for f in spec["fractions"]}
    if spec["impl"] in ("fused", *HEAD_IMPLS):
        hidden.requires_grad_()
        weight.requires_grad_()
    else:
        inputs["logits"] = (hidden @ weight.T).requires_grad_()
    return inputs


def make_step(spec: dict, inputs: dict[str, torch.Tensor], group):
    """The function that runs one forward + backward of ``spec['impl']`` for ``spec['config']``."""
    flags = {key: val for key, val in CONFIGS[spec["config"]].items() if key != "desc"}
    temperature = spec["temperature"]
    batch = {"teacher_ids": inputs["teacher_ids"], "teacher_logprobs": inputs["teacher_log_probs"]}
    if spec["impl"] == "fused":
        from mcore_engine.processor import process_lm_head_hidden

        leaves = (inputs["hidden"], inputs["weight"])

        def forward():
            return process_lm_head_hidden(inputs["hidden"], inputs["weight"], inputs["labels"], temperature,
                                          batch=batch, group=group, chunk_size=spec.get("fused_chunk_size"),
                                          **flags)
    elif spec["impl"] == "ours":
        from mcore_engine.processor import process_lm_head_logits

        leaves = (inputs["logits"],)

        def forward():
            return process_lm_head_logits(inputs["logits"], inputs["labels"], temperature, batch=batch,
                                          group=group, chunk_size=spec.get("chunk_size"), **flags)
    elif spec["impl"] == "naive":
        from bench_naive import naive_process_lm_head_logits

        leaves = (inputs["logits"],)

        def forward():
            return naive_process_lm_head_logits(inputs["logits"], inputs["labels"], temperature,
                                                teacher_ids=inputs["teacher_ids"],
                                                teacher_log_probs=inputs["teacher_log_probs"], **flags)
    elif spec["impl"] in HEAD_IMPLS:
        return _head_step(spec, inputs, group, flags, batch)
    else:
        raise ValueError(f"impl must be 'ours', 'naive', 'fused' or one of {HEAD_IMPLS}, "
                         f"got {spec['impl']!r}")

    def step():
        for leaf in leaves:
            leaf.grad = None
        out = forward()
        keys = [key for key in GRAD_KEYS if key in out]
        torch.autograd.backward([out[key] for key in keys], [inputs["grad_" + key] for key in keys])
        return out

    return step


def _head_step(spec: dict, inputs: dict[str, torch.Tensor], group, flags: dict, batch: dict):
    """One step of a ``HEAD_IMPLS`` path: ``spec["select"]`` None (every row) or the fraction whose
    mask selects the rows; the upstream gradients reach every computed row."""
    from mcore_engine.processor import RowSelection, process_lm_head_hidden, process_lm_head_logits

    hidden, weight, t = inputs["hidden"], inputs["weight"], spec["temperature"]
    select = spec["select"]

    def step():
        hidden.grad = weight.grad = None
        h, labels, rows = hidden[None], inputs["labels"][None], None
        teacher = {k: v[None] for k, v in batch.items()}
        if select is not None:
            rows = RowSelection(inputs["masks"][select][None])
            h, labels = rows.take(h), rows.take(labels)
            teacher = {k: rows.take(v) for k, v in teacher.items()}
        if spec["impl"] == "head":
            out = process_lm_head_logits(h @ weight.T, labels, t, batch=teacher, group=group,
                                         chunk_size=spec.get("chunk_size"), **flags)
        else:
            out = process_lm_head_hidden(h, weight, labels, t, batch=teacher, group=group,
                                         chunk_size=spec.get("fused_chunk_size"), **flags)
        out = {k: (rows.put(v) if rows is not None else v)[0] for k, v in out.items()}
        keys = [key for key in GRAD_KEYS if key in out]
        torch.autograd.backward([out[key] for key in keys], [inputs["grad_" + key] for key in keys])
        return out

    return step


def gradient_checks(inputs: dict[str, torch.Tensor], group) -> dict[str, float]:
    """Norms of the gradients w.r.t. ``hidden`` (summed over the group) and ``weight``; for the
    logits paths from ``G = logits.grad``: ``all_reduce(G @ weight)``, ``G.T @ hidden``."""
    if "logits" in inputs:
        g = inputs["logits"].grad
        grad_h = g @ inputs["weight"]
        grad_w = g.T @ inputs["hidden"]
        if dist.get_world_size(group) > 1:
            dist.all_reduce(grad_h, group=group)
        checks = {"grad_norm": float(g.float().norm())}
    else:
        grad_h, grad_w = inputs["hidden"].grad, inputs["weight"].grad
        checks = {}
    checks.update(grad_hidden_norm=float(grad_h.float().norm()),
                  grad_weight_norm=float(grad_w.float().norm()))
    return checks


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_memory(step, inputs: dict, device: torch.device) -> dict:
    """Peak bytes above the inputs over one step, plus checksums of the outputs and the gradient."""
    for t in inputs.values():  # touch every input page
        if isinstance(t, torch.Tensor):
            t.detach().sum().item()
    gc.collect()
    if device.type == "cuda":
        _sync(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        out = step()
        _sync(device)
        peak_mb = (torch.cuda.max_memory_allocated(device) - base) / 2**20
    else:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        base = proc_status_mib("VmRSS")
        out = step()
        peak_mb = proc_status_mib("VmHWM") - base
    if "masks" in inputs:  # per response fraction: output sums over its rows
        checks = {f"{key}@{f}": float(val.detach().double()[m].sum()) for key, val in out.items()
                  for f, m in inputs["masks"].items()}
    else:
        checks = {key: float(val.detach().double().sum()) for key, val in out.items()}
    return {"peak_mb": peak_mb, "checks": checks}


def measure_time(step, device: torch.device, repeats: int, distributed: bool) -> dict:
    """Median wall and CPU time of ``repeats`` steps, after one warm-up step."""
    step()
    times, cpu_times = [], []
    for _ in range(repeats):
        if distributed:
            dist.barrier()
        _sync(device)
        t0, c0 = time.perf_counter(), time.process_time()
        step()
        _sync(device)
        times.append(time.perf_counter() - t0)
        cpu_times.append(time.process_time() - c0)
    return {"time_ms": 1e3 * statistics.median(times), "cpu_ms": 1e3 * statistics.median(cpu_times),
            "times_ms": [1e3 * t for t in times]}


def main(spec: dict) -> dict:
    torch.set_num_threads(spec.get("threads", 1))
    rank, tp, mode = int(os.environ.get("RANK", "0")), spec["tp"], spec["mode"]
    device = torch.device(spec["device"])
    if device.type == "cuda":
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    # Ours gets the group explicitly (no Megatron import); the naive path needs Megatron's
    # parallel_state, also at TP=1, because its cross entropy reads the TP group from there.
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=rank, world_size=tp)
    group = dist.group.WORLD
    if spec["impl"] == "naive":
        from megatron.core import parallel_state

        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    # A tiny step first: lazy imports and one-time set-up must not count as the step's memory.
    make_step(spec, make_inputs({**spec, "tokens": 3}, rank, device), group)()
    try:
        inputs = make_inputs(spec, rank, device)
        step = make_step(spec, inputs, group)
        if mode in ("memory", "both"):
            result = measure_memory(step, inputs, device)
            if spec["impl"] not in HEAD_IMPLS:
                result["checks"].update(gradient_checks(inputs, group))
        else:
            result = {}
        if mode in ("time", "both"):
            result.update(measure_time(step, device, spec["repeats"], tp > 1))
        elif mode != "memory":
            raise ValueError(f"mode must be 'memory', 'time' or 'both', got {mode!r}")
    except torch.cuda.OutOfMemoryError as exc:  # reported as "OOM" in the table (TP=1; TP>1 peers time out)
        result = {"oom": str(exc).splitlines()[0]}
    result["rank"] = rank
    dist.barrier()
    dist.destroy_process_group()
    return result


if __name__ == "__main__":
    print(json.dumps(main(json.loads(sys.argv[1]))), flush=True)
