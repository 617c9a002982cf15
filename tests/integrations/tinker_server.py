"""The Tinker API server of ``mcore_engine.integrations.tinker.serve`` in a subprocess, for tests.

``tinker_server(model_dir, state_dir, tp=..., pp=...)`` starts the launcher on a free 127.0.0.1
port with an API key, waits for ``/api/v1/healthz`` and stops the whole process group on exit. The
server's output goes to ``state_dir/server.log``; a server that dies early raises with its tail.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

API_KEY = "tml-mcore-engine-tests"


@dataclasses.dataclass(frozen=True)
class Server:
    url: str
    state_dir: Path
    log: Path
    proc: subprocess.Popen

    @property
    def checkpoints(self) -> Path:
        return self.state_dir / "checkpoints"

    def log_tail(self, n: int = 60) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def tinker_server(model_dir: str, state_dir: str | os.PathLike, *, tp: int = 1, pp: int = 1,
                  extra_args: tuple[str, ...] = (), timeout: float = 180.0) -> Iterator[Server]:
    state = Path(state_dir)
    state.mkdir(parents=True, exist_ok=True)
    port = free_port()
    log = state / "server.log"
    env = dict(os.environ, MCORE_TINKER_API_KEY=API_KEY, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "mcore_engine.integrations.tinker.serve", "--base-model", model_dir,
           "--host", "127.0.0.1", "--port", str(port), "--state-dir", str(state),
           "--tensor-parallel-size", str(tp), "--pipeline-parallel-size", str(pp), *extra_args]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    server = Server(f"http://127.0.0.1:{port}", state, log, proc)
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"the server exited with {proc.returncode}:\n{server.log_tail()}")
            try:
                if httpx.get(f"{server.url}/api/v1/healthz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"the server did not answer within {timeout} s:\n{server.log_tail()}")
            time.sleep(0.5)
        yield server
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
