"""``tools/convert.py`` and the engine: HF -> engine checkpoint (TP=2) -> HF, on 2 gloo ranks.

One launch: convert both ways, then resume a ``MegatronEngine`` from the converted checkpoint and
compare its ``infer_batch`` log-probs with the ``transformers`` forward (fp32, rel 1e-4); the
exported folder must equal the original bit for bit and carry its tokenizer files.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.hf.models import VOCAB, save_tiny_model
from tests.utils import assert_rel_close, run_distributed

TOOL = Path(__file__).resolve().parents[2] / "tools" / "convert.py"
LENGTHS = (9, 13, 5)


def _convert_and_infer(rank: int, world_size: int, root: Path) -> None:
    from tensordict import TensorDict

    from mcore_engine import MegatronEngine
    from mcore_engine.config import EngineConfig

    spec = importlib.util.spec_from_file_location("convert_tool", TOOL)
    convert = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(convert)
    convert.main(["hf-to-mcore", "--hf", str(root / "qwen3"), "--out", str(root / "ckpt"), "--tp", "2"])
    convert.main(["mcore-to-hf", "--ckpt", str(root / "ckpt"), "--out", str(root / "back"),
                  "--hf-base", str(root / "qwen3")])

    ref = torch.load(root / "reference.pt")
    engine = MegatronEngine(EngineConfig.from_yaml(root / "ckpt" / "engine_config.yaml"))
    engine.initialize()
    engine.load_checkpoint(str(root / "ckpt"))
    rows = ref["ids"]
    batch = TensorDict({"input_ids": torch.nested.nested_tensor(rows, layout=torch.jagged),
                        "loss_mask": torch.nested.nested_tensor([torch.ones_like(r) for r in rows],
                                                                layout=torch.jagged)},
                       batch_size=[len(rows)])
    out = engine.infer_batch(batch)
    for i, (log_probs, expected) in enumerate(zip(out["log_probs"].unbind(), ref["log_probs"], strict=True)):
        assert_rel_close(log_probs[:-1], expected, 1e-4, f"engine log-probs of sequence {i}, rank {rank}")


@pytest.mark.slow  # three engine builds (model + DDP + optimizer) and a checkpoint on 2 ranks
def test_convert_round_trip_and_engine_log_probs_tp2(tmp_path):
    model = save_tiny_model("qwen3", tmp_path / "qwen3")
    (tmp_path / "qwen3" / "tokenizer_config.json").write_text("{}\n")
    g = torch.Generator().manual_seed(3)
    ids = [torch.randint(0, VOCAB, (n,), generator=g) for n in LENGTHS]
    with torch.no_grad():
        log_probs = [model(r[None]).logits[0, :-1].log_softmax(-1).gather(-1, r[1:, None])[:, 0] for r in ids]
    torch.save({"ids": ids, "log_probs": log_probs}, tmp_path / "reference.pt")

    run_distributed(_convert_and_infer, 2, tmp_path)

    assert (tmp_path / "ckpt" / "engine_config.yaml").is_file()
    original = load_file(tmp_path / "qwen3" / "model.safetensors")
    back = load_file(tmp_path / "back" / "model.safetensors")
    assert sorted(back) == sorted(original)
    for name, t in original.items():
        assert back[name].dtype == t.dtype and torch.equal(back[name], t), name
    assert (tmp_path / "back" / "tokenizer_config.json").read_text() == "{}\n"
