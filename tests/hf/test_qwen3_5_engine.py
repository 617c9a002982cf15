"""Qwen3.5 / Qwen3.5-MoE / Qwen3-Next folders through the engine (2 gloo ranks, one launch): import at
TP=2 (and a fused-expert vision-language folder at EP=2, Qwen3-Next at PP=2), logits and
``infer_batch`` log-probs against ``transformers``' pure-torch path one sequence at a time (fp32, rel
1e-4; GDN chunks of 8 tokens, so sequences span several chunks, and a sequence of one token),
``per_tensor_generator`` yielding the folder's own names and tensors (``model.language_model.*``, fused
experts; no vision tower), and ``export_hf`` -> a folder equal to the source (vision tower and all)
that ``from_pretrained`` loads to the same logits.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from mcore_engine.config import EngineConfig, ParallelConfig
from mcore_engine.hf.hf_config import from_hf_config, read_hf_config
from tests.hf import qwen3_5_models as M
from tests.utils import assert_rel_close, run_distributed

TOL = 1e-4
LENGTHS = (13, 21, 1)
# folder -> (kind, fused experts, layouts (tp, ep, pp, mtp_num_layers)); the vision-language and
# Qwen3-Next folders carry an mtp.* module as the Hub's do (kept out, or loaded with mtp_num_layers=1)
FOLDERS = {"qwen3_5": ("qwen3_5", False, [(2, 1, 1, 0)]),
           "qwen3_5_moe": ("qwen3_5_moe", False, [(2, 1, 1, 0)]),
           "qwen3_next": ("qwen3_next", False, [(2, 1, 1, 0), (1, 1, 2, 0)]),
           "qwen3_5_vl": ("qwen3_5_vl", False, [(2, 1, 1, 0), (2, 1, 1, 1)]),
           "qwen3_5_moe_vl": ("qwen3_5_moe_vl", True, [(2, 1, 1, 0), (1, 2, 1, 1)])}
WITH_MTP = ("qwen3_next", "qwen3_5_vl", "qwen3_5_moe_vl")


def _load(path: Path) -> dict[str, torch.Tensor]:
    return load_file(str(path / "model.safetensors"))


def _hf_logits(model, ids: list[torch.Tensor]) -> list[torch.Tensor]:
    with torch.no_grad():
        return [model(input_ids=r[None]).logits[0] for r in ids]


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("qwen3_5_engine")
    g = torch.Generator().manual_seed(5)
    ids = [torch.randint(0, M.VOCAB, (n,), generator=g) for n in LENGTHS]
    logits = {}
    for i, (folder, (kind, fused, _)) in enumerate(FOLDERS.items()):
        M.save_tiny_model(kind, root / folder, seed=30 + i, fused_experts=fused, mtp=folder in WITH_MTP)
        model = M.model_class(kind).from_pretrained(root / folder).eval()
        logits[folder] = _hf_logits(model, ids)
    torch.save({"ids": ids, "logits": logits}, root / "reference.pt")
    return root


def _engine_config(folder: Path, tp: int, ep: int, pp: int, mtp: int) -> EngineConfig:
    # the language model alone (vision=None): these folders' towers stay out (tests/hf/test_vlm_hf.py)
    model = from_hf_config(read_hf_config(folder), hf_path=str(folder), mtp_num_layers=mtp, vision=None)
    gdn = dataclasses.replace(model.linear_attention, chunk_size=8)
    model = dataclasses.replace(model, linear_attention=gdn)
    return EngineConfig(model=model, parallel=ParallelConfig(tensor_model_parallel_size=tp,
                                                             expert_model_parallel_size=ep,
                                                             pipeline_model_parallel_size=pp))


def _check(rank: int, world_size: int, root: Path) -> None:
    from tensordict import TensorDict

    from mcore_engine import MegatronEngine
    from mcore_engine.hf.checkpoint_io import HFCheckpointReader
    from mcore_engine.hf.mapping import unwrap_chunk
    from mcore_engine.parallel.platform import destroy_distributed
    from mcore_engine.weight_sync import unflatten_bucket

    ref = torch.load(root / "reference.pt")
    ids = ref["ids"]
    batch = TensorDict({"input_ids": torch.nested.nested_tensor(ids, layout=torch.jagged),
                        "loss_mask": torch.nested.nested_tensor([torch.ones_like(r) for r in ids],
                                                                layout=torch.jagged)},
                       batch_size=[len(ids)])
    experts_read: list[int] = []  # experts read from fused 3-D tensors: HFCheckpointReader.read_index
    original_read_index = HFCheckpointReader.read_index

    def recording_read_index(self, name, shape, index):
        experts_read.append(index[0])
        return original_read_index(self, name, shape, index)

    HFCheckpointReader.read_index = recording_read_index
    for folder, (_, fused, layouts) in FOLDERS.items():
        source = _load(root / folder)
        for tp, ep, pp, mtp in layouts:
            what = f"{folder} tp={tp} ep={ep} pp={pp} mtp={mtp} rank={rank}"
            experts_read.clear()
            engine = MegatronEngine(_engine_config(root / folder, tp, ep, pp, mtp))
            engine.initialize()
            if fused:  # each rank read only its own experts' slices (EP) of the fused tensors
                assert set(experts_read) == ({0, 1, 2, 3} if ep == 1 else {2 * rank, 2 * rank + 1}), what
            if mtp:  # the module's parameters hold the folder's mtp.* tensors
                assert any(n.startswith("mtp.") for n, _ in unwrap_chunk(engine.model[-1]).named_parameters())
            out = engine.infer_batch(batch)
            for i, (r, logits) in enumerate(zip(ids, ref["logits"][folder], strict=True)):
                want = logits[:-1].log_softmax(-1).gather(-1, r[1:, None])[:, 0]
                assert_rel_close(out["log_probs"][i][:-1], want, TOL, f"log-probs of sequence {i}, {what}")
            if tp == 2:  # full logits of the first sequence
                import torch.distributed as dist
                from megatron.core import parallel_state as ps

                model = unwrap_chunk(engine.model[0]).eval()
                with torch.no_grad():
                    r = ids[0][None]
                    local = model(r, torch.arange(r.shape[1])[None], None)
                parts = [torch.empty_like(local) for _ in range(tp)]
                dist.all_gather(parts, local.contiguous(), group=ps.get_tensor_model_parallel_group())
                assert_rel_close(torch.cat(parts, -1)[0, :, :M.VOCAB], ref["logits"][folder][0], TOL,
                                 f"logits {what}")
            streamed = {n: t.clone() for n, t in engine.per_tensor_generator()}
            kept_out = ("model.visual.",) if mtp else ("model.visual.", "mtp.")
            language = {n: t for n, t in source.items() if not n.startswith(kept_out)}
            assert sorted(streamed) == sorted(language), what
            for n, t in language.items():
                assert streamed[n].dtype == t.dtype and torch.equal(streamed[n], t), f"{n} {what}"
            bucketed = {}  # the bucketed sync's plan (hf_stream_shapes) has the same names, in order
            for bucket, meta in engine.bucketed_weight_generator(1 << 16):
                bucketed.update({n: t.clone() for n, t in unflatten_bucket(bucket, meta).items()})
            assert list(bucketed) == list(streamed), what
            assert all(torch.equal(bucketed[n], t) for n, t in streamed.items()), what
            engine.export_hf(root / f"export_{folder}_tp{tp}_ep{ep}_pp{pp}_mtp{mtp}")
            del engine
            destroy_distributed()
    HFCheckpointReader.read_index = original_read_index


@pytest.mark.slow  # nine engine builds on 2 ranks
def test_qwen3_5_import_log_probs_sync_and_export(saved):
    run_distributed(_check, 2, saved)

    ref = torch.load(saved / "reference.pt")
    for folder, (kind, _, layouts) in FOLDERS.items():
        source, source_config = _load(saved / folder), read_hf_config(saved / folder)
        for tp, ep, pp, mtp in layouts:
            out = saved / f"export_{folder}_tp{tp}_ep{ep}_pp{pp}_mtp{mtp}"
            exported = _load(out)
            assert sorted(exported) == sorted(source), out.name
            for n, t in source.items():
                assert exported[n].dtype == t.dtype and torch.equal(exported[n], t), f"{n} {out.name}"
            config = json.loads((out / "config.json").read_text())
            assert from_hf_config(config) == from_hf_config(source_config)
            assert {k: v for k, v in config.items() if k != "torch_dtype"} == source_config, out.name
            assert config["architectures"] == source_config["architectures"]
        tp, ep, pp, mtp = layouts[-1]
        model = M.model_class(kind).from_pretrained(saved / f"export_{folder}_tp{tp}_ep{ep}_pp{pp}_mtp{mtp}")
        for got, want in zip(_hf_logits(model.eval(), ref["ids"]), ref["logits"][folder], strict=True):
            assert torch.equal(got, want), folder
