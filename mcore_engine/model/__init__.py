"""The Megatron-Core ``GPTModel`` built from the config: layer spec choice, MoE runtime, MTP."""
