"""An unmodified tinker-cookbook 0.4.3 recipe trains against our server (``make tinker-cookbook``).

The cookbook pins an older ``transformers`` than ours, so it runs in its own venv
(``.venv-cookbook``, built by ``make cookbook-venv``); the test skips where that venv is absent.
Recipe: ``tinker_cookbook.recipes.multiplayer_rl.guess_number.train`` (synthetic, offline,
multi-turn RL with the default ``importance_sampling`` loss), two steps on the tiny local model; and
the cookbook's supervised trainer on its shipped conversations (``examples/tinker_cookbook_sft.py``).
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


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """The tiny model and a server on it (shared by the recipes)."""
    root = tmp_path_factory.mktemp("cookbook")
    model = tiny_tinker_model(str(root / "models" / "tiny"))
    with tinker_server(model, root / "state") as server:
        yield model, server


def test_guess_number_recipe_runs_two_steps(served, tmp_path):
    model, server = served
    # the client (cookbook venv, transformers 5.5.4) and the server (ours) tokenize alike
    from transformers import AutoTokenizer

    text = "User: guess 1234! é\n\nAssistant: <|im_end|>"
    ours = AutoTokenizer.from_pretrained(model).encode(text)
    theirs = _cookbook(["-c", _SAME_IDS, model, text])
    assert theirs.returncode == 0, theirs.stderr[-3000:]
    assert json.loads(theirs.stdout.strip().splitlines()[-1]) == ours

    log_path = tmp_path / "guess_number"
    run = _cookbook(
        ["-m", "tinker_cookbook.recipes.multiplayer_rl.guess_number.train", f"model_name={model}",
         "renderer_name=role_colon", "batch_size=2", "group_size=2", "max_tokens=16", "max_steps=2",
         "eval_every=0", f"log_path={log_path}", "behavior_if_log_dir_exists=delete"],
        env={"TINKER_BASE_URL": server.url, "TINKER_API_KEY": API_KEY})
    assert run.returncode == 0, (run.stdout[-3000:], run.stderr[-5000:], server.log_tail())
    assert "optim_step" in server.log.read_text(errors="replace")
    assert sorted({s.get("step") for s in _metrics(log_path)}) == [0, 1]


def test_supervised_trainer_lowers_the_nll(served, tmp_path):
    """examples/tinker_cookbook_sft.py: the cookbook's own supervised trainer on its example
    conversations; the mean NLL falls (full fine-tuning)."""
    model, server = served
    log_path = tmp_path / "sft"
    run = _cookbook(["examples/tinker_cookbook_sft.py", "--base-model", model, "--log-path", str(log_path),
                     "--max-steps", "5"], env={"TINKER_BASE_URL": server.url, "TINKER_API_KEY": API_KEY})
    assert run.returncode == 0, (run.stdout[-3000:], run.stderr[-5000:], server.log_tail())
    nll = [s["train_mean_nll"] for s in _metrics(log_path) if "train_mean_nll" in s]
    assert len(nll) == 5 and nll[-1] < nll[0] - 0.5, nll


def _metrics(log_path: Path) -> list[dict]:
    lines = (log_path / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]
