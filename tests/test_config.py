"""Configs: every invalid combination is a ValueError naming its fields; YAML round trip; shipped configs."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from mcore_engine.config import EngineConfig, ModelConfig, OptimizerConfig, ParallelConfig

CONFIG_DIR = Path(__file__).parent.parent / "configs"
# The EngineConfig files (other YAMLs in configs/, e.g. the demo job's, have their own schema).
CONFIGS = [CONFIG_DIR / n for n in ("tiny_cpu_tp2.yaml", "tiny_cpu_pp2.yaml", "tiny_cpu_moe.yaml",
                                    "tiny_cpu_moe_tp2_sp.yaml", "tiny_cpu_cp2.yaml", "tiny_cpu_deepseek.yaml",
                                    "tiny_cpu_qwen3_5.yaml", "tiny_cpu_gpt_oss.yaml", "qwen2_0p5b_tp2.yaml")]
MODEL = dict(num_layers=4, hidden_size=64, num_attention_heads=4, num_query_groups=2, vocab_size=250,
             max_sequence_length=128)


def _engine(model=None, parallel=None, optimizer=None, **kw) -> EngineConfig:
    return EngineConfig(model=ModelConfig(**(MODEL | (model or {}))),
                        parallel=ParallelConfig(**(parallel or {})),
                        optimizer=OptimizerConfig(**(optimizer or {})), **kw)


@pytest.mark.parametrize("kwargs,fields", [
    # the list
    (dict(parallel=dict(tensor_model_parallel_size=8)),
     ["num_attention_heads", "tensor_model_parallel_size"]),
    (dict(model=dict(num_attention_heads=8, num_query_groups=2), parallel=dict(tensor_model_parallel_size=4)),
     ["num_query_groups", "tensor_model_parallel_size"]),
    (dict(model=dict(num_layers=3), parallel=dict(pipeline_model_parallel_size=2)),
     ["num_layers", "pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size"]),
    (dict(model=dict(num_layers=6), parallel=dict(pipeline_model_parallel_size=2,
                                                  virtual_pipeline_model_parallel_size=2)),
     ["num_layers", "pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size"]),
    (dict(parallel=dict(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2,
                        batch_p2p_comm=True)), ["batch_p2p_comm", "virtual_pipeline_model_parallel_size"]),
    # the rest of the cross-field checks
    (dict(model=dict(ffn_hidden_size=99), parallel=dict(tensor_model_parallel_size=2)),
     ["ffn_hidden_size", "tensor_model_parallel_size"]),
    (dict(parallel=dict(virtual_pipeline_model_parallel_size=2)),
     ["virtual_pipeline_model_parallel_size", "pipeline_model_parallel_size"]),
    (dict(parallel=dict(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=1)),
     ["virtual_pipeline_model_parallel_size"]),
    (dict(parallel=dict(sequence_parallel=True)), ["sequence_parallel", "tensor_model_parallel_size"]),
    (dict(parallel=dict(tensor_model_parallel_size=0)), ["tensor_model_parallel_size"]),
    (dict(model=dict(hidden_size=66)), ["hidden_size", "num_attention_heads", "kv_channels"]),
    (dict(model=dict(kv_channels=0)), ["kv_channels"]),
    (dict(model=dict(rope_scaling_factor=0.0)), ["rope_scaling_factor"]),
    (dict(model=dict(rope_scaling_factor=float("inf"))), ["rope_scaling_factor"]),
    (dict(model=dict(rope_scaling_factor=True)), ["rope_scaling_factor"]),
    (dict(model=dict(num_query_groups=3)), ["num_attention_heads", "num_query_groups"]),
    (dict(model=dict(normalization="BatchNorm")), ["normalization"]),
    (dict(model=dict(vocab_size=0)), ["vocab_size"]),
    (dict(model=dict(num_layers=True)), ["num_layers"]),
    (dict(optimizer=dict(lr=0.0)), ["lr"]),
    (dict(optimizer=dict(min_lr=1.0, lr=0.1)), ["min_lr"]),
    (dict(optimizer=dict(adam_beta2=1.0)), ["adam_beta2"]),
    (dict(optimizer=dict(weight_decay=-1.0)), ["weight_decay"]),
    (dict(optimizer=dict(clip_grad=-1.0)), ["clip_grad"]),
    (dict(optimizer=dict(lr_decay_style="step")), ["lr_decay_style"]),
    (dict(optimizer=dict(lr_decay_style="cosine", lr_warmup_steps=10, lr_decay_steps=10)),
     ["lr_decay_steps", "lr_warmup_steps"]),
    (dict(precision="fp16"), ["precision"]),
    (dict(data_format="sbhd"), ["data_format"]),
    (dict(micro_batch_size=0), ["micro_batch_size"]),
    (dict(logits_chunk_size=-4), ["logits_chunk_size"]),
    (dict(forward_only="yes"), ["forward_only"]),
    (dict(recompute_granularity="all"), ["recompute_granularity"]),
    (dict(recompute_method="uniform"), ["recompute_method", "recompute_granularity"]),
    (dict(recompute_granularity="selective", recompute_num_layers=1),
     ["recompute_num_layers", "recompute_granularity"]),
    (dict(recompute_granularity="full", recompute_modules=["mlp"]),
     ["recompute_modules", "recompute_granularity"]),
    (dict(recompute_granularity="selective", recompute_modules=["moe_act"]), ["recompute_modules"]),
    (dict(recompute_granularity="selective", recompute_modules=[]), ["recompute_modules"]),
    (dict(recompute_granularity="full", recompute_method="chunk"), ["recompute_method"]),
    (dict(recompute_granularity="full", recompute_num_layers=0), ["recompute_num_layers"]),
    (dict(recompute_granularity="full", recompute_num_layers=3), ["recompute_num_layers", "num_layers"]),
    (dict(parallel=dict(pipeline_model_parallel_size=2), recompute_granularity="full",
          recompute_method="block", recompute_num_layers=3),
     ["recompute_num_layers", "pipeline_model_parallel_size"]),
    (dict(model=dict(moe=dict(num_experts=2)), recompute_granularity="full"),
     ["recompute_granularity", "moe"]),
    (dict(parallel=dict(context_parallel_size=0)), ["context_parallel_size"]),
    (dict(parallel=dict(context_parallel_size=2, cp_comm_type="ring")), ["cp_comm_type"]),
    (dict(parallel=dict(context_parallel_size=2), model=dict(core_attention="local")),
     ["context_parallel_size", "core_attention"]),
    (dict(model=dict(core_attention="flash")), ["core_attention"]),
])
def test_invalid_combinations_name_their_fields(kwargs, fields):
    with pytest.raises(ValueError) as err:
        _engine(**kwargs)
    for f in fields:
        assert f in str(err.value), f"{f!r} not named in: {err.value}"


def test_kv_channels_and_rope_scaling_reach_the_transformer_config():
    from mcore_engine.model.build import build_transformer_config

    cfg = _engine(model=dict(hidden_size=66, kv_channels=32, rope_scaling_factor=8.0))  # heads * d != hidden
    assert build_transformer_config(cfg).kv_channels == 32
    assert build_transformer_config(_engine()).kv_channels == 16  # None: hidden // heads
    assert EngineConfig.from_dict(cfg.to_dict()) == cfg


def test_recompute_reaches_the_transformer_config():
    from mcore_engine.model.build import build_transformer_config, has_te

    cfg = _engine(recompute_granularity="full")  # uniform, 1 layer per unit
    assert (cfg.recompute_method, cfg.recompute_num_layers) == ("uniform", 1)
    assert EngineConfig.from_dict(cfg.to_dict()) == cfg
    tc = build_transformer_config(cfg)
    assert (tc.recompute_granularity, tc.recompute_method, tc.recompute_num_layers) == ("full", "uniform", 1)
    tc = build_transformer_config(_engine(recompute_granularity="selective", recompute_modules=["mlp"]))
    assert tc.recompute_granularity == "selective" and tc.recompute_modules == ["mlp"]
    assert build_transformer_config(_engine()).recompute_granularity is None
    if not has_te():
        with pytest.raises(ValueError, match="recompute_modules 'layernorm'"):
            build_transformer_config(_engine(recompute_granularity="selective",
                                             recompute_modules=["layernorm"]))


def test_world_size_checked_without_process_groups():
    cfg = _engine(parallel=dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2))
    assert cfg.validate_world_size(8) == 2 and cfg.parallel.data_parallel_size(4) == 1
    for world in (2, 6, 0):
        with pytest.raises(ValueError, match="tensor_model_parallel_size.*pipeline_model_parallel_size"):
            cfg.validate_world_size(world)


def test_context_parallel_world_size_checked_without_process_groups(monkeypatch):
    """World = TP x PP x CP x DP: a CP that does not divide world / (TP x PP) is refused by
    ``initialize()`` naming context_parallel_size, before any process-group work."""
    import torch.distributed as dist

    from mcore_engine import MegatronEngine

    cfg = _engine(parallel=dict(tensor_model_parallel_size=2, context_parallel_size=2))
    assert cfg.validate_world_size(8) == 2
    for world in (2, 6):
        with pytest.raises(ValueError, match="context_parallel_size \\(2\\)"):
            cfg.validate_world_size(world)
    if dist.is_initialized():
        pytest.skip("a default process group exists in this process")
    monkeypatch.setenv("WORLD_SIZE", "6")
    monkeypatch.setattr(dist, "init_process_group", lambda *a, **k: pytest.fail("group work started"))
    with pytest.raises(ValueError, match="context_parallel_size"):
        MegatronEngine(cfg).initialize()


def test_init_distributed_rejects_world_size_before_group_work(monkeypatch):
    import torch.distributed as dist

    from mcore_engine import platform

    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setattr(dist, "init_process_group", lambda *a, **k: pytest.fail("group work started"))
    if dist.is_initialized():
        pytest.skip("a default process group exists in this process")
    with pytest.raises(ValueError, match="world_size \\(3\\)"):
        platform.init_distributed(ParallelConfig(tensor_model_parallel_size=2), seed=0)


def test_defaults_resolve():
    m = ModelConfig(**(MODEL | dict(num_query_groups=None)))
    assert m.query_groups == 4 and m.ffn_size == 256


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_shipped_configs_load_and_round_trip(path, tmp_path):
    cfg = EngineConfig.from_yaml(path)
    assert EngineConfig.from_dict(cfg.to_dict()) == cfg
    cfg.to_yaml(tmp_path / "c.yaml")
    assert EngineConfig.from_yaml(tmp_path / "c.yaml") == cfg
    assert yaml.safe_load((tmp_path / "c.yaml").read_text()) == cfg.to_dict()


def test_required_configs():
    from mcore_engine.model.build import padded_vocab_size

    tiny = EngineConfig.from_yaml(CONFIG_DIR / "tiny_cpu_tp2.yaml")
    assert tiny.parallel.tensor_model_parallel_size == 2 and tiny.precision == "fp32"
    assert tiny.model.vocab_size % 128 != 0
    assert padded_vocab_size(tiny.model.vocab_size, 128, 2) == 256
    qwen = EngineConfig.from_yaml(CONFIG_DIR / "qwen2_0p5b_tp2.yaml")
    assert qwen.precision == "bf16" and qwen.parallel.tensor_model_parallel_size == 2
    assert padded_vocab_size(qwen.model.vocab_size, 128, 2) == 152064
    pp = EngineConfig.from_yaml(CONFIG_DIR / "tiny_cpu_pp2.yaml")
    assert pp.parallel.pipeline_model_parallel_size == 2


def test_unknown_and_missing_keys():
    d = _engine().to_dict()
    with pytest.raises(ValueError, match="unknown field.*'hiden_size'"):
        EngineConfig.from_dict(d | {"model": d["model"] | {"hiden_size": 3}})
    with pytest.raises(ValueError, match="unknown field.*'tp'"):
        EngineConfig.from_dict(d | {"tp": 2})
    with pytest.raises(ValueError, match="EngineConfig.model"):
        EngineConfig.from_dict({k: v for k, v in d.items() if k != "model"})
    with pytest.raises(ValueError, match="EngineConfig.parallel"):
        EngineConfig.from_dict(d | {"parallel": 2})


@pytest.mark.parametrize("kwargs,field", [
    (dict(parallel=dict(tensor_model_parallel_size=2, sequence_parallel="no")),
     "ParallelConfig.sequence_parallel"),
    (dict(parallel=dict(batch_p2p_comm=1)), "ParallelConfig.batch_p2p_comm"),
    (dict(model=dict(fused_lm_head="false")), "ModelConfig.fused_lm_head"),
    (dict(optimizer=dict(use_distributed_optimizer="yes")), "OptimizerConfig.use_distributed_optimizer"),
    (dict(forward_only="no"), "EngineConfig.forward_only"),
])
def test_flags_must_be_bools(kwargs, field):
    """A string or an int for a flag is refused by name (YAML ``"no"`` would read as true)."""
    with pytest.raises(ValueError, match=rf"^{field} must be a bool, got"):
        _engine(**kwargs)


def test_mla_heads_need_not_divide_hidden():
    """MLA's head dims are its own: hidden 96 with 5 heads builds (a GQA model needs kv_channels)."""
    mla = dict(kv_lora_rank=16, qk_head_dim=12, qk_pos_emb_head_dim=8, v_head_dim=10)
    assert ModelConfig(**(MODEL | dict(hidden_size=96, num_attention_heads=5, num_query_groups=None)),
                       mla=mla).mla.v_head_dim == 10
    with pytest.raises(ValueError, match="hidden_size.*num_attention_heads"):
        ModelConfig(**(MODEL | dict(hidden_size=96, num_attention_heads=5, num_query_groups=None)))


@pytest.mark.parametrize("kwargs,fields", [
    (dict(parallel=dict(tensor_model_parallel_size=8)),
     ("parallel.tensor_model_parallel_size", "model.num_attention_heads")),
    (dict(parallel=dict(context_parallel_size=2), model=dict(core_attention="local")),
     ("parallel.context_parallel_size", "model.core_attention")),
    (dict(parallel=dict(expert_model_parallel_size=2)), ("parallel.expert_model_parallel_size", "model.moe")),
    (dict(model=dict(moe=dict(num_experts=3)), parallel=dict(expert_model_parallel_size=2)),
     ("parallel.expert_model_parallel_size", "model.moe.num_experts")),
    (dict(model=dict(moe=dict(num_experts=2, router_topk=3))),
     ("model.moe.router_topk", "model.moe.num_experts")),
    (dict(model=dict(lora=dict(rank=4, alpha=0))), ("model.lora.alpha",)),
    (dict(model=dict(mla=dict(kv_lora_rank=8, qk_head_dim=8, qk_pos_emb_head_dim=3, v_head_dim=8))),
     ("model.mla.qk_pos_emb_head_dim",)),
    (dict(model=dict(mtp_loss_scaling_factor=0.1)),
     ("model.mtp_loss_scaling_factor", "model.mtp_num_layers")),
    (dict(optimizer=dict(lr=True)), ("optimizer.lr",)),
    (dict(recompute_granularity="full", recompute_num_layers=3),
     ("recompute_num_layers", "model.num_layers", "parallel.pipeline_model_parallel_size",
      "parallel.virtual_pipeline_model_parallel_size")),
    (dict(model=dict(moe=dict(num_experts=2, aux_loss_type="x"))), ("model.moe.aux_loss_type",)),
])
def test_refusals_carry_their_fields(kwargs, fields):
    """Every refusal is a ``ConfigError`` (a ``ValueError``) whose ``fields`` are dotted paths from
    ``EngineConfig``, the refused one first (``field``)."""
    from mcore_engine.config.checks import ConfigError

    with pytest.raises(ConfigError) as err:
        _engine(**kwargs)
    assert err.value.fields == fields and err.value.field == fields[0], str(err.value)


def test_unknown_keys_carry_their_paths():
    from mcore_engine.config.checks import ConfigError

    d = _engine().to_dict()
    with pytest.raises(ConfigError, match="unknown field") as err:
        EngineConfig.from_dict(d | {"model": d["model"] | {"moe": {"num_experts": 2, "topk": 1}}})
    assert err.value.fields == ("model.moe.topk",)
    with pytest.raises(ConfigError) as err:
        EngineConfig.from_dict(d | {"parallel": {"tp": 2}})
    assert err.value.fields == ("parallel.tp",)
