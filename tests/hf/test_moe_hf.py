"""Tiny random Qwen3-MoE / Mixtral / Qwen2-MoE through ``MegatronEngine(model.hf_path=...)`` and back.

Config mapping (no launch): the MoE fields each family's ``config.json`` implies (MoE layer pattern
from ``mlp_only_layers`` / ``decoder_sparse_step``, top-k renormalisation, shared expert), the round
trip through ``to_hf_config``, refusals by field name, and the Hugging Face tensor names the mapping
expects against the folders ``save_pretrained`` writes (one tensor per expert).

One launch on 2 gloo ranks runs every family at TP=1 x EP=2 (each rank holds two of the four
experts) and at TP=2 (experts split over expert-TP; forward only: MoE training at TP > 1 needs
sequence parallelism, GPU-only): logits and ``infer_batch`` log-probs against the ``transformers``
forward (fp32, rel 1e-4), the expert tensors each rank read (its own experts only at EP=2),
``per_tensor_generator`` and the exported folder bit for bit against the source folder, which
transformers loads back to the same logits.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from mcore_engine.config import EngineConfig, ParallelConfig
from mcore_engine.hf import from_hf_config, read_hf_config, to_hf_config
from mcore_engine.hf.mapping import check_hf_names, hf_shapes
from tests.hf.models import MOE_FAMILIES, VOCAB, hf_config, load_folder, save_tiny_model
from tests.utils import assert_rel_close, run_distributed

TOL = 1e-4
LAYOUTS = ((1, 2), (2, 1))  # (tp, ep) on 2 ranks
NUM_LAYERS = {"qwen3_moe": 3, "mixtral": 2, "qwen2_moe": 2}


# ----------------------------------------------------------------------------------------- config
def _config_dict(family: str, **overrides) -> dict:
    return hf_config(family, NUM_LAYERS[family], **overrides).to_dict()


def test_moe_config_mapping():
    q3 = from_hf_config(_config_dict("qwen3_moe"))
    assert q3.qk_layernorm and not q3.add_qkv_bias and q3.ffn_size == 88
    assert (q3.moe.num_experts, q3.moe.router_topk, q3.moe.ffn_hidden_size) == (4, 2, 24)
    assert q3.moe.layer_freq == [0, 1, 1] and not q3.moe.router_pre_softmax
    assert q3.moe.shared_expert_ffn_hidden_size is None and q3.moe.aux_loss_coeff == 0.001

    mx = from_hf_config(_config_dict("mixtral"))
    assert not mx.qk_layernorm and not mx.add_qkv_bias
    assert mx.moe.ffn_hidden_size == 24 and mx.moe.layer_freq == 1 and not mx.moe.router_pre_softmax

    q2 = from_hf_config(_config_dict("qwen2_moe"))
    assert q2.add_qkv_bias and q2.moe.router_pre_softmax  # norm_topk_prob=False
    assert q2.moe.shared_expert_ffn_hidden_size == 40 and q2.moe.shared_expert_gate

    # decoder_sparse_step: layers i with (i + 1) % step == 0, minus mlp_only_layers
    sparse = from_hf_config(_config_dict("qwen3_moe", num_hidden_layers=5, decoder_sparse_step=2,
                                         mlp_only_layers=[3]))
    assert sparse.moe.layer_freq == [0, 1, 0, 0, 0]

    for family, cfg in (("qwen3_moe", q3), ("mixtral", mx), ("qwen2_moe", q2), ("qwen3_moe", sparse)):
        source = _config_dict(family)
        out = to_hf_config(cfg, base=source)
        assert out["architectures"] == source["architectures"]
        assert from_hf_config(out) == cfg, family
        assert from_hf_config(to_hf_config(cfg)) == cfg, f"{family} without a base"
    # the Hub's Qwen3-MoE folders say num_experts, transformers writes num_local_experts
    hub = _config_dict("qwen3_moe")
    hub["num_experts"] = hub.pop("num_local_experts")
    assert from_hf_config(hub) == q3 and to_hf_config(q3, base=hub)["num_experts"] == 4


@pytest.mark.parametrize("family,change,field", [
    ("mixtral", {"router_jitter_noise": 0.1}, "router_jitter_noise"),
    ("mixtral", {"sliding_window": 16}, "sliding_window"),
    ("qwen2_moe", {"shared_expert_intermediate_size": 0}, "shared_expert_intermediate_size"),
    ("qwen2_moe", {"qkv_bias": False}, "qkv_bias"),
    ("qwen3_moe", {"use_sliding_window": True}, "use_sliding_window"),
])
def test_moe_config_refusals(family, change, field):
    with pytest.raises(ValueError, match=field):
        from_hf_config(_config_dict(family) | change)


def test_moe_to_hf_refusals():
    import dataclasses

    mx = from_hf_config(_config_dict("mixtral"))
    q3 = from_hf_config(_config_dict("qwen3_moe"))
    cases = [(dataclasses.replace(mx, moe=dataclasses.replace(mx.moe, layer_freq=[0, 1])), "layer_freq"),
             (dataclasses.replace(q3, moe=dataclasses.replace(q3.moe, shared_expert_ffn_hidden_size=8)),
              "shared_expert"),
             (dataclasses.replace(q3, moe=dataclasses.replace(q3.moe, router_score_function="sigmoid")),
              "router_score_function")]
    for cfg, field in cases:
        with pytest.raises(ValueError, match=field):
            to_hf_config(cfg)


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """The tiny checkpoints, a token batch and the transformers logits for it."""
    root = tmp_path_factory.mktemp("hf_moe")
    ids = torch.randint(0, VOCAB, (2, 13), generator=torch.Generator().manual_seed(11))
    logits = {}
    for i, family in enumerate(MOE_FAMILIES):
        model = save_tiny_model(family, root / family, seed=20 + i, num_layers=NUM_LAYERS[family])
        with torch.no_grad():
            logits[family] = model(ids).logits
    torch.save({"ids": ids, "logits": logits}, root / "reference.pt")
    return root


def test_moe_hf_names_match_saved_folders(saved):
    for family in MOE_FAMILIES:
        cfg = from_hf_config(read_hf_config(saved / family))
        names = sorted(load_folder(saved / family))
        assert sorted(hf_shapes(cfg)) == names, family
        check_hf_names(names, cfg)
        fifth = next(n for n in names if ".experts.3." in n).replace(".experts.3.", ".experts.4.")
        with pytest.raises(ValueError, match="experts.4"):  # a fifth expert has no place
            check_hf_names(names + [fifth], cfg)


# ----------------------------------------------------------------------------------------- launch
def _engine_config(folder: Path, tp: int, ep: int) -> EngineConfig:
    model = from_hf_config(read_hf_config(folder), hf_path=str(folder))
    return EngineConfig(model=model, parallel=ParallelConfig(tensor_model_parallel_size=tp,
                                                             expert_model_parallel_size=ep))


def _logits(engine, ids: torch.Tensor) -> torch.Tensor:
    """Full-vocab logits ``[b, s, V_pad]`` of the (single-stage) model."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from mcore_engine.hf.mapping import unwrap_chunk

    model = unwrap_chunk(engine.model[0]).eval()
    with torch.no_grad():
        out = model(ids, torch.arange(ids.shape[1]).expand_as(ids), None)
    parts = [torch.empty_like(out) for _ in range(ps.get_tensor_model_parallel_world_size())]
    dist.all_gather(parts, out, group=ps.get_tensor_model_parallel_group())
    return torch.cat(parts, dim=-1)


def _check_layouts(rank: int, world_size: int, root: Path) -> None:
    from megatron.core import parallel_state as ps
    from tensordict import TensorDict

    from mcore_engine import MegatronEngine
    from mcore_engine.hf.checkpoint_io import HFCheckpointReader
    from mcore_engine.parallel.platform import destroy_distributed

    ref = torch.load(root / "reference.pt")
    ids = ref["ids"]
    batch = TensorDict({"input_ids": ids, "attention_mask": torch.ones_like(ids, dtype=torch.bool)},
                       batch_size=[ids.shape[0]])
    read_names: list[str] = []
    original_read = HFCheckpointReader.read

    def recording_read(self, name, *args, **kwargs):
        read_names.append(name)
        return original_read(self, name, *args, **kwargs)

    HFCheckpointReader.read = recording_read
    for family in MOE_FAMILIES:
        original = load_folder(root / family)
        expected = ref["logits"][family]
        for tp, ep in LAYOUTS:
            what = f"{family} tp={tp} ep={ep} rank={rank}"
            read_names.clear()
            engine = MegatronEngine(_engine_config(root / family, tp, ep))
            engine.initialize()
            assert ps.get_expert_model_parallel_world_size() == ep
            # this rank read only its own experts (EP) of the folder
            experts = {int(n.split(".")[5]) for n in read_names if ".experts." in n}
            assert experts == ({0, 1, 2, 3} if ep == 1 else {2 * rank, 2 * rank + 1}), f"{what}: {experts}"

            logits = _logits(engine, ids)[..., :VOCAB]
            assert_rel_close(logits, expected, TOL, f"logits {what}")
            want = expected[:, :-1].log_softmax(-1).gather(-1, ids[:, 1:, None])[..., 0]
            log_probs = engine.infer_batch(batch)["log_probs"][:, :-1]
            assert_rel_close(log_probs, want, TOL, f"infer_batch log-probs {what}")

            streamed = {n: t.clone() for n, t in engine.per_tensor_generator()}
            assert sorted(streamed) == sorted(original), what
            for n, t in original.items():
                assert streamed[n].dtype == t.dtype and torch.equal(streamed[n], t), f"{n} {what}"
            engine.export_hf(root / f"export_{family}_tp{tp}_ep{ep}")
            del engine
            destroy_distributed()
    HFCheckpointReader.read = original_read


def test_moe_import_logits_and_export_bit_exact(saved):
    import transformers

    run_distributed(_check_layouts, 2, saved)

    ref = torch.load(saved / "reference.pt")
    for family in MOE_FAMILIES:
        original, source_config = load_folder(saved / family), read_hf_config(saved / family)
        for tp, ep in LAYOUTS:
            out = saved / f"export_{family}_tp{tp}_ep{ep}"
            exported = load_folder(out)
            assert sorted(exported) == sorted(original), out.name
            for n, t in original.items():
                assert exported[n].dtype == t.dtype and torch.equal(exported[n], t), f"{n} {out.name}"
            config = json.loads((out / "config.json").read_text())
            assert from_hf_config(config) == from_hf_config(source_config)
            assert config["architectures"] == source_config["architectures"]
        model = transformers.AutoModelForCausalLM.from_pretrained(saved / f"export_{family}_tp1_ep2").eval()
        with torch.no_grad():
            assert torch.equal(model(ref["ids"]).logits, ref["logits"][family]), family
