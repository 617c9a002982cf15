"""The engine's configuration: one dataclass per block, YAML only fills them; refusals are
``ConfigError`` (a ``ValueError``) naming their fields."""

from mcore_engine.config.checks import ConfigError
from mcore_engine.config.engine import EngineConfig
from mcore_engine.config.gdn import GDNConfig
from mcore_engine.config.lora import LoRAConfig
from mcore_engine.config.mla import MLAConfig
from mcore_engine.config.model import ModelConfig
from mcore_engine.config.moe import MoEConfig
from mcore_engine.config.optimizer import OptimizerConfig
from mcore_engine.config.parallel import ParallelConfig
from mcore_engine.config.rope import YaRNConfig
from mcore_engine.config.vision import VisionConfig

__all__ = ["ConfigError", "EngineConfig", "GDNConfig", "LoRAConfig", "MLAConfig", "ModelConfig", "MoEConfig",
           "OptimizerConfig", "ParallelConfig", "VisionConfig", "YaRNConfig"]
