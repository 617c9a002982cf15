"""The engine as a backend of the Tinker API, through SkyRL 0.3.0's Tinker server.

``python -m mcore_engine.integrations.tinker.serve --base-model DIR`` starts SkyRL's API with
:class:`~mcore_engine.integrations.tinker.backend.McoreEngineBackend` as its backend; tinker clients
(and tinker-cookbook recipes) then train on Megatron-Core. Nothing here is imported by
``import mcore_engine``: skyrl and tinker are the optional extra ``.[tinker]`` (``docs/tinker.md``).
"""
