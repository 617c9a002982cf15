"""Tiny random Llama / Qwen2 / Qwen3 through the engine's GPTModel and back, on 2 gloo ranks.

One launch runs every family (Llama sharded in and out) at TP=1 (DP=2), TP=2 and PP=2: import,
logits and log-probs against the ``transformers`` forward (fp32, rel 1e-4), the streamed tensors and
the exported folder bit for bit against the original safetensors, and a corrupt folder refused
before any parameter changes; then a bf16 checkpoint into a bf16 model at TP=2.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from mcore_engine.config import EngineConfig, ParallelConfig
from mcore_engine.hf import from_hf_config, load_hf_weights, read_hf_config
from tests.hf.models import FAMILIES, VOCAB, load_folder, save_tiny_model
from tests.utils import assert_rel_close, rel_err, run_distributed

LAYOUTS = ((1, 1), (2, 1), (1, 2))  # (tp, pp) on 2 ranks
TOL = 1e-4


def _engine_config(folder: Path, tp: int = 1, pp: int = 1) -> EngineConfig:
    model = from_hf_config(read_hf_config(folder), hf_path=str(folder))
    return EngineConfig(model=model, parallel=ParallelConfig(tensor_model_parallel_size=tp,
                                                            pipeline_model_parallel_size=pp))


def _export_dir(root: Path, family: str, tp: int, pp: int) -> Path:
    return root / f"export_{family}_tp{tp}_pp{pp}"


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """The three tiny checkpoints, a token batch and the transformers logits for it."""
    root = tmp_path_factory.mktemp("hf")
    ids = torch.randint(0, VOCAB, (2, 13), generator=torch.Generator().manual_seed(7))
    logits = {}
    for i, family in enumerate(FAMILIES):
        model = save_tiny_model(family, root / family, seed=i,
                                max_shard_size="100KB" if family == "llama" else None)
        with torch.no_grad():
            logits[family] = model(ids).logits
    assert (root / "llama" / "model.safetensors.index.json").is_file()  # sharded source
    model = save_tiny_model("qwen2", root / "qwen2_bf16", seed=5, dtype=torch.bfloat16)
    with torch.no_grad():  # bf16 budget: the fp32 forward of the bf16 weights vs transformers' bf16 one
        logits["qwen2_bf16"] = model(ids).logits.float()
        logits["qwen2_bf16_fp32"] = model.float()(ids).logits
    torch.save({"ids": ids, "logits": logits}, root / "reference.pt")
    return root


def _forward(chunk: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor | None:
    """Full-vocab logits ``[b, s, V_pad]`` on the last pipeline stage (manual p2p), None elsewhere."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    pp_group, pp_rank = ps.get_pipeline_model_parallel_group(), ps.get_pipeline_model_parallel_rank()
    positions = torch.arange(ids.shape[1]).expand_as(ids)
    chunk.eval()
    with torch.no_grad():
        if pp_rank > 0:
            hidden = torch.empty(ids.shape[1], ids.shape[0], chunk.config.hidden_size)
            dist.recv(hidden, src=dist.get_global_rank(pp_group, pp_rank - 1))
            chunk.set_input_tensor(hidden)
        out = chunk(ids, positions, None)
        if not ps.is_pipeline_last_stage():
            dist.send(out.contiguous(), dst=dist.get_global_rank(pp_group, pp_rank + 1))
            return None
        parts = [torch.empty_like(out) for _ in range(ps.get_tensor_model_parallel_world_size())]
        dist.all_gather(parts, out, group=ps.get_tensor_model_parallel_group())
    return torch.cat(parts, dim=-1)


def _check_all_layouts(rank: int, world_size: int, root: Path) -> None:
    from mcore_engine.hf import export_hf, iter_hf_tensors
    from mcore_engine.model import build_model_chunks
    from mcore_engine.platform import init_distributed

    ref = torch.load(root / "reference.pt")
    ids = ref["ids"]
    for tp, pp in LAYOUTS:
        for family in FAMILIES:
            what = f"{family} tp={tp} pp={pp} rank={rank}"
            cfg = _engine_config(root / family, tp, pp)
            init_distributed(cfg.parallel, seed=123)
            chunks = build_model_chunks(cfg)
            if (tp, pp) == (2, 1) and family == "qwen3":  # refused before any parameter changes
                before = [p.detach().clone() for p in chunks[0].parameters()]
                with pytest.raises(ValueError, match="model.layers.1.mlp.up_proj.weight"):
                    load_hf_weights(chunks, root / "broken", cfg)
                assert all(torch.equal(a, b) for a, b in zip(before, chunks[0].parameters(), strict=True))
            load_hf_weights(chunks, cfg.model.hf_path, cfg)

            logits = _forward(chunks[0], ids)
            if logits is not None:
                expected = ref["logits"][family]
                assert_rel_close(logits[..., :VOCAB], expected, TOL, f"logits {what}")
                labels = ids[:, 1:, None]
                log_probs = logits[:, :-1, :VOCAB].log_softmax(-1).gather(-1, labels)
                assert_rel_close(log_probs, expected[:, :-1].log_softmax(-1).gather(-1, labels), TOL,
                                 f"log-probs {what}")

            original = load_folder(root / family)
            streamed = {name: t.clone() for name, t in iter_hf_tensors(chunks, cfg)}
            assert sorted(streamed) == sorted(original), what
            for name, t in original.items():
                assert streamed[name].dtype == t.dtype and torch.equal(streamed[name], t), f"{name} {what}"
            export_hf(chunks, cfg, _export_dir(root, family, tp, pp),
                      max_shard_bytes=100_000 if family == "llama" else 5 * 2**30)
            if (tp, pp) == (1, 2) and family == "llama":  # export dtype cast
                for name, t in iter_hf_tensors(chunks, cfg, dtype=torch.bfloat16):
                    assert torch.equal(t, original[name].to(torch.bfloat16)), f"{name} bf16 {what}"

    # bf16 checkpoint into a bf16 model at TP=2: logits within the bf16 budget, export bit for bit
    folder = root / "qwen2_bf16"
    cfg = dataclasses.replace(_engine_config(folder, 2, 1), precision="bf16")
    init_distributed(cfg.parallel, seed=123)
    chunks = build_model_chunks(cfg)
    load_hf_weights(chunks, folder, cfg)
    logits = _forward(chunks[0], ids)
    assert logits.dtype == torch.bfloat16
    exact = ref["logits"]["qwen2_bf16_fp32"]
    budget = 2 * rel_err(ref["logits"]["qwen2_bf16"], exact) + 1e-3  # within 2x transformers' bf16 error
    assert_rel_close(logits[..., :VOCAB].float(), exact, budget, f"bf16 logits rank={rank}")
    export_hf(chunks, cfg, _export_dir(root, "qwen2_bf16", 2, 1))


def test_import_logits_and_export_bit_exact(saved):
    # a checkpoint with one tensor of the wrong shape, for the refusal check inside the launch
    broken = saved / "broken"
    broken.mkdir()
    tensors = load_file(saved / "qwen3" / "model.safetensors")
    tensors["model.layers.1.mlp.up_proj.weight"] = tensors["model.layers.1.mlp.up_proj.weight"][:-2].clone()
    save_file(tensors, str(broken / "model.safetensors"))
    (broken / "config.json").write_text((saved / "qwen3" / "config.json").read_text())

    run_distributed(_check_all_layouts, 2, saved)

    import transformers

    ids = torch.load(saved / "reference.pt")["ids"]
    for family in FAMILIES:
        original = load_folder(saved / family)
        source_config = read_hf_config(saved / family)
        for tp, pp in LAYOUTS:
            out = _export_dir(saved, family, tp, pp)
            exported = load_folder(out)
            assert (family == "llama") == (out / "model.safetensors.index.json").is_file()
            assert sorted(exported) == sorted(original)
            for name, t in original.items():
                same = exported[name].dtype == t.dtype and torch.equal(exported[name], t)
                assert same, f"{name} {out.name}"
            config = json.loads((out / "config.json").read_text())
            assert from_hf_config(config) == from_hf_config(source_config)
            assert config["architectures"] == source_config["architectures"]
        # the exported folder loads in transformers and gives the same logits
        model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
        with torch.no_grad():
            assert torch.equal(model(ids).logits, torch.load(saved / "reference.pt")["logits"][family])
    original = load_file(saved / "qwen2_bf16" / "model.safetensors")
    exported = load_file(_export_dir(saved, "qwen2_bf16", 2, 1) / "model.safetensors")
    assert sorted(exported) == sorted(original)
    for name, t in original.items():
        assert exported[name].dtype == torch.bfloat16 and torch.equal(exported[name], t), name
    assert read_hf_config(_export_dir(saved, "qwen2_bf16", 2, 1))["dtype"] == "bfloat16"
