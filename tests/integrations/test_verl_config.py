"""The mcore_engine backend's verl config mapping and refusals, in-process (no ranks): every verl field
with a meaning maps onto the core's ``EngineConfig``, every one the engine cannot honour is refused
by name (LoRA's settings of both styles included); the value-model registration, ``to(...)`` device
names and ``hdfs_path`` refusals; the packaged Hydra config (``mcore_engine/integrations/verl_hydra``):
verl's ``ppo_megatron_trainer`` with actor, reference and critic on this backend in the actor's dtype
(and LoRA's canonical defaults)."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("verl", reason="verl is installed by `make setup` (pip install --no-deps verl==0.9.1)")

from tests.integrations.verl_setup import VOCAB, make_hf_model  # noqa: E402

# ---------------------------------------------------------------------------- refused config fields
# LoRA as the packaged verl config sets it (Megatron-Bridge's canonical_lora with PEFT's init), rank 4
LORA = {"type": "canonical_lora", "merge": False, "rank": 4, "alpha": 32, "dropout": 0.0,
        "target_modules": ["linear_q", "linear_k", "linear_v", "linear_proj", "linear_fc1_gate",
                           "linear_fc1_up", "linear_fc2"],
        "exclude_modules": [], "dropout_position": "pre", "lora_A_init_method": "kaiming",
        "lora_B_init_method": "zero", "a2a_experimental": False, "dtype": None, "adapter_path": None}
ALL_PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

REFUSED = [
    ("engine", dict(dtype="float16"), "engine_config.dtype"),
    ("engine", dict(override_transformer_config={"cp_comm_type": "ring"}), "cp_comm_type"),
    ("engine", dict(expert_model_parallel_size=2), "engine_config.expert_model_parallel_size"),
    ("engine", dict(expert_tensor_parallel_size=2), "engine_config.expert_tensor_parallel_size"),
    ("engine", dict(dynamic_context_parallel=True), "engine_config.dynamic_context_parallel"),
    ("engine", dict(full_determinism=True), "engine_config.full_determinism"),
    ("engine", dict(pad_to_length=True), "engine_config.pad_to_length"),
    ("engine", dict(use_dist_checkpointing=True), "engine_config.use_dist_checkpointing"),
    ("engine", dict(use_megatron_fsdp=True), "engine_config.use_megatron_fsdp"),
    ("engine", dict(distrib_optim_fully_reshardable_mem_efficient=True),
     "engine_config.distrib_optim_fully_reshardable_mem_efficient"),
    ("engine", dict(max_seqlen_per_dp_cp_rank=8), "engine_config.max_seqlen_per_dp_cp_rank"),
    ("engine", dict(dist_checkpointing_path="ckpt"), "engine_config.dist_checkpointing_path"),
    ("engine", dict(override_ddp_config={"bucket_size": 1}), "engine_config.override_ddp_config"),
    ("engine", dict(override_transformer_config={"apply_rope_fusion": True}),
     r"engine_config.override_transformer_config=\['apply_rope_fusion'\]"),
    ("engine", dict(override_transformer_config={"attention_backend": "cudnn"}),
     "engine_config.override_transformer_config.attention_backend='cudnn'"),
    ("engine", dict(override_transformer_config=dict(recompute_granularity="full", recompute_method="chunk")),
     "engine_config.override_transformer_config.recompute_method='chunk'"),
    ("engine", dict(override_transformer_config=dict(recompute_granularity="full", recompute_num_layers=3)),
     "engine_config.override_transformer_config.recompute_num_layers=3"),
    ("engine", dict(override_transformer_config={"recompute_granularity": "all"}),
     "engine_config.override_transformer_config.recompute_granularity='all'"),
    ("engine", dict(override_mcore_model_config={"x": 1}), "engine_config.override_mcore_model_config"),
    ("engine", dict(router_replay="R2"), "engine_config.router_replay.mode"),
    ("engine", dict(qat=True), "engine_config.qat.enable"),
    ("engine", dict(strategy="megatron"), "engine_config.strategy"),
    # LoRA: what the core cannot honour, by verl's field (Megatron-style block, then FSDP-style fields)
    ("model", dict(lora=dict(LORA, type="dora")), "model_config.lora.type='dora'"),
    ("model", dict(lora=dict(LORA, type="vlm_lora")), "model_config.lora.type='vlm_lora'"),
    ("model", dict(lora={"rank": 4}),  # verl's defaults: type lora, fused linear_qkv / linear_fc1
     r"model_config.lora.target_modules=\['linear_qkv', 'linear_proj', 'linear_fc1', 'linear_fc2'\] is not "
     "supported by the mcore_engine backend: type 'lora' puts one fused adapter on linear_qkv"),
    ("model", dict(lora=dict(LORA, type="lora", target_modules=["linear_proj", "linear_fc1"])),
     "type 'lora' puts one fused adapter on linear_fc1"),
    ("model", dict(lora=dict(LORA, target_modules=["*.layers.0.*.linear_q"])),
     r"unknown module '\*.layers.0.\*.linear_q' for type 'canonical_lora'"),
    ("model", dict(lora=dict(LORA, target_modules=[])), r"model_config.lora.target_modules=\[\]"),
    ("model", dict(lora=dict(LORA, target_modules=None, exclude_modules=["linear_fc2"])),
     "model_config.lora.target_modules=None"),
    ("model", dict(lora=dict(LORA, exclude_modules=["linear_fc2"])), "model_config.lora.exclude_modules"),
    ("model", dict(lora=dict(LORA, lora_A_init_method="xavier")),
     "model_config.lora.lora_A_init_method='xavier'"),
    ("model", dict(lora=dict(LORA, lora_B_init_method="kaiming")), "model_config.lora.lora_B_init_method"),
    ("model", dict(lora=dict(LORA, dropout=0.1, dropout_position="post")),
     "model_config.lora.dropout_position"),
    ("model", dict(lora=dict(LORA, a2a_experimental=True)), "model_config.lora.a2a_experimental"),
    ("model", dict(lora=dict(LORA, dtype="bfloat16")), "model_config.lora.dtype='bfloat16'"),
    ("model", dict(lora=dict(LORA, alpha=0)), "model_config.lora.rank=4 is not supported by the mcore_engine "
     "backend: LoRAConfig.alpha"),
    ("model", dict(lora=dict(LORA, dropout=1.0)), "model_config.lora.rank=4 is not supported by the "
     "mcore_engine backend: LoRAConfig.dropout"),
    ("model", dict(lora=dict(LORA, rank=-1)), "model_config.lora.rank=-1"),
    ("model", dict(lora=dict(LORA, rank=2.5)), "model_config.lora.rank=2.5"),
    ("model", dict(lora=dict(LORA, merge="yes")), "model_config.lora.merge='yes'"),
    ("model", dict(lora=dict(LORA, alpah=8)), r"model_config.lora=\['alpah'\]"),
    ("model", dict(lora={"rank": 0, "adapter_path": "adapter"}), "model_config.lora.adapter_path='adapter'"),
    ("model", dict(lora=LORA, lora_rank=8), "model_config.lora_rank=8 is not supported by the mcore_engine "
     "backend: set either"),
    ("model", dict(lora=dict(LORA, adapter_path="a"), lora_adapter_path="b"),
     "model_config.lora_adapter_path='b' is not supported by the mcore_engine backend: differs"),
    ("model", dict(lora_rank=8, exclude_modules="lm_head"), "model_config.exclude_modules='lm_head'"),
    ("model", dict(lora_rank=8, target_parameters=["mlp.experts"]), "model_config.target_parameters"),
    ("model", dict(lora_rank=8, target_modules="q_proj|v_proj"),
     r"model_config.target_modules='q_proj\|v_proj'"),
    ("model", dict(lora_rank=8, target_modules=["q_proj", "lm_head"]), "model_config.target_modules="),
    ("model", dict(lora_rank=-2), "model_config.lora_rank=-2"),
    ("model", dict(lora_rank=8, lora_alpha=-1), "model_config.lora_rank=8 is not supported by the "
     "mcore_engine backend: LoRAConfig.alpha"),
    ("model", dict(lora_adapter_path="no_such_adapter"), "model_config.lora_adapter_path='no_such_adapter'"),
    ("model", dict(enable_activation_offload=True), "model_config.enable_activation_offload"),
    ("model", dict(use_liger=True), "model_config.use_liger"),
    ("model", dict(fused_kernel_options={"chunk_size": 64}), "model_config.fused_kernel_options"),
    ("model", dict(fused_kernel_options={"impl_backend": "cuda"}),
     "model_config.fused_kernel_options.impl_backend"),
    ("model", dict(tiled_mlp={"enabled": True, "num_shards": 4}), "model_config.tiled_mlp.enabled"),
    ("model", dict(override_config={"num_hidden_layers": 3}), "model_config.override_config"),
    ("model", dict(model_type="reward_model"), "model_config.model_type"),
    ("value", dict(use_fused_kernels=True), "engine_config.use_fused_kernels"),
    ("value", dict(logits_chunk_size=64), "engine_config.logits_chunk_size"),
    ("optim", dict(optimizer="sgd"), "optimizer_config.optimizer"),
    ("optim", dict(lr_warmup_init=1e-4), "optimizer_config.lr_warmup_init"),
    ("optim", dict(lr_decay_style="inverse_square_root"), "optimizer_config.lr_decay_style"),
    ("optim", dict(weight_decay_incr_style="cosine"), "optimizer_config.weight_decay_incr_style"),
    ("optim", dict(lr_wsd_decay_steps=3), "optimizer_config.lr_wsd_decay_steps"),
    ("optim", dict(use_precision_aware_optimizer=True), "optimizer_config.use_precision_aware_optimizer"),
    ("optim", dict(use_layer_wise_distributed_optimizer=True),
     "optimizer_config.use_layer_wise_distributed_optimizer"),
    ("optim", dict(override_optimizer_config={"adam_eps": 1e-6}),
     "optimizer_config.override_optimizer_config"),
    ("optim", dict(lr_decay_style="linear", total_training_steps=-1),
     "optimizer_config.total_training_steps"),
    ("optim", dict(fsdp=True), "optimizer_config"),
    ("checkpoint", dict(save_contents=["model"]), "checkpoint_config.save_contents"),
    ("checkpoint", dict(load_contents=["model", "hf_model"]), "checkpoint_config.load_contents"),
    ("checkpoint", dict(async_save=True), "checkpoint_config.async_save"),
]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("verl_hf") / "hf")
    make_hf_model(path)
    return path


def build_configs(hf_dir: str, group: str, kw: dict):
    """verl's four config objects with ``kw`` applied to ``group``."""
    from verl.trainer.config.config import CheckpointConfig
    from verl.workers.config import FSDPOptimizerConfig, HFModelConfig, McoreOptimizerConfig
    from verl.workers.config.engine import EngineRouterReplayConfig, QATEngineConfig

    from mcore_engine.integrations.verl import McoreEngineVerlConfig

    kw = dict(kw)
    model = dict(path=hf_dir, load_tokenizer=False, enable_gradient_checkpointing=False)
    if group == "value":  # a critic's engine block
        model["model_type"], group = "value_model", "engine"
    engine = dict(dtype="float32", tensor_model_parallel_size=2, use_dynamic_bsz=False)
    optim = dict(lr=1e-3, lr_decay_style="constant")
    if "router_replay" in kw:
        kw["router_replay"] = EngineRouterReplayConfig(mode=kw["router_replay"])
    if "qat" in kw:
        kw["qat"] = QATEngineConfig(enable=True)
    {"model": model, "engine": engine, "optim": optim, "checkpoint": {}}[group].update(kw)
    optim_cls = McoreOptimizerConfig
    if optim.pop("fsdp", False):
        optim_cls = FSDPOptimizerConfig
        optim.pop("lr_decay_style")
    return (HFModelConfig(**model), McoreEngineVerlConfig(**engine), optim_cls(**optim),
            CheckpointConfig(**({} if group != "checkpoint" else kw)))


def test_verl_config_mapping(hf_dir):
    from mcore_engine.integrations.verl_config import engine_config_from_verl

    cfg = engine_config_from_verl(*build_configs(hf_dir, "engine", {}))
    assert (cfg.parallel.tensor_model_parallel_size, cfg.precision, cfg.data_format) == (2, "fp32", "thd")
    assert cfg.model.hf_path == hf_dir and cfg.model.vocab_size == VOCAB and cfg.model.add_qkv_bias
    cfg = engine_config_from_verl(*build_configs(hf_dir, "optim", dict(
        lr=3e-4, betas=(0.8, 0.95), weight_decay=0.1, clip_grad=0.5, lr_decay_style="cosine",
        total_training_steps=100, lr_warmup_steps_ratio=0.1, min_lr=1e-5)))
    o = cfg.optimizer
    assert (o.lr, o.adam_beta1, o.adam_beta2, o.weight_decay, o.clip_grad) == (3e-4, 0.8, 0.95, 0.1, 0.5)
    assert (o.lr_decay_style, o.lr_decay_steps, o.lr_warmup_steps, o.min_lr) == ("cosine", 100, 10, 1e-5)
    cfg = engine_config_from_verl(*build_configs(hf_dir, "engine", dict(
        dtype="bfloat16", pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=None,
        micro_batch_size_per_gpu=3, use_remove_padding=False, seed=7, use_fused_kernels=True)))
    assert (cfg.precision, cfg.parallel.pipeline_model_parallel_size, cfg.micro_batch_size) == ("bf16", 2, 3)
    assert (cfg.data_format, cfg.seed, cfg.model.fused_lm_head) == ("bshd", 7, True)
    # numpy integers (a config filled from arrays) are integers; a string is the core's to refuse
    cfg = engine_config_from_verl(*build_configs(hf_dir, "engine", dict(
        micro_batch_size_per_gpu=np.int64(3), seed=np.int32(7), tensor_model_parallel_size=np.int64(2))))
    ints = (cfg.micro_batch_size, cfg.seed, cfg.parallel.tensor_model_parallel_size)
    assert ints == (3, 7, 2) and {type(v) for v in ints} == {int}
    with pytest.raises(ValueError, match="seed"):
        engine_config_from_verl(*build_configs(hf_dir, "engine", dict(seed="7")))
    engine_config_from_verl(*build_configs(hf_dir, "engine", dict(param_offload=True,
                                                                   optimizer_offload=True)))
    # expert-parallel fields reach ParallelConfig; a dense model refuses them there, by both names
    for kw in (dict(expert_model_parallel_size=2), dict(expert_tensor_parallel_size=1)):
        with pytest.raises(ValueError, match=rf"engine_config\.{next(iter(kw))}=.*ModelConfig\.moe"):
            engine_config_from_verl(*build_configs(hf_dir, "engine", kw))


def test_verl_value_model_registration(hf_dir, monkeypatch):
    """``model_type="value_model"`` selects :class:`McoreEngineVerlValue` (``head="value"``, no fused
    lm-head); each class refuses the other's model type by name, before any process-group work."""
    from verl.workers.engine.base import EngineRegistry

    from mcore_engine.integrations.verl import McoreEngineVerl, McoreEngineVerlValue
    from mcore_engine.integrations.verl_config import BACKEND, engine_config_from_verl

    monkeypatch.setenv("VERL_ENGINE_DEVICE", "cpu")
    assert EngineRegistry.get_engine_cls("value_model", BACKEND) is McoreEngineVerlValue
    assert EngineRegistry.get_engine_cls("language_model", BACKEND) is McoreEngineVerl
    value = build_configs(hf_dir, "value", {})
    cfg = engine_config_from_verl(*value)
    assert (cfg.model.head, cfg.model.fused_lm_head, cfg.model.hf_path) == ("value", False, hf_dir)
    assert engine_config_from_verl(*build_configs(hf_dir, "engine", {})).model.head == "lm"
    with pytest.raises(ValueError, match=r"model_config\.model_type='value_model'"):
        McoreEngineVerl(*value)
    with pytest.raises(ValueError, match=r"model_config\.model_type='language_model'"):
        McoreEngineVerlValue(*build_configs(hf_dir, "engine", {}))


@pytest.mark.parametrize("group, kw, field", REFUSED, ids=[r[2] + ":" + next(iter(r[1])) for r in REFUSED])
def test_verl_refused_field(hf_dir, group, kw, field):
    from mcore_engine.integrations.verl_config import engine_config_from_verl

    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        engine_config_from_verl(*build_configs(hf_dir, group, kw))


@pytest.mark.parametrize("group, kw, match", [
    ("engine", dict(micro_batch_size_per_gpu=0),
     r"^engine_config\.micro_batch_size_per_gpu=0 .*EngineConfig\.micro_batch_size must be an int >= 1"),
    ("engine", dict(pipeline_model_parallel_size=4),
     r"^engine_config\.pipeline_model_parallel_size=4 .*ModelConfig\.num_layers \(2\)"),
    ("engine", dict(tensor_model_parallel_size=8),
     r"^engine_config\.tensor_model_parallel_size=8 .*ModelConfig\.num_attention_heads"),
    ("engine", dict(context_parallel_size=0), r"^engine_config\.context_parallel_size=0 "),
    ("engine", dict(seed=-1), r"^engine_config\.seed=-1 .*EngineConfig\.seed"),
    ("optim", dict(clip_grad=-1.0), r"^optimizer_config\.clip_grad=-1\.0 .*OptimizerConfig\.clip_grad"),
    ("optim", dict(lr_decay_style="cosine", total_training_steps=None),
     r"^optimizer_config\.total_training_steps=None .*OptimizerConfig\.lr_decay_steps"),
])
def test_verl_core_refusals_name_verl_fields(hf_dir, group, kw, match):
    """The core decides and names its field (``ConfigError.fields``); the adapter names verl's
    through ``verl_fields.VERL_FIELDS``."""
    from mcore_engine.integrations.verl_config import engine_config_from_verl

    with pytest.raises(ValueError, match=match):
        engine_config_from_verl(*build_configs(hf_dir, group, kw))


def test_verl_fields_table_names_core_fields():
    """Every key of ``VERL_FIELDS`` is a field of the core's config; ``in_verl_terms`` renames the
    first field of a ``ConfigError`` that has a verl name and leaves other errors alone."""
    import dataclasses

    from mcore_engine.config import EngineConfig, ModelConfig, MoEConfig, OptimizerConfig, ParallelConfig
    from mcore_engine.config.checks import ConfigError
    from mcore_engine.integrations.verl_fields import VERL_FIELDS, in_verl_terms

    blocks = {"": EngineConfig, "model": ModelConfig, "model.moe": MoEConfig, "parallel": ParallelConfig,
              "optimizer": OptimizerConfig}
    for path in VERL_FIELDS:
        block, _, name = path.rpartition(".")
        assert name in {f.name for f in dataclasses.fields(blocks[block])}, path
    otc = {"cp_comm_type": "x"}
    roots = dict(engine_config=type("E", (), dict(seed=7, override_transformer_config=otc))())
    with pytest.raises(ValueError, match=r"^engine_config\.override_transformer_config\.cp_comm_type='x' "):
        with in_verl_terms(**roots):
            raise ConfigError("core message", "model.num_layers", "parallel.cp_comm_type", "seed")
    with pytest.raises(ValueError, match=r"^model_config\.lora\.rank=4 is not supported .*: core message$"):
        with in_verl_terms({"model.lora": "model_config.lora.rank=4"}, **roots):
            raise ConfigError("core message", "model.lora.alpha")
    with pytest.raises(ConfigError, match="^core message$"):  # no verl name: the core's error as is
        with in_verl_terms(**roots):
            raise ConfigError("core message", "model.num_layers")


def test_verl_lora_mapping(hf_dir, tmp_path):
    """verl's LoRA settings -> the core's ``LoRAConfig``: the Megatron-style ``lora`` block (a dict or
    OmegaConf's DictConfig; canonical_lora names, type lora on single-projection linears, Hugging Face
    names; ``adapter_path`` / ``lora_adapter_path``, the init methods not checked with an adapter), the
    FSDP-style ``lora_rank`` / ``lora_alpha`` / ``target_modules`` and ``lora_adapter_path`` (the PEFT
    folder's own config, as verl's FSDP engine); ``merge`` read by ``lora_merge``; a LoRA critic and
    LoRA on MoE experts refused by verl's field name."""
    import json

    from omegaconf import OmegaConf

    from mcore_engine.config.lora import LoRAConfig
    from mcore_engine.integrations.verl_config import engine_config_from_verl, lora_from_verl, lora_merge

    def lora(**model):
        return engine_config_from_verl(*build_configs(hf_dir, "model", model)).model.lora

    assert lora() is None and lora(lora=dict(LORA, rank=0)) is None  # verl's default block: rank 0
    assert lora(lora=dict(LORA, alpha=8, dropout=0.1)) == LoRAConfig(rank=4, alpha=8.0, dropout=0.1,
                                                                      target_modules=ALL_PROJECTIONS)
    assert lora(lora=OmegaConf.create(LORA)) == LoRAConfig(rank=4, alpha=32.0,
                                                           target_modules=ALL_PROJECTIONS)
    single = dict(LORA, type="lora", target_modules=["linear_proj", "linear_fc2"])  # one projection each
    assert lora(lora=single).target_modules == ["o_proj", "down_proj"]
    assert lora(lora=dict(LORA, target_modules=["q_proj", "linear_v"])).target_modules == ["q_proj", "v_proj"]
    folder = tmp_path / "adapter"
    folder.mkdir()
    (folder / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": 2, "lora_alpha": 4, "lora_dropout": 0.05,
         "target_modules": ["v_proj", "q_proj"]}))
    # Megatron-style: the block decides (the core checks the folder against it when it loads)
    with_adapter = dict(LORA, adapter_path=str(folder), lora_A_init_method="xavier")
    assert lora(lora=with_adapter).adapter_path == str(folder)
    assert lora(lora=LORA, lora_adapter_path=str(folder)).adapter_path == str(folder)
    assert lora(lora=dict(LORA, merge=True)).rank == 4
    # FSDP-style: PEFT's fields; with an adapter folder its adapter_config.json decides
    assert lora(lora_rank=8) == LoRAConfig(rank=8, alpha=16.0, target_modules="all-linear")
    assert lora(lora_rank=8, lora_alpha=4, target_modules=["v_proj", "q_proj"]) == LoRAConfig(
        rank=8, alpha=4.0, target_modules=["q_proj", "v_proj"])
    want = LoRAConfig(rank=2, alpha=4.0, dropout=0.05, target_modules=["q_proj", "v_proj"],
                      adapter_path=str(folder))
    assert lora(lora_adapter_path=str(folder)) == want
    assert lora(lora_rank=16, lora_adapter_path=str(folder)) == want
    # merge: verl's worker and this backend's weight sync read the block's flag in both styles
    model, *_ = build_configs(hf_dir, "model", dict(lora_rank=8, lora={"merge": True}))
    assert lora_merge(model) and not lora_merge(build_configs(hf_dir, "model", dict(lora=LORA))[0])
    # the adapters are in the model's dtype: lora.dtype may name it
    model = build_configs(hf_dir, "model", dict(lora=dict(LORA, dtype="bfloat16")))[0]
    engine = build_configs(hf_dir, "engine", dict(dtype="bfloat16"))[1]
    optim, ckpt = build_configs(hf_dir, "model", {})[2:]
    assert engine_config_from_verl(model, engine, optim, ckpt).model.lora.rank == 4
    assert lora_from_verl(model, "bf16")[1] == "model_config.lora.rank=4"
    # no LoRA critic; no LoRA on MoE experts (the core's check, by verl's field)
    for kw, field in ((dict(lora=LORA), "model_config.lora.rank"),
                      (dict(lora_rank=8), "model_config.lora_rank")):
        value = build_configs(hf_dir, "value", {})
        value = (build_configs(hf_dir, "model", dict(kw, model_type="value_model"))[0], *value[1:])
        with pytest.raises(ValueError, match=rf"^{field.replace('.', '[.]')}=.*no LoRA critic"):
            engine_config_from_verl(*value)
    from tests.hf.models import hf_config

    moe_dir = str(tmp_path / "moe")
    hf_config("mixtral").save_pretrained(moe_dir)
    moe = build_configs(moe_dir, "model", dict(lora=LORA))
    with pytest.raises(ValueError, match=r"^model_config[.]lora[.]rank=4 .*MLP linears of a MoE model"):
        engine_config_from_verl(*moe)
    # recompute with LoRA: the core makes the embedding's output require grad, so every recompute
    # reaches the adapters (tests/test_lora.py trains under full recompute)
    def recompute(targets, modules):
        model = build_configs(hf_dir, "model", dict(lora=dict(LORA, target_modules=targets)))[0]
        otc = dict(recompute_granularity="selective", recompute_modules=modules)
        rest = build_configs(hf_dir, "engine", dict(override_transformer_config=otc))[1:]
        return engine_config_from_verl(model, *rest).recompute_modules

    assert recompute(["linear_fc2"], ["core_attn"]) == ["core_attn"]
    assert recompute(["linear_fc1_up", "linear_fc2"], ["mlp"]) == ["mlp"]
    attention = dict(LORA, target_modules=["linear_q", "linear_k", "linear_v", "linear_proj"])
    moe = build_configs(moe_dir, "model", dict(lora=attention))
    assert engine_config_from_verl(*moe).model.lora.rank == 4


def test_verl_recompute_mapping(hf_dir):
    """verl's ``enable_gradient_checkpointing`` (default True) is full recompute, uniform, one layer
    per unit; ``override_transformer_config``'s recompute keys (verl's Megatron engine's) win."""
    from mcore_engine.integrations.verl_config import engine_config_from_verl

    def recompute(model=None, otc=None):
        model_config = build_configs(hf_dir, "model", model or {})[0]
        rest = build_configs(hf_dir, "engine", dict(override_transformer_config=otc or {}))[1:]
        cfg = engine_config_from_verl(model_config, *rest)
        return (cfg.recompute_granularity, cfg.recompute_method, cfg.recompute_num_layers,
                cfg.recompute_modules)

    verl_default = dict(recompute_granularity=None, recompute_modules=["core_attn"], recompute_method=None,
                        recompute_num_layers=None)  # verl's megatron.yaml
    assert recompute() == recompute(otc=verl_default) == (None, None, None, None)
    assert recompute(dict(enable_gradient_checkpointing=True)) == ("full", "uniform", 1, None)
    assert recompute(dict(enable_gradient_checkpointing=True), verl_default) == ("full", "uniform", 1, None)
    assert recompute(otc=dict(verl_default, recompute_granularity="full", recompute_method="block",
                              recompute_num_layers=2)) == ("full", "block", 2, None)
    assert recompute(dict(enable_gradient_checkpointing=True),
                     dict(verl_default, recompute_granularity="selective")) == (
        "selective", None, None, ["core_attn"])
    with pytest.raises(ValueError, match=r"^model_config\.enable_gradient_checkpointing=True, engine_config"
                                         r"\.override_transformer_config\.recompute_num_layers=3 .*"
                                         r"EngineConfig\.recompute_num_layers"):
        recompute(dict(enable_gradient_checkpointing=True), dict(recompute_num_layers=3))


def test_verl_default_transformer_overrides_accepted(hf_dir):
    """verl's megatron.yaml ``override_transformer_config`` (recompute keys null, ``recompute_modules``,
    ``attention_backend: flash``), hf_model.yaml's ``lora`` block with rank 0 and its
    ``fused_kernel_options: {impl_backend: torch}``, which verl's
    trainer hands every role, build the engine: the attention backend is not applicable (the core's
    layer spec picks the attention), no recompute, LoRA off."""
    from mcore_engine.integrations.verl_config import NOT_APPLICABLE, engine_config_from_verl

    verl_default = dict(recompute_granularity=None, recompute_modules=["core_attn"], recompute_method=None,
                        recompute_num_layers=None, attention_backend="flash")
    lora_off = {"type": "lora", "merge": False, "rank": 0, "alpha": 32, "adapter_path": None}  # hf_model.yaml
    model_config = build_configs(hf_dir, "model", dict(lora=lora_off, lora_rank=0,
                                                       fused_kernel_options={"impl_backend": "torch"}))[0]
    assert engine_config_from_verl(model_config, *build_configs(hf_dir, "model", {})[1:]).model.head == "lm"
    model_config.model_type = "value_model"  # verl's critic: TrainingWorker sets it on the same object
    rest = build_configs(hf_dir, "model", {})[1:]
    assert engine_config_from_verl(model_config, *rest).model.head == "value"
    for backend in ("flash", "auto", "local", "unfused", "fused", None):
        otc = dict(verl_default, attention_backend=backend)
        cfg = engine_config_from_verl(*build_configs(hf_dir, "engine", dict(override_transformer_config=otc)))
        assert cfg.recompute_granularity is None
    assert "engine_config.override_transformer_config.attention_backend" in NOT_APPLICABLE


def test_verl_context_parallel(hf_dir):
    """``context_parallel_size`` (and ``override_transformer_config.cp_comm_type``) reach the core."""
    from mcore_engine.integrations.verl_config import engine_config_from_verl

    cfg = engine_config_from_verl(*build_configs(hf_dir, "engine", dict(
        context_parallel_size=2, override_transformer_config={"cp_comm_type": "a2a"})))
    assert (cfg.parallel.context_parallel_size, cfg.parallel.cp_comm_type) == (2, "a2a")
    assert cfg.parallel.data_parallel_size(8) == 2
    assert engine_config_from_verl(*build_configs(hf_dir, "engine", {})).parallel.cp_comm_type == "p2p"


def test_verl_sequence_parallel(hf_dir):
    """verl's default ``sequence_parallel=True`` reaches the core at TP > 1 (CPU too), off at TP=1."""
    from mcore_engine.integrations.verl_config import engine_config_from_verl

    assert engine_config_from_verl(*build_configs(hf_dir, "engine", {})).parallel.sequence_parallel
    off = engine_config_from_verl(*build_configs(hf_dir, "engine", dict(sequence_parallel=False)))
    assert not off.parallel.sequence_parallel
    tp1 = engine_config_from_verl(*build_configs(hf_dir, "engine", dict(tensor_model_parallel_size=1)))
    assert not tp1.parallel.sequence_parallel


def test_verl_refused_without_transformer_engine(hf_dir):
    from mcore_engine.integrations.verl_config import engine_config_from_verl
    from mcore_engine.model.build import has_te

    if has_te():
        pytest.skip("Transformer Engine imports here")
    otc = dict(recompute_granularity="selective", recompute_modules=["layernorm"])
    with pytest.raises(ValueError, match=r"^engine_config\.override_transformer_config\.recompute_modules="):
        engine_config_from_verl(*build_configs(hf_dir, "engine", dict(override_transformer_config=otc)))


def test_verl_to_device_names():
    """``to("cpu")`` offloads; ``"device"``, verl's device name (``"cuda"`` on a CPU-only host too) and
    the engine's own device onload; anything else is a ValueError naming both meanings."""
    from verl.utils.device import get_device_name

    from mcore_engine.integrations.verl import McoreEngineVerl
    from mcore_engine.parallel.platform import get_device

    class Core:
        def __init__(self):
            self.calls = []

        def offload(self, **parts):
            self.calls.append(("offload", parts))

        def onload(self, **parts):
            self.calls.append(("onload", parts))

    adapter = object.__new__(McoreEngineVerl)
    adapter.engine = core = Core()
    for device in ("device", get_device_name(), get_device().type, f"{get_device().type}:0"):
        if device != "cpu":
            adapter.to(device, model=True, optimizer=False, grad=False)
            assert core.calls.pop() == ("onload", dict(params=True, grads=False, optimizer=False)), device
    adapter.to("cpu", model=False, optimizer=True, grad=False)
    assert core.calls.pop() == ("offload", dict(params=False, grads=False, optimizer=True))
    with pytest.raises(ValueError, match=r"device='xpu'; expected 'cpu' \(offload.*'device'"):
        adapter.to("xpu", model=True)


def test_verl_refused_hdfs_path():
    from mcore_engine.integrations.verl import McoreEngineVerl

    engine = object.__new__(McoreEngineVerl)
    for method in (McoreEngineVerl.save_checkpoint, McoreEngineVerl.load_checkpoint):
        with pytest.raises(ValueError, match="hdfs_path"):
            method(engine, "ckpt", hdfs_path="hdfs://x")


# ------------------------------------------------------------------------- the packaged Hydra config
CONFIG_MODULE, CONFIG_NAME = "mcore_engine.integrations.verl_hydra", "ppo_mcore_engine_trainer"
ARR = "actor_rollout_ref"
# what the packaged config changes in verl's ppo_megatron_trainer (unresolved values), and adds
CHANGED = {f"{ARR}.actor._target_", f"{ARR}.actor.strategy", f"{ARR}.actor.megatron._target_",
           f"{ARR}.ref._target_", f"{ARR}.ref.strategy", f"{ARR}.ref.megatron._target_",
           f"{ARR}.ref.megatron.dtype", f"{ARR}.ref.megatron.sequence_parallel",
           "critic.strategy", "critic.megatron._target_", "critic.megatron.dtype",
           f"{ARR}.model.lora.type", f"{ARR}.model.lora.target_modules",
           f"{ARR}.model.lora.lora_A_init_method"}
ADDED = {f"{ARR}.actor.megatron.logits_chunk_size", f"{ARR}.ref.megatron.logits_chunk_size"}


def compose_trainer(module: str, name: str, overrides: tuple[str, ...] = ()):
    from hydra import compose, initialize_config_module

    with initialize_config_module(config_module=module, version_base=None):
        return compose(config_name=name, overrides=list(overrides))


def flat(cfg) -> dict:
    from omegaconf import OmegaConf

    out = {}

    def walk(node, prefix):
        if isinstance(node, dict) and node:
            for key, value in node.items():
                walk(value, f"{prefix}.{key}" if prefix else str(key))
        else:
            out[prefix] = node

    walk(OmegaConf.to_container(cfg, resolve=False), "")
    return out


def test_verl_trainer_config_is_verl_megatron_trainer_plus_backend(tmp_path):
    """The packaged config is verl's whole ``ppo_megatron_trainer`` (every key, every value) except
    the role blocks that select the backend and the reference / critic dtype (the actor's); the same
    when a user's own primary config includes ``mcore_engine_backend`` through ``hydra.searchpath``."""
    from hydra import compose, initialize_config_dir

    ours = flat(compose_trainer(CONFIG_MODULE, CONFIG_NAME))
    verl = flat(compose_trainer("verl.trainer.config", "ppo_megatron_trainer"))
    assert set(ours) - set(verl) == ADDED and not set(verl) - set(ours)
    assert {k for k in verl if ours[k] != verl[k]} == CHANGED
    assert verl[f"{ARR}.ref.strategy"] == "megatron" and verl[f"{ARR}.ref.megatron.dtype"] == "bfloat16"
    (tmp_path / "my_run.yaml").write_text(
        f"hydra:\n  searchpath: [pkg://{CONFIG_MODULE}, pkg://verl.trainer.config]\n"
        "defaults: [mcore_engine_backend, _self_]\n")
    with initialize_config_dir(config_dir=str(tmp_path), version_base=None):
        assert flat(compose(config_name="my_run")) == ours


def test_verl_trainer_config_selects_backend_for_every_role(hf_dir):
    """One switch: actor, reference policy and critic build this backend's engine configs (what verl's
    workers instantiate), the reference forward-only; reference and critic take the actor's dtype
    (verl's megatron_ref.yaml fixes ``strategy: megatron`` and bfloat16 for the reference)."""
    from omegaconf import open_dict
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.engine.base import EngineRegistry

    from mcore_engine.integrations.verl import (
        McoreEngineActorConfig,
        McoreEngineVerl,
        McoreEngineVerlConfig,
        McoreEngineVerlValue,
    )

    run = (f"{ARR}.actor.ppo_micro_batch_size_per_gpu=2", f"{ARR}.ref.log_prob_micro_batch_size_per_gpu=2",
           "critic.ppo_micro_batch_size_per_gpu=2", f"critic.model.path={hf_dir}",
           f"critic.model.tokenizer_path={hf_dir}", "+critic.model.load_tokenizer=False")
    for dtype in ("bfloat16", "float32"):
        cfg = compose_trainer(CONFIG_MODULE, CONFIG_NAME, (*run, f"{ARR}.actor.megatron.dtype={dtype}"))
        actor = omega_conf_to_dataclass(cfg[ARR].actor)
        ref_cfg = cfg[ARR].ref
        with open_dict(ref_cfg):  # what ActorRolloutRefWorker.init_model does before instantiating it
            ref_cfg.ppo_mini_batch_size = cfg[ARR].actor.ppo_mini_batch_size
            for name in ("micro_batch_size", "micro_batch_size_per_gpu", "max_token_len_per_gpu"):
                ref_cfg[f"ppo_{name}"] = ref_cfg.pop(f"log_prob_{name}")
            ref_cfg.use_dynamic_bsz = ref_cfg.pop("log_prob_use_dynamic_bsz")
        ref = omega_conf_to_dataclass(ref_cfg)
        critic = omega_conf_to_dataclass(cfg.critic)
        for role, config in (("actor", actor), ("ref", ref), ("critic", critic)):
            assert config.strategy == config.engine.strategy == "mcore_engine", role
            assert type(config.engine) is McoreEngineVerlConfig and config.engine.dtype == dtype, role
        assert type(actor) is type(ref) is McoreEngineActorConfig
        assert (actor.engine.forward_only, ref.engine.forward_only, critic.engine.forward_only) == (
            False, True, False)
        assert EngineRegistry.get_engine_cls("language_model", ref.engine.strategy) is McoreEngineVerl
        assert EngineRegistry.get_engine_cls("value_model", critic.engine.strategy) is McoreEngineVerlValue
    # the reference follows the actor's layout and lm-head settings too
    cfg = compose_trainer(CONFIG_MODULE, CONFIG_NAME, (
        f"{ARR}.actor.megatron.tensor_model_parallel_size=2", f"{ARR}.actor.megatron.sequence_parallel=False",
        f"{ARR}.actor.megatron.logits_chunk_size=64"))
    ref = cfg[ARR].ref.megatron
    assert (ref.tensor_model_parallel_size, ref.sequence_parallel, ref.logits_chunk_size) == (2, False, 64)


def test_verl_trainer_config_lora(hf_dir):
    """With the packaged config, ``actor_rollout_ref.model.lora.rank=N`` alone is LoRA on all seven
    projections with PEFT's initialisation (Megatron-Bridge's canonical_lora + kaiming: the core's
    adapters); verl's own defaults (type lora: fused linear_qkv / linear_fc1 adapters, xavier init)
    are refused by name. The model block reaches the engine as verl's workers build it."""
    from verl.utils.config import omega_conf_to_dataclass

    from mcore_engine.config.lora import LoRAConfig
    from mcore_engine.integrations.verl_config import engine_config_from_verl, lora_merge

    run = (f"{ARR}.model.path={hf_dir}", f"+{ARR}.model.load_tokenizer=False",
           f"{ARR}.model.enable_gradient_checkpointing=False", f"{ARR}.model.lora.rank=4",
           f"{ARR}.model.lora.alpha=8")
    rest = build_configs(hf_dir, "model", {})[1:]
    model = omega_conf_to_dataclass(compose_trainer(CONFIG_MODULE, CONFIG_NAME, run)[ARR].model)
    assert engine_config_from_verl(model, *rest).model.lora == LoRAConfig(rank=4, alpha=8.0,
                                                                          target_modules=ALL_PROJECTIONS)
    assert not lora_merge(model)  # verl's default: the base once, then adapters with a PEFT config
    model = omega_conf_to_dataclass(compose_trainer(CONFIG_MODULE, CONFIG_NAME, (
        *run, f"{ARR}.model.lora.merge=True"))[ARR].model)
    assert lora_merge(model)
    # verl's default full recompute (enable_gradient_checkpointing=True) works with LoRA
    model = omega_conf_to_dataclass(compose_trainer(CONFIG_MODULE, CONFIG_NAME, (
        *run, f"{ARR}.model.enable_gradient_checkpointing=True"))[ARR].model)
    assert engine_config_from_verl(model, *rest).recompute_granularity == "full"
    verl = compose_trainer("verl.trainer.config", "ppo_megatron_trainer", run)
    verl = omega_conf_to_dataclass(verl[ARR].model)
    with pytest.raises(ValueError, match=r"^model_config[.]lora[.]target_modules=.*one fused adapter"):
        engine_config_from_verl(verl, *rest)


def test_verl_config_registers_backend_when_unpickled():
    """verl's driver pickles the critic's engine config to the worker: unpickling one registers the
    backend in a fresh process (no other import of mcore_engine.integrations.verl)."""
    import pickle
    import subprocess
    import sys

    from mcore_engine.integrations.verl import McoreEngineVerlConfig

    code = ("import pickle, sys; c = pickle.loads(sys.stdin.buffer.read()); "
            "from verl.workers.engine.base import EngineRegistry; "
            "print(EngineRegistry.get_engine_cls('value_model', c.strategy).__name__)")
    out = subprocess.run([sys.executable, "-c", code], input=pickle.dumps(McoreEngineVerlConfig()),
                         capture_output=True, check=True)
    assert out.stdout.decode().split()[-1] == "McoreEngineVerlValue", out


def test_import_mcore_engine_does_not_import_verl():
    import subprocess
    import sys

    code = "import sys, mcore_engine, mcore_engine.integrations; print('verl' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True).stdout.strip() == "False"
