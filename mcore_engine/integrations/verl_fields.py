"""Refusals in verl's terms: ``_refuse`` / ``_check`` name a verl field; ``in_verl_terms`` re-raises
a core :class:`~mcore_engine.config.checks.ConfigError` naming the verl field its field comes from
(``VERL_FIELDS``), so the adapter maps fields and the core decides."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from mcore_engine.config.checks import ConfigError

__all__ = ["PARALLEL_FIELDS", "VERL_FIELDS", "in_verl_terms"]

DTYPES = {"float32": "fp32", "fp32": "fp32", "bfloat16": "bf16", "bf16": "bf16"}
PARALLEL_FIELDS = ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                   "virtual_pipeline_model_parallel_size", "context_parallel_size",
                   "expert_model_parallel_size", "expert_tensor_parallel_size")
_OTC = "engine_config.override_transformer_config"

# core field (dotted path from EngineConfig; a block's path covers its fields) -> the verl field it
# comes from. The LoRA block, the recompute fields, the MTP fields and the decay steps have several
# possible verl sources: the caller names the one it used (``sources`` of ``in_verl_terms``).
VERL_FIELDS: dict[str, str] = {
    **{f"parallel.{n}": f"engine_config.{n}" for n in PARALLEL_FIELDS},
    "parallel.sequence_parallel": "engine_config.sequence_parallel",
    "parallel.cp_comm_type": f"{_OTC}.cp_comm_type",
    "seed": "engine_config.seed",
    "micro_batch_size": "engine_config.micro_batch_size_per_gpu",
    "logits_chunk_size": "engine_config.logits_chunk_size",
    "model.fused_lm_head": "engine_config.use_fused_kernels",
    "model.moe.router_bias_update_rate": f"{_OTC}.moe_router_bias_update_rate",
    "optimizer.lr": "optimizer_config.lr",
    "optimizer.min_lr": "optimizer_config.min_lr",
    "optimizer.adam_beta1": "optimizer_config.betas",
    "optimizer.adam_beta2": "optimizer_config.betas",
    "optimizer.weight_decay": "optimizer_config.weight_decay",
    "optimizer.clip_grad": "optimizer_config.clip_grad",
    "optimizer.lr_decay_style": "optimizer_config.lr_decay_style",
}


def _refuse(field: str, value: Any, why: str) -> None:
    raise ValueError(f"{field}={value!r} is not supported by the mcore_engine backend: {why}")


def _check(ok: Any, field: str, value: Any, why: str) -> None:
    if not ok:
        _refuse(field, value, why)


def _plain(value: Any) -> Any:
    """OmegaConf containers as plain dicts / lists (verl hands blocks over either way)."""
    from omegaconf import DictConfig, ListConfig, OmegaConf

    if isinstance(value, (DictConfig, ListConfig)):
        return OmegaConf.to_container(value, resolve=True)
    return value


def _read(path: str, roots: Mapping[str, Any]) -> Any:
    """The value of a verl field ``"engine_config.a.b"`` under ``roots`` (attributes or keys)."""
    root, *parts = path.split(".")
    node = roots.get(root)
    for part in parts:
        node = node.get(part) if isinstance(node, Mapping) else getattr(node, part, None)
    return node


def verl_name(core_field: str, sources: Mapping[str, str], roots: Mapping[str, Any]) -> str | None:
    """``"verl_field=value"`` for a core field (``sources`` first, then ``VERL_FIELDS``), or None."""
    parts = core_field.split(".")
    for prefix in (".".join(parts[:i]) for i in range(len(parts), 0, -1)):
        if prefix in sources:
            return sources[prefix]
        if prefix in VERL_FIELDS and VERL_FIELDS[prefix].split(".")[0] in roots:
            return f"{VERL_FIELDS[prefix]}={_read(VERL_FIELDS[prefix], roots)!r}"
    return None


@contextmanager
def in_verl_terms(sources: Mapping[str, str] | None = None, **roots: Any) -> Iterator[None]:
    """Around a core constructor: a ``ConfigError`` becomes ``ValueError("<verl field>=<value> is not
    supported ...: <core message>")`` for the first of its fields with a verl name. ``sources``: core
    path -> ``"verl_field=value"`` for fields with several possible verl sources; ``roots``: verl's
    config objects by name (``engine_config=...``) to read the values of ``VERL_FIELDS``."""
    try:
        yield
    except ConfigError as exc:
        names = (verl_name(f, sources or {}, roots) for f in exc.fields)
        name = next((n for n in names if n is not None), None)
        if name is None:
            raise
        raise ValueError(f"{name} is not supported by the mcore_engine backend: {exc}") from exc
