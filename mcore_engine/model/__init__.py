"""The Megatron-Core ``GPTModel`` from the config: transformer config, layer spec, MoE runtime and
routing replay, the output head, and its wrapping (DDP or forward-only)."""
