"""Offload / onload: storages released while offloaded, bit-identical after onload, clear errors.

One launch of two gloo ranks walks four layouts (TP=2 fp32, TP=2 bf16 with fp32 main weights, DP=2
with the distributed optimizer, PP=2). Per layout, two engines from the same seed take a step; one
of them then offloads each part alone (only that part's storages are 0 bytes, the others intact),
then everything (every parameter, grad-buffer and optimizer-state storage is 0 bytes; the calls
that need a part raise ``RuntimeError`` naming it; with only the parameters back, inference runs
and training is still refused), onloads, and both take a second step: losses, grad norms,
parameters, main weights and Adam state are bit-identical to the engine that never offloaded.
"""

from __future__ import annotations

import pytest
import torch

from tests.engine_setup import make_batch, policy_loss, tiny_config
from tests.utils import run_distributed

LAYOUTS = {"tp2": dict(tp=2), "tp2-bf16": dict(tp=2, precision="bf16"),
           "dp2-distributed-optimizer": dict(use_distributed_optimizer=True), "pp2": dict(pp=2)}


def _key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def _part_tensors(engine) -> dict[str, list[torch.Tensor]]:
    """What each part holds, found from the engine's objects (not through the offloader)."""
    from mcore_engine.optim import sub_optimizers

    params = [p for chunk in engine.model for p in chunk.module.parameters()]
    grads = [b.grad_data for chunk in engine.model for b in chunk.buffers]
    grads += [p.main_grad for p in params if getattr(p, "main_grad", None) is not None]
    owned = {_key(t) for t in params + grads}
    opt = []
    for sub in sub_optimizers(engine.optimizer):
        opt += [v for s in sub.optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
        opt += [p for g in sub.optimizer.param_groups for p in g["params"] if _key(p) not in owned]
    return {"params": params, "grads": grads, "optimizer": opt}


def _sizes(engine) -> dict[str, list[int]]:
    return {part: [t.untyped_storage().size() for t in ts] for part, ts in _part_tensors(engine).items()}


def _snapshot(engine) -> list[torch.Tensor]:
    from mcore_engine.optim import sub_optimizers

    out = [p.detach().clone() for chunk in engine.model for p in chunk.module.parameters()]
    for sub in sub_optimizers(engine.optimizer):
        out += [p.detach().clone() for g in sub.optimizer.param_groups for p in g["params"]]
        out += [s[k].clone() for s in sub.optimizer.state.values() for k in sorted(s)
                if torch.is_tensor(s[k])]
    return out


def _same(a: list[torch.Tensor], b: list[torch.Tensor], what: str) -> None:
    assert len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True)), what


def _step(engine, seed: int):
    out = engine.train_batch(make_batch(seed, 5, calculate_entropy=True), policy_loss)
    return out.get_non_tensor("loss").clone(), out.get_non_tensor("metrics")["grad_norm"]


def _refused(call, *args, needs: str) -> None:
    with pytest.raises(RuntimeError, match=needs):
        call(*args)


def _offload_layouts(rank: int, world_size: int) -> None:
    from mcore_engine.engine import MegatronEngine
    from mcore_engine.platform import destroy_distributed

    for name, kwargs in LAYOUTS.items():
        destroy_distributed()
        engines = [MegatronEngine(tiny_config(**kwargs)) for _ in range(2)]
        for engine in engines:
            engine.initialize()
        ref, moved = engines
        _same(_snapshot(ref), _snapshot(moved), f"{name}: engines differ before the test")
        _step(ref, 1)
        _step(moved, 1)
        before, full = _snapshot(moved), _sizes(moved)
        assert all(n > 0 for sizes in full.values() for n in sizes) and full["optimizer"], name

        for part in ("params", "grads", "optimizer"):  # each part alone
            moved.offload(**{p: p == part for p in ("params", "grads", "optimizer")})
            assert moved.offloaded == {part}, f"{name}: offloaded {moved.offloaded}"
            sizes = _sizes(moved)
            assert all(n == 0 for n in sizes[part]), f"{name}: {part} storages not released"
            for other in {"params", "grads"} - {part}:
                assert sizes[other] == full[other], f"{name}: offloading {part} touched {other}"
            moved.onload()
            assert moved.offloaded == frozenset() and _sizes(moved) == full, f"{name}: {part} onload"
            _same(_snapshot(moved), before, f"{name}: {part} not bit-identical after onload")

        moved.offload()
        moved.offload(grads=True)  # already offloaded: nothing happens
        assert all(n == 0 for sizes in _sizes(moved).values() for n in sizes), f"{name}: storages held"
        batch = make_batch(2, 5, calculate_entropy=True)
        _refused(moved.train_batch, batch, policy_loss, needs=r"train_batch needs \['params'")
        _refused(moved.infer_batch, batch, needs=r"infer_batch needs \['params'\]")
        _refused(moved.forward_backward_batch, batch, policy_loss, needs="forward_backward_batch")
        _refused(moved.optimizer_step, needs="optimizer_step")
        _refused(moved.per_tensor_generator, needs="per_tensor_generator")
        _refused(moved.save_checkpoint, "never-written", needs="save_checkpoint")
        moved.onload(grads=False, optimizer=False)  # the inference-only state of a colocated rollout
        moved.infer_batch(batch)
        _refused(moved.train_batch, batch, policy_loss, needs=r"\['grads', 'optimizer'\]")
        moved.onload()
        _same(_snapshot(moved), before, f"{name}: not bit-identical after the full offload")

        assert _step(moved, 2) == _step(ref, 2), f"{name}: loss / grad norm after onload"
        _same(_snapshot(moved), _snapshot(ref), f"{name}: state after the next step")


def test_offload_onload_is_bit_identical_and_releases_storage():
    run_distributed(_offload_layouts, 2)
