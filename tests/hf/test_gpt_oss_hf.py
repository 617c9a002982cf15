"""gpt-oss (``GptOssForCausalLM``) through ``MegatronEngine(model.hf_path=...)`` and back.

No launch: ``config.json`` <-> ``ModelConfig`` (sinks, ``layer_types`` windows, YaRN, biases, the clamped
quick-GELU experts) and its refusals by field name; MXFP4 dequantisation bit for bit against
``transformers``' ``convert_moe_packed_tensors`` (fp32, bf16); Megatron-Core's YaRN cos / sin (with its
mscale) against ``GptOssRotaryEmbedding`` (``truncate`` False and True); the folder's names (dense and
MXFP4) against the mapping, and wrong blocks / scales / sinks shapes refused before anything loads.

One launch on 2 gloo ranks: the tiny random gpt-oss (``tests.hf.gpt_oss_models``: window 4, sinks,
biases, the clamp at 7 active) packed (thd, the SDPA core attention) at DP=2, TP=2 + SP (MXFP4 folder),
EP=2 (MXFP4 folder) and PP=2, and bshd on Megatron-Core's DotProductAttention: ``infer_batch``
log-probs and entropy against ``transformers`` eager, one sequence at a time (fp32, rel 1e-4), on
sequences longer than the window and the YaRN original context, each rank reading only its experts,
``per_tensor_generator`` / the bucketed sync in the dequantised folder's names and tensors (bit for
bit), ``export_hf`` -> a dequantised folder that ``from_pretrained`` loads to identical logits, and a
training step on the MXFP4 folder at TP=2 + SP that moves the sinks and every kind of bias.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from mcore_engine.config import EngineConfig, ParallelConfig
from mcore_engine.hf import from_hf_config, read_hf_config, to_hf_config
from mcore_engine.hf.mapping import head_dim
from mcore_engine.hf.mxfp4 import dequantize, quantize
from tests.hf import gpt_oss_models as M
from tests.utils import assert_rel_close, run_distributed

TOL = 1e-4
LENGTHS = (13, 9, 21)  # beyond the window (4) and the YaRN original context (16)
# (folder, tp, ep, pp, sequence parallel, data format, core attention, export): the project's SDPA
# core attention packed (thd) on every layout, and Megatron-Core's DotProductAttention (bshd) as a
# second implementation of sinks and windows
LAYOUTS = (("dense", 1, 1, 1, False, "thd", "sdpa", False), ("mxfp4", 2, 1, 1, True, "thd", "sdpa", True),
           ("mxfp4", 1, 2, 1, False, "thd", "sdpa", False), ("dense", 1, 1, 2, False, "thd", "sdpa", True),
           ("dense", 1, 1, 1, False, "bshd", "local", False))


def _config_dict(**overrides) -> dict:
    return M.hf_config(**overrides).to_dict()


# ----------------------------------------------------------------------------------------- config
def test_gpt_oss_config_mapping():
    cfg = from_hf_config(_config_dict())
    assert (cfg.add_bias_linear, cfg.attention_sinks, cfg.add_qkv_bias) == (True, True, False)
    assert cfg.sliding_window == 4 and cfg.sliding_window_pattern == [1, 0, 1, 0]
    assert (cfg.glu_activation, cfg.glu_linear_offset, cfg.glu_clamp) == ("quick_gelu", 1.0, 7.0)
    assert cfg.yarn.factor == 4.0 and cfg.yarn.original_max_position_embeddings == 16
    assert not cfg.yarn.truncate and (cfg.yarn.mscale, cfg.yarn.mscale_all_dim) == (1.0, 0.0)
    assert head_dim(cfg) == 16 and cfg.query_groups == 2 and cfg.rotary_base == 10000.0
    moe = cfg.moe
    assert (moe.num_experts, moe.router_topk, moe.ffn_hidden_size, moe.layer_freq) == (4, 2, 32, 1)
    assert moe.router_score_function == "softmax" and not moe.router_pre_softmax
    source = _config_dict()
    out = to_hf_config(cfg, base=source)
    assert out["architectures"] == ["GptOssForCausalLM"] and out["layer_types"] == source["layer_types"]
    assert out["rope_parameters"] == source["rope_parameters"] and out["swiglu_limit"] == 7.0
    assert from_hf_config(out) == cfg and from_hf_config(to_hf_config(cfg)) == cfg
    # every layer sliding: no pattern; transformers' default layer_types (sliding on even layers)
    every = from_hf_config(_config_dict(layer_types=["sliding_attention"] * 4))
    assert every.sliding_window == 4 and every.sliding_window_pattern is None
    assert from_hf_config(to_hf_config(every)) == every
    default = _config_dict()
    default.pop("layer_types")
    assert from_hf_config(default).sliding_window_pattern == [1, 0, 1, 0]
    # an MXFP4 folder's quantization_config is not written back (the export is dequantised)
    quantized = source | {"quantization_config": M.MXFP4_CONFIG}
    assert from_hf_config(quantized) == cfg and "quantization_config" not in to_hf_config(cfg, base=quantized)


def test_gpt_oss_hub_config():
    """A config.json as the Hub's gpt-oss-20b has it (``rope_scaling``, top-level ``rope_theta``, MXFP4)."""
    hub = {"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "attention_bias": True,
           "head_dim": 64, "hidden_act": "silu", "hidden_size": 2880, "initial_context_length": 4096,
           "intermediate_size": 2880, "layer_types": ["sliding_attention", "full_attention"] * 12,
           "max_position_embeddings": 131072, "num_attention_heads": 64, "num_experts_per_tok": 4,
           "num_hidden_layers": 24, "num_key_value_heads": 8, "num_local_experts": 32,
           "output_router_logits": False, "rms_norm_eps": 1e-05, "rope_theta": 150000,
           "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                            "original_max_position_embeddings": 4096, "rope_type": "yarn", "truncate": False},
           "router_aux_loss_coef": 0.9, "sliding_window": 128, "swiglu_limit": 7.0,
           "tie_word_embeddings": False, "vocab_size": 201088, "quantization_config": M.MXFP4_CONFIG}
    cfg = from_hf_config(hub)
    assert cfg.rotary_base == 150000 and cfg.yarn.factor == 32.0 and not cfg.yarn.truncate
    assert cfg.yarn.original_max_position_embeddings == 4096 and cfg.sliding_window == 128
    assert cfg.sliding_window_pattern == [1, 0] * 12 and head_dim(cfg) == 64 and cfg.query_groups == 8
    assert (cfg.moe.num_experts, cfg.moe.router_topk, cfg.moe.ffn_hidden_size) == (32, 4, 2880)
    assert cfg.moe.aux_loss_coeff == 0.0  # transformers adds no aux loss without output_router_logits
    out = to_hf_config(cfg, base=hub)
    assert "quantization_config" not in out and from_hf_config(out) == cfg
    assert out["router_aux_loss_coef"] == 0.9 and out["output_router_logits"] is False
    with_aux = from_hf_config({**hub, "output_router_logits": True})
    assert with_aux.moe.aux_loss_coeff == 0.9
    assert to_hf_config(with_aux, base=hub)["output_router_logits"] is True


@pytest.mark.parametrize("change,field", [
    ({"swiglu_alpha": 1.5}, "swiglu_alpha"),
    ({"layer_types": ["sliding_attention", "full_attention", "sliding_attention"]}, "layer_types"),
    ({"layer_types": ["sliding_attention", "chunked_attention"] * 2}, "layer_types"),
    ({"attention_bias": False}, "attention_bias"),
    ({"sliding_window": None}, "sliding_window"),
    ({"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}, "rope_parameters"),
    ({"rope_parameters": {**M.CONFIG["rope_parameters"], "attention_factor": 2.0}}, "attention_factor"),
])
def test_gpt_oss_config_refusals(change, field):
    config = _config_dict() | change
    with pytest.raises(ValueError, match=field):
        from_hf_config(config)


def test_gpt_oss_to_hf_and_layout_refusals():
    cfg = from_hf_config(_config_dict())
    moe = cfg.moe
    cases = [(dataclasses.replace(cfg, glu_activation="silu"), "glu_activation"),
             (dataclasses.replace(cfg, moe=dataclasses.replace(moe, layer_freq=[1, 0, 1, 1])), "layer_freq"),
             (dataclasses.replace(cfg, moe=dataclasses.replace(moe, router_pre_softmax=True)),
              "router_pre_softmax")]
    for bad, field in cases:
        with pytest.raises(ValueError, match=field):
            to_hf_config(bad)
    # layouts the experts cannot take: 4 experts over 3 EP ranks; expert TP with expert biases
    with pytest.raises(ValueError, match="expert_model_parallel_size"):
        EngineConfig(model=cfg, parallel=ParallelConfig(expert_model_parallel_size=3))
    with pytest.raises(ValueError, match="expert_tensor_parallel_size"):
        EngineConfig(model=cfg, parallel=ParallelConfig(tensor_model_parallel_size=2,
                                                         expert_tensor_parallel_size=2))


# ----------------------------------------------------------------------------------------- MXFP4
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mxfp4_dequantize_matches_transformers(dtype):
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    g = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 10, 2, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(110, 140, (3, 10, 2), generator=g, dtype=torch.uint8)
    ours = dequantize(blocks, scales, dtype)
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=dtype)  # [3, 64, 10]: transposed
    assert ours.dtype == dtype and ours.shape == (3, 10, 64)
    assert torch.equal(ours.transpose(1, 2), theirs)
    # quantize is the inverse on MXFP4 values (up to -0 vs +0), and rounds other values to them
    assert torch.equal(dequantize(*quantize(ours)), ours.float())
    w = torch.randn(5, 64, generator=g)
    assert (dequantize(*quantize(w)) - w).abs().max() <= w.abs().max() / 6
    with pytest.raises(ValueError, match="blocks"):
        dequantize(blocks, scales[..., :1])
    nan_scale = scales.clone()
    nan_scale[1, 4, 0] = 255  # E8M0's NaN code
    blocks[1, 4, 0] = 0x77  # nonzero codes (6.0)
    with pytest.raises(ValueError, match=r"experts.down_proj_scales: scale byte\(s\) \[255\]"):
        dequantize(blocks, nan_scale, dtype, name="experts.down_proj_scales")
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize(torch.randn(4, 40))


# ----------------------------------------------------------------------------------------- YaRN
@pytest.mark.parametrize("truncate", [False, True])
def test_yarn_matches_transformers(truncate, monkeypatch):
    import transformers
    from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import YarnRotaryEmbedding

    hf = M.hf_config(rope_parameters={**M.CONFIG["rope_parameters"], "truncate": truncate})
    cfg = from_hf_config(hf.to_dict())
    y = cfg.yarn
    assert y.truncate is truncate
    d = head_dim(cfg)
    if not torch.cuda.is_available():  # Megatron moves its tables to torch.cuda.current_device()
        monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")
    ours = YarnRotaryEmbedding(d, rotary_base=cfg.rotary_base, scaling_factor=y.factor,
                               original_max_position_embeddings=y.original_max_position_embeddings,
                               beta_fast=y.beta_fast, beta_slow=y.beta_slow, mscale=y.mscale,
                               mscale_all_dim=y.mscale_all_dim, correction_range_round_to_int=y.truncate,
                               use_cpu_initialization=True)
    emb, mscale = ours(48)  # [s, 1, 1, d]: both halves the d / 2 angles
    angles = emb[:, 0, 0, : d // 2]
    rope = transformers.models.gpt_oss.modeling_gpt_oss.GptOssRotaryEmbedding(hf)
    cos, sin = rope(torch.zeros(1), torch.arange(48)[None])
    assert mscale != 1.0
    assert_rel_close(angles.cos() * mscale, cos[0], 1e-6, "cos")
    assert_rel_close(angles.sin() * mscale, sin[0], 1e-6, "sin")


# ----------------------------------------------------------------------------------------- folders
@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """The dense and MXFP4 folders, a batch and the transformers eager logits for it."""
    root = tmp_path_factory.mktemp("gpt_oss")
    model = M.save_tiny_model(root / "dense", seed=7)
    M.save_mxfp4_folder(root / "dense", root / "mxfp4")
    g = torch.Generator().manual_seed(3)
    ids = [torch.randint(0, M.VOCAB, (n,), generator=g) for n in LENGTHS]
    clamped = []  # the routed experts' gate / up pre-activations beyond the limit

    def hook(module, args):
        h, idx = args[0], args[1]
        gate_up = torch.einsum("th,tkhf->tkf", h, module.gate_up_proj[idx]) + module.gate_up_proj_bias[idx]
        clamped.append(((gate_up[..., ::2] > 7).sum().item(), (gate_up[..., 1::2].abs() > 7).sum().item()))

    handles = [layer.mlp.experts.register_forward_pre_hook(hook) for layer in model.model.layers]
    with torch.no_grad():
        logits = [model(input_ids=r[None]).logits[0] for r in ids]
    for h in handles:
        h.remove()
    gates, ups = map(sum, zip(*clamped, strict=True))
    assert gates > 0 and ups > 0, f"the clamp never bites: {clamped}"
    torch.save({"ids": ids, "logits": logits}, root / "reference.pt")
    return root


def test_gpt_oss_folder_names_and_bad_shapes(saved, tmp_path):
    from mcore_engine.hf.checkpoint_io import HFCheckpointReader
    from mcore_engine.hf.folder import FolderReader, folder_format
    from mcore_engine.hf.load import check_shapes
    from mcore_engine.hf.mapping import check_hf_names, hf_shapes, hf_stream_shapes

    dense = load_file(str(saved / "dense" / "model.safetensors"))
    for folder in ("dense", "mxfp4"):
        cfg = from_hf_config(read_hf_config(saved / folder), hf_path=str(saved / folder))
        assert folder_format(saved / folder).mxfp4 == (folder == "mxfp4")
        with HFCheckpointReader(saved / folder) as raw, FolderReader(raw) as reader:
            assert sorted(reader.names()) == sorted(hf_shapes(cfg)), folder
            check_hf_names(reader.names(), cfg)
            check_shapes(reader, hf_shapes(cfg), cfg)
        # weight sync's plan: the dequantised folder's names and shapes, MXFP4 source or not
        assert hf_stream_shapes(cfg) == {n: tuple(t.shape) for n, t in dense.items()}, folder

    mx = load_file(str(saved / "mxfp4" / "model.safetensors"))
    blocks = "model.layers.1.mlp.experts.gate_up_proj_blocks"
    scales = "model.layers.2.mlp.experts.down_proj_scales"
    cases = {blocks: (mx[blocks][:, :, :1], "(4, 64, 2, 16)"), scales: (mx[scales][:, :32], "(4, 64, 1)"),
             "model.layers.0.self_attn.sinks": (torch.zeros(3), "(4,)")}
    cfg = from_hf_config(read_hf_config(saved / "mxfp4"))
    for name, (bad, expected) in cases.items():
        folder = tmp_path / name.replace(".", "_")
        folder.mkdir()
        save_file(mx | {name: bad.contiguous()}, str(folder / "model.safetensors"))
        (folder / "config.json").write_text((saved / "mxfp4" / "config.json").read_text())
        with HFCheckpointReader(folder) as raw, FolderReader(raw) as reader:
            with pytest.raises(ValueError, match=re.escape(name) + ".*expected " + re.escape(expected)):
                check_shapes(reader, hf_shapes(cfg), cfg)


# ----------------------------------------------------------------------------------------- launch
def _engine_config(folder: Path, tp: int, ep: int, pp: int, sp: bool, data_format: str,
                   attention: str) -> EngineConfig:
    model = from_hf_config(read_hf_config(folder), hf_path=str(folder), core_attention=attention)
    # the three sequences in one micro-batch: packed (thd) / padded (bshd) together
    return EngineConfig(model=model, data_format=data_format, micro_batch_size=3, parallel=ParallelConfig(
        tensor_model_parallel_size=tp, expert_model_parallel_size=ep, expert_tensor_parallel_size=1,
        pipeline_model_parallel_size=pp, sequence_parallel=sp))


def _check(rank: int, world_size: int, root: Path) -> None:
    from tensordict import TensorDict

    from mcore_engine import MegatronEngine
    from mcore_engine.hf.checkpoint_io import HFCheckpointReader
    from mcore_engine.parallel.platform import destroy_distributed
    from mcore_engine.weight_sync import unflatten_bucket

    ref = torch.load(root / "reference.pt")
    ids = ref["ids"]
    batch = TensorDict({"input_ids": torch.nested.nested_tensor(ids, layout=torch.jagged)},
                       batch_size=[len(ids)])
    batch.set_non_tensor("calculate_entropy", True)
    dense = load_file(str(root / "dense" / "model.safetensors"))
    experts_read: list[int] = []  # the experts of the fused (and MXFP4) tensors this rank read
    original_read_index = HFCheckpointReader.read_index

    def recording_read_index(self, name, shape, index):
        if ".mlp.experts." in name:
            experts_read.append(index[0])
        return original_read_index(self, name, shape, index)

    HFCheckpointReader.read_index = recording_read_index
    for folder, tp, ep, pp, sp, data_format, attention, export in LAYOUTS:
        what = f"{folder} tp={tp} ep={ep} pp={pp} sp={sp} {data_format} {attention} rank={rank}"
        experts_read.clear()
        engine = MegatronEngine(_engine_config(root / folder, tp, ep, pp, sp, data_format, attention))
        engine.initialize()
        assert set(experts_read) == ({0, 1, 2, 3} if ep == 1 else {2 * rank, 2 * rank + 1}), what

        out = engine.infer_batch(batch)
        for i, (r, logits) in enumerate(zip(ids, ref["logits"], strict=True)):
            log_p = logits.log_softmax(-1)
            want = log_p[:-1].gather(-1, r[1:, None])[:, 0]
            assert_rel_close(out["log_probs"][i][:-1], want, TOL, f"log-probs of sequence {i}, {what}")
            assert_rel_close(out["entropy"][i], -(log_p.exp() * log_p).sum(-1), TOL, f"entropy {i}, {what}")

        streamed = {n: t.clone() for n, t in engine.per_tensor_generator()}
        assert sorted(streamed) == sorted(dense), what
        for n, t in dense.items():
            assert streamed[n].dtype == t.dtype and torch.equal(streamed[n], t), f"{n} {what}"
        bucketed = {}  # the bucketed sync's plan (hf_stream_shapes) has the same names, in order
        for bucket, meta in engine.bucketed_weight_generator(1 << 16):
            bucketed.update({n: t.clone() for n, t in unflatten_bucket(bucket, meta).items()})
        assert list(bucketed) == list(streamed), what
        if export:
            engine.export_hf(root / f"export_{folder}_tp{tp}_ep{ep}_pp{pp}")
        if sp:  # the MXFP4 folder trains packed at TP=2 + SP: sinks, expert and router biases move
            _train_step(engine, what)
        del engine
        destroy_distributed()
    HFCheckpointReader.read_index = original_read_index


def _train_step(engine, what: str) -> None:
    from mcore_engine.hf.mapping import unwrap_chunk
    from tests.engine_setup import make_batch, policy_loss

    params = dict(unwrap_chunk(engine.model[0]).named_parameters())
    before = {n: p.detach().clone() for n, p in params.items()}
    out = engine.forward_backward_batch(make_batch(5, lengths=list(LENGTHS)), policy_loss)
    engine.optimizer_step()
    assert torch.isfinite(torch.as_tensor(out["loss"])), what
    for key in ("core_attention.softmax_offset", "linear_fc1.bias", "linear_fc2.bias", "router.bias",
                "linear_qkv.bias", "linear_proj.bias"):
        moved = [n for n, p in params.items() if key in n and not torch.equal(p.detach(), before[n])]
        assert moved, f"{key} did not train, {what}"


def test_gpt_oss_engine_layouts_sync_and_export(saved):
    import transformers

    run_distributed(_check, 2, saved)

    ref = torch.load(saved / "reference.pt")
    dense = load_file(str(saved / "dense" / "model.safetensors"))
    source_config = read_hf_config(saved / "dense")
    for folder, tp, ep, pp, *_, export in LAYOUTS:
        if not export:
            continue
        out = saved / f"export_{folder}_tp{tp}_ep{ep}_pp{pp}"
        exported = load_file(str(out / "model.safetensors"))
        assert sorted(exported) == sorted(dense), out.name
        for n, t in dense.items():
            assert exported[n].dtype == t.dtype and torch.equal(exported[n], t), f"{n} {out.name}"
        config = json.loads((out / "config.json").read_text())
        assert "quantization_config" not in config
        assert from_hf_config(config) == from_hf_config(source_config)
        model = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
        with torch.no_grad():
            for r, want in zip(ref["ids"], ref["logits"], strict=True):
                assert torch.equal(model(input_ids=r[None]).logits[0], want), out.name
