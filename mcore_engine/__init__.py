"""mcore-engine: a Megatron-Core tensor-parallel training backend for RL post-training.

``MegatronEngine`` and ``EngineConfig`` load lazily, so ``mcore_engine.ops`` stays importable
without paying for Megatron-Core's import. Importing the package quiets Megatron-Core's CPU-only
hints before anything imports it (``platform.quiet_cpu_warnings``).
"""

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
