"""The launcher: SkyRL 0.3.0's Tinker API server with this engine as its backend.

    python -m mcore_engine.integrations.tinker.serve --base-model /abs/path/to/model [--port 8000]

What it adds to ``python -m skyrl.tinker.api`` (which it does not edit):

- the engine process is ours (``_compat.build_engine_cmd``: this interpreter, torchrun for TP * PP > 1);
- four routes are replaced by copies of 0.3.0's that keep what the tinker client sends and SkyRL drops:
  ``create_model`` (``lora_config.train_attn / train_mlp / train_unembed``, alpha from
  ``--backend-config lora_alpha``; the base model must be the served one), ``optim_step``
  (``adam_params.grad_clip_norm``), ``load_weights`` (``optimizer``), ``weights_info`` (returns the
  ``train_*`` flags, so ``create_training_client_from_state`` recreates the same adapters);
- an API key: with the variable named by ``--api-key-env`` (default ``MCORE_TINKER_API_KEY``) set,
  every request but ``/api/v1/healthz`` needs ``X-API-Key: <it>`` (401 otherwise). Without it the server
  binds loopback hosts only and answers loopback clients only;
- its state (SQLite database, checkpoints) under ``--state-dir`` instead of SkyRL's site-packages / tmp
  defaults;
- exit status 1 when the engine process died before the server was asked to stop, 0 after SIGTERM /
  SIGINT (which also stop the engine process).
"""

from __future__ import annotations

import argparse
import contextlib
import hmac
import ipaddress
import json
import os
import random
import signal
import sys
import threading
from pathlib import Path
from typing import Annotated
from uuid import uuid4

import mcore_engine.integrations.tinker._compat as compat  # before any other skyrl import

# isort: split
import skyrl.tinker.api as api
from cloudpathlib import AnyPath
from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from pydantic import BaseModel, Field, ValidationError
from skyrl.tinker import types
from skyrl.tinker.config import EngineConfig
from skyrl.tinker.db_models import ModelDB
from sqlmodel.ext.asyncio.session import AsyncSession

from mcore_engine.integrations.tinker.config import McoreBackendConfig

DEFAULT_API_KEY_ENV = "MCORE_TINKER_API_KEY"
OPEN_PATHS = ("/api/v1/healthz",)  # answered without a key (the readiness probe)
DBSession = Annotated[AsyncSession, Depends(api.get_session)]


# --------------------------------------------------------------------------------------------------
# The four routes (copies of skyrl 0.3.0 api.py: create_model :815, optim_step :955, load_weights :972,
# weights_info :1347) with the fields that stock SkyRL drops.
# --------------------------------------------------------------------------------------------------


class LoRAConfig(BaseModel):
    """The tinker client's ``LoraConfig``; ``rank == 0`` means full fine-tuning."""

    rank: int = Field(..., ge=0)
    seed: int | None = None
    train_attn: bool = True
    train_mlp: bool = True
    train_unembed: bool = True


class CreateModelRequest(BaseModel):
    session_id: str
    base_model: str
    lora_config: LoRAConfig
    model_role: str = "policy"


class CreateModelResponse(BaseModel):
    model_id: str
    base_model: str
    lora_config: LoRAConfig | None = None
    status: str = "created"
    request_id: str


class AdamParams(api.AdamParams):
    grad_clip_norm: float = Field(default=0.0, ge=0.0)


class OptimStepRequest(BaseModel):
    model_id: str
    adam_params: AdamParams


class LoadWeightsRequest(BaseModel):
    model_id: str
    path: str
    optimizer: bool = True
    type: str | None = None


class WeightsInfoResponse(api.WeightsInfoResponse):
    train_unembed: bool | None = None
    train_mlp: bool | None = None
    train_attn: bool | None = None


async def create_model(request: CreateModelRequest, req: Request, session: DBSession):
    """Create a model (LoRA when ``lora_config.rank > 0``, else full fine-tuning) of the served base."""
    served = req.app.state.engine_config.base_model
    if request.base_model != served:
        raise HTTPException(status_code=400, detail=f"base_model {request.base_model!r} is not served here; "
                            f"this server serves {served!r}")
    session_db = await session.get(api.SessionDB, request.session_id)
    if session_db is None:
        raise HTTPException(status_code=404, detail="Session not found")
    model_id = f"model_{uuid4().hex[:8]}"
    seed = request.lora_config.seed if request.lora_config.seed is not None else random.randint(0, 2**31 - 1)
    lora_config = types.LoraConfig(
        rank=request.lora_config.rank,
        alpha=req.app.state.mcore_lora_alpha,
        seed=seed,
        train_attn=request.lora_config.train_attn,
        train_mlp=request.lora_config.train_mlp,
        train_unembed=request.lora_config.train_unembed,
    )
    request_id = await api.create_future(
        session=session,
        request_type=types.RequestType.CREATE_MODEL,
        model_id=model_id,
        request_data=types.CreateModelInput(lora_config=lora_config, model_role=request.model_role),
    )
    session.add(
        ModelDB(
            model_id=model_id,
            base_model=request.base_model,
            lora_config=lora_config.model_dump(),
            status="created",
            request_id=request_id,
            session_id=request.session_id,
        )
    )
    await session.commit()
    return CreateModelResponse(model_id=model_id, base_model=request.base_model,
                               lora_config=request.lora_config, request_id=str(request_id))


async def optim_step(request: OptimStepRequest, session: DBSession):
    """Apply the accumulated gradients with these Adam parameters (and ``grad_clip_norm``, 0 = none)."""
    await api.get_model(session, request.model_id)
    request_id = await api.create_future(
        session=session,
        request_type=types.RequestType.OPTIM_STEP,
        model_id=request.model_id,
        request_data=compat.McoreOptimStepInput(adam_params=compat.McoreAdamParams(**request.adam_params.model_dump())),
    )
    await session.commit()
    return api.FutureResponse(future_id=str(request_id), status="pending", request_id=str(request_id))


def _weights_path(tinker_path: str, detail: str) -> tuple[str, str]:
    path = types.TinkerPath.parse(tinker_path)
    if not path or path.kind != "weights" or not path.primary_id or not path.secondary_id:
        raise HTTPException(status_code=400, detail=detail)
    return path.primary_id, path.secondary_id


async def load_weights(request: LoadWeightsRequest, req: Request, session: DBSession):
    """Load a training checkpoint; ``optimizer=False`` (``load_state``) resets the Adam state."""
    await api.get_model(session, request.model_id)
    source_model_id, checkpoint_id = _weights_path(
        request.path, "request.path must be in format tinker://source_model_id/weights/checkpoint_id"
    )
    await api.validate_checkpoint(req, source_model_id, checkpoint_id, types.CheckpointType.TRAINING, session)
    request_id = await api.create_future(
        session=session,
        request_type=types.RequestType.LOAD_WEIGHTS,
        model_id=request.model_id,
        request_data=compat.McoreLoadWeightsInput(
            source_model_id=source_model_id, checkpoint_id=checkpoint_id, optimizer=request.optimizer
        ),
    )
    await session.commit()
    return api.FutureResponse(future_id=str(request_id), status="pending", request_id=str(request_id))


async def weights_info(request: api.WeightsInfoRequest, req: Request, session: DBSession):
    """Base model, LoRA rank and ``train_*`` flags of a training checkpoint's model."""
    model_id, checkpoint_id = _weights_path(
        request.tinker_path, "Invalid tinker path format. Expected: tinker://model_id/weights/checkpoint_id"
    )
    model = await api.get_model(session, model_id)
    await api.validate_checkpoint(req, model_id, checkpoint_id, types.CheckpointType.TRAINING, session)
    lora = types.LoraConfig.model_validate(model.lora_config)
    return WeightsInfoResponse(
        base_model=model.base_model,
        is_lora=lora.rank > 0,
        lora_rank=lora.rank,
        train_unembed=lora.train_unembed,
        train_mlp=lora.train_mlp,
        train_attn=lora.train_attn,
    )


ROUTES = {
    "/api/v1/create_model": (create_model, CreateModelResponse),
    "/api/v1/optim_step": (optim_step, api.FutureResponse),
    "/api/v1/load_weights": (load_weights, api.FutureResponse),
    "/api/v1/weights_info": (weights_info, WeightsInfoResponse),
}


def replace_routes(app: FastAPI) -> None:
    """Swap SkyRL's POST routes of :data:`ROUTES` for ours (FastAPI binds request models per route)."""
    ours = lambda r: isinstance(r, APIRoute) and r.path in ROUTES and "POST" in r.methods
    app.router.routes[:] = [r for r in app.router.routes if not ours(r)]
    for path, (handler, response_model) in ROUTES.items():
        app.post(path, response_model=response_model)(handler)


# --------------------------------------------------------------------------------------------------
# API key
# --------------------------------------------------------------------------------------------------


def is_loopback(host: str) -> bool:
    """``localhost`` or a loopback IP address (127.0.0.0/8, ::1)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def resolve_api_key(env_name: str, host: str) -> str | None:
    """The key clients must send, or None (then only loopback ``host`` is allowed).

    Raises ValueError naming ``--host`` / ``--api-key-env`` when the server would be reachable without a
    key, or when the key cannot be sent by a tinker client (it must start with ``tml-``).
    """
    key = os.environ.get(env_name) or None
    if key is None and not is_loopback(host):
        raise ValueError(
            f"--host {host} is not a loopback address: set an API key in ${env_name} (--api-key-env), "
            "or bind 127.0.0.1"
        )
    if key is not None and not key.startswith("tml-"):
        raise ValueError(f"${env_name} (--api-key-env) must start with 'tml-' "
                         "(the tinker client refuses other keys)")
    return key


async def _check_api_key(request: Request, call_next):
    expected = request.app.state.mcore_api_key
    if request.url.path not in OPEN_PATHS:
        if expected is None:
            client = request.client.host if request.client else ""
            if not is_loopback(client):
                detail = "no API key is set: loopback clients only"
                return JSONResponse(status_code=403, content={"detail": detail})
        elif not hmac.compare_digest(request.headers.get("x-api-key", "").encode(), expected.encode()):
            return JSONResponse(status_code=401, content={"detail": "invalid X-API-Key"})
    return await call_next(request)


_skyrl_get_model = api.get_model


async def get_model_naming_the_id(session: AsyncSession, model_id: str) -> ModelDB:
    """SkyRL's model lookup (every route's), its 404 naming the field and the id."""
    try:
        return await _skyrl_get_model(session, model_id)
    except HTTPException as e:
        if e.status_code == 404:
            raise HTTPException(status_code=404, detail=f"model_id {model_id!r}: model not found") from None
        raise


def configure_app(app: FastAPI, engine_config: EngineConfig, backend_config: McoreBackendConfig,
                  api_key: str | None) -> FastAPI:
    """Prepare SkyRL's ``app`` for this backend: config, our routes, the API-key middleware."""
    app.state.engine_config = engine_config
    app.state.mcore_api_key = api_key
    app.state.mcore_lora_alpha = backend_config.lora_alpha if backend_config.lora_alpha is not None else 32.0
    replace_routes(app)
    api.get_model = get_model_naming_the_id  # a module global SkyRL's routes look up at call time
    if not getattr(app.state, "mcore_auth_installed", False):
        app.middleware("http")(_check_api_key)
        app.state.mcore_auth_installed = True
    return app


# --------------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------------


def check_base_model(path: str) -> str:
    """The absolute base-model folder, checked for what the tinker client and the engine need.

    The client loads the tokenizer from this string after cutting it at ``:`` and, when it has exactly
    two ``/``, to its first two parts (an ``org/model`` hub name); clients must send it verbatim.
    """
    folder = os.path.abspath(path)
    if ":" in folder:
        raise ValueError(f"--base-model {folder!r} contains ':', which the tinker client cuts off")
    if folder.count("/") == 2:
        raise ValueError(
            f"--base-model {folder!r} has exactly two '/', which the tinker client reads as a hub name "
            "'org/model': move the folder one level deeper"
        )
    if not os.path.isfile(os.path.join(folder, "config.json")):
        raise ValueError(f"--base-model {folder!r} has no config.json (a Hugging Face model folder)")
    if not any(os.path.isfile(os.path.join(folder, f)) for f in ("tokenizer.json", "tokenizer_config.json")):
        raise ValueError(f"--base-model {folder!r} has no tokenizer (tokenizer.json / tokenizer_config.json)")
    return folder


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m mcore_engine.integrations.tinker.serve",
        description="SkyRL 0.3.0's Tinker API server with the Megatron-Core engine as its backend.",
    )
    p.add_argument("--base-model", required=True, help="absolute path of a Hugging Face model folder")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (non-loopback needs an API key)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--state-dir", default="tinker-state",
                   help="database (tinker.db) and checkpoints (checkpoints/) of the server")
    p.add_argument("--tensor-parallel-size", type=int, default=None)
    p.add_argument("--pipeline-parallel-size", type=int, default=None)
    p.add_argument("--precision", choices=["fp32", "bf16"], default=None)
    p.add_argument("--backend-config", default="{}",
                   help="JSON object of McoreBackendConfig fields (the flags above override it)")
    p.add_argument("--api-key-env", default=DEFAULT_API_KEY_ENV,
                   help="environment variable holding the key clients send as X-API-Key")
    p.add_argument("--session-timeout-sec", type=int, default=60,
                   help="unload a session's models after this long without a heartbeat (-1: never); the "
                        "client heartbeats every 10 s, so a finished script frees its models within a minute")
    p.add_argument("--external-inference-url", default=None,
                   help="SkyRL's sampling through a vLLM server (drops stop and prompt_logprobs)")
    return p


def configs_from_args(args: argparse.Namespace) -> tuple[EngineConfig, McoreBackendConfig]:
    """SkyRL's ``EngineConfig`` and our backend config; ValueError naming the flag on bad values."""
    base_model = check_base_model(args.base_model)
    try:
        raw = json.loads(args.backend_config)
    except json.JSONDecodeError as e:
        raise ValueError(f"--backend-config is not JSON: {e}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"--backend-config must be a JSON object, got {type(raw).__name__}")
    for flag in ("tensor_parallel_size", "pipeline_parallel_size", "precision"):
        if getattr(args, flag) is not None:
            raw[flag] = getattr(args, flag)
    try:
        backend_config = McoreBackendConfig(**raw)
    except ValidationError as e:
        raise ValueError(f"--backend-config: {e}") from None
    state = Path(args.state_dir).resolve()
    engine_config = EngineConfig(
        base_model=base_model,
        backend=compat.BACKEND_NAME,
        backend_config=backend_config.model_dump(),
        checkpoints_base=AnyPath(str(state / "checkpoints")),
        database_url=f"sqlite:///{state / 'tinker.db'}",
        external_inference_url=args.external_inference_url,
        external_inference_lora_base=state / "lora_models",
        session_cleanup_interval_sec=10,
        session_timeout_sec=args.session_timeout_sec,
    )
    return engine_config, backend_config


def main(argv: list[str] | None = None) -> int:
    import uvicorn
    from skyrl.utils.log import get_uvicorn_log_config

    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        engine_config, backend_config = configs_from_args(args)
        api_key = resolve_api_key(args.api_key_env, args.host)
    except ValueError as e:
        parser.error(str(e))
    Path(args.state_dir).resolve().joinpath("checkpoints").mkdir(parents=True, exist_ok=True)
    app = configure_app(api.app, engine_config, backend_config, api_key)
    print(f"serving base model {engine_config.base_model} on http://{args.host}:{args.port} "
          f"(TP={backend_config.tensor_parallel_size}, PP={backend_config.pipeline_parallel_size}, "
          f"API key {'from $' + args.api_key_env if api_key else 'off: loopback only'})", flush=True)

    engine_dead_at_exit = []

    class _Server(uvicorn.Server):
        def handle_exit(self, sig, frame):  # SkyRL's monitor signals us when the engine has died
            proc = getattr(app.state, "background_engine", None)
            engine_dead_at_exit.append(proc is not None and proc.returncode is not None)
            super().handle_exit(sig, frame)

        @contextlib.contextmanager
        def capture_signals(self):  # uvicorn's re-raises the signal after shutdown: we return a status
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)

    _Server(uvicorn.Config(app, host=args.host, port=args.port, log_config=get_uvicorn_log_config())).run()
    if engine_dead_at_exit and engine_dead_at_exit[0]:
        print(f"the engine process exited ({app.state.background_engine.returncode}) before the server "
              "was stopped", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
