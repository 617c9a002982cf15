"""The backend's own settings: ``--backend-config`` JSON of SkyRL's engine, validated by name.

A pydantic model because SkyRL builds it with ``config_class(**backend_config)``; ``extra="forbid"``
so a misspelt key is refused naming it instead of being dropped.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class McoreBackendConfig(BaseModel):
    """How the engine behind the Tinker API is laid out and what it allows.

    ``tensor_parallel_size * pipeline_parallel_size`` ranks (DP = 1) run behind one server: rank 0 is
    SkyRL's engine loop and the controller, the others follow its broadcast commands.
    """

    model_config = ConfigDict(extra="forbid")

    tensor_parallel_size: int = Field(1, ge=1)
    pipeline_parallel_size: int = Field(1, ge=1)
    sequence_parallel: bool = True                  # only where tensor_parallel_size > 1
    precision: Literal["fp32", "bf16"] = "fp32"
    max_token_len_per_gpu: int = Field(8192, ge=1)  # tokens per micro-batch (dynamic batch size)
    lora_alpha: float | None = None                 # None: SkyRL's API default of 32.0
    max_models: int = Field(4, ge=1)                # one engine (one copy of the base) per model id
    sampler_cache_size: int = Field(2, ge=1)        # sampler models kept in memory (LRU)
    stop_on_eos: bool = True                        # sampling also stops at the tokenizer's EOS
    engine_overrides: dict[str, Any] = Field(default_factory=dict)  # EngineConfig fields, e.g. {"seed": 3}

    @property
    def world_size(self) -> int:
        """Ranks the engine process group needs."""
        return self.tensor_parallel_size * self.pipeline_parallel_size
