"""The Qwen3.5 hybrid (3 Gated DeltaNet layers + 1 gated attention layer, ``tests.parallel_setup``'s
``"hybrid"`` / ``"hybrid-moe"`` from trained-like weights) with the engine's other features.

Launch 1 (one gloo rank): the reference (two ``train_batch`` steps: losses, grad norms, outputs, the
first step's gradients, the weights after each step, the weight stream of the initial weights);
activation recompute (full uniform / block, selective ``core_attn`` and ``core_attn`` + ``mlp``:
Megatron's full recompute checkpoints whole layers, GDN mixers included; ``core_attn`` touches the
attention layer only) gives the outputs, loss and every gradient of no recompute bit for bit; the
hybrid MoE's recorded routing replayed reproduces the outputs, loss and gradients bit for bit.

Launch 2 (two gloo ranks), from the reference's initial weights, the batch rows split over DP:
- DP=2 with the distributed optimizer, TP=2, PP=2, PP=2 x VPP=2, TP=2 + SP with full recompute,
  CP=2 with block recompute: the weight stream (``per_tensor_generator`` and the bucketed one)
  equals one rank's bit for bit; two steps equal the reference (loss, grad norm, outputs 1e-5,
  weights ``tests.compare``); a checkpoint after step 1.
- the checkpoints reshard: TP=2, PP=2 and PP=2 x VPP=2 load at TP=1 / PP=1 (DP=2; full recompute on
  the PP one, GDN chunks of 4 tokens instead of 8 on the VPP one: a compute choice, not state), DP=2
  with the distributed optimizer loads at TP=2 with the distributed optimizer: the stream after the
  load equals the saver's bit for bit, the next step equals the reference's step 2; a hybrid of other
  layer types refuses the checkpoint (``ValueError`` naming ``model.linear_attention``), unchanged.
- TP=2: offload / onload between the steps (a colocated cycle): every storage released, parameters,
  main weights and Adam state bit-identical after the onload, the next step equal to the reference.
- the hybrid MoE at EP=2: router replay reproduces the outputs, loss and gradients bit for bit; after
  a step its checkpoint loads at EP=1 (the stream bit for bit).

No launch: config fields the engine cannot honour on a hybrid raise ``ValueError`` naming them.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from tests.engine_setup import (
    check_router_replay,
    flat_values,
    full_state,
    load_full_state,
    local_params,
    main_grads,
    policy_loss,
)
from tests.parallel_setup import GDN, TOL, batches, config, same_tensors, trained_like
from tests.utils import assert_identical, assert_rel_close, run_distributed

KEYS = ("log_probs", "entropy")


def _config(model: str = "hybrid", *, distopt: bool = False, **kwargs):
    """``tests.parallel_setup.config`` with the distributed optimizer on (``distopt``), any
    ``EngineConfig`` recompute field and the GDN ``chunk_size``."""
    recompute = {k: kwargs.pop(k) for k in list(kwargs) if k.startswith("recompute_")}
    chunk_size = kwargs.pop("chunk_size", None)
    cfg = config(model, **kwargs)
    optimizer = dataclasses.replace(cfg.optimizer, use_distributed_optimizer=distopt)
    if chunk_size is not None:
        gdn = dataclasses.replace(cfg.model.linear_attention, chunk_size=chunk_size)
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, linear_attention=gdn))
    return dataclasses.replace(cfg, optimizer=optimizer, **recompute)


def _rows(batch):
    """This DP rank's rows of ``batch`` and its first / last token offsets in the packed batch."""
    from megatron.core import parallel_state as ps

    n, dp, r = batch.batch_size[0], ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    start, stop = r * n // dp, (r + 1) * n // dp
    offsets = batch["input_ids"].offsets()
    return batch[torch.arange(start, stop)], slice(int(offsets[start]), int(offsets[stop]))


def _step(engine, batch) -> dict:
    """One ``train_batch`` on this DP rank's rows: loss, grad norm, outputs, (clipped) gradients."""
    mine, tokens = _rows(batch)
    out = engine.train_batch(mine, policy_loss)
    metrics = out.get_non_tensor("metrics")
    assert metrics["update_skipped"] == 0.0
    got = {"loss": out.get_non_tensor("loss").clone(), "tokens": tokens,
           "grad_norm": torch.tensor(metrics["grad_norm"], dtype=torch.float64),
           "grads": [{k: p.main_grad.detach().float().clone() for k, p in chunk.module.named_parameters()}
                     for chunk in engine.model],
           **{k: flat_values(out[k]) for k in KEYS}}
    engine.lr_scheduler_step()
    return got


def _same_step(name: str, got: dict, ref: dict, i: int) -> None:
    """Step ``i`` (0 or 1) of a layout against the reference's: loss, grad norm, this rank's outputs."""
    from tests.parallel_setup import after_steps

    tol = after_steps(TOL, i)
    assert_rel_close(got["loss"], ref["steps"][i]["loss"], tol, f"{name}: step {i + 1} loss")
    assert_rel_close(got["grad_norm"], ref["steps"][i]["grad_norm"], tol, f"{name}: step {i + 1} grad norm")
    for key in KEYS:
        assert_rel_close(got[key], ref["steps"][i][key][got["tokens"]], tol, f"{name}: step {i + 1} {key}")


def _stream(engine) -> dict[str, torch.Tensor]:
    return {n: t.clone() for n, t in engine.per_tensor_generator()}


def _same_stream(engine, want: dict[str, torch.Tensor], what: str) -> None:
    """``per_tensor_generator`` and the bucketed generator give ``want``: names, order, bits."""
    from mcore_engine.weight_sync import unflatten_bucket

    got = _stream(engine)
    assert list(got) == list(want), f"{what}: streamed names"
    assert_identical(list(got.values()), list(want.values()), f"{what}: streamed tensors")
    bucketed = {}
    for bucket, meta in engine.bucketed_weight_generator(1 << 14):
        bucketed.update({n: t.clone() for n, t in unflatten_bucket(bucket, meta).items()})
    assert list(bucketed) == list(want), f"{what}: bucketed names"
    assert_identical(list(bucketed.values()), list(want.values()), f"{what}: bucketed tensors")


def _storage_bytes(engine) -> int:
    from mcore_engine.step.optimizer import sub_optimizers

    tensors = [p for chunk in engine.model for p in chunk.module.parameters()]
    tensors += [b.grad_data for chunk in engine.model for b in chunk.buffers]
    for sub in sub_optimizers(engine.optimizer):
        tensors += [v for s in sub.optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
        tensors += [p for g in sub.optimizer.param_groups for p in g["params"]]
    return sum(t.untyped_storage().size() for t in tensors)


# ---------------------------------------------------------------------------------------- launch 1
# name -> config fields, the modules that run twice per micro-batch (forward and recompute): GDN
# mixers gdn0-2, the attention layer's core attention core_attn3, MLPs mlp0-3
FULL = dict(recompute_granularity="full")
MLPS = {f"mlp{i}" for i in range(4)}
RECOMPUTE = {"full-uniform": (dict(FULL, recompute_method="uniform", recompute_num_layers=1),
                              {"gdn0", "gdn1", "gdn2", "core_attn3", *MLPS}),
             "full-block": (dict(FULL, recompute_method="block", recompute_num_layers=3),
                            {"gdn0", "gdn1", "gdn2", "mlp0", "mlp1", "mlp2"}),
             "selective-core-attn": (dict(recompute_granularity="selective", recompute_modules=["core_attn"]),
                                     {"core_attn3"}),
             "selective-core-attn-mlp": (dict(recompute_granularity="selective",
                                              recompute_modules=["core_attn", "mlp"]), {"core_attn3", *MLPS})}


def _forward_backward(engine, batch) -> tuple[list[torch.Tensor], dict[str, int]]:
    """Loss, outputs and every gradient of one ``forward_backward_batch``, and how often the GDN
    mixers, the attention layer's core attention and the MLPs ran."""
    from mcore_engine.layers.gated_delta_net import GatedDeltaNet

    calls, hooks = {}, []
    for chunk in engine.model:
        for i, layer in enumerate(chunk.module.decoder.layers):
            mixer = layer.self_attention
            for name, module in ((f"gdn{i}", mixer) if isinstance(mixer, GatedDeltaNet)
                                 else (f"core_attn{i}", mixer.core_attention), (f"mlp{i}", layer.mlp)):
                calls[name] = 0
                hooks.append(module.register_forward_hook(
                    lambda *_, n=name: calls.__setitem__(n, calls[n] + 1)))
    engine.zero_grad()
    out = engine.forward_backward_batch(batch, policy_loss)
    for hook in hooks:
        hook.remove()
    got = [out.get_non_tensor("loss").clone(), *(flat_values(out[k]) for k in KEYS)]
    grads = main_grads(engine)
    engine.zero_grad()
    return got + [grads[k] for k in sorted(grads)], calls


def _one_rank(rank: int, world_size: int, path: str) -> None:
    from mcore_engine.engine import MegatronEngine
    from mcore_engine.parallel.platform import destroy_distributed

    data = batches()
    engine = MegatronEngine(_config())
    engine.initialize()
    trained_like(engine)
    ref = {"full0": full_state(engine), "stream0": _stream(engine), "steps": []}
    want = _forward_backward(engine, data[0])  # no recompute
    for batch in data:
        ref["steps"].append(_step(engine, batch))
        ref.setdefault("full1", full_state(engine))
    ref["full2"] = full_state(engine)
    del engine
    destroy_distributed()

    want, once = want
    assert len(once) == 8 and all(once.values()), once
    for name, (kwargs, twice) in RECOMPUTE.items():
        engine = MegatronEngine(_config(**kwargs))
        engine.initialize()
        load_full_state(engine, ref["full0"])
        got, calls = _forward_backward(engine, data[0])
        assert calls == {k: n * (2 if k in twice else 1) for k, n in once.items()}, \
            f"recompute {name}: module calls {calls}, without recompute {once}"
        assert_identical(got, want, f"recompute {name}: loss, outputs, gradients")
        del engine
        destroy_distributed()

    engine = MegatronEngine(_config("hybrid-moe"))
    engine.initialize()
    trained_like(engine)
    ref["moe0"] = full_state(engine)
    check_router_replay("hybrid-moe one rank", engine, data[0])
    del engine
    destroy_distributed()
    torch.save(ref, path)


# ---------------------------------------------------------------------------------------- launch 2
SOURCES = {"dp2-distopt": dict(distopt=True), "tp2": dict(tp=2), "pp2": dict(pp=2),
           "pp2-vpp2": dict(pp=2, vpp=2, micro_batch_size=1),
           # recompute with the GDN layer's collectives: SP gathers, CP head all-to-alls re-run
           "tp2-sp (full recompute)": dict(tp=2, sp=True, **FULL),
           "cp2 (block recompute)": dict(cp=2, **FULL, recompute_method="block", recompute_num_layers=2)}
# loader <- saved source; the loader's layout
LOADS = {"tp2 -> tp1": ("tp2", dict()),
         "pp2 -> pp1 (full recompute)": ("pp2", FULL),
         "pp2-vpp2 -> pp1 (GDN chunks of 4)": ("pp2-vpp2", dict(chunk_size=4)),
         "dp2-distopt -> tp2-distopt": ("dp2-distopt", dict(tp=2, distopt=True))}


def _two_ranks(rank: int, world_size: int, path: str) -> None:
    from mcore_engine.engine import MegatronEngine
    from mcore_engine.parallel.platform import destroy_distributed
    from tests.engine_setup import engine_snapshot

    ref = torch.load(path, weights_only=False)
    data = batches()
    folder = os.path.dirname(path)
    saved = {}
    for name, kwargs in SOURCES.items():
        engine = MegatronEngine(_config(**kwargs))
        engine.initialize()
        load_full_state(engine, ref["full0"])
        _same_stream(engine, ref["stream0"], f"{name}: weight stream")
        got = _step(engine, data[0])
        _same_step(name, got, ref, 0)
        if not kwargs.get("distopt"):  # (reduce-scattered: each rank holds its shard's sums only)
            same_tensors(f"{name}: gradients of step 1", engine, got["grads"], ref["steps"][0]["grads"][0])
        same_tensors(f"{name}: weights after step 1", engine, local_params(engine), ref["full1"],
                     steps_from=ref["steps"][0]["grads"][0], steps=1)
        engine.save_checkpoint(os.path.join(folder, name))
        saved[name] = _stream(engine)
        if name == "tp2":  # a colocated cycle: everything off the device for the rollout, then back
            before, full = engine_snapshot(engine), _storage_bytes(engine)
            engine.offload()
            assert engine.offloaded == {"params", "grads", "optimizer"} and _storage_bytes(engine) == 0, \
                f"{name}: storages held while offloaded ({_storage_bytes(engine)} of {full} bytes)"
            engine.onload()
            assert engine.offloaded == frozenset() and _storage_bytes(engine) == full, f"{name}: onload"
            assert_identical(engine_snapshot(engine), before, f"{name}: state after offload / onload")
        _same_step(name, _step(engine, data[1]), ref, 1)
        same_tensors(f"{name}: weights after 2 steps", engine, local_params(engine), ref["full2"],
                     steps_from=ref["steps"][0]["grads"][0])
        del engine
        destroy_distributed()

    for name, (source, kwargs) in LOADS.items():
        engine = MegatronEngine(_config(**kwargs))
        engine.initialize()
        engine.load_checkpoint(os.path.join(folder, source))
        assert engine.global_step == 1, f"{name}: global_step {engine.global_step}"
        _same_stream(engine, saved[source], f"{name}: weights after the load")
        _same_step(name, _step(engine, data[1]), ref, 1)
        same_tensors(f"{name}: weights after 2 steps", engine, local_params(engine), ref["full2"],
                     steps_from=ref["steps"][0]["grads"][0])
        del engine
        destroy_distributed()

    cfg = _config()  # the attention layer first: layers 0 and 3 hold other tensors
    types = ["full_attention", "linear_attention", "linear_attention", "linear_attention"]
    gdn = dataclasses.replace(cfg.model.linear_attention, layer_types=types)
    model = dataclasses.replace(cfg.model, linear_attention=gdn)
    engine = MegatronEngine(dataclasses.replace(cfg, model=model))
    engine.initialize()
    before = engine_snapshot(engine, counters=True)
    with pytest.raises(ValueError, match="model.linear_attention"):
        engine.load_checkpoint(os.path.join(folder, "tp2"))
    assert_identical(engine_snapshot(engine, counters=True), before, "refused checkpoint: engine changed")
    del engine
    destroy_distributed()

    engine = MegatronEngine(_config("hybrid-moe", ep=2))
    engine.initialize()
    load_full_state(engine, ref["moe0"])
    check_router_replay("hybrid-moe ep2", engine, _rows(data[0])[0])
    _step(engine, data[0])
    engine.save_checkpoint(os.path.join(folder, "moe-ep2"))
    want = _stream(engine)
    del engine
    destroy_distributed()
    engine = MegatronEngine(_config("hybrid-moe"))  # EP=1 x DP=2
    engine.initialize()
    engine.load_checkpoint(os.path.join(folder, "moe-ep2"))
    _same_stream(engine, want, "hybrid-moe ep2 -> ep1: weights after the load")
    del engine
    destroy_distributed()


def test_hybrid_composes_with_the_engine(tmp_path):
    path = str(tmp_path / "reference.pt")
    run_distributed(_one_rank, 1, path)
    run_distributed(_two_ranks, 2, path)


# ---------------------------------------------------------------------------------------- bad input
def _gdn(**kwargs):
    from mcore_engine.config import GDNConfig

    return GDNConfig(**{**GDN, **kwargs})


def _hybrid(gdn=None, **model):
    cfg = config("hybrid")
    m = dataclasses.replace(cfg.model, **model, **({} if gdn is None else {"linear_attention": gdn}))
    return dataclasses.replace(cfg, model=m)


def _layout(tp: int = 1, cp: int = 1, ep: int = 1, model: str = "hybrid"):
    cfg = config(model)
    return dataclasses.replace(cfg, parallel=dataclasses.replace(
        cfg.parallel, tensor_model_parallel_size=tp, context_parallel_size=cp, expert_model_parallel_size=ep))


def _mla():
    from mcore_engine.config.mla import MLAConfig

    cfg = config("hybrid")
    return dataclasses.replace(cfg.model, kv_channels=None, qk_layernorm=False, attention_output_gate=False,
                               num_query_groups=None, rotary_percent=1.0,
                               mla=MLAConfig(kv_lora_rank=16, qk_head_dim=16, qk_pos_emb_head_dim=8,
                                             v_head_dim=16))


BAD = {  # what -> (build the config, field names the error must carry)
    "key heads TP cannot split": (lambda: dataclasses.replace(
        _hybrid(_gdn(num_key_heads=1, num_value_heads=2)), parallel=_layout(tp=2).parallel),
        ["num_key_heads", "tensor_model_parallel_size"]),
    "key heads TP x CP cannot split": (lambda: _layout(tp=2, cp=2),
                                       ["num_key_heads", "context_parallel_size"]),
    "value heads not a multiple of key heads": (lambda: _gdn(num_key_heads=2, num_value_heads=3),
                                                ["num_value_heads", "num_key_heads"]),
    "layer_types too short": (lambda: _hybrid(_gdn(layer_types=["linear_attention"] * 3)),
                              ["layer_types", "num_layers"]),
    "layer_types too long": (lambda: _hybrid(_gdn(layer_types=["linear_attention"] * 5)),
                             ["layer_types", "num_layers"]),
    "layer_types unknown value": (lambda: _gdn(layer_types=["linear_attention", "sliding_attention"] * 2),
                                  ["layer_types"]),
    "layer_types a string": (lambda: _gdn(layer_types="linear_attention"), ["layer_types"]),
    "chunk_size 0": (lambda: _gdn(chunk_size=0), ["chunk_size"]),
    "chunk_size float": (lambda: _gdn(chunk_size=8.0), ["chunk_size"]),
    "conv_kernel_dim 0": (lambda: _gdn(conv_kernel_dim=0), ["conv_kernel_dim"]),
    "key_head_dim 0": (lambda: _gdn(key_head_dim=0), ["key_head_dim"]),
    "full_attention_interval 0": (lambda: _gdn(full_attention_interval=0), ["full_attention_interval"]),
    "linear_attention with MLA": (lambda: dataclasses.replace(config("hybrid"), model=_mla()),
                                  ["linear_attention", "mla"]),
    "core_attention local with CP": (lambda: dataclasses.replace(
        _hybrid(core_attention="local"), parallel=_layout(cp=2).parallel),
        ["core_attention", "context_parallel_size"]),
    "zero_centered_norm with LayerNorm": (lambda: _hybrid(normalization="LayerNorm"), ["zero_centered_norm"]),
    "recompute with the hybrid MoE": (lambda: dataclasses.replace(config("hybrid-moe"), **FULL),
                                      ["recompute_granularity", "moe"]),
}


@pytest.mark.parametrize("what", list(BAD))
def test_hybrid_config_refused_by_field(what):
    build, fields = BAD[what]
    with pytest.raises(ValueError) as err:
        build()
    for field in fields:
        assert field in str(err.value), f"{what}: {field!r} not named in {err.value}"
