"""Adapters that make the engine a registered backend of an RL framework.

Each adapter lives in its own module and imports its framework; this package imports none of them,
so ``import mcore_engine`` never pulls a framework in. ``mcore_engine.integrations.verl``: verl's
``BaseEngine`` under the backend name ``"mcore_engine"``.
"""
