"""Where the engine's state goes: in-memory state, distributed checkpoints, host offload, weight
export, LoRA adapters."""
