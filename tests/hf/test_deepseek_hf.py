"""DeepSeek-V3 / GLM-4.5 ``config.json`` <-> ``ModelConfig`` and the MLA / expert-bias tensor names
(no launch; the engine runs are in ``tests/test_deepseek.py``).

The fields each tiny config implies (MLA dims, YaRN, partial RoPE, sigmoid routing with the expert
bias, groups, shared experts, ``first_k_dense_replace``), the round trip through ``to_hf_config``
(with and without the source config), the Hub's legacy spellings (``rope_scaling`` with ``type``,
top-level ``partial_rotary_factor``, DeepSeek's ``scoring_func`` / ``topk_method``, Kimi-K2's
``model_type``), the names against the folders ``save_pretrained`` writes, YaRN's frequencies and
scales against ``transformers``, and every refusal by field name: ``ModelConfig`` / ``MLAConfig`` /
``EngineConfig`` validation, what ``from_hf_config`` and ``to_hf_config`` cannot express.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from mcore_engine.config import EngineConfig, ModelConfig, ParallelConfig
from mcore_engine.config.lora import LoRAConfig
from mcore_engine.config.mla import MLAConfig
from mcore_engine.hf import from_hf_config, read_hf_config, to_hf_config
from mcore_engine.hf.mapping import check_hf_names, hf_shapes
from tests.hf.deepseek_models import MODELS, YARN, hf_config_dict, save_tiny_model
from tests.hf.models import hf_config_dict as qwen_config_dict
from tests.hf.models import load_folder


def test_config_mapping():
    ds = from_hf_config(hf_config_dict("ds_qlora"))
    assert ds.mla == MLAConfig(q_lora_rank=48, kv_lora_rank=32, qk_head_dim=16, qk_pos_emb_head_dim=8,
                               v_head_dim=12, rope_type="yarn", rotary_scaling_factor=4.0,
                               original_max_position_embeddings=16, mscale=0.9, mscale_all_dim=0.8)
    assert ds.num_query_groups is None and ds.kv_channels is None and not ds.qk_layernorm
    assert (ds.rotary_base, ds.rotary_percent, ds.ffn_size, ds.mtp_num_layers) == (1e4, 1.0, 88, 0)
    moe = ds.moe
    assert (moe.num_experts, moe.router_topk, moe.ffn_hidden_size) == (8, 4, 24)
    assert moe.shared_expert_ffn_hidden_size == 24 and moe.layer_freq == [0, 1, 1, 1]
    assert moe.router_score_function == "sigmoid" and moe.router_expert_bias
    assert (moe.router_num_groups, moe.router_group_topk, moe.router_topk_scaling_factor) == (4, 2, 2.5)
    assert not moe.router_pre_softmax and not moe.shared_expert_gate and moe.router_bias_update_rate == 0

    top2 = from_hf_config(hf_config_dict("ds_top2"))
    assert top2.mla.q_lora_rank is None and top2.mla.rope_type == "rope" and top2.rotary_base == 5000.0
    assert top2.moe.router_topk == 2 and top2.moe.router_topk_scaling_factor == 1.5

    glm = from_hf_config(hf_config_dict("glm"))
    assert glm.mla is None and (glm.num_query_groups, glm.kv_channels, glm.rotary_percent) == (2, 24, 0.5)
    assert glm.add_qkv_bias and glm.qk_layernorm and glm.norm_epsilon == 1e-5
    assert glm.moe.router_num_groups is None and glm.moe.router_topk_scaling_factor == 1.8

    for name, cfg in zip(MODELS, (ds, top2, glm), strict=True):
        source = hf_config_dict(name)
        out = to_hf_config(cfg, base=source)
        assert out["architectures"] == source["architectures"] and out["model_type"] == source["model_type"]
        assert from_hf_config(out) == cfg, name
        assert from_hf_config(to_hf_config(cfg)) == cfg, f"{name} without a base"
    # ModelConfig.mla from YAML (a mapping) and back
    cfg = EngineConfig(model=ds)
    assert EngineConfig.from_dict(cfg.to_dict()) == cfg


def test_hub_spellings():
    """The Hub's DeepSeek-V3 / Kimi-K2 / GLM-4.5 config.json spellings map like transformers' own."""
    ds = hf_config_dict("ds_qlora")
    hub = {k: v for k, v in ds.items() if k != "rope_parameters"}
    hub.update(rope_theta=1e4, rope_scaling={"type": "yarn", **{k: v for k, v in YARN.items()
                                                                if k not in ("rope_type", "rope_theta")}},
               scoring_func="sigmoid", topk_method="noaux_tc", model_type="kimi_k2")
    assert from_hf_config(hub) == from_hf_config(ds)
    glm = hf_config_dict("glm")
    legacy = {k: v for k, v in glm.items() if k != "rope_parameters"}
    legacy.update(rope_theta=20000.0, partial_rotary_factor=0.5)
    assert from_hf_config(legacy) == from_hf_config(glm)
    # YaRN factor from the context lengths when the config leaves it out (transformers' rule)
    no_factor = dict(ds, rope_parameters={k: v for k, v in YARN.items() if k != "factor"})
    assert from_hf_config(no_factor).mla.rotary_scaling_factor == 64 / 16
    # mscale_all_dim 0: transformers scales cos / sin by ms(f, 1) whatever mscale says
    zero = dict(ds, rope_parameters={**YARN, "mscale": 0.5, "mscale_all_dim": 0})
    assert (from_hf_config(zero).mla.mscale, from_hf_config(zero).mla.mscale_all_dim) == (1.0, 0.0)


def test_yarn_scales_match_transformers(monkeypatch):
    """Megatron's YaRN inverse frequencies, cos / sin factor and MLA softmax scale equal transformers'."""
    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")  # YaRN places its tables there
    import transformers
    from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import (
        YarnRotaryEmbedding,
        _yarn_get_concentration_factor,
        _yarn_get_mscale,
    )
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.deepseek_v3 import modeling_deepseek_v3

    for rope in (YARN, {**YARN, "mscale": 0.5, "mscale_all_dim": 0.0}, {**YARN, "factor": 40.0}):
        hf = transformers.DeepseekV3Config(**{**hf_config_dict("ds_qlora"), "rope_parameters": rope})
        inv_freq, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](hf)
        mla = from_hf_config(hf.to_dict()).mla
        yarn = YarnRotaryEmbedding(mla.qk_pos_emb_head_dim, rotary_base=1e4, use_cpu_initialization=True,
                                   scaling_factor=mla.rotary_scaling_factor,
                                   original_max_position_embeddings=mla.original_max_position_embeddings,
                                   beta_fast=mla.beta_fast, beta_slow=mla.beta_slow, mscale=mla.mscale,
                                   mscale_all_dim=mla.mscale_all_dim)
        emb, concentration = yarn.get_emb(5)
        assert torch.allclose(emb[1, 0, 0, : len(inv_freq)], inv_freq, rtol=1e-6, atol=0), rope
        assert math.isclose(concentration, attention_factor, rel_tol=1e-12), rope
        assert concentration == _yarn_get_concentration_factor(mla.rotary_scaling_factor, mla.mscale,
                                                               mla.mscale_all_dim)
        hf_scale = modeling_deepseek_v3.yarn_apply_mscale(hf.rope_parameters, 1.0)
        ours = _yarn_get_mscale(mla.rotary_scaling_factor, mla.mscale_all_dim) ** 2
        assert math.isclose(ours, hf_scale, rel_tol=1e-12), rope


def test_names_match_saved_folders(tmp_path):
    for i, name in enumerate(MODELS):
        save_tiny_model(name, tmp_path / name, seed=i)
        cfg = from_hf_config(read_hf_config(tmp_path / name))
        folder = load_folder(tmp_path / name)
        names = sorted(folder)
        assert sorted(hf_shapes(cfg)) == names, name
        assert all(tuple(folder[n].shape) == s for n, s in hf_shapes(cfg).items()), name
        assert folder["model.layers.1.mlp.gate.e_score_correction_bias"].abs().min() > 0  # non-zero, random
        check_hf_names(names, cfg)
        with pytest.raises(ValueError, match="layers.0.mlp.gate.e_score_correction_bias"):  # a dense layer
            check_hf_names(names + ["model.layers.0.mlp.gate.e_score_correction_bias"], cfg)


@pytest.mark.parametrize("name,change,field", [
    ("ds_qlora", {"rope_interleave": False}, "rope_interleave"),
    ("ds_qlora", {"attention_bias": True}, "attention_bias"),
    ("ds_qlora", {"rope_parameters": {**YARN, "rope_type": "longrope"}}, "rope_scaling"),
    ("ds_qlora", {"rope_parameters": {**YARN, "attention_factor": 1.2}}, "attention_factor"),
    ("ds_qlora", {"rope_parameters": {**YARN, "truncate": False}}, "truncate"),
    ("ds_qlora", {"rope_parameters": {**YARN, "mscale": 0.0}}, "mscale"),
    ("ds_qlora", {"rope_parameters": {k: v for k, v in YARN.items()
                                      if k != "original_max_position_embeddings"}},
     "original_max_position_embeddings"),
    ("ds_qlora", {"scoring_func": "softmax"}, "scoring_func"),
    ("ds_qlora", {"topk_method": "greedy"}, "topk_method"),
    ("ds_qlora", {"n_shared_experts": 0}, "n_shared_experts"),
    ("ds_qlora", {"first_k_dense_replace": 4}, "first_k_dense_replace"),
    ("ds_qlora", {"n_group": 3}, "router_num_groups"),
    ("ds_qlora", {"topk_group": 1}, "router_topk"),
    ("ds_qlora", {"num_attention_heads": 4, "qk_rope_head_dim": 7}, "qk_pos_emb_head_dim"),
    ("glm", {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0,
                                 "original_max_position_embeddings": 16}}, "rope_scaling"),
    ("glm", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.3}},
     "rotary_percent"),
])
def test_config_refusals(name, change, field):
    with pytest.raises(ValueError, match=field):
        from_hf_config(hf_config_dict(name) | change)


def test_partial_rope_refused_outside_glm():
    with pytest.raises(ValueError, match="partial_rotary_factor"):
        from_hf_config(qwen_config_dict("llama") | {"partial_rotary_factor": 0.5})
    llama = from_hf_config(qwen_config_dict("llama"))
    with pytest.raises(ValueError, match="rotary_percent"):
        to_hf_config(dataclasses.replace(llama, rotary_percent=0.5))


def test_to_hf_refusals():
    ds, glm = from_hf_config(hf_config_dict("ds_qlora")), from_hf_config(hf_config_dict("glm"))
    moe = ds.moe
    def with_moe(**changes) -> ModelConfig:
        return dataclasses.replace(ds, moe=dataclasses.replace(moe, **changes))

    cases = [
        (with_moe(layer_freq=[1, 0, 1, 1]), "layer_freq"),
        (with_moe(router_expert_bias=False), "router_expert_bias"),
        (with_moe(shared_expert_ffn_hidden_size=30), "shared_expert_ffn_hidden_size"),
        (with_moe(shared_expert_gate=True), "shared_expert_gate"),
        (dataclasses.replace(ds, moe=None), "ModelConfig.moe"),
        (dataclasses.replace(ds, mla=dataclasses.replace(ds.mla, mscale=0.5, mscale_all_dim=0.0)), "mscale"),
        (dataclasses.replace(glm, rope_scaling_factor=8.0), "rope_scaling_factor"),
    ]
    for cfg, field in cases:
        with pytest.raises(ValueError, match=field):
            to_hf_config(cfg)
    qwen = from_hf_config(qwen_config_dict("qwen3_moe") | {"num_hidden_layers": 4})  # softmax routing
    with pytest.raises(ValueError, match="router_num_groups"):
        to_hf_config(dataclasses.replace(qwen, moe=dataclasses.replace(moe, router_score_function="softmax",
                                                                        router_expert_bias=False)))


def _mla_model(**changes) -> ModelConfig:
    mla = MLAConfig(q_lora_rank=6, kv_lora_rank=8, qk_head_dim=8, qk_pos_emb_head_dim=4, v_head_dim=8)
    fields = dict(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=64, max_sequence_length=16,
                  mla=mla)
    return ModelConfig(**{**fields, **changes})


@pytest.mark.parametrize("changes,field", [
    (dict(num_query_groups=2), "num_query_groups"),
    (dict(qk_layernorm=True), "qk_layernorm"),
    (dict(add_qkv_bias=True), "add_qkv_bias"),
    (dict(rope_scaling_factor=8.0), "rope_scaling_factor"),
    (dict(rotary_percent=0.5), "rotary_percent"),
    (dict(core_attention="local"), "core_attention"),
    (dict(lora=LoRAConfig(rank=4)), "lora"),
    (dict(mla={"kv_lora_rank": 8, "qk_head_dim": 8, "qk_pos_emb_head_dim": 4, "v_head_dim": 8,
               "rope_type": "ntk"}), "rope_type"),
    (dict(mla={"kv_lora_rank": 8, "qk_head_dim": 8, "qk_pos_emb_head_dim": 4, "v_head_dim": 8,
               "rotary_scaling_factor": 4.0}), "rotary_scaling_factor"),
    (dict(mla={"kv_lora_rank": 8, "qk_head_dim": 8, "qk_pos_emb_head_dim": 4, "v_head_dim": 8,
               "q_lora": 4}), "unknown field"),
    (dict(mla=None, rotary_percent=0.1), "rotary_percent"),
    (dict(mla=None, rotary_percent=1.5), "rotary_percent"),
])
def test_model_config_refusals(changes, field):
    with pytest.raises(ValueError, match=field):
        _mla_model(**changes)


@pytest.mark.parametrize("tp,changes,field", [
    (8, {}, "num_attention_heads"),
    (4, {}, "q_lora_rank"),  # 6 % 4
    (2, {"kv_lora_rank": 7, "q_lora_rank": 8}, "kv_lora_rank"),  # 7 + 4 = 11 rows of the kv down projection
])
def test_layout_refusals(tp, changes, field):
    m = _mla_model()
    m = dataclasses.replace(m, mla=dataclasses.replace(m.mla, **changes))
    EngineConfig(model=m, parallel=ParallelConfig(tensor_model_parallel_size=1))
    with pytest.raises(ValueError, match=field):
        EngineConfig(model=m, parallel=ParallelConfig(tensor_model_parallel_size=tp))
