"""``LoRAConfig`` (``ModelConfig.lora``): low-rank adapters on the attention and MLP linears.

PEFT's LoRA on a frozen base: ``y = W x + (alpha / rank) * B A dropout(x)`` per adapted projection.
``target_modules`` takes Megatron's linear names, Hugging Face projection names or
``"all-linear"``; :meth:`LoRAConfig.targets` resolves them to the projections adapted in each of
Megatron's four linears (the fused ``linear_qkv`` / ``linear_fc1`` carry PEFT's separate q / k / v
and gate / up adapters) and, on a hybrid (Qwen3.5) model, the Gated DeltaNet linears
(``in_proj_qkv`` / ``in_proj_z`` / ``in_proj_b`` / ``in_proj_a`` / ``out_proj``, one adapter each,
named as in Hugging Face; Qwen3-Next's fused ``in_proj_qkvz`` / ``in_proj_ba`` name the pairs
``in_proj_qkv`` + ``in_proj_z`` / ``in_proj_b`` + ``in_proj_a``, whose two adapters share PEFT's one
``A``). On a MoE model the MLP projections adapt the shared expert (PEFT's
``mlp.shared_expert.*``) and the dense layers' MLP; the routed experts take none (and on folders whose
PEFT takes those names as the routed experts, Qwen3-Next / Qwen2-MoE, ``hf.peft`` refuses them).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from mcore_engine.config.checks import Block, fail, is_number, require

__all__ = ["FUSED_GDN", "GDN_LINEARS", "HF_PROJECTIONS", "LINEAR_PROJECTIONS", "LoRAConfig",
           "linear_projections"]

DENSE_LINEARS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
GDN_LINEARS = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")
"""The Gated DeltaNet layer's linears: Megatron name = Hugging Face name = projection (one adapter)."""
FUSED_GDN: dict[str, tuple[str, str]] = {"in_proj_qkvz": ("in_proj_qkv", "in_proj_z"),
                                         "in_proj_ba": ("in_proj_b", "in_proj_a")}
"""Qwen3-Next's fused Hugging Face GDN projections -> the engine's two linears (one PEFT ``A``, shared)."""

# Megatron linear -> the Hugging Face projections it fuses (SwiGLU fc1: gate and up)
LINEAR_PROJECTIONS: dict[str, tuple[str, ...]] = {
    "linear_qkv": ("q", "k", "v"), "linear_proj": ("o",), "linear_fc1": ("gate", "up"),
    "linear_fc2": ("down",), **{name: (name,) for name in GDN_LINEARS}}
# Hugging Face module name -> (Megatron linear, projection)
HF_PROJECTIONS: dict[str, tuple[str, str]] = {
    "q_proj": ("linear_qkv", "q"), "k_proj": ("linear_qkv", "k"), "v_proj": ("linear_qkv", "v"),
    "o_proj": ("linear_proj", "o"), "gate_proj": ("linear_fc1", "gate"), "up_proj": ("linear_fc1", "up"),
    "down_proj": ("linear_fc2", "down"), **{name: (name, name) for name in GDN_LINEARS}}
PROJECTION_HF_NAMES = {proj: name for name, (_, proj) in HF_PROJECTIONS.items()}


def linear_projections(linear: str, swiglu: bool) -> tuple[str, ...]:
    """The projections Megatron's ``linear`` fuses; without SwiGLU ``linear_fc1`` is ``up`` alone."""
    return ("up",) if linear == "linear_fc1" and not swiglu else LINEAR_PROJECTIONS[linear]


@dataclass(kw_only=True)
class LoRAConfig(Block):
    """Low-rank adapters (PEFT's LoRA) on the attention and MLP linears; the base weights are frozen
    (no gradient, no grad buffer, no optimizer state)."""

    PATH = "model.lora"

    rank: int
    """r: the adapters' inner dimension (``A [r, in]``, ``B [out, r]``)."""
    alpha: float = 16.0
    """Scaling numerator: the update is ``(alpha / rank) * B A x`` (PEFT's ``lora_alpha``)."""
    dropout: float = 0.0
    """PEFT's ``lora_dropout`` on the adapters' input (training only)."""
    target_modules: str | list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])
    """Megatron names (``linear_qkv``, ``linear_proj``, ``linear_fc1``, ``linear_fc2``), Hugging Face
    names (``q_proj`` ... ``down_proj``; on a hybrid model also the Gated DeltaNet's ``in_proj_qkv``,
    ``in_proj_z``, ``in_proj_b``, ``in_proj_a``, ``out_proj``; Qwen3-Next's fused ``in_proj_qkvz`` /
    ``in_proj_ba`` for the pairs) or ``"all-linear"`` (every one of them the model has)."""
    adapter_path: str | None = None
    """A PEFT adapter folder (``adapter_config.json`` + ``adapter_model.safetensors``) applied on
    top of ``ModelConfig.hf_path``; None: fresh adapters (A random, B zero)."""

    def __post_init__(self) -> None:
        self._ints("rank")
        self._numbers("alpha", strict=True)
        self._require(is_number(self.dropout) and 0 <= self.dropout < 1,
                      f"LoRAConfig.dropout must be in [0, 1), got {self.dropout!r}", "dropout")
        if isinstance(self.target_modules, tuple):
            self.target_modules = list(self.target_modules)
        self.targets(hybrid=True)  # validates the names (the GDN ones against the model in check())
        self._require(self.adapter_path is None or isinstance(self.adapter_path, str),
                      f"LoRAConfig.adapter_path must be None or a path, got {self.adapter_path!r}",
                      "adapter_path")

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    def targets(self, swiglu: bool = True, hybrid: bool = False) -> dict[str, set[str]]:
        """Megatron linear -> the projections adapted in it (only linears with at least one).
        Without SwiGLU ``linear_fc1`` is one projection, ``up``; ``hybrid`` (the model has Gated
        DeltaNet layers): ``"all-linear"`` includes the GDN linears, else naming one is a ValueError."""
        names = self.target_modules
        if names == "all-linear":
            names = list(DENSE_LINEARS) + (list(GDN_LINEARS) if hybrid else [])
        self._require(isinstance(names, list) and names and all(isinstance(n, str) for n in names),
                      "LoRAConfig.target_modules must be 'all-linear' or a non-empty list of module names, "
                      f"got {self.target_modules!r}", "target_modules")
        out: dict[str, set[str]] = {}
        for name in names:
            if (name in GDN_LINEARS or name in FUSED_GDN) and not hybrid:
                fail(f"LoRAConfig.target_modules: {name!r} is a Gated DeltaNet linear; this model has no "
                     "GDN layers (ModelConfig.linear_attention is None)", self.path("target_modules"),
                     "model.linear_attention")
            if name in FUSED_GDN:  # Qwen3-Next: two linears (hf.peft.check_gdn_family checks the family)
                for linear in FUSED_GDN[name]:
                    out.setdefault(linear, set()).add(linear)
                continue
            if name in LINEAR_PROJECTIONS:
                linear, projections = name, set(LINEAR_PROJECTIONS[name])
            elif name in HF_PROJECTIONS:
                linear, projection = HF_PROJECTIONS[name]
                projections = {projection}
            else:
                fail(f"LoRAConfig.target_modules: unknown module {name!r}; expected one of "
                     f"{list(dict.fromkeys([*LINEAR_PROJECTIONS, *HF_PROJECTIONS, *FUSED_GDN]))} or "
                     "'all-linear'",
                     self.path("target_modules"))
            out.setdefault(linear, set()).update(projections)
        if not swiglu and "linear_fc1" in out:
            require(out["linear_fc1"] != {"gate"}, "LoRAConfig.target_modules: gate_proj needs "
                    "ModelConfig.swiglu (no gate without SwiGLU)", self.path("target_modules"),
                    "model.swiglu")
            out["linear_fc1"] &= set(linear_projections("linear_fc1", swiglu))
        return out

    def hf_target_modules(self, swiglu: bool = True, hybrid: bool = False,
                          fused_gdn: bool = False) -> list[str]:
        """The Hugging Face module names adapted (PEFT's ``target_modules``), sorted; ``fused_gdn``
        (Qwen3-Next): the GDN pairs as ``in_proj_qkvz`` / ``in_proj_ba``."""
        names = {PROJECTION_HF_NAMES[p] for ps in self.targets(swiglu, hybrid).values() for p in ps}
        if fused_gdn:
            for fused, pair in FUSED_GDN.items():
                if names & set(pair):
                    names = (names - set(pair)) | {fused}
        return sorted(names)

    def check(self, model: Any, parallel: Any) -> None:
        """No MLP targets on a MoE model without a shared expert (its MLP linears are the experts'; with
        one they adapt the shared expert), an lm head, a base for a loaded adapter."""
        targets = self.targets(model.swiglu, model.linear_attention is not None)
        shared = model.moe is not None and model.moe.shared_expert_ffn_hidden_size is not None
        require(model.moe is None or shared or not {"linear_fc1", "linear_fc2"} & set(targets),
                "ModelConfig.lora.target_modules: the MLP linears of a MoE model without a shared expert are "
                "its experts' (not supported: target the attention linears q_proj / k_proj / v_proj / "
                "o_proj)", "model.lora.target_modules", "model.moe")
        require(model.head == "lm", "ModelConfig.lora needs ModelConfig.head='lm' (no LoRA critic)",
                "model.lora", "model.head")
        require(self.adapter_path is None or model.hf_path is not None, "ModelConfig.lora.adapter_path "
                "needs ModelConfig.hf_path (the base the adapters were trained on)",
                "model.lora.adapter_path", "model.hf_path")
