"""The Tinker server plumbing: launcher checks, the replaced routes, the API key, the engine command, and
an end-to-end start of the real launcher with a stub backend driven by the real tinker 0.24.1 client.

The stub (``tinker_stub_backend.py``) reaches the server's processes through a ``sitecustomize.py`` on
their ``PYTHONPATH`` that puts an import finder on ``sys.meta_path``; the launcher, SkyRL and the
engine process run unchanged, and production code carries no test hook.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("skyrl")
tinker = pytest.importorskip("tinker")

import mcore_engine.integrations.tinker._compat as compat  # noqa: E402  (before skyrl)

# isort: split
import httpx  # noqa: E402
import skyrl.tinker.api as api  # noqa: E402
import skyrl.tinker.engine as skyrl_engine  # noqa: E402
from fastapi.routing import APIRoute  # noqa: E402
from fastapi.testclient import TestClient  # noqa: E402
from skyrl.tinker.config import EngineConfig  # noqa: E402

from mcore_engine.integrations.tinker import serve  # noqa: E402
from mcore_engine.integrations.tinker.config import McoreBackendConfig  # noqa: E402
from tests.integrations import tinker_stub_backend  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
KEY = "tml-plumbing-test"


def _model_folder(root: Path) -> Path:
    """A folder that passes ``check_base_model`` (the stub never reads it); >= 3 slashes, no ':'."""
    folder = root / "tinker" / "models" / "tiny"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen2", "vocab_size": 300}))
    (folder / "tokenizer_config.json").write_text("{}")
    return folder


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return _model_folder(tmp_path_factory.mktemp("tsrv"))


# --------------------------------------------------------------------------------------------------
# In-process: _compat, argument checks, routes, API key
# --------------------------------------------------------------------------------------------------


def test_compat_replaces_skyrl_globals():
    assert skyrl_engine.get_backend_classes is compat.get_backend_classes
    assert api._build_uv_run_cmd_engine is compat.build_engine_cmd
    with pytest.raises(ValueError, match="Unknown backend"):  # other names still go to SkyRL's lookup
        compat.get_backend_classes("no-such-backend")
    adam = {"learning_rate": 1e-3, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8, "weight_decay": 0.0}
    assert compat.McoreOptimStepInput.model_validate({"adam_params": adam}).adam_params.grad_clip_norm == 0.0
    assert compat.McoreLoadWeightsInput(source_model_id="m", checkpoint_id="c").optimizer is True


@pytest.mark.parametrize("tp,pp,world", [(1, 1, 1), (2, 1, 2), (1, 2, 2)])
def test_engine_command(model_dir, tp, pp, world):
    cfg = EngineConfig(base_model=str(model_dir), backend="mcore_engine",
                       backend_config={"tensor_parallel_size": tp, "pipeline_parallel_size": pp})
    cmd = compat.build_engine_cmd(["uv", "run", "whatever"], cfg)
    module_at = cmd.index("mcore_engine.integrations.tinker.engine_main")
    if world == 1:
        assert cmd[:module_at + 1] == [sys.executable, "-m", "mcore_engine.integrations.tinker.engine_main"]
    else:
        assert cmd[:module_at + 1] == [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                       "--nnodes=1", f"--nproc-per-node={world}", "-m",
                                       "mcore_engine.integrations.tinker.engine_main"]
    from mcore_engine.integrations.tinker.engine_main import parse_engine_config

    assert parse_engine_config(cmd[module_at + 1:]) == cfg  # the engine reads back the same config
    with pytest.raises(ValueError, match="backend must be 'mcore_engine'"):
        compat.build_engine_cmd([], cfg.model_copy(update={"backend": "jax"}))


def test_base_model_checks(tmp_path, monkeypatch):
    good = _model_folder(tmp_path)
    assert serve.check_base_model(str(good) + "/") == str(good)
    monkeypatch.chdir(good.parent)
    assert serve.check_base_model("tiny") == str(good)  # relative -> absolute
    colon = _model_folder(tmp_path / "a:b")
    with pytest.raises(ValueError, match="--base-model .*':'"):
        serve.check_base_model(str(colon))
    with pytest.raises(ValueError, match="--base-model .*exactly two '/'"):
        serve.check_base_model("/models/tiny")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="--base-model .*config.json"):
        serve.check_base_model(str(tmp_path / "empty"))
    (good / "tokenizer_config.json").unlink()
    with pytest.raises(ValueError, match="--base-model .*tokenizer"):
        serve.check_base_model(str(good))


def test_configs_from_args(model_dir, tmp_path):
    parser = serve.build_parser()
    args = parser.parse_args(["--base-model", str(model_dir), "--state-dir", str(tmp_path / "st"),
                              "--backend-config", '{"tensor_parallel_size": 4, "lora_alpha": 16}',
                              "--tensor-parallel-size", "2", "--precision", "bf16",
                              "--session-timeout-sec", "-1"])
    engine_cfg, backend_cfg = serve.configs_from_args(args)
    b = backend_cfg
    assert (b.tensor_parallel_size, b.precision, b.lora_alpha) == (2, "bf16", 16)  # flags override JSON
    assert engine_cfg.backend == "mcore_engine" and engine_cfg.base_model == str(model_dir)
    assert McoreBackendConfig(**engine_cfg.backend_config) == backend_cfg
    assert str(engine_cfg.checkpoints_base) == str(tmp_path / "st" / "checkpoints")
    assert engine_cfg.database_url == f"sqlite:///{tmp_path / 'st' / 'tinker.db'}"
    assert engine_cfg.session_timeout_sec == -1
    for bad, match in [('{"tensor_paralel_size": 2}', "(?s)--backend-config.*tensor_paralel_size"),
                       ("[1]", "--backend-config must be a JSON object"),
                       ("{", "--backend-config is not JSON")]:
        with pytest.raises(ValueError, match=match):
            serve.configs_from_args(parser.parse_args(["--base-model", str(model_dir),
                                                       "--backend-config", bad]))


def test_api_key_resolution(model_dir, monkeypatch, capsys):
    monkeypatch.delenv("MY_KEY", raising=False)
    assert serve.resolve_api_key("MY_KEY", "127.0.0.1") is None
    assert serve.resolve_api_key("MY_KEY", "::1") is None
    with pytest.raises(ValueError, match="--host 0.0.0.0 is not a loopback address.*MY_KEY"):
        serve.resolve_api_key("MY_KEY", "0.0.0.0")
    monkeypatch.setenv("MY_KEY", "secret")
    with pytest.raises(ValueError, match=r"\$MY_KEY .*'tml-'"):
        serve.resolve_api_key("MY_KEY", "0.0.0.0")
    monkeypatch.setenv("MY_KEY", KEY)
    assert serve.resolve_api_key("MY_KEY", "0.0.0.0") == KEY
    # the launcher itself refuses to start (before binding anything)
    monkeypatch.delenv(serve.DEFAULT_API_KEY_ENV, raising=False)
    with pytest.raises(SystemExit) as e:
        serve.main(["--base-model", str(model_dir), "--host", "0.0.0.0"])
    assert e.value.code == 2 and "--host 0.0.0.0 is not a loopback address" in capsys.readouterr().err


def test_routes_and_api_key_middleware(model_dir, tmp_path):
    args = serve.build_parser().parse_args(["--base-model", str(model_dir), "--state-dir", str(tmp_path)])
    engine_cfg, backend_cfg = serve.configs_from_args(args)
    app = serve.configure_app(api.app, engine_cfg, backend_cfg, KEY)
    serve.configure_app(app, engine_cfg, backend_cfg, KEY)  # idempotent: one route per path, one middleware
    posts = [r for r in app.routes if isinstance(r, APIRoute) and "POST" in r.methods]
    for path in serve.ROUTES:
        [route] = [r for r in posts if r.path == path]
        assert route.endpoint.__module__ == serve.__name__, path
    spec = app.openapi()
    schema = lambda ref: spec["components"]["schemas"][ref["$ref"].rsplit("/", 1)[1]]["properties"]
    json_of = lambda part: schema(part["content"]["application/json"]["schema"])
    body = lambda path: json_of(spec["paths"][path]["post"]["requestBody"])
    answer = lambda path: json_of(spec["paths"][path]["post"]["responses"]["200"])
    flags = {"train_attn", "train_mlp", "train_unembed"}
    assert flags <= set(schema(body("/api/v1/create_model")["lora_config"]))
    assert "grad_clip_norm" in schema(body("/api/v1/optim_step")["adam_params"])
    assert "optimizer" in body("/api/v1/load_weights")
    assert flags <= set(answer("/api/v1/weights_info"))
    assert sum(m.kwargs.get("dispatch") is serve._check_api_key for m in app.user_middleware) == 1

    client = TestClient(app)  # no lifespan: the middleware answers before any route runs
    assert client.get("/api/v1/healthz").status_code == 200
    for headers in ({}, {"X-API-Key": "tml-wrong"}):
        r = client.post("/api/v1/create_session", json={}, headers=headers)
        assert (r.status_code, r.json()) == (401, {"detail": "invalid X-API-Key"})
    app.state.mcore_api_key = None  # no key: loopback clients only (TestClient's client is "testclient")
    assert client.post("/api/v1/create_session", json={}).status_code == 403


# --------------------------------------------------------------------------------------------------
# End to end: the real launcher (subprocess), its engine process, the stub backend, the tinker client
# --------------------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Server:
    """``python -m mcore_engine.integrations.tinker.serve`` with the stub backend, in its own folder."""

    def __init__(self, root: Path, model: Path, *extra: str, env: dict[str, str] | None = None):
        root.mkdir(parents=True, exist_ok=True)
        site = root / "site"
        site.mkdir(exist_ok=True)
        (site / "sitecustomize.py").write_text(tinker_stub_backend.SITECUSTOMIZE)
        self.log = root / "stub.jsonl"
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.out = open(root / "server.log", "w")  # noqa: SIM115
        pythonpath = os.pathsep.join([str(site), str(REPO), os.environ.get("PYTHONPATH", "")])
        full_env = {**os.environ, "PYTHONPATH": pythonpath, "MCORE_TINKER_STUB_LOG": str(self.log),
                    serve.DEFAULT_API_KEY_ENV: KEY, "OMP_NUM_THREADS": "1", **(env or {})}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mcore_engine.integrations.tinker.serve", "--base-model", str(model),
             "--port", str(self.port), "--state-dir", str(root / "state"), *extra],
            env=full_env, cwd=root, stdout=self.out, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"server exited {self.proc.returncode}:\n{self.text()}"
            try:
                if httpx.get(f"{self.url}/api/v1/healthz", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.3)
        raise AssertionError(f"server not ready in {timeout} s:\n{self.text()}")

    def wait_records(self, method: str, n: int, timeout: float = 30.0) -> list[dict]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = [r for r in self.records() if r["method"] == method]
            if len(found) >= n:
                return found
            time.sleep(0.2)
        raise AssertionError(f"{n} x {method} not recorded: {self.records()}\n{self.text()}")

    def records(self) -> list[dict]:
        return [json.loads(line) for line in self.log.read_text().splitlines()] if self.log.exists() else []

    def text(self) -> str:
        return Path(self.out.name).read_text()  # written by the server process itself

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait()
        self.out.close()
        return code


@pytest.fixture
def server_factory(tmp_path):
    started = []

    def start(*extra, env=None):
        started.append(_Server(tmp_path / f"srv{len(started)}", _model_folder(tmp_path), *extra, env=env))
        return started[-1]

    yield start
    for s in started:
        s.stop()


def _datum(tokens: list[int], weights: list[float]):
    return tinker.types.Datum(model_input=tinker.types.ModelInput.from_ints(tokens[:-1]),
                              loss_fn_inputs={"target_tokens": tokens[1:], "weights": weights})


@pytest.mark.slow
def test_client_through_launcher_world1(server_factory):
    srv = server_factory()
    srv.wait_ready()
    base = str(srv.proc.args[srv.proc.args.index("--base-model") + 1])

    # the key: healthz is open, the rest needs X-API-Key
    for headers in ({}, {"X-API-Key": "tml-x"}):
        r = httpx.post(f"{srv.url}/api/v1/create_session", json={}, headers=headers)
        assert (r.status_code, r.json()) == (401, {"detail": "invalid X-API-Key"})

    sc = tinker.ServiceClient(base_url=srv.url, api_key=KEY)
    tc = sc.create_lora_training_client(base_model=base, rank=4, seed=7, train_mlp=False, train_unembed=False)
    fb = tc.forward_backward([_datum([1, 2, 3, 4], [1.0, 1.0, 0.0])], "cross_entropy").result()
    assert fb.metrics["loss:sum"] == pytest.approx(1.0)
    assert fb.loss_fn_outputs[0]["logprobs"].tolist() == [-0.5] * 3
    opt = tc.optim_step(tinker.types.AdamParams(learning_rate=1e-3, grad_clip_norm=0.75)).result()
    assert opt.metrics["stub/grad_clip_norm"] == pytest.approx(0.75)
    path = tc.save_state("s1").result().path
    tc.load_state(path).result()
    tc.load_state_with_optimizer(path).result()
    info = sc.create_rest_client().get_weights_info_by_tinker_path(path).result()
    assert (info.base_model, info.is_lora, info.lora_rank) == (base, True, 4)
    assert (info.train_attn, info.train_mlp, info.train_unembed) == (True, False, False)
    tc2 = sc.create_training_client_from_state_with_optimizer(path)
    full = sc.create_lora_training_client(base_model=base, rank=0)  # rank 0: full fine-tuning
    full.forward([_datum([5, 6, 7], [1.0, 1.0])], "cross_entropy").result()

    # a base model this server does not serve is refused, naming it
    session = httpx.post(f"{srv.url}/api/v1/create_session", headers={"X-API-Key": KEY},
                         json={"tags": [], "sdk_version": "0"}).json()["session_id"]
    r = httpx.post(f"{srv.url}/api/v1/create_model", headers={"X-API-Key": KEY},
                   json={"session_id": session, "base_model": "Qwen/Qwen3-8B", "lora_config": {"rank": 4}})
    assert r.status_code == 400 and "Qwen/Qwen3-8B" in r.json()["detail"] and base in r.json()["detail"]

    [init] = srv.wait_records("init", 1)
    assert init["config_type"] == "McoreBackendConfig" and init["base_model"] == base and init["rank"] is None
    creates = srv.wait_records("create_model", 3)
    assert creates[0]["lora"] == {"rank": 4, "alpha": 32.0, "seed": 7, "train_attn": True, "train_mlp": False,
                                  "train_unembed": False}
    assert creates[1]["lora"]["train_mlp"] is False  # from_state recreated the same targets
    assert creates[2]["lora"]["rank"] == 0
    [step] = srv.wait_records("optim_step", 1)
    assert step["input_type"] == "McoreOptimStepInput" and step["adam"]["grad_clip_norm"] == 0.75
    loads = srv.wait_records("load_checkpoint", 3)
    assert [(ld["model_id"] == tc2.model_id, ld["optimizer"], ld["exists"]) for ld in loads] == [
        (False, False, True), (False, True, True), (True, True, True)]
    assert srv.stop() == 0
    assert "-m mcore_engine.integrations.tinker.engine_main" in " ".join(srv.text().split())


@pytest.mark.slow
def test_launcher_world2_and_engine_crash(server_factory):
    srv = server_factory("--tensor-parallel-size", "2", "--backend-config", '{"lora_alpha": 8}')
    srv.wait_ready()
    base = str(srv.proc.args[srv.proc.args.index("--base-model") + 1])
    sc = tinker.ServiceClient(base_url=srv.url, api_key=KEY)
    tc = sc.create_lora_training_client(base_model=base, rank=2)
    fb = tc.forward_backward([_datum([1, 2, 3], [2.0, 1.0])], "cross_entropy").result()
    assert fb.metrics["loss:sum"] == 1.5
    [init] = srv.wait_records("init", 1)
    [worker] = srv.wait_records("run_worker", 1)
    assert (init["rank"], init["world"], worker["rank"], worker["world"]) == ("0", "2", "1", "2")
    assert worker["config_type"] == "McoreBackendConfig" and worker["base_model"] == base
    assert worker["config"] == init["config"] and init["config"]["tensor_parallel_size"] == 2
    [create] = srv.wait_records("create_model", 1)
    assert create["lora"]["alpha"] == 8.0  # --backend-config lora_alpha reaches the LoraConfig
    assert srv.stop() == 0

    # the engine process dies at start: the launcher stops and says so with its exit status
    bad = server_factory(env={"MCORE_TINKER_STUB_FAIL": "1"})
    assert bad.proc.wait(timeout=60) == 1, bad.text()
    assert "stub backend told to fail" in bad.text()
