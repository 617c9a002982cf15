"""SkyRL 0.3.0 made to run this backend, without editing SkyRL. Import it before any ``skyrl`` module.

On import:

1. :mod:`.skyrl_types` (the Python 3.11 ``TypedDict`` fix) first.
2. Checks that the installed skyrl is 0.3.0 (there too): the routes of ``serve.py`` and the engine subclass of
   ``engine_main.py`` copy its internals (``api.get_model``, ``create_future``, ``validate_checkpoint``,
   ``TinkerEngine.process_single_request``).
3. Replaces two module globals that SkyRL looks up at call time:
   ``skyrl.tinker.engine.get_backend_classes`` (an if/elif over SkyRL's own backends) gains
   ``"mcore_engine"``, and ``skyrl.tinker.api._build_uv_run_cmd_engine`` (``uv run ... -m
   skyrl.tinker.engine``) becomes :func:`build_engine_cmd`, the engine of this package started with this
   interpreter, under ``torch.distributed.run`` when the layout has more than one rank.

It also defines the engine-side request types that keep what SkyRL's API drops:
``McoreOptimStepInput`` (``adam_params.grad_clip_norm``) and ``McoreLoadWeightsInput`` (``optimizer``).
"""

from __future__ import annotations

import sys

from mcore_engine.integrations.tinker.skyrl_types import types

# isort: split
import skyrl.tinker.api as _api  # noqa: E402
import skyrl.tinker.engine as _engine  # noqa: E402
from pydantic import BaseModel, Field  # noqa: E402
from skyrl.tinker.config import config_to_argv  # noqa: E402

ENGINE_MODULE = "mcore_engine.integrations.tinker.engine_main"
BACKEND_NAME = "mcore_engine"

_skyrl_get_backend_classes = _engine.get_backend_classes


class McoreAdamParams(types.AdamParams):
    """SkyRL's Adam parameters plus the tinker client's ``grad_clip_norm`` (0 = no clipping)."""

    grad_clip_norm: float = Field(0.0, ge=0.0)


class McoreOptimStepInput(types.OptimStepInput):
    """An optim_step request as the engine process reads it back from the database."""

    adam_params: McoreAdamParams


class McoreLoadWeightsInput(types.LoadWeightsInput):
    """A load_weights request that remembers ``load_state`` (False) vs ``load_state_with_optimizer``."""

    optimizer: bool = True


def get_backend_classes(backend_name: str, use_ray: bool = False) -> tuple[type, type[BaseModel]]:
    """SkyRL's backend lookup with ``"mcore_engine"`` added; other names go to SkyRL's own."""
    if backend_name == BACKEND_NAME:
        from mcore_engine.integrations.tinker.backend import McoreEngineBackend
        from mcore_engine.integrations.tinker.config import McoreBackendConfig

        return McoreEngineBackend, McoreBackendConfig
    return _skyrl_get_backend_classes(backend_name, use_ray=use_ray)


def build_engine_cmd(parent_cmd: list[str], engine_config: BaseModel) -> list[str]:
    """The command that starts the engine process (replaces SkyRL's ``uv run`` command).

    ``python -m mcore_engine.integrations.tinker.engine_main <EngineConfig as argv>`` for one rank,
    ``python -m torch.distributed.run --standalone --nnodes=1 --nproc-per-node=N -m ...`` for
    N = tensor_parallel_size * pipeline_parallel_size > 1 ranks. ``parent_cmd`` (the API process's
    parent command line, which SkyRL parses for ``uv run`` flags) is not used.
    """
    from mcore_engine.integrations.tinker.config import McoreBackendConfig

    if engine_config.backend != BACKEND_NAME:
        raise ValueError(f"backend must be {BACKEND_NAME!r}, got {engine_config.backend!r}")
    world = McoreBackendConfig(**engine_config.backend_config).world_size
    launcher = [sys.executable]
    if world > 1:
        launcher += ["-m", "torch.distributed.run", "--standalone", "--nnodes=1", f"--nproc-per-node={world}"]
    return [*launcher, "-m", ENGINE_MODULE, *config_to_argv(engine_config)]


_engine.get_backend_classes = get_backend_classes
_api._build_uv_run_cmd_engine = build_engine_cmd
