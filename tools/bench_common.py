"""What the benchmark scripts in tools/ share: the machine / versions header, the result table,
/proc/self/status memory figures and the activations saved for backward.

The scripts run from tools/ (``python tools/bench_moe.py``), so they import this module by its bare name.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from importlib import metadata

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _proc_field(path: str, key: str) -> str | None:
    """The value of the first ``key: value`` line of a /proc file, or None."""
    try:
        with open(path) as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith(key)), None)
    except OSError:
        return None


def proc_status_mib(field: str) -> float:
    """A ``kB`` field of /proc/self/status (``VmRSS``, ``VmHWM``) in MiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


class SavedActivations:
    """``saved_tensors_hooks`` that add up the distinct non-parameter storages autograd saves (the
    activations kept for backward; exact on any device). ``mb``: their total in MiB."""

    def __init__(self, params) -> None:
        self.params = {p.untyped_storage().data_ptr() for p in params}
        self.storages: dict[int, int] = {}
        self.hooks = None

    def pack(self, t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in self.params:
            self.storages[storage.data_ptr()] = storage.nbytes()
        return t

    def __enter__(self):
        import torch

        self.hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)
        self.hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.hooks.__exit__(*exc)

    @property
    def mb(self) -> float:
        return sum(self.storages.values()) / 2**20


def measured_step(engine, step) -> tuple[float, float]:
    """Run ``step()`` (one ``train_batch``) once more and return ``(peak MiB, saved MiB)``: the
    memory above its start (CUDA: ``max_memory_allocated`` above the allocated bytes; CPU: VmHWM
    after a reset, above VmRSS) and the activations autograd saved for backward."""
    import torch

    cuda = torch.cuda.is_available()
    if cuda:
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    else:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        base = proc_status_mib("VmRSS")
    with SavedActivations(p for chunk in engine.model for p in chunk.module.parameters()) as saved:
        step()
    if cuda:
        torch.cuda.synchronize()
        return (torch.cuda.max_memory_allocated() - base) / 2**20, saved.mb
    return proc_status_mib("VmHWM") - base, saved.mb


def usable_cores() -> int:
    """The CPU cores this process may run on (its affinity mask where the platform has one)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "not installed"


def machine_header(extra: str = "", packages: tuple[str, ...] = ()) -> list[str]:
    """Two lines: ``machine:`` (host, usable cores, CPU model, RAM, GPU, then ``extra``) and ``versions:``
    (python, torch, megatron-core, then each of ``packages``)."""
    import torch

    cpu = _proc_field("/proc/cpuinfo", "model name") or platform.processor() or "unknown"
    mem_kb = _proc_field("/proc/meminfo", "MemTotal")
    mem = f", {int(mem_kb.split()[0]) / 2**20:.1f} GiB RAM" if mem_kb else ""
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
    versions = ", ".join(f"{p} {_version(p)}" for p in ("megatron-core", *packages))
    return [f"machine: {platform.node()}, {usable_cores()} cores ({cpu}){mem}, GPU: {gpu}{extra}",
            f"versions: python {platform.python_version()}, torch {torch.__version__}, {versions}"]


def format_table(columns: list[str], rows: list[list[str]], markdown: bool = False, *,
                 right: bool = False) -> str:
    """``rows`` under the header ``columns``: a markdown table, or columns padded to their widest cell
    (left-aligned, or right-aligned with ``right``), two spaces apart, a dashed line under the header."""
    if markdown:
        lines = ["| " + " | ".join(columns) + " |", "|" + "|".join("---" for _ in columns) + "|"]
        return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])
    widths = [max([len(c), *(len(r[i]) for r in rows)]) for i, c in enumerate(columns)]
    fmt = "  ".join(f"{{:{'>' if right else '<'}{w}}}" for w in widths)
    return "\n".join([fmt.format(*columns), fmt.format(*("-" * w for w in widths))]
                     + [fmt.format(*r) for r in rows])


def run_torchrun_worker(script: str, nproc: int, args: list[str], timeout: int, *,
                        track_memory: bool = True) -> dict:
    """Run ``script args`` under ``torchrun --standalone --nproc_per_node=nproc`` and return the JSON
    its rank 0 printed after ``RESULT ``; ``RuntimeError`` with the output's tail when there is none.

    The worker imports the repository (``PYTHONPATH``), runs one thread per rank unless
    ``OMP_NUM_THREADS`` is set, and with ``track_memory`` mmaps allocations over 64 KiB and never trims
    the heap, so its RSS tracks live bytes (the peak-memory columns)."""
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    if track_memory:
        env.update(MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           script, *args]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False, timeout=timeout)
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if line is None:
        raise RuntimeError(f"{os.path.basename(script)} {' '.join(args)} failed:\n{out.stdout[-2000:]}\n"
                           f"{out.stderr[-4000:]}")
    return json.loads(line[len("RESULT "):])
