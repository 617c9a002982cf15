"""LoRA on a Megatron ``GPTModel`` chunk: :func:`apply_lora` puts the adapters of
:mod:`mcore_engine.layers.lora_linear` on its attention / MLP / Gated DeltaNet linears; switch them off
(:func:`adapters_disabled`), list them (:func:`lora_modules`), read (:func:`adapter_shards`) and load
(:func:`load_adapters`) them in PEFT's full orientation.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.utils import get_pg_size
from torch import Tensor

from mcore_engine.config.lora import GDN_LINEARS, LINEAR_PROJECTIONS, linear_projections
from mcore_engine.layers.lora_linear import (
    LORA_TP_PARTIAL_GRAD,
    ColumnLayout,
    LoRAColumnParallelLinear,
    LoRARowParallelLinear,
    LoRAShard,
    _check_base,
    _hyper,
)

__all__ = ["LINEAR_PROJECTIONS", "LORA_TP_PARTIAL_GRAD", "ColumnLayout", "LoRAColumnParallelLinear",
           "LoRARowParallelLinear", "LoRAShard", "adapter_shards", "adapters_disabled", "apply_lora",
           "load_adapters", "lora_modules", "set_adapters_enabled", "sum_partial_adapter_grads"]

LoRALinear = LoRAColumnParallelLinear | LoRARowParallelLinear


def lora_modules(model: torch.nn.Module | Iterable[torch.nn.Module]) -> Iterator[tuple[str, LoRALinear]]:
    """``(qualified name, module)`` of every LoRA linear in a model or a list of model chunks."""
    models = [model] if isinstance(model, torch.nn.Module) else list(model)
    for m in models:
        for name, module in m.named_modules():
            if isinstance(module, LoRALinear):
                yield name, module


def set_adapters_enabled(model: torch.nn.Module | Iterable[torch.nn.Module], enabled: bool) -> None:
    """Switch every adapter of a model (or chunks) on or off (``module.lora_enabled``)."""
    for _, module in lora_modules(model):
        module.lora_enabled = bool(enabled)


@contextmanager
def adapters_disabled(model: torch.nn.Module | Iterable[torch.nn.Module]) -> Iterator[None]:
    """Inside, every LoRA linear runs exactly its base forward (the reference policy); each module's
    previous state comes back on exit."""
    modules = [m for _, m in lora_modules(model)]
    before = [m.lora_enabled for m in modules]
    try:
        for m in modules:
            m.lora_enabled = False
        yield
    finally:
        for m, state in zip(modules, before, strict=True):
            m.lora_enabled = state


_WHERE = {"linear_qkv": "self_attention", "linear_proj": "self_attention", "linear_fc1": "mlp",
          "linear_fc2": "mlp", **{name: "self_attention" for name in GDN_LINEARS}}
_ROW_LINEARS = ("linear_proj", "linear_fc2", "out_proj")


def _is_gdn(mixer: torch.nn.Module | None) -> bool:
    """A Gated DeltaNet mixer (``in_proj_qkv`` ...) rather than attention (``linear_qkv`` ...)."""
    return mixer is not None and hasattr(mixer, "in_proj_qkv") and hasattr(mixer, "gdn")


def _gdn_layout(mixer: torch.nn.Module, linear: str, tp: int) -> ColumnLayout:
    """The GDN column linears: ``in_proj_qkv`` one projection of blocks ``[q; k; v]`` (rank ``t`` holds
    ``[q_t; k_t; v_t]``), the others one plain projection."""
    g = mixer.gdn
    if g.num_key_heads % tp or g.num_value_heads % tp:
        raise ValueError(f"targets[{linear!r}]: the GDN heads ({g.num_key_heads} key, {g.num_value_heads} "
                         f"value) are not divisible by the tensor-parallel size {tp}")
    if linear == "in_proj_qkv":
        return ColumnLayout((linear,), (2 * g.key_dim + g.value_dim,),
                            blocks=(g.key_dim, g.key_dim, g.value_dim))
    return ColumnLayout((linear,), (getattr(mixer, linear).output_size,))


def _plan(model: torch.nn.Module, targets: dict[str, set[str]], swiglu: bool) -> list[tuple]:
    """``(module, linear, global layer, layout)`` for every linear to convert; all checks, no changes.
    On a hybrid model the attention linears are taken from the attention layers, the GDN linears
    from the GDN layers; a linear that no layer has is a ValueError."""
    config = model.config
    layers = list(model.decoder.layers)
    plan: list[tuple] = []
    found: set[str] = set()
    for layer in layers:
        global_layer = layer.layer_number - 1
        gdn = _is_gdn(getattr(layer, "self_attention", None))
        for linear in (name for name in LINEAR_PROJECTIONS if name in targets):
            if _WHERE[linear] == "self_attention" and gdn != (linear in GDN_LINEARS):
                continue  # the other mixer kind's linear (hybrid model)
            found.add(linear)
            parent = getattr(layer, _WHERE[linear], None)
            where = f"decoder.layers.{global_layer}.{_WHERE[linear]}"
            if linear in ("linear_fc1", "linear_fc2") and hasattr(parent, "experts"):
                if getattr(parent, "shared_experts", None) is None:
                    raise ValueError(f"targets[{linear!r}]: {where} is an MoE layer without a shared expert; "
                                     "LoRA on MoE expert linears (mlp.experts: SequentialMLP / GroupedMLP) "
                                     "is not supported (adapt linear_qkv / linear_proj only)")
                parent, where = parent.shared_experts, f"{where}.shared_experts"  # the routed experts: none
            module = getattr(parent, linear, None)
            if module is None:
                raise ValueError(f"targets[{linear!r}]: {where} has no {linear} (MLA or another attention / "
                                 "MLP without Megatron's fused linears is not supported)")
            if hasattr(module, "lora_targets"):
                raise ValueError(f"targets[{linear!r}]: {where}.{linear} already has LoRA adapters")
            is_column = linear not in _ROW_LINEARS
            _check_base(module, ColumnParallelLinear if is_column else RowParallelLinear)
            layout = None
            if linear == "linear_qkv":
                ng = config.num_query_groups or config.num_attention_heads
                tp = get_pg_size(module.tp_group)
                if ng % tp:
                    raise ValueError(f"targets['linear_qkv']: num_query_groups={ng} is not divisible by the "
                                     f"tensor-parallel size {tp} (k / v adapters need whole query groups "
                                     "per rank)")
                d, per_group = config.kv_channels, config.num_attention_heads // ng
                if config.attention_output_gate:  # per group [q; gate; k; v]; PEFT q_proj: [q_h; g_h]
                    layout = ColumnLayout(("q", "k", "v"), (2 * per_group * d, d, d), ng, True,
                                          output_gate=(per_group, d))
                else:
                    layout = ColumnLayout(("q", "k", "v"), (per_group * d, d, d), ng, True)
            elif linear == "linear_fc1":
                rows = module.output_size
                layout = ColumnLayout(("gate", "up"), (rows // 2, rows // 2)) if swiglu else \
                    ColumnLayout(("up",), (rows,))
            elif linear in GDN_LINEARS and is_column:
                layout = _gdn_layout(parent, linear, get_pg_size(module.tp_group))
            plan.append((module, linear, global_layer, layout))
    missing = [name for name in targets if name not in found]
    whole = getattr(model, "pre_process", True) and getattr(model, "post_process", True)
    if missing and layers and whole:  # a pipeline stage may hold one layer kind only
        raise ValueError(f"targets: no decoder layer has {missing} (Gated DeltaNet linears need a hybrid "
                         "model, attention linears an attention layer)")
    return plan


def apply_lora(model: torch.nn.Module, *, rank: int, alpha: float, targets: Mapping[str, Iterable[str]],
               seed: int, dropout: float = 0.0, swiglu: bool | None = None,
               init_lora_weights: bool | str = True,
               shared_a: Iterable[tuple[str, str]] = ()) -> list[torch.nn.Parameter]:
    """Put LoRA adapters on every decoder layer of one unwrapped ``GPTModel`` chunk, in place, before
    DDP; returns the adapter parameters. ``targets``: Megatron linear -> projections (``linear_qkv`` ⊆
    {q, k, v}, ``linear_proj`` {o}, ``linear_fc1`` ⊆ {gate, up} (without SwiGLU {up}), ``linear_fc2``
    {down}); on a hybrid model also the Gated DeltaNet's ``in_proj_qkv`` / ``in_proj_z`` / ``in_proj_b`` /
    ``in_proj_a`` / ``out_proj`` ({their own name}), and ``linear_qkv`` with an output gate (PEFT's
    ``q_proj`` adapter covers query and gate rows). Adapter ``p`` of global layer ``i`` is drawn in
    full from ``(seed, "decoder.layers.<i>.<where>.<linear>", p)`` and sliced, so every TP / PP layout
    holds slices of the same adapters. ``shared_a``: pairs ``(first, second)`` of Gated DeltaNet column
    linears whose adapters share one ``A`` (Qwen3-Next's fused ``in_proj_qkvz`` / ``in_proj_ba``: PEFT's
    one adapter on them): in each layer adapting both, ``second`` uses ``first``'s ``A`` parameter (both
    linears' gradients reach it; no dropout then, PEFT's one mask cannot be reproduced across two
    linears). On a MoE layer ``linear_fc1`` / ``linear_fc2`` are the shared
    expert's (the routed experts take none). MTP layers are not adapted. ``ValueError`` before any change
    for bad hyper-parameters or targets, MoE MLPs without a shared expert, MLA, Transformer Engine
    linears, ``num_query_groups`` not divisible by TP, a linear no layer has, or adapters already
    present."""
    _hyper(rank, alpha, dropout, init_lora_weights)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"seed must be an int, got {seed!r}")
    if hasattr(model, "module") or not hasattr(model, "decoder"):
        raise ValueError(f"apply_lora needs an unwrapped GPTModel (apply it before DDP / Float16Module), "
                         f"got {type(model).__name__}")
    gated = bool(model.config.gated_linear_unit)
    swiglu = gated if swiglu is None else swiglu
    if swiglu != gated:
        raise ValueError(f"swiglu={swiglu} but the model's gated_linear_unit is {gated}")
    wanted: dict[str, set[str]] = {}
    for linear, projections in dict(targets).items():
        if linear not in LINEAR_PROJECTIONS:
            raise ValueError(f"targets: unknown linear {linear!r}; expected one of "
                             f"{list(LINEAR_PROJECTIONS)}")
        allowed = linear_projections(linear, swiglu)
        chosen = {projections} if isinstance(projections, str) else set(projections)
        if not chosen or not chosen <= set(allowed):
            raise ValueError(f"targets[{linear!r}] = {sorted(chosen)}: expected a non-empty subset of "
                             f"{allowed}")
        wanted[linear] = chosen
    if not wanted:
        raise ValueError("targets: no linear to adapt")
    shared_a = [tuple(pair) for pair in shared_a]
    for pair in shared_a:
        if len(pair) != 2 or not set(pair) <= set(GDN_LINEARS) - {"out_proj"} or pair[0] == pair[1]:
            raise ValueError(f"shared_a: {pair!r} is not a pair of Gated DeltaNet column linears")
        if dropout and set(pair) <= set(wanted):
            raise ValueError(f"dropout={dropout}: adapters sharing one A ({pair}) need dropout 0")
    params: list[torch.nn.Parameter] = []
    converted: dict[tuple[int, str], torch.nn.Module] = {}
    for module, linear, layer, layout in _plan(model, wanted, swiglu):
        name = f"decoder.layers.{layer}.{_WHERE[linear]}.{linear}"
        common = dict(rank=rank, alpha=alpha, seed=seed, name=name, dropout=dropout,
                      init_lora_weights=init_lora_weights)
        if layout is None:
            LoRARowParallelLinear.from_base(module, projection=LINEAR_PROJECTIONS[linear][0], **common)
        else:
            LoRAColumnParallelLinear.from_base(module, layout=layout, targets=wanted[linear], **common)
        module.lora_layer = layer
        converted[(layer, linear)] = module
    for first, second in shared_a:
        for (layer, linear), module in converted.items():
            if linear == second and (layer, first) in converted:
                # both column linears of the same input: A [r, hidden] replicated over TP alike
                module.lora_A[second] = converted[(layer, first)].lora_A[first]
                module._lora_shared_a = (*getattr(module, "_lora_shared_a", ()), second)
                module.register_load_state_dict_pre_hook(_fill_shared_a)
    for module in converted.values():
        params += [t for p in module.lora_targets for t in (module.lora_A[p], module.lora_B[p])]
    return list({id(p): p for p in params}.values())


def _fill_shared_a(module: torch.nn.Module, state_dict: dict, prefix: str, *args) -> None:
    """Load pre-hook of a linear whose ``A`` is another's (``apply_lora(shared_a=...)``): a checkpoint
    holds that ``A`` once, under its owner; the missing entry is the parameter itself (a no-op copy)."""
    for p in module._lora_shared_a:
        state_dict.setdefault(f"{prefix}lora_A.{p}", module.lora_A[p].detach())


def adapter_shards(model: torch.nn.Module | Iterable[torch.nn.Module]) -> dict[tuple[int, str], LoRAShard]:
    """``(global layer, projection) -> this rank's LoRAShard`` over a model (or chunks) made by
    :func:`apply_lora`; gather a shard over TP along its ``a_tp_dim`` / ``b_tp_dim`` for the full tensor."""
    return {(m.lora_layer, p): shard for _, m in lora_modules(model)
            for p, shard in m.adapter_shards().items()}


def load_adapters(model: torch.nn.Module | Iterable[torch.nn.Module],
                  adapters: Mapping[tuple[int, str], tuple[Tensor, Tensor]]) -> None:
    """Copy FULL adapters ``(global layer, projection) -> (A [r, in], B [out, r])`` (PEFT's orientation)
    into this rank's slices. Entries for layers this chunk does not hold are ignored; ``ValueError``,
    before any copy, when an adapted projection of this chunk has no entry or a shape differs."""
    plan = []
    for _, m in lora_modules(model):
        for p in m.lora_targets:
            if (m.lora_layer, p) not in adapters:
                raise ValueError(f"adapters: no entry for layer {m.lora_layer} projection {p!r}")
            a, b = adapters[(m.lora_layer, p)]
            if (tuple(a.shape), tuple(b.shape)) != m.full_shapes(p):
                raise ValueError(f"adapters: layer {m.lora_layer} {p!r} has shapes {tuple(a.shape)} / "
                                 f"{tuple(b.shape)}, expected {m.full_shapes(p)}")
            plan.append((m, p, a, b))
    for m, p, a, b in plan:
        m.load_full(p, a, b)


def sum_partial_adapter_grads(model_chunks: Sequence[torch.nn.Module]) -> None:
    """SUM over TP the ``main_grad`` of every trainable parameter marked ``lora_tp_partial_grad``
    (one coalesced all-reduce; nothing without TP or without such parameters)."""
    group = parallel_state.get_tensor_model_parallel_group()
    if dist.get_world_size(group) == 1:
        return
    grads = [p.main_grad for chunk in model_chunks for p in getattr(chunk, "module", chunk).parameters()
             if p.requires_grad and getattr(p, LORA_TP_PARTIAL_GRAD, False)
             and getattr(p, "main_grad", None) is not None]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    for g, part in zip(grads, flat.split([g.numel() for g in grads]), strict=True):
        g.copy_(part.view_as(g))
