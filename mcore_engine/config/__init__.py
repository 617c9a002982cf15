"""The engine's configuration: one dataclass per block, YAML only fills them."""

from mcore_engine.config.engine import EngineConfig, ModelConfig, OptimizerConfig, ParallelConfig
from mcore_engine.config.lora import LoRAConfig
from mcore_engine.config.mla import MLAConfig
from mcore_engine.config.moe import MoEConfig

__all__ = ["EngineConfig", "LoRAConfig", "MLAConfig", "ModelConfig", "MoEConfig", "OptimizerConfig",
           "ParallelConfig"]
