"""The engine process behind the Tinker API: one process per rank, started by the API process.

``python -m mcore_engine.integrations.tinker.engine_main <SkyRL EngineConfig as argv>``, directly for
one rank or under ``torch.distributed.run`` for tensor_parallel_size * pipeline_parallel_size ranks
(``_compat.build_engine_cmd``).

- Rank 0 runs :class:`McoreTinkerEngine`, SkyRL's database loop (``TinkerEngine``), whose backend
  (``McoreEngineBackend``, through ``get_backend_classes``) is the controller of the engine ranks.
- Ranks >= 1 run ``control.run_worker``: they execute the controller's broadcast commands and return
  when it shuts down.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import mcore_engine.integrations.tinker._compat as compat  # before any other skyrl import

# isort: split
from skyrl.tinker import types
from skyrl.tinker.config import EngineConfig, add_model
from skyrl.tinker.db_models import SessionDB
from skyrl.tinker.engine import TinkerEngine, _model_not_found_error
from sqlmodel import Session, update


class McoreTinkerEngine(TinkerEngine):
    """SkyRL's engine loop, passing on the request fields that stock SkyRL drops.

    ``optim_step`` requests are read as :class:`~._compat.McoreOptimStepInput` (with
    ``adam_params.grad_clip_norm``) and ``load_weights`` as :class:`~._compat.McoreLoadWeightsInput`,
    whose ``optimizer`` flag reaches ``backend.load_checkpoint(path, model_id, optimizer=...)``. The
    routes of ``serve.py`` write these fields; everything else is SkyRL 0.3.0's.
    """

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        # the backend refuses checkpoint paths outside this folder (defence in depth: SkyRL checks ids)
        self.backend.checkpoints_base = Path(str(config.checkpoints_base)).resolve()

    def cleanup_stale_sessions(self) -> int:
        """SkyRL's cleanup, which selects ``last_heartbeat_at < cutoff``, also for sessions that never
        sent a heartbeat (a script that ended within the client's first 10 s): their NULL
        ``last_heartbeat_at`` starts at ``created_at``, else their models would stay loaded for good."""
        with Session(self.db_engine) as session:
            session.exec(update(SessionDB)
                         .where(SessionDB.status == "active", SessionDB.last_heartbeat_at.is_(None))
                         .values(last_heartbeat_at=SessionDB.created_at))
            session.commit()
        return super().cleanup_stale_sessions()

    def process_single_request(self, request_type: types.RequestType, model_id: str, request_data: dict):
        if request_type == types.RequestType.OPTIM_STEP:
            return self.process_optim_step(model_id, compat.McoreOptimStepInput.model_validate(request_data))
        if request_type == types.RequestType.LOAD_WEIGHTS:
            load = compat.McoreLoadWeightsInput.model_validate(request_data)
            return self.process_load_weights(model_id, load)
        return super().process_single_request(request_type, model_id, request_data)

    def process_load_weights(self, model_id: str, request_data: types.LoadWeightsInput):
        """SkyRL's ``process_load_weights`` (0.3.0) plus the ``optimizer`` keyword."""
        if not self.backend.has_model(model_id):
            return _model_not_found_error(model_id)
        optimizer = getattr(request_data, "optimizer", True)
        source, ckpt = request_data.source_model_id, request_data.checkpoint_id
        path = self.config.checkpoints_base / source / f"{ckpt}.tar.gz"
        self.backend.load_checkpoint(path, model_id, optimizer=optimizer)
        return types.LoadWeightsOutput(type="load_weights")


def parse_engine_config(argv: list[str] | None = None) -> EngineConfig:
    """The ``EngineConfig`` that ``config_to_argv`` wrote on the command line."""
    parser = argparse.ArgumentParser(description="mcore_engine Tinker engine process (started by serve)")
    add_model(parser, EngineConfig)
    return EngineConfig.model_validate(vars(parser.parse_args(argv)))


def main(argv: list[str] | None = None) -> None:
    cfg = parse_engine_config(argv)
    if int(os.environ.get("RANK", "0")) == 0:
        McoreTinkerEngine(cfg).run()
        return
    from mcore_engine.integrations.tinker.config import McoreBackendConfig
    from mcore_engine.integrations.tinker.control import run_worker

    run_worker(cfg.base_model, McoreBackendConfig(**cfg.backend_config))


if __name__ == "__main__":
    main()
