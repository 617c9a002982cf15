"""nn modules of the project's own that are swapped into Megatron-Core's layer spec or model
(norms, core attention, value head). They know nothing of the engine: import them by module path."""
