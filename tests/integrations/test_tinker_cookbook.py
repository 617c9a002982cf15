"""An unmodified tinker-cookbook 0.4.3 recipe trains against our server (``make tinker-cookbook``).

The cookbook pins an older ``transformers`` than ours, so it runs in its own venv
(``.venv-cookbook``, built by ``make cookbook-venv``); the test skips where that venv is absent.
Recipe: ``tinker_cookbook.recipes.multiplayer_rl.guess_number.train`` (synthetic, offline,
multi-turn RL with the default ``importance_sampling`` loss), two steps on the tiny local model.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

pytest.importorskip("skyrl")
pytest.importorskip("tinker")

from tests.integrations.tinker_server import API_KEY, tinker_server  # noqa: E402
from tests.integrations.tinker_setup import tiny_tinker_model  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
COOKBOOK_PY = ROOT / ".venv-cookbook" / "bin" / "python"

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not COOKBOOK_PY.exists(), reason="no .venv-cookbook (make cookbook-venv)")]

_SAME_IDS = """
import sys
from transformers import AutoTokenizer
tok = AutoTokenizer.from_pretrained(sys.argv[1])
print(tok.encode(sys.argv[2]))
"""


def _cookbook(args: list[str], env: dict[str, str] | None = None, timeout: float = 900
              ) -> subprocess.CompletedProcess:
    return subprocess.run([str(COOKBOOK_PY), *args], capture_output=True, text=True, timeout=timeout,
                          env=dict(os.environ, **(env or {})), cwd=ROOT)


def test_guess_number_recipe_runs_two_steps(tmp_path):
    model = tiny_tinker_model(str(tmp_path / "models" / "tiny"))
    # the client (cookbook venv, transformers 5.5.4) and the server (ours) tokenize alike
    from transformers import AutoTokenizer

    text = "User: guess 1234! é\n\nAssistant: <|im_end|>"
    ours = AutoTokenizer.from_pretrained(model).encode(text)
    theirs = _cookbook(["-c", _SAME_IDS, model, text])
    assert theirs.returncode == 0, theirs.stderr[-3000:]
    assert json.loads(theirs.stdout.strip().splitlines()[-1]) == ours

    log_path = tmp_path / "guess_number"
    with tinker_server(model, tmp_path / "state") as server:
        run = _cookbook(
            ["-m", "tinker_cookbook.recipes.multiplayer_rl.guess_number.train", f"model_name={model}",
             "renderer_name=role_colon", "batch_size=2", "group_size=2", "max_tokens=16", "max_steps=2",
             "eval_every=0", f"log_path={log_path}", "behavior_if_log_dir_exists=delete"],
            env={"TINKER_BASE_URL": server.url, "TINKER_API_KEY": API_KEY})
        assert run.returncode == 0, (run.stdout[-3000:], run.stderr[-5000:], server.log_tail())
        served = server.log.read_text(errors="replace")
    lines = (log_path / "metrics.jsonl").read_text().splitlines()
    steps = [json.loads(line) for line in lines if line.strip()]
    assert sorted({s.get("step") for s in steps}) == [0, 1], steps
    assert "optim_step" in served
