"""Checkpoints: atomic per-rank shards; resume is bit-identical; torn or foreign checkpoints refused.

In-process: the folder protocol of ``save_shard`` / ``load_shard`` on one rank without
``torch.distributed`` (round trip, overwrite, leftovers of a crashed save, missing meta, missing or
truncated shard, other layout). Two gloo ranks (one launch): a TP=2 engine in fp32 and in bf16
(fp32 main weights in the optimizer) and a DP=2 engine with the distributed optimizer (each rank
holds a slice of the Adam state) resume bit-identically into the same and into a freshly
initialised engine (weights, Adam state, scheduler, step counters, RNG: loading restores the
process-global generators), and a torn checkpoint, one written under another layout, or one for
another model of the same shapes (``meta.json``'s config, differing fields named) is refused with
``ValueError`` on both ranks, engine untouched. A save that crashed between its two renames loads
the previous checkpoint from ``path.old`` with a warning.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from mcore_engine.checkpoint import CheckpointLayout, load_shard, save_shard
from tests.engine_setup import make_batch, policy_loss, tiny_config
from tests.utils import run_distributed

LAYOUT = CheckpointLayout(world_size=1, tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                          virtual_pipeline_model_parallel_size=None, data_parallel_size=1, precision="fp32",
                          use_distributed_optimizer=False)


def _shard() -> dict:
    return {"weights": torch.randn(5, 3), "step": 7}


def test_round_trip_and_overwrite(tmp_path):
    path = str(tmp_path / "ckpt")
    first, second = _shard(), _shard()
    save_shard(path, first, LAYOUT, step=1)
    assert torch.equal(load_shard(path, LAYOUT)["weights"], first["weights"])
    save_shard(path, second, LAYOUT, step=2)
    assert torch.equal(load_shard(path, LAYOUT)["weights"], second["weights"])
    assert sorted(os.listdir(tmp_path)) == ["ckpt"], "temporary or old folders left behind"


def test_never_deletes_a_folder_that_is_not_a_checkpoint(tmp_path):
    user = tmp_path / "results"
    user.mkdir()
    (user / "notes.txt").write_text("precious")
    with pytest.raises(ValueError, match="not an mcore-engine checkpoint"):
        save_shard(str(user), _shard(), LAYOUT, step=1)
    assert (user / "notes.txt").read_text() == "precious" and not os.path.exists(str(user) + ".tmp")


def test_crashed_save_leaves_previous_checkpoint(tmp_path):
    path = str(tmp_path / "ckpt")
    shard = _shard()
    save_shard(path, shard, LAYOUT, step=1)
    os.makedirs(path + ".tmp")  # a save that died before its rename
    torch.save({"junk": 1}, path + ".tmp/rank_00000.pt")
    assert torch.equal(load_shard(path, LAYOUT)["weights"], shard["weights"])
    save_shard(path, _shard(), LAYOUT, step=2)
    assert not os.path.exists(path + ".tmp")


def test_save_crashed_between_renames_loads_the_previous_checkpoint(tmp_path):
    path = str(tmp_path / "ckpt")
    first = _shard()
    save_shard(path, first, LAYOUT, step=1)
    save_shard(str(tmp_path / "next"), _shard(), LAYOUT, step=2)
    os.rename(path, path + ".old")                   # the first rename of a save of step 2 ...
    os.rename(str(tmp_path / "next"), path + ".tmp")  # ... its complete new folder, never renamed
    with pytest.warns(RuntimeWarning, match="interrupted between its renames"):
        assert torch.equal(load_shard(path, LAYOUT)["weights"], first["weights"])
    third = _shard()
    save_shard(path, third, LAYOUT, step=3)
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]
    assert torch.equal(load_shard(path, LAYOUT)["weights"], third["weights"])


def test_config_mismatch_is_refused_by_name(tmp_path):
    from mcore_engine.checkpoint import config_record

    record = config_record(tiny_config())
    path = str(tmp_path / "ckpt")
    save_shard(path, _shard(), LAYOUT, step=1, config=record)
    with open(os.path.join(path, "meta.json")) as f:
        assert json.load(f)["config"]["model"]["hidden_size"] == 64
    other = {"model": {**record["model"], "norm_epsilon": 1e-6, "hf_path": "/elsewhere",
                       "fused_lm_head": True},
             "parallel": {**record["parallel"], "sequence_parallel": True}}
    with pytest.raises(ValueError, match="model.norm_epsilon") as info:
        load_shard(path, LAYOUT, config=other)
    assert "hf_path" not in str(info.value) and "sequence_parallel" not in str(info.value)
    fine = {"model": {**record["model"], "hf_path": "/elsewhere", "max_sequence_length": 4096},
            "parallel": record["parallel"]}
    load_shard(path, LAYOUT, config=fine)  # fields that do not define the weights may change


def _refused(path: str, layout: CheckpointLayout, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        load_shard(path, layout)


def test_torn_or_foreign_checkpoints_are_refused(tmp_path):
    path = str(tmp_path / "ckpt")
    save_shard(path, _shard(), LAYOUT, step=1)

    torn = str(tmp_path / "no_meta")
    shutil.copytree(path, torn)
    os.remove(os.path.join(torn, "meta.json"))
    _refused(torn, LAYOUT, "torn or incomplete")

    missing = str(tmp_path / "missing_shard")
    shutil.copytree(path, missing)
    os.remove(os.path.join(missing, "rank_00000.pt"))
    _refused(missing, LAYOUT, "missing shards")

    truncated = str(tmp_path / "truncated")
    shutil.copytree(path, truncated)
    with open(os.path.join(truncated, "rank_00000.pt"), "r+b") as f:
        f.truncate(40)
    _refused(truncated, LAYOUT, "unreadable shard")

    other = CheckpointLayout(**{**LAYOUT.to_dict(), "tensor_model_parallel_size": 2, "world_size": 2})
    _refused(path, other, "tensor_model_parallel_size")
    _refused(path, CheckpointLayout(**{**LAYOUT.to_dict(), "precision": "bf16"}), "precision")
    _refused(str(tmp_path / "nothing"), LAYOUT, "not a checkpoint folder")


# ------------------------------------------------------------------ two ranks, real engines
def _snapshot(engine):
    from mcore_engine.optim import sub_optimizers

    params = [p.detach().clone() for chunk in engine.model for p in chunk.module.parameters()]
    adam = [{k: v.clone() if torch.is_tensor(v) else v for k, v in s.items()}
            for sub in sub_optimizers(engine.optimizer) for s in sub.optimizer.state.values()]
    main = [p.detach().clone() for sub in sub_optimizers(engine.optimizer)
            for g in sub.optimizer.param_groups for p in g["params"]]
    return params, adam, main, engine.global_step, engine.lr_scheduler.num_steps


def _assert_identical(a, b, what: str) -> None:
    assert len(a[0]) == len(b[0]) and all(torch.equal(x, y) for x, y in zip(a[0], b[0], strict=True)), \
        f"{what}: parameters differ"
    assert len(a[1]) == len(b[1]), f"{what}: Adam state entries differ"
    for x, y in zip(a[1], b[1], strict=True):
        assert all(torch.equal(x[k], y[k]) if torch.is_tensor(x[k]) else x[k] == y[k] for k in x), \
            f"{what}: Adam state differs"
    assert all(torch.equal(x, y) for x, y in zip(a[2], b[2], strict=True)), f"{what}: main params differ"
    assert a[3:] == b[3:], f"{what}: step counters {a[3:]} vs {b[3:]}"


def _step(engine, seed: int):
    out = engine.train_batch(make_batch(seed, 5, calculate_entropy=True, temperature=0.9), policy_loss)
    engine.lr_scheduler_step()
    return out.get_non_tensor("loss").clone(), out.get_non_tensor("metrics")["grad_norm"]


def _resume(rank: int, world_size: int, tmp: str) -> None:
    import torch.distributed as dist

    from mcore_engine.engine import MegatronEngine
    from mcore_engine.platform import destroy_distributed

    layouts = {"fp32": dict(tp=2), "bf16": dict(tp=2, precision="bf16"),
               "dp2-distributed-optimizer": dict(use_distributed_optimizer=True)}
    for name, kwargs in layouts.items():
        path = f"{tmp}/{name}"
        destroy_distributed()  # each layout gets its own process groups
        engine = MegatronEngine(tiny_config(**kwargs))
        engine.config.checkpoint_dir = path  # the default folder of save / load_checkpoint()
        engine.initialize()
        _step(engine, 1)
        engine.save_checkpoint()
        draw = torch.rand(4)
        loss, norm = _step(engine, 2)
        after = _snapshot(engine)

        engine.load_checkpoint()  # the same engine, one step further
        assert torch.equal(torch.rand(4), draw), f"{name}: RNG not restored"
        assert _step(engine, 2) == (loss, norm), f"{name}: loss / grad norm after resume"
        _assert_identical(_snapshot(engine), after, f"{name}: resume into the same engine")

        fresh = MegatronEngine(tiny_config(**kwargs, seed=99))  # other weights
        fresh.initialize()
        if name == "fp32":  # same shapes, another model: refused by name on both ranks, untouched
            fresh.config.model.rotary_base = 5000
            before = _snapshot(fresh)
            with pytest.raises(ValueError, match="model.rotary_base"):
                fresh.load_checkpoint(path)
            _assert_identical(_snapshot(fresh), before, "refused checkpoint of another model")
            fresh.config.model.rotary_base = engine.config.model.rotary_base
        fresh.load_checkpoint(path)
        assert _step(fresh, 2) == (loss, norm), f"{name}: loss / grad norm after a fresh resume"
        _assert_identical(_snapshot(fresh), after, f"{name}: resume into a fresh engine")

    # a checkpoint of another layout is refused on both ranks (the DP=2 engine, the TP=2 checkpoint)
    before = _snapshot(engine)
    with pytest.raises(ValueError, match="tensor_model_parallel_size"):
        engine.load_checkpoint(f"{tmp}/fp32")
    _assert_identical(_snapshot(engine), before, "refused checkpoint of another layout")

    # a torn copy (one rank's shard missing) is refused on both ranks
    torn = f"{tmp}/torn"
    if rank == 0:
        shutil.copytree(f"{tmp}/fp32", torn)
        os.remove(f"{torn}/rank_00001.pt")
    dist.barrier()
    destroy_distributed()
    tp2 = MegatronEngine(tiny_config(tp=2))
    tp2.initialize()
    before = _snapshot(tp2)
    with pytest.raises(ValueError, match="torn"):
        tp2.load_checkpoint(torn)
    _assert_identical(_snapshot(tp2), before, "refused torn checkpoint")


def test_resume_is_bit_identical_and_bad_checkpoints_are_refused(tmp_path):
    run_distributed(_resume, 2, str(tmp_path))
