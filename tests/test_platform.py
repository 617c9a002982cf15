"""Platform layer: the CPU device layer, the Device abstraction, and Megatron-Core's DDP, optimizers
and schedules running one step on 2 gloo ranks on top of it."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from functools import partial

import pytest
import torch

from tests.utils import run_distributed

TINY = dict(num_layers=4, hidden_size=32, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=48,
            vocab_size=250, max_sequence_length=64)


def test_device_layer_not_applied_when_cuda_exists():
    """With CUDA present (mocked) the layer leaves torch.cuda and the torch-function stack alone."""
    code = textwrap.dedent("""
        import torch
        from unittest import mock
        before = {n: getattr(torch.cuda, n) for n in ("current_device", "get_rng_state", "synchronize",
                                                      "Stream", "Event", "current_stream", "manual_seed")}
        with mock.patch.object(torch.cuda, "is_available", return_value=True):
            from mcore_engine import platform
            platform.apply_cpu_device_layer()
            assert platform.get_device().type == "cuda"
        assert not platform.cpu_device_layer_active()
        assert all(getattr(torch.cuda, n) is f for n, f in before.items())
        assert not torch.overrides._is_torch_function_mode_enabled()
        print("OK")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "OK" in out.stdout, out.stderr[-3000:]


def test_cpu_only_third_party_hints_are_quiet():
    """On CPU, importing mcore_engine silences Megatron-Core's TE / Apex fallbacks, the CUDA-graph
    scope and CUDA_DEVICE_MAX_CONNECTIONS hints; with CUDA (mocked) no filter is installed."""
    code = textwrap.dedent("""
        import warnings
        import mcore_engine  # noqa: F401
        import megatron.core.optimizer  # noqa: F401
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.transformer import TransformerConfig
        get_gpt_layer_local_spec()
        TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1)
        warnings.warn("When using async grad allreduce it is recommended to set the environment "
                      "variable CUDA_DEVICE_MAX_CONNECTIONS to 1 for maximum speedup")
        warnings.warn("`torch.distributed.all_gather_into_tensor` is deprecated. Please use "
                      "`torch.distributed.all_gather_single` instead.", FutureWarning)
        warnings.warn("an unrelated warning stays")
    """)
    out = subprocess.run([sys.executable, "-W", "always", "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    for noise in ("not installed", "full scope", "CUDA_DEVICE_MAX_CONNECTIONS", "all_gather_into_tensor"):
        assert noise not in out.stderr, out.stderr[-3000:]
    assert "an unrelated warning stays" in out.stderr
    code = textwrap.dedent("""
        import warnings
        from unittest import mock
        import torch
        with mock.patch.object(torch.cuda, "is_available", return_value=True):
            import mcore_engine.parallel.platform as platform
            platform.quiet_cpu_warnings()
        assert not any("Apex" in str(f[1]) for f in warnings.filters), warnings.filters
        print("OK")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "OK" in out.stdout, out.stderr[-3000:]


def test_cpu_device_stats(monkeypatch):
    from mcore_engine.parallel.device import get_device

    dev = get_device()
    assert dev is get_device() and dev.type == "cpu" and dev.torch_device == torch.device("cpu")
    dev.empty_cache()
    dev.synchronize()
    calls = []
    monkeypatch.setattr(dev, "empty_cache", lambda: calls.append(1))
    get_device().empty_cache()
    assert calls == [1]
    dev.reset_peak_memory_stats()
    before = dev.max_memory_allocated()
    x = torch.ones(64 * 2**20 // 8, dtype=torch.float64)  # 64 MiB, touched
    assert dev.memory_allocated() > 0 and dev.max_memory_allocated() >= before + 32 * 2**20
    del x


# ----------------------------------------------------------------------------------------------------
# 2-rank launch: the device layer's patches, then one optimizer step through every Megatron path.
# ----------------------------------------------------------------------------------------------------
def _check_device_layer() -> None:
    from megatron.core.tensor_parallel import random as mcore_random

    from mcore_engine.parallel.cpu_device import apply_cpu_device_layer, cpu_device_layer_active

    apply_cpu_device_layer()
    apply_cpu_device_layer()  # idempotent
    assert cpu_device_layer_active()
    t = torch.empty(3, device="cuda")
    assert t.device.type == "cpu"
    assert torch.zeros(2, device=torch.device("cuda", 0)).device.type == "cpu"
    assert torch.ones(2, device=0).device.type == "cpu"
    assert t.cuda() is t and t.to("cuda").device.type == "cpu" and t.to(0).device.type == "cpu"
    assert t.pin_memory() is t and not torch.empty(2, pin_memory=True).is_pinned()
    assert t.to(torch.float64).dtype == torch.float64 and t.to("cuda", torch.float16).dtype == torch.float16
    assert t.type() == "torch.cuda.FloatTensor" and t.bfloat16().type() == "torch.cuda.BFloat16Tensor"
    assert t.type(torch.float64).dtype == torch.float64
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        ev = torch.cuda.Event()
        ev.record()
    torch.cuda.synchronize()
    # RNG: the CUDA calls drive the CPU default generator, and Megatron's setter really sets it.
    torch.cuda.manual_seed(7)
    a = torch.rand(4)
    torch.manual_seed(7)
    assert torch.equal(a, torch.rand(4))
    state = torch.cuda.get_rng_state()
    b = torch.rand(4)
    mcore_random._set_cuda_rng_state(state)
    assert torch.equal(b, torch.rand(4))


def _check_seed_layout(rank: int, world_size: int) -> None:
    """Megatron's layout on the CPU generator: default stream ``seed`` on every TP rank, the tracker's
    tensor-parallel stream ``seed + 2718 + tp_rank``; forking restores the default stream."""
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    from mcore_engine.config import ParallelConfig
    from mcore_engine.parallel.distributed import destroy_distributed, init_distributed

    init_distributed(ParallelConfig(tensor_model_parallel_size=2), seed=5)
    default = torch.Generator().manual_seed(5)
    a = torch.rand(3)
    with get_cuda_rng_tracker().fork():
        b = torch.rand(3)
    c = torch.rand(3)
    assert torch.equal(a, torch.rand(3, generator=default))
    assert torch.equal(c, torch.rand(3, generator=default))
    assert torch.equal(b, torch.rand(3, generator=torch.Generator().manual_seed(5 + 2718 + rank)))

    # the same layout again (a second engine): the groups are kept, only the streams are reseeded
    from megatron.core import parallel_state

    groups = (parallel_state.get_tensor_model_parallel_group(), parallel_state.get_data_parallel_group())
    init_distributed(ParallelConfig(tensor_model_parallel_size=2), seed=6)
    assert parallel_state.get_tensor_model_parallel_group() is groups[0]
    assert parallel_state.get_data_parallel_group() is groups[1]
    assert torch.equal(torch.rand(3), torch.rand(3, generator=torch.Generator().manual_seed(6)))
    # another layout is refused, naming both, and leaves the groups alone
    with pytest.raises(ValueError) as err:
        init_distributed(ParallelConfig(pipeline_model_parallel_size=2), seed=6)
    message = str(err.value)
    assert "tensor_model_parallel_size=2, pipeline_model_parallel_size=1" in message, message
    assert "tensor_model_parallel_size=1, pipeline_model_parallel_size=2" in message, message
    assert parallel_state.get_tensor_model_parallel_group() is groups[0]
    destroy_distributed()
    init_distributed(ParallelConfig(pipeline_model_parallel_size=2), seed=6)  # after a tear-down: fine
    assert parallel_state.get_pipeline_model_parallel_world_size() == 2
    destroy_distributed()


def _loss_func(output: torch.Tensor):
    loss = output.float().mean()
    return loss, {"loss": loss.detach()}


def _forward_step(batches, data_iterator, model):
    ids = next(data_iterator)
    pos = torch.arange(ids.shape[1]).expand_as(ids)
    out = model(ids, pos, None, labels=torch.roll(ids, -1, dims=1))
    return out, _loss_func


def _tied_weights(model: list) -> list[torch.Tensor]:
    """The shared embedding / output weight of every pipeline rank (first and last stage hold one)."""
    local = [c.module.shared_embedding_or_output_weight() for c in model]
    local = [w.detach().clone() for w in local if w is not None]
    out = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(out, local)
    return [w for ws in out for w in ws]


def _one_step(parallel: dict, precision: str, distributed_optimizer: bool, num_microbatches: int,
              tied: bool = False) -> dict:
    """Build, wrap in Megatron DDP, get_megatron_optimizer, one get_forward_backward_func step."""
    import megatron.core.optimizer as mopt
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from mcore_engine.config import EngineConfig, ModelConfig, ParallelConfig
    from mcore_engine.model.build import build_model_chunks
    from mcore_engine.parallel.distributed import destroy_distributed, init_distributed

    cfg = EngineConfig(model=ModelConfig(**TINY, tie_word_embeddings=tied),
                       parallel=ParallelConfig(**parallel), precision=precision)
    init_distributed(cfg.parallel, cfg.seed)
    chunks = build_model_chunks(cfg)
    tf_config = chunks[0].config
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True,
                                               use_distributed_optimizer=distributed_optimizer)
    model = [DistributedDataParallel(config=tf_config, ddp_config=ddp_config, module=c,
                                     disable_bucketing=i > 0) for i, c in enumerate(chunks)]
    tf_config.finalize_model_grads_func = finalize_model_grads
    optimizer = mopt.get_megatron_optimizer(
        mopt.OptimizerConfig(optimizer="adam", lr=1e-2, weight_decay=0.0, clip_grad=1.0,
                             bf16=precision == "bf16", params_dtype=tf_config.params_dtype,
                             use_distributed_optimizer=distributed_optimizer), model)
    tied_before = _tied_weights(model) if tied else []
    before = [p.detach().clone() for m in model for p in m.parameters()]
    g = torch.Generator().manual_seed(0)
    data = [torch.randint(0, 250, (2, 24), generator=g) for _ in range(num_microbatches)]
    iters = [iter(data) for _ in model] if len(model) > 1 else iter(data)
    for m in model:
        m.zero_grad_buffer()
    optimizer.zero_grad()
    losses = get_forward_backward_func()(
        forward_step_func=partial(_forward_step, None), data_iterator=iters, model=model,
        num_microbatches=num_microbatches, seq_length=24, micro_batch_size=2, forward_only=False)
    ok, grad_norm, _ = optimizer.step()
    after = [p.detach() for m in model for p in m.parameters()]
    changed = [not torch.equal(b, a) for b, a in zip(before, after, strict=True)]
    tied_after = _tied_weights(model) if tied else []
    destroy_distributed()
    if tied:  # first and last stage start equal and stay equal (embedding-group grad all-reduce)
        assert len(tied_before) == 2 and torch.equal(*tied_before), "tied weights differ at init"
        assert torch.equal(*tied_after) and not torch.equal(tied_before[0], tied_after[0]), "tied after step"
    return dict(ok=ok, grad_norm=grad_norm, losses=losses, changed=changed)


def _distributed_smoke(rank: int, world_size: int) -> None:
    _check_device_layer()
    _check_seed_layout(rank, world_size)
    cases = {
        "tp2_fp32_no_pipelining": (dict(tensor_model_parallel_size=2), "fp32", False, 2),
        "tp2_bf16_float16_optimizer": (dict(tensor_model_parallel_size=2), "bf16", False, 1),
        "dp2_bf16_distopt": (dict(), "bf16", True, 1),
        "dp2_fp32_distopt": (dict(), "fp32", True, 1),
        "pp2_1f1b": (dict(pipeline_model_parallel_size=2), "fp32", False, 3),
        "pp2_1f1b_tied_embeddings": (dict(pipeline_model_parallel_size=2), "fp32", False, 2, True),
        "pp2_vpp2_interleaved": (dict(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2),
                                 "fp32", False, 4),
    }
    for name, (parallel, precision, distopt, nmb, *tied) in cases.items():
        r = _one_step(parallel, precision, distopt, nmb, *tied)
        assert r["ok"], f"{name}: optimizer step skipped"
        assert r["grad_norm"] is not None and 0 < r["grad_norm"] < float("inf"), f"{name}: {r['grad_norm']}"
        assert all(r["changed"]), f"{name}: some parameters did not change: {r['changed']}"
        last_stage = not parallel.get("pipeline_model_parallel_size") or rank == world_size - 1
        assert len(r["losses"]) == (nmb if last_stage else 0), f"{name}: {len(r['losses'])} losses"
        for d in r["losses"]:
            assert torch.isfinite(d["loss"]), f"{name}: loss {d['loss']}"
        # grad norm is a global quantity: every rank must report the same one
        norms = [None] * world_size
        torch.distributed.all_gather_object(norms, float(r["grad_norm"]))
        assert max(norms) - min(norms) <= 1e-6 * max(norms), f"{name}: grad norms differ {norms}"


@pytest.mark.slow
def test_megatron_paths_one_step_on_two_ranks():
    run_distributed(_distributed_smoke, 2)


REINIT = """
import dataclasses, os, sys
import torch.distributed as dist
from mcore_engine import EngineConfig, MegatronEngine
from mcore_engine.parallel.distributed import destroy_distributed

cfg = EngineConfig.from_yaml(sys.argv[1])
for parallel in (cfg.parallel, dataclasses.replace(cfg.parallel, tensor_model_parallel_size=1,
                                                   context_parallel_size=2)):
    engine = MegatronEngine(dataclasses.replace(cfg, parallel=parallel))
    engine.initialize()
    del engine
    destroy_distributed()
os.write(1, f"reinit ok {dist.get_rank()}\\n".encode())  # one write: the ranks share the pipe
"""


def test_engines_of_two_layouts_in_one_torchrun_job(tmp_path):
    """initialize() -> destroy_distributed() -> initialize() at another layout under torchrun: the
    job's default group is kept (a second env:// rendezvous of the same job fails), so it works."""
    import subprocess
    import sys
    from pathlib import Path

    script = tmp_path / "reinit.py"
    script.write_text(REINIT)
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                          str(script), str(root / "configs" / "tiny_cpu_tp2.yaml")], capture_output=True,
                         text=True, timeout=300, cwd=root)
    assert out.returncode == 0, out.stderr[-3000:]
    assert sorted(line for line in out.stdout.splitlines() if line.startswith("reinit ok")) == [
        "reinit ok 0", "reinit ok 1"], out.stdout[-2000:]
