"""Bucketed weight sync (``mcore_engine.weight_sync``): the planner, the sender's buffer reuse, the
receiver's checks (in process), and one launch on 2 gloo ranks at TP=2 then PP=2 in which every tiny
family's ``transformers`` state dict is rebuilt bit for bit from the buckets at several bucket sizes.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mcore_engine.weight_sync import BucketMeta, fill_buckets, plan_buckets, unflatten_bucket
from tests.hf.models import FAMILIES, save_tiny_model
from tests.utils import run_distributed

LAYOUTS = ((2, 1), (1, 2))  # (tp, pp) on 2 ranks
SHAPES = {"a": (3, 4), "b": (5,), "big": (40,), "c": (2, 3), "d": (1,), "e": (7,)}


def _stream(dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    tensors = {n: torch.randn(s, generator=g).to(dtype) for n, s in SHAPES.items()}
    tensors["c"] = torch.randn(3, 2, generator=g).to(dtype).t()  # non-contiguous input
    return tensors


def test_plan_buckets_is_greedy_and_isolates_large_tensors():
    plan = plan_buckets(SHAPES, torch.float32, 80)  # 20 elements a bucket
    assert [m.names for m in plan] == [("a", "b"), ("big",), ("c", "d", "e")]
    assert [m.offsets for m in plan] == [(0, 12), (0,), (0, 6, 7)]
    assert [m.numel for m in plan] == [17, 40, 14] and plan[0].nbytes == 68
    # 32 bytes: 8 fp32 or 16 bf16 elements
    assert [m.names for m in plan_buckets(SHAPES, torch.float32, 32)] == [("a",), ("b",), ("big",),
                                                                         ("c", "d"), ("e",)]
    assert [m.names for m in plan_buckets(SHAPES, torch.bfloat16, 32)] == [("a",), ("b",), ("big",),
                                                                          ("c", "d", "e")]
    assert len(plan_buckets(SHAPES, torch.float32, 1)) == len(SHAPES)
    assert [m.names for m in plan_buckets(SHAPES, torch.float32, 10**9)] == [tuple(SHAPES)]
    for bad in (0, -8, 2.5, True, "80", None):
        with pytest.raises(ValueError, match="bucket_bytes"):
            plan_buckets(SHAPES, torch.float32, bad)
    with pytest.raises(ValueError, match="dtype"):
        plan_buckets(SHAPES, "float32", 80)


def test_plan_buckets_per_name_dtypes_never_mix_dtypes_in_a_bucket():
    """A per-name dtype (the fp32 expert bias of a bf16 stream) opens a bucket of its own dtype; the
    buckets round-trip bit for bit with one reused buffer per dtype."""
    dtypes = {n: torch.float32 if n in ("b", "d") else torch.bfloat16 for n in SHAPES}
    plan = plan_buckets(SHAPES, dtypes, 10**9)
    assert [(m.names, m.dtype) for m in plan] == [
        (("a",), torch.bfloat16), (("b",), torch.float32), (("big", "c"), torch.bfloat16),
        (("d",), torch.float32), (("e",), torch.bfloat16)]
    assert [m.names for m in plan_buckets(SHAPES, dtypes, 32)] == [("a",), ("b",), ("big",), ("c",), ("d",),
                                                                  ("e",)]
    tensors = {n: t.to(dtypes[n]) for n, t in _stream().items()}
    rebuilt = {}
    for bucket, meta in fill_buckets(tensors.items(), plan):
        assert bucket.dtype == meta.dtype
        rebuilt.update({n: v.clone() for n, v in unflatten_bucket(bucket, meta).items()})
    assert all(torch.equal(rebuilt[n], t) and rebuilt[n].dtype == t.dtype for n, t in tensors.items())
    with pytest.raises(ValueError, match="dtype.*'e'"):
        plan_buckets(SHAPES, {n: dtypes[n] for n in SHAPES if n != "e"}, 80)


def test_buckets_round_trip_with_one_reused_buffer():
    tensors = _stream()
    plan = plan_buckets(SHAPES, torch.float32, 80)
    rebuilt, storages = {}, set()
    for bucket, meta in fill_buckets(tensors.items(), plan):
        assert bucket.dim() == 1 and bucket.is_contiguous() and bucket.numel() == meta.numel
        if len(meta.names) > 1:
            storages.add(bucket.untyped_storage().data_ptr())
            assert bucket.untyped_storage().nbytes() == 17 * 4  # the largest multi-tensor bucket
        else:  # a one-tensor bucket is the tensor itself, not a copy
            assert bucket.data_ptr() == tensors[meta.names[0]].data_ptr()
        views = unflatten_bucket(bucket, meta)
        assert all(v.untyped_storage().data_ptr() == bucket.untyped_storage().data_ptr()
                   for v in views.values())
        rebuilt.update({n: v.clone() for n, v in views.items()})
    assert len(storages) == 1
    assert list(rebuilt) == list(tensors)
    assert all(torch.equal(rebuilt[n], t) for n, t in tensors.items())


def test_fill_buckets_refuses_a_stream_that_does_not_match_the_plan():
    plan = plan_buckets(SHAPES, torch.float32, 80)
    tensors = _stream()
    cases = {
        "renamed": [("x" if n == "b" else n, t) for n, t in tensors.items()],
        "reshaped": [(n, t.reshape(-1) if n == "a" else t) for n, t in tensors.items()],
        "recast": [(n, t.double() if n == "e" else t) for n, t in tensors.items()],
        "short": list(tensors.items())[:-1],
        "long": [*tensors.items(), ("f", torch.zeros(1))],
    }
    for stream in cases.values():
        with pytest.raises(ValueError, match="named_tensors"):
            list(fill_buckets(stream, plan))


def test_unflatten_bucket_refuses_a_bucket_that_does_not_match():
    meta = plan_buckets({"a": (2, 3), "b": (4,)}, torch.float32, 10**6)[0]
    bucket = torch.arange(10, dtype=torch.float32)
    views = unflatten_bucket(bucket, meta)
    assert torch.equal(views["a"], bucket[:6].view(2, 3)) and views["b"].data_ptr() == bucket[6:].data_ptr()
    bad = {"wrong dtype": bucket.double(), "too short": bucket[:9], "too long": torch.zeros(11),
           "2-D": bucket.view(2, 5), "strided": torch.zeros(20)[::2], "not a tensor": list(range(10))}
    for b in bad.values():
        with pytest.raises(ValueError, match="bucket"):
            unflatten_bucket(b, meta)
    with pytest.raises(ValueError, match="meta"):
        unflatten_bucket(bucket, {"names": ["a", "b"]})


def test_bucket_meta_refuses_inconsistent_fields():
    ok = dict(names=["a", "b"], shapes=[[2, 3], [4]], offsets=[0, 6], dtype=torch.float32, numel=10)
    meta = BucketMeta(**ok)
    assert meta.names == ("a", "b") and meta.shapes == ((2, 3), (4,)) and meta.nbytes == 40
    assert BucketMeta(**(ok | {"offsets": [2, 8], "numel": 12})).offsets == (2, 8)  # gaps allowed
    bad = {"names": {"names": ["a", "a"]}, "shapes": {"shapes": [[2, 3], [-1]]},
           "offsets": {"offsets": [0, 5]}, "numel": {"numel": 9}, "dtype": {"dtype": "float32"}}
    for field, change in bad.items():
        with pytest.raises(ValueError, match=f"meta.{field}"):
            BucketMeta(**(ok | change))
    with pytest.raises(ValueError, match="one length"):
        BucketMeta(**(ok | {"offsets": [0]}))


def test_receiver_imports_without_megatron():
    code = ("import sys; import mcore_engine.weight_sync; "
            "assert not [m for m in sys.modules if m.startswith('megatron')], 'megatron imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """The tiny checkpoints and their ``transformers`` state dicts (a tied ``lm_head.weight`` dropped:
    the export writes the shared tensor once, as ``save_pretrained`` does)."""
    root = tmp_path_factory.mktemp("weight_sync")
    expected = {}
    for i, family in enumerate(FAMILIES):
        state = save_tiny_model(family, root / family, seed=20 + i).state_dict()
        if family == "qwen2":
            assert state["lm_head.weight"].data_ptr() == state["model.embed_tokens.weight"].data_ptr()
            del state["lm_head.weight"]
        expected[family] = {n: t.clone() for n, t in state.items()}
    torch.save(expected, root / "expected.pt")
    return root


def _check_buckets(engine, expected: dict, stream: list, bucket_bytes: int, dtype, what: str) -> int:
    """Rebuild the state dict from the buckets of ``bucket_bytes``; returns the bucket count."""
    rebuilt, buffers, count = {}, set(), 0
    for bucket, meta in engine.bucketed_weight_generator(bucket_bytes, dtype=dtype):
        assert bucket.dim() == 1 and bucket.is_contiguous() and bucket.dtype == meta.dtype == dtype, what
        if len(meta.names) > 1:
            assert bucket.untyped_storage().nbytes() <= bucket_bytes, what
            buffers.add(bucket.untyped_storage().data_ptr())
        rebuilt.update({n: v.clone() for n, v in unflatten_bucket(bucket, meta).items()})
        count += 1
    assert len(buffers) <= 1, f"{what}: one reused buffer"
    assert sorted(rebuilt) == sorted(expected), what
    for n, t in expected.items():
        assert rebuilt[n].dtype == dtype and torch.equal(rebuilt[n], t.to(dtype)), f"{n} {what}"
    if dtype == torch.float32:  # the same tensors, in the same order, as per_tensor_generator
        assert list(rebuilt) == [n for n, _ in stream], what
        assert all(torch.equal(rebuilt[n], t) for n, t in stream), what
    return count


def _check_layouts(rank: int, world_size: int, root: Path) -> None:
    from mcore_engine import MegatronEngine
    from mcore_engine.config import EngineConfig, ParallelConfig
    from mcore_engine.hf import from_hf_config, read_hf_config
    from mcore_engine.parallel.platform import destroy_distributed

    expected_all = torch.load(root / "expected.pt")
    for tp, pp in LAYOUTS:
        destroy_distributed()
        for family in FAMILIES:
            what = f"{family} tp={tp} pp={pp} rank={rank}"
            folder = root / family
            model = from_hf_config(read_hf_config(folder), hf_path=str(folder))
            parallel = ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
            engine = MegatronEngine(EngineConfig(model=model, parallel=parallel, precision="fp32"))
            engine.initialize()
            expected = expected_all[family]
            stream = [(n, t.clone()) for n, t in engine.per_tensor_generator()]
            sizes = [t.nbytes for _, t in stream]
            largest, total = max(sizes), sum(sizes)
            with pytest.raises(ValueError, match="bucket_bytes"):
                engine.bucketed_weight_generator(0)
            counts = {b: _check_buckets(engine, expected, stream, b, torch.float32, f"{what} bytes={b}")
                      for b in (1, 4096, largest // 2, total + 1)}
            assert counts[1] == len(stream) and counts[total + 1] == 1, f"{what}: {counts}"
            assert 1 < counts[largest // 2] < counts[4096] <= len(stream), f"{what}: {counts}"
            _check_buckets(engine, expected, stream, largest // 2, torch.bfloat16, f"{what} bf16")


def test_buckets_rebuild_the_transformers_state_dict_at_tp2_and_pp2(saved):
    run_distributed(_check_layouts, 2, saved)
