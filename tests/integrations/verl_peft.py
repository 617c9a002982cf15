"""The receiving end of verl's LoRA weight sync on a ``transformers`` model, with PEFT: what a rollout
with LoRA support (vLLM's ``enable_lora``, SGLang's adapters) does with the three kinds of update
``ActorRolloutRefWorker.update_weights`` sends (``peft_config`` and ``base_sync_done`` of
``rollout.update_weights``):

- ``"full"`` (``peft_config`` None): the whole model in Hugging Face names, loaded as it is (no LoRA, or
  ``model.lora.merge=True``: merged weights); names are the checkpoint's (a model that ``transformers``
  loads into other parameters, e.g. fused MoE experts, takes them through its own load conversion);
- ``"base"`` (a ``peft_config``, ``base_sync_done=False``): the frozen base in Hugging Face names,
  loaded under the adapters (vLLM's ``load_weights`` on its LoRA-wrapped model);
- ``"adapter"`` (a ``peft_config``, ``base_sync_done=True``): the adapters only, in PEFT key names,
  put on the base with ``peft.get_peft_model`` + ``set_peft_model_state_dict`` (vLLM's ``add_lora``
  of a tensor LoRA request); every adapter of the model must be in the update and nothing else.

Used by the trainer harness's ``hf_cpu`` server and by ``test_verl_lora.py``.
"""

from __future__ import annotations

from typing import Any

import torch

LORA_KEY_PREFIX = "base_model.model."


def sync_kind(peft_config: Any, base_sync_done: bool) -> str:
    """``"full"``, ``"base"`` or ``"adapter"`` for verl's ``rollout.update_weights`` arguments."""
    if not peft_config:
        return "full"
    return "adapter" if base_sync_done else "base"


class PeftReceiver:
    """A ``transformers`` causal LM that takes verl's weight syncs (module docstring). ``model`` stays
    the object to call: PEFT injects its LoRA layers into it in place."""

    def __init__(self, model: torch.nn.Module, name: str = "rollout") -> None:
        from transformers.core_model_loading import revert_weight_conversion

        self.model, self.name = model, name
        self.peft = None  # the PeftModel after the first adapter update
        self.peft_config: dict[str, Any] | None = None
        # transformers 5 loads some checkpoints into other parameters (MoE experts fused into one
        # tensor a layer); a sync, like the folder, speaks the checkpoint's names
        own = model.state_dict()
        self.converts = set(revert_weight_conversion(model, dict(own))) != set(own)

    def _from_checkpoint_names(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Checkpoint-named tensors as the model's parameters (transformers' own load conversion)."""
        model, info = type(self.model).from_pretrained(None, config=self.model.config, state_dict=state,
                                                       dtype=torch.float32, output_loading_info=True)
        if info["missing_keys"] or info["unexpected_keys"] or info.get("mismatched_keys"):
            raise ValueError(f"{self.name}: weight sync names differ: missing "
                             f"{sorted(info['missing_keys'])}, unexpected {sorted(info['unexpected_keys'])}, "
                             f"mismatched {info.get('mismatched_keys')}")
        return model.state_dict()

    def _base_params(self) -> dict[str, torch.Tensor]:
        """Hugging Face name -> the live base tensor (PEFT's ``base_layer`` and adapters left out)."""
        out = {}
        for key, value in self.model.state_dict(keep_vars=True).items():
            if ".lora_" not in key:
                out[key.replace(".base_layer.", ".")] = value
        return out

    def update(self, kind: str, state: dict[str, torch.Tensor],
               peft_config: dict[str, Any] | None = None) -> None:
        if kind == "adapter":
            self._load_adapter(state, peft_config)
            return
        if kind == "full" and self.peft is not None:
            raise ValueError(f"{self.name}: a full (merged) weight update after adapters were loaded")
        own = self._base_params()
        if self.converts:
            state = self._from_checkpoint_names(state)
        missing, unexpected = sorted(set(own) - set(state)), sorted(set(state) - set(own))
        if missing or unexpected:
            raise ValueError(f"{self.name}: weight sync names differ: missing {missing}, "
                             f"unexpected {unexpected}")
        with torch.no_grad():
            for key, value in state.items():
                if own[key].shape != value.shape:
                    raise ValueError(f"{self.name}: {key} shape {tuple(value.shape)} != "
                                     f"{tuple(own[key].shape)}")
                own[key].copy_(value)

    def _load_adapter(self, tensors: dict[str, torch.Tensor], peft_config: dict[str, Any]) -> None:
        from peft import LoraConfig, get_peft_model, set_peft_model_state_dict

        bad = [k for k in tensors if not (k.startswith(LORA_KEY_PREFIX) and ".lora_" in k)]
        if bad or not tensors:
            raise ValueError(f"{self.name}: an adapter update holds non-PEFT keys {bad[:3]} (or nothing)")
        # the adapted modules come from the tensors (vLLM ignores target_modules as well)
        targets = sorted({k.split(".lora_")[0].rsplit(".", 1)[-1] for k in tensors})
        config = {k: peft_config[k] for k in ("r", "lora_alpha", "lora_dropout", "bias") if k in peft_config}
        if self.peft is None:
            self.peft_config = dict(config, target_modules=targets)
            self.peft = get_peft_model(self.model, LoraConfig(task_type="CAUSAL_LM", **self.peft_config))
            self.peft.eval()
        elif dict(config, target_modules=targets) != self.peft_config:
            raise ValueError(f"{self.name}: the adapters changed shape: {config} vs {self.peft_config}")
        result = set_peft_model_state_dict(self.peft, tensors)
        missing = [k for k in result.missing_keys if ".lora_" in k]
        if missing or result.unexpected_keys:
            raise ValueError(f"{self.name}: adapter update: missing {missing[:3]}, "
                             f"unexpected {list(result.unexpected_keys)[:3]}")

    @torch.no_grad()
    def effective_state(self) -> dict[str, torch.Tensor]:
        """What the model computes with, in Hugging Face names: the base, and for every adapted linear
        ``W + scaling B A`` (PEFT's ``get_delta_weight``); new tensors."""
        state = {k: v.detach().clone() for k, v in self._base_params().items()}
        if self.peft is not None:
            from peft.tuners.lora import LoraLayer

            for name, module in self.model.named_modules():
                if isinstance(module, LoraLayer) and "default" in module.lora_A:
                    state[f"{name}.weight"] = module.base_layer.weight + module.get_delta_weight("default")
        if self.converts:  # in the checkpoint's names (MoE experts one tensor each)
            from transformers.core_model_loading import revert_weight_conversion

            state = {k: v.contiguous() for k, v in revert_weight_conversion(self.model, state).items()}
        return state
