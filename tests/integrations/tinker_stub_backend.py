"""A stub Tinker backend: tests the server plumbing (launcher, routes, engine process) without an engine.

``test_tinker_server.py`` starts the real launcher in a subprocess whose ``PYTHONPATH`` begins with a
folder holding a ``sitecustomize.py`` (written by the test) that puts :class:`StubFinder` on
``sys.meta_path``: every Python process of the server (the API process and the engine process it
spawns) then imports *this file* when SkyRL's patched ``get_backend_classes`` imports
``mcore_engine.integrations.tinker.backend`` (and ``engine_main`` on ranks >= 1 imports it as
``...tinker.control``). Production code has no test hook.

The stub records each call as a JSON line in ``$MCORE_TINKER_STUB_LOG`` so the test can check what
reached the backend (``grad_clip_norm``, ``load_checkpoint(optimizer=...)``, the LoRA ``train_*`` flags).
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

BACKEND_MODULE = "mcore_engine.integrations.tinker.backend"
CONTROL_MODULE = "mcore_engine.integrations.tinker.control"


class StubFinder:
    """A ``sys.meta_path`` finder that loads this file as the package's ``backend`` and ``control``."""

    def find_spec(self, name, path=None, target=None):
        if name in (BACKEND_MODULE, CONTROL_MODULE):
            return importlib.util.spec_from_file_location(name, __file__)
        return None


SITECUSTOMIZE = f"""import sys
sys.path.insert(0, {str(Path(__file__).parent)!r})
import tinker_stub_backend
sys.meta_path.insert(0, tinker_stub_backend.StubFinder())
"""


def _record(method: str, **fields) -> None:
    with open(os.environ["MCORE_TINKER_STUB_LOG"], "a") as f:
        f.write(json.dumps({"method": method, "pid": os.getpid(), "rank": os.environ.get("RANK"),
                            "world": os.environ.get("WORLD_SIZE"), **fields}) + "\n")


if __name__ == CONTROL_MODULE:  # ranks >= 1 of the engine process

    def run_worker(base_model: str, config) -> None:
        """Records that the worker started with the controller's config, and returns (no commands)."""
        _record("run_worker", base_model=base_model, config=config.model_dump(),
                config_type=type(config).__name__)


if __name__ == BACKEND_MODULE:  # only when loaded as the backend, in a process that imported _compat
    import mcore_engine.integrations.tinker._compat  # noqa: F401  (TypedDict fix before skyrl)

    # isort: split
    from skyrl.backends.backend import AbstractBackend
    from skyrl.tinker import types

    def _tensor(values: list[float]) -> dict:
        return {"data": values, "dtype": "float32", "shape": [len(values)]}

    class McoreEngineBackend(AbstractBackend):
        """Records calls; forward_backward returns logprobs -0.5 per target and loss:sum = 0.5 * sum(w)."""

        def __init__(self, base_model: str, config) -> None:
            if os.environ.get("MCORE_TINKER_STUB_FAIL"):
                raise RuntimeError("stub backend told to fail (MCORE_TINKER_STUB_FAIL)")
            self.models: dict[str, dict] = {}
            self.metrics = types.EngineMetrics()
            _record("init", base_model=base_model, config=config.model_dump(),
                    config_type=type(config).__name__)

        def create_model(self, model_id, lora_config, model_role="policy"):
            self.models[model_id] = {"lora": lora_config.model_dump(), "role": model_role}
            _record("create_model", model_id=model_id, lora=lora_config.model_dump(), role=model_role)

        def _pass(self, batch, name):
            results = {}
            for request_id, _model_id, start, end in batch.request_batch_slices:
                outs, total = [], 0.0
                for i in range(start, end):
                    n = len(batch.all_targets[i])
                    w = batch.all_token_weights[i]
                    outs.append({"logprobs": _tensor([-0.5] * n),
                                 "elementwise_loss": _tensor([0.5 * x for x in w])})
                    total += 0.5 * sum(w)
                results[request_id] = types.ForwardBackwardOutput(
                    loss_fn_output_type="scalar", loss_fn_outputs=outs, metrics={"loss:sum": total})
            _record(name, loss_fns=batch.all_loss_fns, n=len(batch.all_targets))
            return results

        def forward_backward(self, prepared_batch):
            return self._pass(prepared_batch, "forward_backward")

        def forward(self, prepared_batch):
            return self._pass(prepared_batch, "forward")

        def optim_step(self, model_id, request_data):
            _record("optim_step", model_id=model_id, input_type=type(request_data).__name__,
                    adam=request_data.adam_params.model_dump())
            clip = request_data.adam_params.grad_clip_norm
            return types.OptimStepOutput(metrics={"stub/grad_clip_norm": clip})

        def sample(self, prepared_batch):
            raise NotImplementedError("the stub does not sample")

        def save_checkpoint(self, output_path, model_id):
            Path(output_path).parent.mkdir(parents=True, exist_ok=True)
            Path(output_path).write_text(json.dumps(self.models[model_id]))
            _record("save_checkpoint", model_id=model_id, path=str(output_path))

        def load_checkpoint(self, checkpoint_path, model_id, *, optimizer: bool = True):
            _record("load_checkpoint", model_id=model_id, path=str(checkpoint_path), optimizer=optimizer,
                    exists=Path(checkpoint_path).is_file())

        def save_sampler_checkpoint(self, output_path, model_id, persist=True):
            Path(output_path).parent.mkdir(parents=True, exist_ok=True)
            Path(output_path).write_text("stub")

        def has_model(self, model_id):
            return model_id in self.models

        def delete_model(self, model_id):
            self.models.pop(model_id, None)
            _record("delete_model", model_id=model_id)
