"""The activation-recompute block: ``EngineConfig.recompute_*`` (top-level YAML keys), checked against
the model and the layout; ``"full"``'s ``None`` defaults filled in."""

from __future__ import annotations

from typing import Any

from mcore_engine.config.checks import is_int, one_of, require

__all__ = ["RECOMPUTE_MODULES", "check_recompute"]

RECOMPUTE_MODULES = ("core_attn", "layernorm", "mlp")


def check_recompute(cfg: Any) -> None:
    """``cfg``: the ``EngineConfig``; its recompute fields resolved in place."""
    m, p = cfg.model, cfg.parallel
    gran, method, n, modules = (cfg.recompute_granularity, cfg.recompute_method, cfg.recompute_num_layers,
                                cfg.recompute_modules)
    require(gran in (None, "full", "selective"), "EngineConfig.recompute_granularity must be "
            f"{one_of((None, 'full', 'selective'))}, got {gran!r}", "recompute_granularity")
    if gran != "full":
        for name in ("recompute_method", "recompute_num_layers"):
            require(getattr(cfg, name) is None, f"EngineConfig.{name} needs "
                    f"EngineConfig.recompute_granularity='full', got {name}={getattr(cfg, name)!r} with "
                    f"recompute_granularity={gran!r}",
                    name, "recompute_granularity")
    if gran != "selective":
        require(modules is None, "EngineConfig.recompute_modules needs EngineConfig.recompute_granularity="
                f"'selective', got {modules!r} with recompute_granularity={gran!r}",
                "recompute_modules", "recompute_granularity")
    if gran is None:
        return
    require(m.moe is None, f"EngineConfig.recompute_granularity={gran!r} with ModelConfig.moe: MoE layers "
            "are not recomputed here (routing replay follows one forward per micro-batch)",
            "recompute_granularity", "model.moe")
    deep = m.vision.deepstack_visual_indexes if m.vision is not None else []
    require(gran != "full" or not deep, "EngineConfig.recompute_granularity='full' with DeepStack "
            f"(ModelConfig.vision deepstack_visual_indexes {deep}): the tower's features join the first "
            "decoder layers' outputs by hooks a recomputed layer does not see; use 'selective'",
            "recompute_granularity", "model.vision")
    if gran == "selective":
        require(modules is None or (isinstance(modules, list) and modules
                                    and set(modules) <= set(RECOMPUTE_MODULES)),
                f"EngineConfig.recompute_modules must be None or a non-empty list of {RECOMPUTE_MODULES}, "
                f"got {modules!r}", "recompute_modules")
        return
    cfg.recompute_method = method = "uniform" if method is None else method
    require(method in ("uniform", "block"), "EngineConfig.recompute_method must be "
            f"{one_of((None, 'uniform', 'block'))}, got {method!r}", "recompute_method")
    cfg.recompute_num_layers = n = 1 if n is None else n
    require(is_int(n, 1),
            f"EngineConfig.recompute_num_layers must be an int >= 1, got {n!r}", "recompute_num_layers")
    chunk = m.num_layers // (p.pipeline_model_parallel_size * (p.virtual_pipeline_model_parallel_size or 1))
    require(chunk % n == 0 if method == "uniform" else n <= chunk,
            f"EngineConfig.recompute_num_layers ({n}) must "
            f"{'divide' if method == 'uniform' else 'be at most'} the layers of one model chunk ({chunk}: "
            "ModelConfig.num_layers / (pipeline_model_parallel_size x virtual_pipeline_model_parallel_size)) "
            f"with recompute_method={method!r}",
            "recompute_num_layers", "model.num_layers", "parallel.pipeline_model_parallel_size",
            "parallel.virtual_pipeline_model_parallel_size")
    if m.mtp_num_layers and m.mtp_loss_scaling_factor and method == "uniform":
        require(n == 1 and cfg.data_format == "bshd",
                "ModelConfig.mtp_loss_scaling_factor > 0 with EngineConfig.recompute_granularity='full', "
                "recompute_method='uniform' needs recompute_num_layers=1 and EngineConfig.data_format='bshd' "
                f"(got {n} and {cfg.data_format!r}): Megatron-Core 0.16 recomputes an MTP module only so "
                "(packed-sequence parameters break its checkpoint); recompute_method='block' leaves the MTP "
                "modules un-recomputed", "recompute_num_layers", "data_format",
                "model.mtp_loss_scaling_factor")
