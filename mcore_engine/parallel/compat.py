"""Megatron-Core on machines without Transformer Engine / CUDA: quiet hints, MoE and MLA patches.

:func:`quiet_cpu_warnings` filters the third-party hints that say nothing on a CPU machine;
:func:`apply_moe_compat` and :func:`apply_mla_compat` patch Megatron-Core 0.16's MoE and
multi-latent attention modules to run without Transformer Engine (and MoE on gloo). All idempotent.
"""

from __future__ import annotations

import logging
import warnings

import torch

from mcore_engine.parallel.gloo_collectives import apply_gloo_collectives

__all__ = ["apply_mla_compat", "apply_moe_compat", "mcore_version", "quiet_cpu_warnings"]

# Megatron-Core warns at import that Transformer Engine / Apex (from 0.19 also absl) are missing
# (the torch fallbacks are the intended CPU path), on every TransformerConfig that its default
# CUDA-graph scope "full" is deprecated, and on the first TP linear that
# CUDA_DEVICE_MAX_CONNECTIONS=1 speeds up async all-reduces; torch.fx logs an is_fx_tracing hint
# from Megatron's forward; torch 2.13 deprecates ``all_gather_into_tensor``, which Megatron calls.
_CPU_NOISE = (
    r"Transformer Engine and Apex are not installed",
    r"Apex is not installed",
    r"absl\.logging is not installed",  # Megatron-Core >= 0.19 (hyper_comm_grid), at import
    r"full scope is deprecated",
    r"When using (sequence parallelism|async grad allreduce) it is recommended to set the environment "
    r"variable CUDA_DEVICE_MAX_CONNECTIONS",
)
_QUIETED = False
_MOE_COMPAT = False
_MLA_COMPAT = False


def quiet_cpu_warnings() -> None:
    """Ignore the third-party hints above when CUDA is absent (GPU runs keep every warning);
    called by ``import mcore_engine``, before megatron.core is imported; idempotent."""
    global _QUIETED
    if _QUIETED or torch.cuda.is_available():
        return
    for message in _CPU_NOISE:
        warnings.filterwarnings("ignore", message=message, category=UserWarning)
    warnings.filterwarnings("ignore", message=r"`torch.distributed.all_gather_into_tensor` is deprecated",
                            category=FutureWarning)
    logging.getLogger("torch.fx._symbolic_trace").setLevel(logging.ERROR)
    _QUIETED = True


def apply_moe_compat() -> None:
    """Megatron-Core 0.16 MoE without Transformer Engine / on gloo, routed as the checkpoints route.
    Binds ``moe_utils.te_general_gemm`` to ``None`` (the router's torch path), installs
    :mod:`mcore_engine.layers.router` (grouped top-k, sigmoid weights renormalised unless
    ``moe_router_pre_softmax``; CPU and GPU) and, CPU only, :mod:`mcore_engine.parallel.gloo_collectives`."""
    global _MOE_COMPAT
    if _MOE_COMPAT:
        return
    from megatron.core.transformer.moe import moe_utils

    from mcore_engine.layers.router import install_checkpoint_routing

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    install_checkpoint_routing()
    apply_gloo_collectives()
    _MOE_COMPAT = True


def apply_mla_compat() -> None:
    """Megatron-Core 0.16 multi-latent attention without Transformer Engine (a no-op when TE imports).
    Without TE, ``megatron.core.extensions.transformer_engine`` binds ``MagicMock`` stand-ins, so
    ``multi_latent_attention`` sets ``HAVE_TE = True`` and its ``isinstance(..., TELinear)`` raises
    ``TypeError``; this binds what its own ``ImportError`` branch would (``HAVE_TE = False``, TE names
    ``None``). MLA's rotary tables follow ``torch.cuda.current_device()``: the CPU device layer on CPU."""
    global _MLA_COMPAT
    if _MLA_COMPAT:
        return
    from megatron.core.extensions import transformer_engine as te_ext

    if not te_ext.HAVE_TE:
        from megatron.core.transformer import multi_latent_attention as mla

        mla.HAVE_TE = False
        mla.TEColumnParallelLinear = mla.TELinear = mla.Linear = mla.set_save_original_input = None
    _MLA_COMPAT = True


def mcore_version() -> tuple[int, int]:
    """The installed Megatron-Core's ``(major, minor)``, e.g. ``(0, 16)`` (supported: ``>=0.16.1,<0.20``)."""
    from megatron.core import __version__

    major, minor = __version__.split(".")[:2]
    return int(major), int(minor)
