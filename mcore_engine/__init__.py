"""mcore-engine: a Megatron-Core training backend for RL post-training. ``MegatronEngine`` and
``EngineConfig`` load lazily (``mcore_engine.ops`` imports without Megatron-Core); importing the
package quiets Megatron-Core's CPU-only hints (``parallel.platform.quiet_cpu_warnings``).

Modules that moved into their subsystem's folder keep their old import path (``_MOVED``): an old
name imports the same module object, so ``mcore_engine.platform.get_device is
mcore_engine.parallel.platform.get_device``."""

import importlib
import importlib.abc
import importlib.util
import sys
from typing import Any

from mcore_engine.parallel.platform import quiet_cpu_warnings

__all__ = ["EngineConfig", "MegatronEngine"]
__version__ = "0.1.0"

_MOVED = {
    "adapters": "state.adapters", "checkpoint": "state.checkpoint", "config_checks": "config.checks",
    "gloo_collectives": "parallel.gloo_collectives", "lm_head_outputs": "step.lm_head",
    "lora_config": "config.lora", "loss_guard": "step.loss_guard", "mla_config": "config.mla",
    "moe": "model.moe", "moe_config": "config.moe", "mtp": "step.mtp", "mtp_config": "config.mtp",
    "offload": "state.offload", "optim": "step.optimizer", "platform": "parallel.platform",
}


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """``mcore_engine.<old>`` -> the module now at ``mcore_engine.<new>`` (the same object)."""

    specs: dict[str, Any] = {}

    def find_spec(self, fullname: str, path: Any = None, target: Any = None):
        prefix, _, old = fullname.partition(".")
        if prefix != __name__ or old not in _MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec):
        module = importlib.import_module(f"{__name__}.{_MOVED[spec.name.partition('.')[2]]}")
        self.specs[module.__name__] = module.__spec__
        return module

    def exec_module(self, module) -> None:
        module.__spec__ = self.specs[module.__name__]  # the import system set the alias's spec


sys.meta_path.append(_MovedModules())
quiet_cpu_warnings()


def __getattr__(name: str) -> Any:
    if name == "MegatronEngine":
        from mcore_engine.engine import MegatronEngine

        return MegatronEngine
    if name == "EngineConfig":
        from mcore_engine.config import EngineConfig

        return EngineConfig
    raise AttributeError(f"module 'mcore_engine' has no attribute {name!r}")
