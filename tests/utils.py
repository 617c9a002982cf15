"""Shared test helpers: a gloo multi-rank launcher, a dtype -> tolerance table, a verbose allclose.

Multi-rank checks run in fresh spawned processes (one per rank) that talk over gloo on a free
``tcp://127.0.0.1`` port. A launch costs seconds, so put many checks into one launched function.
"""

from __future__ import annotations

import os
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# Relative-norm error budgets on values AND gradients, by the logits' dtype.
REL_TOL: dict[torch.dtype, float] = {torch.float64: 1e-10, torch.float32: 1e-5, torch.bfloat16: 2e-2,
                                     torch.float16: 5e-3}


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """||actual - expected|| / max(||expected||, tiny), computed in float64."""
    a, e = actual.detach().double(), expected.detach().double()
    return float((a - e).norm() / e.norm().clamp_min(1e-30))


def assert_rel_close(actual: torch.Tensor, expected: torch.Tensor, tol: float, what: str = "") -> None:
    """Relative-norm check with a message that names the quantity, the error and the worst element."""
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert torch.isfinite(actual).all(), f"{what}: non-finite values in result"
    err = rel_err(actual, expected)
    if err > tol:
        diff = (actual.detach().double() - expected.detach().double()).abs()
        idx = int(diff.argmax())
        raise AssertionError(
            f"{what}: relative norm error {err:.3e} > {tol:.1e}; worst element at flat index {idx}: "
            f"{actual.flatten()[idx].item()!r} vs {expected.flatten()[idx].item()!r}"
        )


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _StartupError(AssertionError):
    """The ranks failed before ``fn`` ran (typically EADDRINUSE: another process took the port)."""


def _worker(rank: int, world_size: int, port: int, fn: Callable, args: tuple, err_q) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world_size)
    except BaseException:
        err_q.put((rank, "startup", traceback.format_exc()))
        raise
    try:
        fn(rank, world_size, *args)
        dist.barrier()  # no rank tears gloo down while a peer is still talking to it
    except BaseException:
        err_q.put((rank, "run", traceback.format_exc()))
        raise
    finally:
        dist.destroy_process_group()


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any) -> None:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned gloo ranks; re-raise failures.

    A launch whose ranks died without a Python traceback from ``fn`` (failed start-up, a gloo abort)
    is relaunched once; a failure inside ``fn`` is reported at once.
    """
    run_distributed_retrying(fn, world_size, *args, attempts=2)


def _run_once(fn: Callable[..., Any], world_size: int, *args: Any) -> None:
    """One launch of ``fn(rank, world_size, *args)`` on ``world_size`` spawned gloo ranks.

    ``fn`` must be a module-level function (it is pickled by reference). The default process group
    is initialised before ``fn`` runs and destroyed after it.
    """
    ctx = mp.get_context("spawn")
    err_q = ctx.SimpleQueue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, fn, args, err_q))
             for r in range(world_size)]
    for p in procs:
        p.start()
    errors: list[tuple[int, str]] = []
    deadline = time.monotonic() + 600
    failed_at = None
    # Poll rather than join: drain the queue (a big traceback would block its writer) and stop the
    # surviving ranks soon after one fails (they would otherwise wait in a collective until gloo's
    # 30-minute timeout).
    while any(p.is_alive() for p in procs):
        while not err_q.empty():
            errors.append(err_q.get())
        now = time.monotonic()
        if failed_at is None and any(p.exitcode not in (None, 0) for p in procs):
            failed_at = now
        if now > deadline or (failed_at is not None and now - failed_at > 15):
            for p in procs:
                if p.is_alive():
                    p.kill()
                    errors.append((-1, "kill", f"rank process {p.pid} killed (timeout or a peer failed)"))
            break
        time.sleep(0.05)
    for p in procs:
        p.join()
    while not err_q.empty():
        errors.append(err_q.get())
    if errors or any(p.exitcode != 0 for p in procs):
        msg = "\n".join(f"--- rank {r} ({phase}) ---\n{tb}" for r, phase, tb in sorted(errors))
        # No Python traceback from inside ``fn``: the ranks failed to start or died in C++ (gloo
        # aborts with "terminate called without an active exception" when its peers are slow to
        # start on an overloaded machine). Such runs are worth one relaunch.
        startup_only = all(phase != "run" for _, phase, _ in errors)
        cls = _StartupError if startup_only else AssertionError
        raise cls(f"distributed run failed (exit codes {[p.exitcode for p in procs]}):\n{msg}")


def run_distributed_retrying(fn: Callable[..., Any], world_size: int, *args: Any, attempts: int = 3) -> None:
    """``run_distributed``, relaunched (up to ``attempts`` times) when the ranks failed before ``fn``
    started: typically ``EADDRINUSE``, another process took the free port before rank 0 bound it."""
    for attempt in range(attempts):
        try:
            _run_once(fn, world_size, *args)
            return
        except _StartupError:
            if attempt == attempts - 1:
                raise
