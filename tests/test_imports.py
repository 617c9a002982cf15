"""Every import path a user names keeps working: the README, ``../shared/API.md``, ``examples/``, the
packaged verl Hydra config (its ``_target_`` classes) and the module paths from before the package
was split into subsystem folders (``mcore_engine._MOVED``)."""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

import mcore_engine

ROOT = Path(__file__).resolve().parents[1]

# (module, names) that the README, API.md and examples import
PUBLIC = [
    ("mcore_engine", ["MegatronEngine", "EngineConfig"]),
    ("mcore_engine.config", ["EngineConfig", "ModelConfig", "ParallelConfig", "OptimizerConfig", "MoEConfig",
                             "LoRAConfig", "MLAConfig"]),
    ("mcore_engine.engine", ["MegatronEngine"]),
    ("mcore_engine.processor", ["process_lm_head_logits", "process_lm_head_hidden", "RowSelection"]),
    ("mcore_engine.ops", ["is_scalar_unit_temperature", "scale_logits_by_temperature",
                          "vocab_parallel_log_probs", "vocab_parallel_entropy",
                          "vocab_parallel_sum_pi_squared", "vocab_parallel_topk",
                          "vocab_parallel_forward_kl_topk", "vocab_parallel_logits_outputs"]),
    ("mcore_engine.ops.lm_head", ["fused_lm_head_outputs"]),
    ("mcore_engine.losses", ["distillation_ppo_loss", "ppo_value_loss", "LossContext"]),
    ("mcore_engine.weight_sync", ["BucketMeta", "plan_buckets", "unflatten_bucket", "iter_weight_buckets"]),
    ("mcore_engine.hf", ["export_hf", "from_hf_config", "load_hf_weights", "read_hf_config",
                         "iter_hf_tensors"]),
    ("mcore_engine.recipes", ["JobConfig", "run_job"]),
    ("mcore_engine.recipes.grpo", ["run_grpo"]),
    ("mcore_engine.recipes.grpo_config", ["GRPOJobConfig"]),
    ("mcore_engine.recipes.logging", ["plot_grpo_runs"]),
    ("mcore_engine.integrations.verl", ["McoreEngineVerlConfig", "McoreEngineActorConfig"]),
    ("mcore_engine.parallel.platform", ["init_distributed", "destroy_distributed", "get_device"]),
    ("mcore_engine_kernels.forward", ["chunk_stats", "row_max"]),
]


@pytest.mark.parametrize("module,names", PUBLIC, ids=[m for m, _ in PUBLIC])
def test_public_names_import(module: str, names: list[str]):
    mod = importlib.import_module(module)
    missing = [n for n in names if not hasattr(mod, n)]
    assert not missing, f"{module} lacks {missing}"


@pytest.mark.parametrize("old", sorted(mcore_engine._MOVED))
def test_moved_module_keeps_its_old_path(old: str):
    """``mcore_engine.<old>`` is the very module now in its subsystem folder, attributes and all."""
    new = importlib.import_module(f"mcore_engine.{mcore_engine._MOVED[old]}")
    alias = importlib.import_module(f"mcore_engine.{old}")
    assert alias is new
    assert new.__spec__.name == new.__name__  # the alias does not rename the module it points at
    public = [n for n in vars(new) if not n.startswith("_")]
    assert public and all(getattr(alias, n) is getattr(new, n) for n in public)


# The pre-split modules' ``__all__`` (commit 5edb286), frozen: each name still imports from its old
# path. Left out: ``mtp_config.validate_mtp`` (the MTP rules are ``config.mtp.MTP.check`` and
# ``config.recompute``, split between the model and the engine checks).
OLD_ALL = {
    "model": ["PackedDotProductAttention", "build_model_chunks", "build_transformer_config", "has_te",
              "apply_output_layer", "is_last_stage_chunk", "lm_head_weight", "output_hidden_states",
              "padded_vocab_size"],
    "step": ["LOSS_CONVENTIONS", "MicroBatch", "PreparedStep", "attention_mask", "collect_outputs",
             "gather_micro_batch_metrics", "gather_results", "micro_batch_iterator",
             "micro_batch_loss_result", "micro_batch_outputs", "pad_inputs", "prepare_step"],
    "adapters": ["attach_lora", "gather_adapters", "iter_adapter_tensors", "merged_weight_overrides",
                 "sum_partial_adapter_grads"],
    "moe": ["ROUTING_KEY", "MoERuntime", "validate_routing"],
    "checkpoint": ["FORMAT", "IGNORED_CONFIG", "checkpoint_layout", "config_mismatch", "config_record",
                   "load_engine_checkpoint", "rng_state", "save_engine_checkpoint", "set_rng_state"],
    "offload": ["PARTS", "HostOffloader"],
    "optim": ["StepResult", "build_optimizer", "build_scheduler", "load_optimizer_state_dict",
              "init_optimizer_state", "optimizer_param_shapes", "optimizer_state_dict",
              "reset_optimizer_state", "step_optimizer", "sub_optimizers"],
    "loss_guard": ["LossGuard", "check_loss_result"],
    "lm_head_outputs": ["check_head_flags", "lm_head_outputs", "merge_logits_func"],
    "mtp": ["MTP_METRIC", "loss_with_mtp", "mtp_loss", "shift_in_sequence"],
    "platform": ["Device", "apply_cpu_device_layer", "apply_mla_compat", "apply_moe_compat",
                 "cpu_device_layer_active", "destroy_distributed", "get_device", "init_distributed",
                 "mcore_version", "quiet_cpu_warnings", "seed_everything"],
    "config": ["EngineConfig", "ModelConfig", "OptimizerConfig", "ParallelConfig"],
    "lora_config": ["HF_PROJECTIONS", "LINEAR_PROJECTIONS", "LoRAConfig"],
    "mla_config": ["MLAConfig"], "moe_config": ["MoEConfig"], "gloo_collectives": ["apply_gloo_collectives"],
    "hf.mapping": ["model_family"],
}


@pytest.mark.parametrize("old", sorted(OLD_ALL))
def test_old_module_names_import(old: str):
    module = importlib.import_module(f"mcore_engine.{old}")
    missing = [n for n in OLD_ALL[old] if not hasattr(module, n)]
    assert not missing, f"mcore_engine.{old} lost {missing}"


def test_old_from_import_forms():
    from mcore_engine.lora_config import LoRAConfig
    from mcore_engine.moe_config import MoEConfig
    from mcore_engine.platform import destroy_distributed

    from mcore_engine import config, parallel

    assert LoRAConfig is config.LoRAConfig and MoEConfig is config.MoEConfig
    assert destroy_distributed is parallel.platform.destroy_distributed
    from mcore_engine.model import build_model_chunks
    from mcore_engine.step import prepare_step

    assert build_model_chunks is importlib.import_module("mcore_engine.model.build").build_model_chunks
    assert prepare_step is importlib.import_module("mcore_engine.step.prepare").prepare_step
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("mcore_engine.no_such_module")
    assert not hasattr(importlib.import_module("mcore_engine.model"), "no_such_name")


def test_hydra_targets_import():
    """Each ``_target_`` of the packaged verl Hydra config resolves to a class."""
    targets = set()
    for path in (ROOT / "mcore_engine" / "integrations" / "verl_hydra").glob("*.yaml"):
        targets |= set(re.findall(r"_target_:\s*(mcore_engine[\w.]+)", path.read_text()))
    assert targets
    for target in sorted(targets):
        module, _, name = target.rpartition(".")
        assert isinstance(getattr(importlib.import_module(module), name), type), target


def test_light_modules_import_without_megatron():
    """``weight_sync.unflatten_bucket`` (an inference engine's receiver), ``ops`` and ``config`` import in
    a process where ``megatron`` cannot be imported."""
    code = ("import sys; sys.modules['megatron'] = None\n"
            "from mcore_engine.weight_sync import BucketMeta, unflatten_bucket\n"
            "from mcore_engine.ops import vocab_parallel_log_probs\n"
            "from mcore_engine.config import EngineConfig\n"
            "assert not any(m.startswith('megatron.') for m in sys.modules), 'megatron imported'\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
