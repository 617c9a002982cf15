"""Where the engine's state goes: distributed checkpoints, host offload, LoRA adapters."""
