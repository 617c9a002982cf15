"""Controller -> worker commands for TP / PP > 1 behind one server process.

Global rank 0 (the controller, inside SkyRL's engine loop) runs each collective command itself and
first broadcasts ``(method, kwargs)`` to the workers (ranks >= 1) over a gloo group of its own with a
one-year timeout (idle workers wait in that broadcast while the server waits for clients). After every
command all ranks all-gather their status, so a rank that failed alone cannot leave the others
waiting in a collective, and the controller raises one error naming each failed rank::

    controller: broadcast (method, kwargs) -> result = impl.method(**kwargs) -> all-gather errors
    worker:     loop { receive -> impl.method(**kwargs) -> all-gather errors } until "shutdown"

Kwargs are plain python or pydantic objects (pickled). With one rank nothing is broadcast.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch.distributed as dist

__all__ = ["SHUTDOWN", "Controller", "control_group", "run_worker"]

SHUTDOWN = "shutdown"
_TIMEOUT = timedelta(days=365)


def control_group() -> Any:
    """A new gloo group over the whole world with a one-year timeout (collective: every rank calls
    it, in the same order as its other ``new_group`` calls); ``None`` for a world of one."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    return dist.new_group(backend="gloo", timeout=_TIMEOUT)


def _status(group: Any, error: str | None) -> list[str | None]:
    errors: list[str | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(errors, error, group=group)
    return errors


def _run(impl: Any, method: str, kwargs: dict[str, Any]) -> tuple[Any, str | None]:
    try:
        return getattr(impl, method)(**kwargs), None
    except Exception as exc:  # reported to every rank through the status all-gather
        return None, f"{type(exc).__name__}: {exc}"


class Controller:
    """Rank 0's side: :meth:`call` runs a command on every rank and returns rank 0's result."""

    def __init__(self, impl: Any, group: Any) -> None:
        self.impl, self.group = impl, group
        self.closed = False

    def call(self, method: str, **kwargs: Any) -> Any:
        """``impl.method(**kwargs)`` on every rank; rank 0's result, or ``RuntimeError`` naming the
        ranks that failed (a failure of rank 0 alone with one rank: its own exception)."""
        if self.closed:
            raise RuntimeError(f"{method}: the backend was shut down")
        if self.group is None:
            return getattr(self.impl, method)(**kwargs)
        dist.broadcast_object_list([(method, kwargs)], src=0, group=self.group)
        result, error = _run(self.impl, method, kwargs)
        errors = _status(self.group, error)
        failed = [(r, e) for r, e in enumerate(errors) if e]
        if failed:
            if len(failed) == 1 and failed[0][0] == 0:
                raise RuntimeError(failed[0][1])
            raise RuntimeError("; ".join(f"rank {r}: {e}" for r, e in failed))
        return result

    def shutdown(self) -> None:
        """Release the workers (their :func:`serve` returns); idempotent."""
        if self.closed:
            return
        self.closed = True
        if self.group is not None:
            dist.broadcast_object_list([(SHUTDOWN, {})], src=0, group=self.group)


def serve(impl: Any, group: Any) -> None:
    """A worker's loop: run each broadcast command, report its status, return at shutdown."""
    while True:
        message: list[Any] = [None]
        dist.broadcast_object_list(message, src=0, group=group)
        method, kwargs = message[0]
        if method == SHUTDOWN:
            return
        _, error = _run(impl, method, kwargs)
        _status(group, error)


def run_worker(base_model: str, config: Any) -> None:
    """Ranks >= 1 of the engine process: build the backend's per-rank state (as rank 0 does) and follow
    the controller's commands until it shuts down."""
    from mcore_engine.integrations.tinker.backend import McoreEngineBackend

    backend = McoreEngineBackend(base_model, config)
    if backend.is_controller:
        raise RuntimeError("run_worker is for ranks >= 1; rank 0 is the controller (McoreEngineBackend)")
    serve(backend._impl, backend._ctrl.group)
