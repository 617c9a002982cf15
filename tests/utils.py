"""Shared test helpers: a gloo multi-rank launcher, a dtype -> tolerance table, a verbose allclose.

Multi-rank checks run in fresh processes (one per rank) that meet at a gloo file store. A launch
costs about a second, more with Megatron imports, so put many checks into one launched function.
"""

from __future__ import annotations

import os
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# Relative-norm error budgets on values and gradients, by the logits' dtype.
REL_TOL: dict[torch.dtype, float] = {torch.float64: 1e-10, torch.float32: 1e-5, torch.bfloat16: 2e-2,
                                     torch.float16: 5e-3}


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """||actual - expected|| / max(||expected||, tiny), computed in float64; ``actual`` must be finite
    and of the expected shape. The one relative error of the tests (``tests.compare`` builds on it)."""
    a, e = actual.detach().double(), expected.detach().double()
    assert a.shape == e.shape, f"shape {tuple(a.shape)} != {tuple(e.shape)}"
    assert torch.isfinite(a).all(), "non-finite values"
    return float((a - e).norm() / e.norm().clamp_min(1e-300))


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


def assert_identical(actual: list[torch.Tensor], expected: list[torch.Tensor], what: str) -> None:
    """The two lists have the same length and are equal tensor by tensor, bit for bit."""
    assert len(actual) == len(expected) and all(
        torch.equal(x, y) for x, y in zip(actual, expected, strict=True)), what


def _worker(rank: int, world_size: int, store: str, env: dict, fn: Callable, args: tuple, err_q) -> None:
    os.environ.clear()
    os.environ.update(env)  # the caller's environment, not the one the fork server started with
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world_size)
        fn(rank, world_size, *args)
        dist.barrier()  # no rank tears gloo down while a peer is still talking to it
    except BaseException:
        err_q.put((rank, traceback.format_exc()))
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any) -> None:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned gloo ranks; re-raise failures.

    ``fn`` must be a module-level function (it is pickled by reference). The ranks are forked from
    one fork server per session that has imported torch (about 0.5 s a launch instead of ~4 s for
    fresh interpreters) and get the caller's environment. They meet at a file store in a fresh
    directory under ``$TMPDIR``, removed afterwards; the default process group is initialised
    before ``fn`` runs and destroyed after it. When a rank fails, the others are killed 15 s later
    (they would otherwise wait in a collective until gloo's timeout) and every rank's traceback is
    raised in one ``AssertionError``.
    """
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed"])
    err_q = ctx.SimpleQueue()
    with tempfile.TemporaryDirectory(prefix="gloo-") as tmp:
        store = os.path.join(tmp, "store")
        procs = [ctx.Process(target=_worker, args=(r, world_size, store, dict(os.environ), fn, args, err_q))
                 for r in range(world_size)]
        for p in procs:
            p.start()
        errors: list[tuple[int, str]] = []
        deadline = time.monotonic() + 600
        failed_at = None
        # Poll rather than join: drain the queue (a big traceback would block its writer).
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
                        errors.append((-1, f"rank process {p.pid} killed (timeout or a peer failed)"))
                break
            time.sleep(0.05)
        for p in procs:
            p.join()
        while not err_q.empty():
            errors.append(err_q.get())
    if errors or any(p.exitcode != 0 for p in procs):
        msg = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(errors))
        raise AssertionError(f"distributed run failed (exit codes {[p.exitcode for p in procs]}):\n{msg}")
