"""The table of Hugging Face families (``mcore_engine.hf.families``): every row reachable from its
``config.json`` and from the ``ModelConfig`` it produces, every MoE dialect known; what no row
describes is refused by name."""

from __future__ import annotations

import dataclasses

import pytest

from mcore_engine.hf.families import ARCHITECTURES, FAMILIES, family_of, hf_family_of
from mcore_engine.hf.hf_config import MOE_DIALECTS, from_hf_config, to_hf_config
from tests.hf import deepseek_models, gpt_oss_models, models, qwen3_5_models

CONFIGS = {**{f: (lambda f=f: models.hf_config_dict(f)) for f in (*models.FAMILIES, *models.MOE_FAMILIES)},
           "deepseek_v3": lambda: deepseek_models.hf_config_dict("ds_qlora"),
           "glm4_moe": lambda: deepseek_models.hf_config_dict("glm"),
           **{qwen3_5_models.MODEL_TYPES[k]: (lambda k=k: qwen3_5_models.hf_config_dict(k))
              for k in ("qwen3_5", "qwen3_5_moe", "qwen3_next")},
           "gpt_oss": lambda: gpt_oss_models.hf_config().to_dict()}


def test_rows_are_consistent():
    assert {f.model_type for f in FAMILIES} == set(CONFIGS) and len(FAMILIES) == len(CONFIGS)
    for f in FAMILIES:
        assert f.moe in (None, *MOE_DIALECTS), f.model_type
        assert (f.moe is None) == (f.moe_names is None), f.model_type
        assert f.shared_expert in (None, "gated", "ungated")
        assert f.rope in ("llama3", "partial", "mla", "yarn")
        assert ARCHITECTURES[f.architecture] == f.model_type
        value_arch = f.architecture.replace("ForCausalLM", "ForTokenClassification")
        assert (value_arch in ARCHITECTURES) == f.value_head


@pytest.mark.parametrize("model_type", sorted(CONFIGS))
def test_family_of_round_trip(model_type):
    """config.json -> its row; the ModelConfig it gives -> the same row; export keeps it."""
    d = CONFIGS[model_type]()
    assert hf_family_of(d).model_type == model_type
    assert hf_family_of({"model_type": model_type}).model_type == model_type  # no architectures
    cfg = from_hf_config(d)
    assert family_of(cfg).model_type == model_type
    assert to_hf_config(cfg)["model_type"] == model_type


def test_combinations_without_a_family_are_refused():
    q3 = from_hf_config(CONFIGS["qwen3"]())
    with pytest.raises(ValueError, match="add_qkv_bias=True with qk_layernorm=True .*no Hugging Face family"):
        family_of(dataclasses.replace(q3, add_qkv_bias=True))
    with pytest.raises(ValueError, match="architectures: unknown architecture"):
        hf_family_of({"architectures": ["GPTNeoXForCausalLM"]})
    moe = from_hf_config(CONFIGS["qwen3_moe"]())
    with pytest.raises(ValueError, match="model.head: a value head on a qwen3_moe model"):
        to_hf_config(dataclasses.replace(moe, head="value"))
