"""Hydra configs for verl's trainer with actor, reference policy and critic on the mcore_engine backend
(YAML only; this package imports nothing):

- ``mcore_engine_backend.yaml``: verl's own ``ppo_megatron_trainer`` plus the role blocks that select
  this backend (the reference policy and the critic in the actor's dtype); include it from your own
  primary config, with this package and ``pkg://verl.trainer.config`` in ``hydra.searchpath``;
- ``ppo_mcore_engine_trainer.yaml``: the same as a primary config, for the command line::

    python -m verl.trainer.main_ppo --config-path pkg://mcore_engine.integrations.verl_hydra \\
        --config-name ppo_mcore_engine_trainer ...
"""
