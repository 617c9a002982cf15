"""Offload / onload: storages released while offloaded, bit-identical after onload, clear errors.

One launch of two gloo ranks walks four layouts (TP=2 fp32, TP=2 bf16 with fp32 main weights, DP=2
with the distributed optimizer, PP=2). Per layout, two engines from the same seed take a step; one
of them then offloads each part alone (only that part's storages are 0 bytes, the others intact),
then everything (every parameter, grad-buffer and optimizer-state storage is 0 bytes; the calls
that need a part raise ``RuntimeError`` naming it; with only the parameters back, inference runs
and training is still refused), onloads, and both take a second step: losses, grad norms,
parameters, main weights and Adam state are bit-identical to the engine that never offloaded.

Then a ``forward_only`` engine per layout loads the trained engine's checkpoint: no DDP wrapper,
optimizer or gradient storage, ``infer_batch`` and ``forward_backward_batch(forward_only=True)``
outputs bit-identical to the trained engine's, every training call refused naming ``forward_only``.
At TP=2 also: its weight stream equals the trained engine's, offload / onload move the parameters
only, and its model-only checkpoint loads back into a training engine.

Offload is all or nothing (TP=2, fp32 and bf16): the weight stream shares no live storage (a
receiver's ``.numpy()`` pins nothing), a storage pinned by ``.numpy()`` is refused naming its owner
before anything moves, and a failure part-way puts back every storage it had freed.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from tests.engine_setup import engine_snapshot, flat_values, make_batch, policy_loss, tiny_config
from tests.utils import assert_identical, run_distributed

LAYOUTS = {"tp2": dict(tp=2), "tp2-bf16": dict(tp=2, precision="bf16"),
           "dp2-distributed-optimizer": dict(use_distributed_optimizer=True), "pp2": dict(pp=2)}


def _key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def _part_tensors(engine) -> dict[str, list[torch.Tensor]]:
    """What each part holds, found from the engine's objects (not through the offloader)."""
    from mcore_engine.step.optimizer import sub_optimizers

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


def _step(engine, seed: int):
    out = engine.train_batch(make_batch(seed, 5, calculate_entropy=True), policy_loss)
    return out.get_non_tensor("loss").clone(), out.get_non_tensor("metrics")["grad_norm"]


def _refused(call, *args, needs: str) -> None:
    with pytest.raises(RuntimeError, match=needs):
        call(*args)


def _outputs(out) -> list[torch.Tensor]:
    return [flat_values(out[key]) for key in ("log_probs", "entropy")]


def _forward_only(name: str, kwargs: dict, trained, other, path: str) -> None:
    """A ``forward_only`` engine from ``trained``'s checkpoint against ``trained`` (module docstring);
    ``other`` (a training engine of the same layout) loads the forward-only engine's checkpoint."""
    from megatron.core.distributed import DistributedDataParallel

    from mcore_engine.engine import MegatronEngine

    engine = MegatronEngine(dataclasses.replace(tiny_config(**kwargs), forward_only=True))
    engine.initialize()
    trained.save_checkpoint(os.path.join(path, name))
    engine.load_checkpoint(os.path.join(path, name))
    params = [p for chunk in engine.model for p in chunk.module.parameters()]
    assert engine.optimizer is None and engine.lr_scheduler is None, name
    assert not any(isinstance(chunk, DistributedDataParallel) for chunk in engine.model), name
    assert not any(p.grad is not None or hasattr(p, "main_grad") for p in params), name
    assert_identical(params, [p for chunk in trained.model for p in chunk.module.parameters()],
                     f"{name}: weights")

    batch = make_batch(3, 5, calculate_entropy=True)
    want = _outputs(trained.infer_batch(batch))
    assert_identical(_outputs(engine.infer_batch(batch)), want, f"{name}: forward_only infer_batch")
    assert_identical(_outputs(engine.forward_backward_batch(batch, None, forward_only=True)), want,
                     f"{name}: forward_only forward_backward_batch")
    calls = {"train_batch": (engine.train_batch, batch, policy_loss),
             r"forward_backward_batch\(forward_only=False\)": (engine.forward_backward_batch, batch,
                                                               policy_loss),
             "zero_grad": (engine.zero_grad,), "optimizer_step": (engine.optimizer_step,),
             "lr_scheduler_step": (engine.lr_scheduler_step,)}
    for what, (call, *args) in calls.items():
        _refused(call, *args, needs=rf"^{what}: .*forward_only=True")
    if name != "tp2":
        return

    ours, theirs = list(engine.per_tensor_generator()), list(trained.per_tensor_generator())
    assert [k for k, _ in ours] == [k for k, _ in theirs], name
    assert_identical([t for _, t in ours], [t for _, t in theirs],
                     f"{name}: forward_only per_tensor_generator")
    engine.offload()
    assert engine.offloaded == {"params"} and all(p.untyped_storage().size() == 0 for p in params), name
    assert engine._offloader.device_bytes() == {"params": 0, "grads": 0, "optimizer": 0}, name
    _refused(engine.infer_batch, batch, needs=r"infer_batch needs \['params'\]")
    engine.onload()
    assert engine.offloaded == frozenset(), name
    assert_identical(_outputs(engine.infer_batch(batch)), want, f"{name}: forward_only infer after onload")

    engine.save_checkpoint(os.path.join(path, "forward-only"))  # model only, into a training engine
    other.load_checkpoint(os.path.join(path, "forward-only"))
    assert_identical(_outputs(other.infer_batch(batch)), want,
                     f"{name}: training engine on the model-only checkpoint")
    other.train_batch(batch, policy_loss)


def _pin(t: torch.Tensor) -> None:
    """What a receiver's ``.numpy()`` does to ``t``'s storage: marks it not resizable, for good."""
    (t.detach().view(torch.int16) if t.dtype == torch.bfloat16 else t.detach()).numpy()


def _offload_is_atomic(name: str, engine) -> None:
    """Streamed tensors pin nothing; a pinned storage is refused before anything moves; a failure
    part-way (the pre-check bypassed) puts back everything it freed. Pins ``engine`` for good."""
    import mcore_engine.state.offload as offload_module
    from mcore_engine.step.optimizer import sub_optimizers

    batch = make_batch(4, 5, calculate_entropy=True)
    want, before, full = _outputs(engine.infer_batch(batch)), engine_snapshot(engine), _sizes(engine)
    live = {_key(t) for part in _part_tensors(engine).values() for t in part}
    for hf_name, t in engine.per_tensor_generator():
        assert _key(t) not in live, f"{name}: {hf_name} shares a live storage"
        _pin(t)
    engine.offload()
    engine.onload()
    assert_identical(_outputs(engine.infer_batch(batch)), want, f"{name}: after a receiver's .numpy()")

    # an Adam state storage pinned: the last part, so params and grads would be freed before it
    states = [v for sub in sub_optimizers(engine.optimizer) for st in sub.optimizer.state.values()
              for v in st.values() if torch.is_tensor(v) and v.numel() > 1]
    _pin(states[-1])
    _refused(engine.offload, needs=r"'optimizer' storage .*not resizable.*nothing was offloaded")
    assert engine.offloaded == frozenset() and _sizes(engine) == full, f"{name}: moved before refusing"
    check = offload_module._not_resizable
    offload_module._not_resizable = lambda plan: []
    try:
        _refused(engine.offload, needs="resiz")
    finally:
        offload_module._not_resizable = check
    assert engine.offloaded == frozenset() and _sizes(engine) == full, f"{name}: not rolled back"
    assert_identical(engine_snapshot(engine), before, f"{name}: rolled back, but not bit-identical")
    assert_identical(_outputs(engine.infer_batch(batch)), want, f"{name}: infer after the rollback")

    pname, param = list(engine.model[-1].module.named_parameters())[-1]
    _pin(param)
    _refused(engine.offload, needs=rf"parameter '{pname}'.*not resizable")
    assert engine.offloaded == frozenset() and _sizes(engine) == full, f"{name}: moved before refusing"


def _offload_layouts(rank: int, world_size: int, path: str) -> None:
    from mcore_engine.engine import MegatronEngine
    from mcore_engine.parallel.platform import destroy_distributed

    for name, kwargs in LAYOUTS.items():
        destroy_distributed()
        engines = [MegatronEngine(tiny_config(**kwargs)) for _ in range(2)]
        for engine in engines:
            engine.initialize()
        ref, moved = engines
        assert_identical(engine_snapshot(ref), engine_snapshot(moved),
                         f"{name}: engines differ before the test")
        _step(ref, 1)
        _step(moved, 1)
        before, full = engine_snapshot(moved), _sizes(moved)
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
            assert_identical(engine_snapshot(moved), before, f"{name}: {part} not bit-identical after onload")

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
        assert_identical(engine_snapshot(moved), before, f"{name}: not bit-identical after the full offload")

        assert _step(moved, 2) == _step(ref, 2), f"{name}: loss / grad norm after onload"
        assert_identical(engine_snapshot(moved), engine_snapshot(ref), f"{name}: state after the next step")
        _forward_only(name, kwargs, ref, moved, path)
        if name in ("tp2", "tp2-bf16"):
            _offload_is_atomic(name, moved)


def test_offload_onload_is_bit_identical_and_releases_storage(tmp_path):
    run_distributed(_offload_layouts, 2, str(tmp_path))
