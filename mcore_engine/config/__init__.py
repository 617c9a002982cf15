"""The engine's configuration: one dataclass per block, YAML only fills them."""

from mcore_engine.config.engine import EngineConfig
from mcore_engine.config.lora import LoRAConfig
from mcore_engine.config.mla import MLAConfig
from mcore_engine.config.model import ModelConfig
from mcore_engine.config.moe import MoEConfig
from mcore_engine.config.optimizer import OptimizerConfig
from mcore_engine.config.parallel import ParallelConfig

__all__ = ["EngineConfig", "LoRAConfig", "MLAConfig", "ModelConfig", "MoEConfig", "OptimizerConfig",
           "ParallelConfig"]
