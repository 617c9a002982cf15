"""mcore-engine: a Megatron-Core training backend for RL post-training. ``MegatronEngine`` and
``EngineConfig`` load lazily (``mcore_engine.ops`` imports without Megatron-Core); importing the
package quiets Megatron-Core's CPU-only hints (``platform.quiet_cpu_warnings``)."""

from typing import Any

from mcore_engine.platform import quiet_cpu_warnings

__all__ = ["EngineConfig", "MegatronEngine"]
__version__ = "0.1.0"

quiet_cpu_warnings()


def __getattr__(name: str) -> Any:
    if name == "MegatronEngine":
        from mcore_engine.engine import MegatronEngine

        return MegatronEngine
    if name == "EngineConfig":
        from mcore_engine.config import EngineConfig

        return EngineConfig
    raise AttributeError(f"module 'mcore_engine' has no attribute {name!r}")
