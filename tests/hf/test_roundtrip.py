"""Tiny random Llama / Qwen2 / Qwen3 through the engine's GPTModel and back, on 2 gloo ranks.

One launch runs every family (Llama sharded in and out) at TP=1 (DP=2), TP=2 and PP=2: import,
logits and log-probs against the ``transformers`` forward (fp32, rel 1e-4), the streamed tensors and
the exported folder bit for bit against the original safetensors, and a corrupt folder refused
before any parameter changes; then a 4-layer Llama at PP=2 x VPP=2 and a bf16 checkpoint into a
bf16 model at TP=2. Last, ``MegatronEngine`` with ``model.hf_path`` (TP=2) on a Llama with Llama-3
RoPE scaling and ``head_dim`` 32 != hidden / heads: RoPE frequencies and ``infer_batch`` log-probs
against transformers, ``per_tensor_generator`` and ``export_hf`` bit for bit.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from mcore_engine.config import EngineConfig, ParallelConfig
from mcore_engine.hf import from_hf_config, load_hf_weights, read_hf_config
from tests.hf.models import FAMILIES, VOCAB, load_folder, save_tiny_model
from tests.utils import assert_rel_close, rel_err, run_distributed

# (checkpoint folder, tp, pp, vpp, precision) on 2 ranks; tp = pp = 1 means 2 data-parallel replicas
CASES = [(family, tp, pp, None, "fp32") for tp, pp in ((1, 1), (2, 1), (1, 2)) for family in FAMILIES]
CASES += [("llama4", 1, 2, 2, "fp32"), ("qwen2_bf16", 2, 1, None, "bf16")]
TOL = 1e-4
# Llama-3 RoPE scaling with Megatron-Core's fixed parameters (a large theta: several scaled bands)
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def _engine_config(folder: Path, tp: int = 1, pp: int = 1, vpp: int | None = None,
                   precision: str = "fp32") -> EngineConfig:
    model = from_hf_config(read_hf_config(folder), hf_path=str(folder))
    parallel = ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                              virtual_pipeline_model_parallel_size=vpp)
    return EngineConfig(model=model, parallel=parallel, precision=precision)


def _export_dir(root: Path, name: str, tp: int, pp: int, vpp: int | None) -> Path:
    return root / f"export_{name}_tp{tp}_pp{pp}_vpp{vpp}"


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """The tiny checkpoints, a token batch and the transformers logits for it."""
    root = tmp_path_factory.mktemp("hf")
    ids = torch.randint(0, VOCAB, (2, 13), generator=torch.Generator().manual_seed(7))
    logits = {}
    for i, family in enumerate(FAMILIES):
        model = save_tiny_model(family, root / family, seed=i,
                                max_shard_size="100KB" if family == "llama" else None)
        with torch.no_grad():
            logits[family] = model(ids).logits
    assert (root / "llama" / "model.safetensors.index.json").is_file()  # sharded source
    model = save_tiny_model("llama", root / "llama4", seed=4, num_layers=4)
    with torch.no_grad():
        logits["llama4"] = model(ids).logits
    model = save_tiny_model("qwen2", root / "qwen2_bf16", seed=5, dtype=torch.bfloat16)
    with torch.no_grad():  # bf16 budget: the fp32 forward of the bf16 weights vs transformers' bf16 one
        logits["qwen2_bf16"] = model(ids).logits.float()
        logits["qwen2_bf16_fp32"] = model.float()(ids).logits
    model = save_tiny_model("llama", root / "llama_rope", seed=6, head_dim=32, rope_parameters=LLAMA3_ROPE)
    with torch.no_grad():
        logits["llama_rope"] = model(ids).logits
    inv_freq = model.model.rotary_emb.inv_freq.clone()
    unscaled = 1 / 5e5 ** (torch.arange(0, 32, 2, dtype=torch.float32) / 32)
    assert (inv_freq != unscaled).sum() >= 4, "the RoPE scaling must change several frequencies"
    torch.save({"ids": ids, "logits": logits, "inv_freq": inv_freq}, root / "reference.pt")
    return root


def _forward(chunks: list[torch.nn.Module], ids: torch.Tensor) -> torch.Tensor | None:
    """Full-vocab logits ``[b, s, V_pad]`` on the last pipeline stage, None elsewhere.

    Runs the (virtual) stages in order with blocking p2p: stage (v, r) receives from the previous
    pipeline rank (rank pp-1 of chunk v-1 for r = 0) and sends to the next one.
    """
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    pp_group, pp_rank = ps.get_pipeline_model_parallel_group(), ps.get_pipeline_model_parallel_rank()
    pp_size = ps.get_pipeline_model_parallel_world_size()
    positions = torch.arange(ids.shape[1]).expand_as(ids)
    with torch.no_grad():
        for v, chunk in enumerate(chunks):
            chunk.eval()
            if v > 0 or pp_rank > 0:
                hidden = torch.empty(ids.shape[1], ids.shape[0], chunk.config.hidden_size,
                                     dtype=chunk.config.params_dtype)
                dist.recv(hidden, src=dist.get_global_rank(pp_group, (pp_rank - 1) % pp_size))
                chunk.set_input_tensor(hidden)
            out = chunk(ids, positions, None)
            if v < len(chunks) - 1 or pp_rank < pp_size - 1:
                dist.send(out.contiguous(), dst=dist.get_global_rank(pp_group, (pp_rank + 1) % pp_size))
        if pp_rank < pp_size - 1:
            return None
        parts = [torch.empty_like(out) for _ in range(ps.get_tensor_model_parallel_world_size())]
        dist.all_gather(parts, out, group=ps.get_tensor_model_parallel_group())
    return torch.cat(parts, dim=-1)


def _check_all_layouts(rank: int, world_size: int, root: Path) -> None:
    from mcore_engine.hf import export_hf, iter_hf_tensors
    from mcore_engine.model.build import build_model_chunks
    from mcore_engine.parallel.platform import destroy_distributed, init_distributed

    ref = torch.load(root / "reference.pt")
    ids, labels = ref["ids"], ref["ids"][:, 1:, None]
    for name, tp, pp, vpp, precision in CASES:
        what = f"{name} tp={tp} pp={pp} vpp={vpp} rank={rank}"
        cfg = _engine_config(root / name, tp, pp, vpp, precision)
        destroy_distributed()  # each layout gets its own process groups
        init_distributed(cfg.parallel, seed=123)
        chunks = build_model_chunks(cfg)
        if (name, tp, pp) == ("qwen3", 2, 1):  # a corrupt folder is refused before any parameter changes
            before = [p.detach().clone() for p in chunks[0].parameters()]
            with pytest.raises(ValueError, match="model.layers.1.mlp.up_proj.weight"):
                load_hf_weights(chunks, root / "broken", cfg)
            assert all(torch.equal(a, b) for a, b in zip(before, chunks[0].parameters(), strict=True))
        load_hf_weights(chunks, cfg.model.hf_path, cfg)

        logits = _forward(chunks, ids)
        if logits is not None and precision == "fp32":
            expected = ref["logits"][name]
            assert_rel_close(logits[..., :VOCAB], expected, TOL, f"logits {what}")
            log_probs = logits[:, :-1, :VOCAB].log_softmax(-1).gather(-1, labels)
            assert_rel_close(log_probs, expected[:, :-1].log_softmax(-1).gather(-1, labels), TOL,
                             f"log-probs {what}")
        elif logits is not None:  # bf16: within twice transformers' own bf16 error (+1e-3)
            assert logits.dtype == torch.bfloat16
            exact = ref["logits"][f"{name}_fp32"]
            budget = 2 * rel_err(ref["logits"][name], exact) + 1e-3
            assert_rel_close(logits[..., :VOCAB].float(), exact, budget, f"logits {what}")

        original = load_folder(root / name)
        streamed = {n: t.clone() for n, t in iter_hf_tensors(chunks, cfg)}
        assert sorted(streamed) == sorted(original), what
        for n, t in original.items():
            assert streamed[n].dtype == t.dtype and torch.equal(streamed[n], t), f"{n} {what}"
        export_hf(chunks, cfg, _export_dir(root, name, tp, pp, vpp),
                  max_shard_bytes=100_000 if name == "llama" else 5 * 2**30)
        if (name, pp) == ("llama", 2):  # export dtype cast
            for n, t in iter_hf_tensors(chunks, cfg, dtype=torch.bfloat16):
                assert torch.equal(t, original[n].to(torch.bfloat16)), f"{n} bf16 {what}"
    _check_engine_hf_path(root, ref)


def _check_engine_hf_path(root: Path, ref: dict) -> None:
    """``MegatronEngine(model.hf_path=...)`` at TP=2: weights imported in ``initialize``."""
    from tensordict import TensorDict

    from mcore_engine import MegatronEngine
    from mcore_engine.hf.mapping import unwrap_chunk

    folder = root / "llama_rope"
    engine = MegatronEngine(_engine_config(folder, tp=2))
    assert engine.config.model.kv_channels == 32 and engine.config.model.rope_scaling_factor == 8.0
    engine.initialize()  # same layout as the last case: the groups are kept
    inv_freq = unwrap_chunk(engine.model[0]).rotary_pos_emb.inv_freq
    assert_rel_close(inv_freq, ref["inv_freq"], 1e-6, "Llama-3 scaled RoPE frequencies")

    ids = ref["ids"]
    batch = TensorDict({"input_ids": ids, "attention_mask": torch.ones_like(ids, dtype=torch.bool)},
                       batch_size=[ids.shape[0]])
    log_probs = engine.infer_batch(batch)["log_probs"][:, :-1]
    expected = ref["logits"]["llama_rope"][:, :-1].log_softmax(-1).gather(-1, ids[:, 1:, None])[..., 0]
    assert_rel_close(log_probs, expected, TOL, "engine log-probs with hf_path")

    original = load_folder(folder)
    streamed = {n: t.clone() for n, t in engine.per_tensor_generator()}
    assert sorted(streamed) == sorted(original)
    for n, t in original.items():
        assert torch.equal(streamed[n], t), f"per_tensor_generator {n}"
    engine.export_hf(root / "export_engine", max_shard_bytes=100_000)


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
    for name, tp, pp, vpp, _ in CASES:
        original, source_config = load_folder(saved / name), read_hf_config(saved / name)
        out = _export_dir(saved, name, tp, pp, vpp)
        exported = load_folder(out)
        assert (name == "llama") == (out / "model.safetensors.index.json").is_file()
        assert sorted(exported) == sorted(original)
        for n, t in original.items():
            assert exported[n].dtype == t.dtype and torch.equal(exported[n], t), f"{n} {out.name}"
        config = json.loads((out / "config.json").read_text())
        assert from_hf_config(config) == from_hf_config(source_config)
        assert config["architectures"] == source_config["architectures"]
        assert config["dtype"] == str(t.dtype).removeprefix("torch.")
    exported, config = load_folder(saved / "export_engine"), read_hf_config(saved / "export_engine")
    original = load_folder(saved / "llama_rope")
    assert sorted(exported) == sorted(original)
    assert all(torch.equal(exported[n], original[n]) for n in original)
    assert config["rope_parameters"] == LLAMA3_ROPE and config["head_dim"] == 32
    assert from_hf_config(config) == from_hf_config(read_hf_config(saved / "llama_rope"))
    for name in FAMILIES:  # an exported folder loads in transformers and gives the same logits
        model = transformers.AutoModelForCausalLM.from_pretrained(_export_dir(saved, name, 2, 1, None)).eval()
        with torch.no_grad():
            assert torch.equal(model(ids).logits, torch.load(saved / "reference.pt")["logits"][name])
