"""Tests of mcore_engine.data: step flags, batch validation, micro-batching, thd/bshd packing.

References are built token by token with Python loops over the sequences (no shared code with the
vectorised implementation); attention-mask semantics are checked against per-sequence float64
causal attention with Megatron's ``masked_fill_(mask, -10000.0)`` convention.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch
from tensordict import TensorDict, is_non_tensor

from mcore_engine.data.flags import StepFlags, parse_step_flags
from mcore_engine.data.micro_batching import (
    balanced_partition,
    merge_micro_batches,
    restore_order,
    split_micro_batches,
)
from mcore_engine.data.packing import flatten_per_token, pack_micro_batch, unpack_per_token
from mcore_engine.data.validation import validate_batch
from tests.utils import REL_TOL, assert_rel_close

VOCAB, K = 53, 3
LENGTHS = [5, 1, 9, 3, 7, 2]  # odd lengths, including a single-token sequence


def _jag(rows: list[torch.Tensor]) -> torch.Tensor:
    return torch.nested.nested_tensor(rows, layout=torch.jagged)


def make_batch(lengths=LENGTHS, *, padded=False, seed=0, teacher=True, temperature="tensor",
               lp_dtype=torch.float32) -> tuple[TensorDict, dict[str, list[torch.Tensor]]]:
    """A batch plus its per-sequence rows (the reference). Padded batches pad on both sides."""
    g = torch.Generator().manual_seed(seed)
    rows = {
        "input_ids": [torch.randint(0, VOCAB, (n,), generator=g) for n in lengths],
        "loss_mask": [(torch.rand(n, generator=g) > 0.3).float() for n in lengths],
        "old_log_probs": [-torch.rand(n, generator=g) - 0.1 for n in lengths],
        "advantages": [torch.randn(n, 2, generator=g) + 0.5 for n in lengths],
    }
    if teacher:
        rows["teacher_ids"] = [torch.randint(0, VOCAB, (n, K), generator=g) for n in lengths]
        rows["teacher_logprobs"] = [(-torch.rand(n, K, generator=g) - 0.1).to(lp_dtype) for n in lengths]
    b = len(lengths)
    if padded:
        s = max(lengths) + 3
        left = [i % 3 for i in range(b)]
        fields = {"attention_mask": torch.zeros(b, s, dtype=torch.int64)}
        for i, n in enumerate(lengths):
            fields["attention_mask"][i, left[i]: left[i] + n] = 1
        for key, rs in rows.items():
            t = torch.full((b, s, *rs[0].shape[1:]), -7, dtype=rs[0].dtype)  # poison the padding
            for i, r in enumerate(rs):
                t[i, left[i]: left[i] + lengths[i]] = r
            fields[key] = t
    else:
        fields = {key: _jag(rs) for key, rs in rows.items()}
    td = TensorDict(fields, batch_size=[b])
    if temperature == "tensor":
        td["temperature"] = torch.rand(b, generator=g) + 0.5
    elif temperature is not None:
        td.set_non_tensor("temperature", temperature)
    td.set_non_tensor("calculate_entropy", True)
    return td, rows


def snapshot(td: TensorDict) -> dict:
    out = {}
    for k, v in td.items():
        out[k] = v.data if is_non_tensor(v) else (torch.cat(v.unbind()) if v.is_nested else v).clone()
    return out


def assert_unchanged(td: TensorDict, snap: dict) -> None:
    now = snapshot(td)
    assert now.keys() == snap.keys()
    for k in snap:
        if isinstance(snap[k], torch.Tensor):
            assert torch.equal(now[k], snap[k]), f"{k} was modified"
        else:
            assert now[k] == snap[k], f"{k} was modified"


# ------------------------------------------------------------------ flags
def test_parse_step_flags_values_and_defaults():
    td, _ = make_batch(temperature=None)
    assert parse_step_flags(td) == StepFlags(calculate_entropy=True)
    td.set_non_tensor("temperature", 1)
    td.set_non_tensor("distillation_use_topk", True)
    td.set_non_tensor("distillation_only", True)
    td.set_non_tensor("calculate_sum_pi_squared", False)
    td.set_non_tensor("use_dynamic_bsz", True)
    td.set_non_tensor("max_token_len_per_gpu", 17)
    td.set_non_tensor("micro_batch_size_per_gpu", 3)
    flags = parse_step_flags(td)
    assert flags.temperature == 1 and type(flags.temperature) is int  # unit host scalar kept as given
    assert flags.distillation_only and flags.distillation_use_topk and flags.use_dynamic_bsz
    assert (flags.max_token_len_per_gpu, flags.micro_batch_size_per_gpu) == (17, 3)
    with pytest.raises(dataclasses.FrozenInstanceError):
        flags.temperature = 2.0
    tensor_t, _ = make_batch(temperature="tensor")
    assert parse_step_flags(tensor_t).temperature is None
    assert parse_step_flags(make_batch(temperature=0.7)[0]).temperature == 0.7


def test_parse_step_flags_accepts_numpy_scalars():
    td, _ = make_batch(temperature=None)
    values = {"calculate_entropy": np.True_, "distillation_use_topk": np.bool_(True),
              "distillation_only": np.False_, "use_dynamic_bsz": np.bool_(True),
              "max_token_len_per_gpu": np.int64(17), "micro_batch_size_per_gpu": np.int32(3),
              "temperature": np.float32(0.5), "distillation_log_prob_min_clamp": np.float32(-10.0)}
    for key, value in values.items():
        td.set_non_tensor(key, value)
    flags = parse_step_flags(td)
    assert flags == StepFlags(calculate_entropy=True, distillation_use_topk=True, use_dynamic_bsz=True,
                              max_token_len_per_gpu=17, micro_batch_size_per_gpu=3, temperature=0.5,
                              distillation_log_prob_min_clamp=-10.0)
    assert type(flags.calculate_entropy) is bool and type(flags.micro_batch_size_per_gpu) is int
    assert type(flags.temperature) is float
    td.set_non_tensor("temperature", np.int64(1))
    assert type(parse_step_flags(td).temperature) is int  # a unit host scalar stays unit
    for key, value in (("calculate_entropy", np.int64(1)), ("micro_batch_size_per_gpu", np.float64(2.0)),
                       ("micro_batch_size_per_gpu", np.True_), ("temperature", np.float64("nan"))):
        td, _ = make_batch(temperature=None)
        td.set_non_tensor(key, value)
        with pytest.raises(ValueError, match=key):
            parse_step_flags(td)


@pytest.mark.parametrize("key,value", [
    ("calculate_entropy", "yes"), ("calculate_sum_pi_squared", 1), ("distillation_use_topk", "true"),
    ("use_dynamic_bsz", 0.0), ("micro_batch_size_per_gpu", 0), ("micro_batch_size_per_gpu", -2),
    ("micro_batch_size_per_gpu", 2.0), ("micro_batch_size_per_gpu", True), ("max_token_len_per_gpu", -5),
    ("temperature", 0.0), ("temperature", -1.0), ("temperature", math.nan), ("temperature", math.inf),
    ("temperature", "hot"), ("temperature", True), ("distillation_log_prob_min_clamp", math.nan),
    ("distillation_log_prob_min_clamp", "low"), ("distillation_log_prob_min_clamp", True),
])
def test_parse_step_flags_rejects_bad_values(key, value):
    td, _ = make_batch(temperature=None)
    td.set_non_tensor(key, value)
    with pytest.raises(ValueError, match=key):
        parse_step_flags(td)


def test_parse_step_flags_rejects_bad_combinations():
    td, _ = make_batch(temperature=None)
    td.set_non_tensor("distillation_only", True)
    with pytest.raises(ValueError, match="distillation_only.*distillation_use_topk"):
        parse_step_flags(td)
    td, _ = make_batch(temperature=None)
    td.set_non_tensor("use_dynamic_bsz", True)
    with pytest.raises(ValueError, match="max_token_len_per_gpu"):
        parse_step_flags(td)
    td, _ = make_batch(temperature=None)
    td["calculate_entropy"] = torch.ones(len(LENGTHS), dtype=torch.bool)  # a flag stored as a tensor
    with pytest.raises(ValueError, match="calculate_entropy"):
        parse_step_flags(td)


def test_per_sample_temperature_b_or_b1():
    """A per-sample temperature ``[B]`` or verl's ``[B, 1]`` column: the same float32 ``[B]``, the same
    packed per-token temperature, on every micro-batch; the batch is not modified."""
    from mcore_engine.data.flags import per_sample_temperature

    td, _ = make_batch()
    column = td.clone()
    column["temperature"] = td["temperature"].reshape(-1, 1).double()
    snap = snapshot(column)
    assert parse_step_flags(column).temperature is None
    flat = per_sample_temperature(column)
    assert flat.dtype == torch.float32 and flat.shape == (len(LENGTHS),)
    assert torch.equal(flat, td["temperature"])
    for data_format in ("thd", "bshd"):
        for a, b in zip(split_micro_batches(td, parse_step_flags(td), default_micro_batch_size=4)[0],
                        split_micro_batches(column, parse_step_flags(column), default_micro_batch_size=4)[0],
                        strict=True):
            want = pack_micro_batch(a, data_format=data_format, temperature=None).temperature
            got = pack_micro_batch(b, data_format=data_format, temperature=None).temperature
            assert torch.equal(got, want), data_format
    assert_unchanged(column, snap)


@pytest.mark.parametrize("value", [
    torch.zeros(len(LENGTHS)), torch.tensor([1.0, math.nan, 1, 1, 1, 1]), torch.full((len(LENGTHS), 1), -1.0),
    torch.ones(len(LENGTHS), dtype=torch.int64), torch.ones(len(LENGTHS), 2), torch.ones(len(LENGTHS), 1, 1),
], ids=["zero", "nan", "negative_column", "int", "b2", "b11"])
def test_parse_step_flags_rejects_bad_tensor_temperature(value):
    td, _ = make_batch()
    td.set("temperature", value)
    with pytest.raises(ValueError, match="temperature must be"):
        parse_step_flags(td)


# ------------------------------------------------------------------ validation
@pytest.mark.parametrize("padded", [False, True])
def test_validate_batch_accepts_good_batches(padded):
    td, _ = make_batch(padded=padded)
    snap = snapshot(td)
    validate_batch(td, vocab_size=VOCAB, max_sequence_length=max(LENGTHS), require_teacher=True)
    assert_unchanged(td, snap)
    # padding slots hold -7: ids outside the vocab there are not real tokens and are ignored.


def _bad(padded, edit):
    td, rows = make_batch(padded=padded)
    edit(td, rows)
    return td


def _set_rows(td, key, rows):
    td[key] = _jag(rows)


BAD_JAGGED = {
    "input_ids_missing": ("input_ids", lambda td, r: td.del_("input_ids")),
    "input_ids_float": ("input_ids", lambda td, r: _set_rows(
        td, "input_ids", [x.float() for x in r["input_ids"]])),
    "input_ids_negative": ("input_ids", lambda td, r: _set_rows(
        td, "input_ids", [x - 100 * (i == 2) for i, x in enumerate(r["input_ids"])])),
    "input_ids_vocab": ("input_ids", lambda td, r: _set_rows(
        td, "input_ids", [x + VOCAB for x in r["input_ids"]])),
    "input_ids_3d": ("input_ids", lambda td, r: _set_rows(td, "input_ids", r["teacher_ids"])),
    "loss_mask_len": ("loss_mask", lambda td, r: _set_rows(
        td, "loss_mask", [torch.ones(n + 1) for n in LENGTHS])),
    "old_log_probs_len": ("old_log_probs", lambda td, r: _set_rows(
        td, "old_log_probs", [torch.zeros(n + 1) for n in LENGTHS])),
    "position_ids_float": ("position_ids", lambda td, r: _set_rows(
        td, "position_ids", [torch.zeros(n) for n in LENGTHS])),
    "teacher_ids_len": ("teacher_ids", lambda td, r: _set_rows(
        td, "teacher_ids", [torch.zeros(n + 1, K, dtype=torch.int64) for n in LENGTHS])),
    "teacher_logprobs_len": ("teacher_logprobs", lambda td, r: _set_rows(
        td, "teacher_logprobs", [torch.zeros(n + 2, K) for n in LENGTHS])),
    "teacher_k": ("teacher_logprobs", lambda td, r: _set_rows(
        td, "teacher_logprobs", [torch.zeros(n, K + 1) for n in LENGTHS])),
    "teacher_logprobs_int": ("teacher_logprobs", lambda td, r: _set_rows(
        td, "teacher_logprobs", [x.long() for x in r["teacher_ids"]])),
    "teacher_ids_vocab": ("teacher_ids", lambda td, r: _set_rows(
        td, "teacher_ids", [x + VOCAB for x in r["teacher_ids"]])),
    "teacher_ids_2d": ("teacher_ids", lambda td, r: _set_rows(td, "teacher_ids", r["input_ids"])),
    "teacher_ids_missing": ("teacher_ids", lambda td, r: td.del_("teacher_ids")),
    "teacher_logprobs_missing": ("teacher_logprobs", lambda td, r: td.del_("teacher_logprobs")),
    "teacher_logprobs_nan": ("teacher_logprobs", lambda td, r: _set_rows(
        td, "teacher_logprobs", [x.index_fill(0, torch.tensor([0]), math.nan) if i == 2 else x
                                 for i, x in enumerate(r["teacher_logprobs"])])),
    "teacher_logprobs_pos_inf": ("teacher_logprobs", lambda td, r: _set_rows(
        td, "teacher_logprobs", [x.index_fill(0, torch.tensor([0]), math.inf) if i == 4 else x
                                 for i, x in enumerate(r["teacher_logprobs"])])),
    "loss_mask_nan": ("loss_mask", lambda td, r: _set_rows(
        td, "loss_mask", [x.index_fill(0, torch.tensor([0]), math.nan) for x in r["loss_mask"]])),
    "loss_mask_inf": ("loss_mask", lambda td, r: _set_rows(
        td, "loss_mask", [x.index_fill(0, torch.tensor([0]), -math.inf) for x in r["loss_mask"]])),
}


@pytest.mark.parametrize("padded", [False, True])
def test_validate_batch_accepts_neg_inf_teacher_logprobs_and_ignores_padding(padded):
    """-inf is a zero teacher probability (valid); NaN / +inf on padding slots are not real tokens."""
    td, rows = make_batch(padded=padded)
    lp = [x.index_fill(1, torch.tensor([1]), -math.inf) for x in rows["teacher_logprobs"]]
    if padded:
        dense = td["teacher_logprobs"].clone()
        dense[td["attention_mask"].bool()] = torch.cat(lp)
        dense[~td["attention_mask"].bool()] = math.nan
        td["teacher_logprobs"] = dense
    else:
        td["teacher_logprobs"] = _jag(lp)
    validate_batch(td, vocab_size=VOCAB, max_sequence_length=max(LENGTHS), require_teacher=True)
    if padded:
        dense[0, :, 0][td["attention_mask"][0].bool()] = math.inf
        with pytest.raises(ValueError, match="teacher_logprobs must not contain NaN and \\+inf"):
            validate_batch(td, vocab_size=VOCAB, max_sequence_length=max(LENGTHS), require_teacher=True)


@pytest.mark.parametrize("case", sorted(BAD_JAGGED))
def test_validate_batch_rejects_bad_jagged(case):
    key, edit = BAD_JAGGED[case]
    td = _bad(False, edit)
    with pytest.raises(ValueError, match=key):
        validate_batch(td, vocab_size=VOCAB, max_sequence_length=16, require_teacher=True)


def test_validate_batch_rejects_bad_padded_and_lengths():
    check = dict(vocab_size=VOCAB, require_teacher=False)
    td, _ = make_batch()
    with pytest.raises(ValueError, match="input_ids.*max_sequence_length=8"):
        validate_batch(td, max_sequence_length=8, **check)
    td = _bad(True, lambda td, r: td.del_("attention_mask"))
    with pytest.raises(ValueError, match="attention_mask"):
        validate_batch(td, max_sequence_length=16, **check)
    td = _bad(True, lambda td, r: td.set("attention_mask", td["attention_mask"] * 2))
    with pytest.raises(ValueError, match="attention_mask"):
        validate_batch(td, max_sequence_length=16, **check)
    td = _bad(True, lambda td, r: td["attention_mask"][1].zero_())
    with pytest.raises(ValueError, match="input_ids.*>= 1 token"):
        validate_batch(td, max_sequence_length=16, **check)
    td = _bad(True, lambda td, r: td["input_ids"].__setitem__((2, slice(None)), VOCAB))
    with pytest.raises(ValueError, match="input_ids"):
        validate_batch(td, max_sequence_length=16, **check)
    td = _bad(True, lambda td, r: td.set("loss_mask", td["loss_mask"][:, :-1]))
    with pytest.raises(ValueError, match="loss_mask"):
        validate_batch(td, max_sequence_length=16, **check)
    td = _bad(True, lambda td, r: td.set("teacher_ids", td["teacher_ids"][..., :1]))
    with pytest.raises(ValueError, match="teacher_logprobs K"):
        validate_batch(td, max_sequence_length=16, **check)
    td = _bad(False, lambda td, r: td.set("advantages", td["advantages"]))
    td.batch_size = []
    with pytest.raises(ValueError, match="batch_size"):
        validate_batch(td, max_sequence_length=16, **check)


# ------------------------------------------------------------------ packing
def _reference_layout(lengths, data_format, m):
    """Slot of token t of sequence i, the model shape, and each slot's (sequence, position)."""
    padded = [math.ceil(n / m) * m for n in lengths]
    slots, seq_of_slot, pos_of_slot = {}, [], []
    if data_format == "thd":
        start = 0
        for i, (n, p) in enumerate(zip(lengths, padded, strict=True)):
            for t in range(p):
                if t < n:
                    slots[i, t] = start + t
                seq_of_slot.append(i)
                pos_of_slot.append(t)
            start += p
        return slots, (1, start), seq_of_slot, pos_of_slot
    s = max(padded)
    for i, n in enumerate(lengths):
        for t in range(s):
            if t < n:
                slots[i, t] = i * s + t
            seq_of_slot.append(i)
            pos_of_slot.append(t)
    return slots, (len(lengths), s), seq_of_slot, pos_of_slot


@pytest.mark.parametrize("data_format", ["thd", "bshd"])
@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("m", [1, 3])
def test_pack_matches_reference_and_round_trips(data_format, padded, m):
    td, rows = make_batch(padded=padded, lp_dtype=torch.bfloat16)
    snap = snapshot(td)
    flags = parse_step_flags(td)
    x = pack_micro_batch(td, data_format=data_format, temperature=flags.temperature, pad_multiple=m,
                         thd_attention_mask=True)
    slots, shape, seq_of_slot, pos_of_slot = _reference_layout(LENGTHS, data_format, m)
    num = shape[0] * shape[1]
    ids, labels = torch.zeros(num, dtype=torch.int64), torch.zeros(num, dtype=torch.int64)
    mask = torch.zeros(num)
    temp = torch.ones(num)
    t_ids, t_lp = torch.zeros(num, K, dtype=torch.int64), torch.zeros(num, K, dtype=torch.bfloat16)
    for (i, t), slot in slots.items():
        n = LENGTHS[i]
        ids[slot] = rows["input_ids"][i][t]
        labels[slot] = rows["input_ids"][i][t + 1] if t + 1 < n else 0
        mask[slot] = rows["loss_mask"][i][t] * (t + 1 < n)
        temp[slot] = td["temperature"][i]
        t_ids[slot], t_lp[slot] = rows["teacher_ids"][i][t], rows["teacher_logprobs"][i][t]
    assert tuple(x.input_ids.shape) == shape
    assert torch.equal(x.input_ids.reshape(-1), ids) and torch.equal(x.labels.reshape(-1), labels)
    assert x.loss_mask.dtype == torch.float32 and torch.equal(x.loss_mask.reshape(-1), mask)
    assert torch.equal(x.position_ids.reshape(-1), torch.tensor(pos_of_slot))
    assert torch.equal(x.temperature.reshape(-1), temp)
    assert x.teacher_logprobs.dtype == torch.bfloat16 and x.teacher_logprobs.shape == (*shape, K)
    assert torch.equal(x.teacher_ids.reshape(-1, K), t_ids)
    assert torch.equal(x.teacher_logprobs.reshape(-1, K), t_lp)
    seq = torch.tensor(seq_of_slot)
    pos = torch.arange(num)
    if data_format == "thd":
        starts = [0] + torch.tensor([math.ceil(n / m) * m for n in LENGTHS]).cumsum(0).tolist()
        p = x.packed_seq_params
        assert p.qkv_format == "thd" and p.cu_seqlens_q.dtype == torch.int32
        for cu in (p.cu_seqlens_q, p.cu_seqlens_kv, p.cu_seqlens_q_padded, p.cu_seqlens_kv_padded):
            assert cu.tolist() == starts
        assert p.max_seqlen_q == p.max_seqlen_kv == max(math.ceil(n / m) * m for n in LENGTHS)
        blocked = (seq[:, None] != seq[None, :]) | (pos[None, :] > pos[:, None])
        assert torch.equal(x.attention_mask, blocked[None, None])
    else:
        assert x.packed_seq_params is None and x.attention_mask.dtype == torch.bool
        s = shape[1]
        for i, n in enumerate(LENGTHS):
            ref = torch.tensor([[k > q or k >= n for k in range(s)] for q in range(s)])
            assert torch.equal(x.attention_mask[i, 0], ref)
    assert x.cu_seqlens.dtype == torch.int32
    assert x.cu_seqlens.tolist() == [0, *torch.tensor(LENGTHS).cumsum(0).tolist()]

    # Round trip of a differentiable per-token output, model layout and flat [T], fp32 and bf16.
    for dtype in (torch.float32, torch.bfloat16):
        out = torch.randn(*shape, 2, dtype=dtype, requires_grad=True)
        back = unpack_per_token(out, x)
        flat_back = unpack_per_token(out.reshape(num, 2), x)
        w = torch.randn(sum(LENGTHS), 2, dtype=torch.float64)
        if padded:
            assert back.shape == (len(LENGTHS), td["input_ids"].shape[1], 2)
            keep = td["attention_mask"].bool()
            assert bool((back[~keep] == 0).all())
            got, got_flat = back[keep], flat_back[keep]
        else:
            assert back.is_nested and [r.shape[0] for r in back.unbind()] == LENGTHS
            got, got_flat = torch.cat(back.unbind()), torch.cat(flat_back.unbind())
        expected = torch.stack([out.detach().reshape(num, 2)[slots[i, t]]
                                for i, n in enumerate(LENGTHS) for t in range(n)])
        assert torch.equal(got.detach(), expected) and torch.equal(got_flat.detach(), expected)
        (got.double() * w).sum().backward()
        grad_ref = torch.zeros(num, 2, dtype=torch.float64)
        for j, slot in enumerate(slots[i, t] for i, n in enumerate(LENGTHS) for t in range(n)):
            grad_ref[slot] = w[j]
        assert_rel_close(out.grad.reshape(num, 2), grad_ref, REL_TOL[dtype], f"unpack grad {dtype}")
    ids_back = unpack_per_token(x.input_ids, x)
    if padded:
        keep = td["attention_mask"].bool()
        assert torch.equal(ids_back[keep], td["input_ids"][keep])
    else:
        assert all(torch.equal(a, b) for a, b in zip(ids_back.unbind(), rows["input_ids"], strict=True))
    assert_unchanged(td, snap)


def test_pack_scalar_temperature_and_user_positions_pass_through():
    td, rows = make_batch(temperature=1, teacher=False)
    td["position_ids"] = _jag([torch.arange(n) + 10 * i for i, n in enumerate(LENGTHS)])
    flags = parse_step_flags(td)
    x = pack_micro_batch(td, data_format="thd", temperature=flags.temperature, pad_multiple=2)
    assert x.temperature == 1 and not isinstance(x.temperature, torch.Tensor)
    assert x.teacher_ids is None and x.teacher_logprobs is None and x.attention_mask is None
    got = unpack_per_token(x.position_ids, x)
    assert all(torch.equal(r, torch.arange(n) + 10 * i) for i, (r, n) in enumerate(zip(got.unbind(), LENGTHS,
                                                                                          strict=True)))
    with pytest.raises(ValueError, match="data_format"):
        pack_micro_batch(td, data_format="sbhd", temperature=1.0)
    with pytest.raises(ValueError, match="pad_multiple"):
        pack_micro_batch(td, data_format="thd", temperature=1.0, pad_multiple=0)
    with pytest.raises(ValueError, match="temperature"):
        pack_micro_batch(td, data_format="thd", temperature=None)
    with pytest.raises(ValueError, match="t must have shape"):
        unpack_per_token(torch.zeros(3, 4), x)


@pytest.mark.parametrize("data_format", ["thd", "bshd"])
def test_attention_mask_gives_per_sequence_causal_attention(data_format):
    """Megatron convention (masked_fill(mask, -10000), softmax) on the packed layout == per-sequence
    causal attention, float64, for every real token."""
    td, _ = make_batch(teacher=False)
    x = pack_micro_batch(td, data_format=data_format, temperature=None, pad_multiple=4,
                         thd_attention_mask=True)
    n, d = sum(LENGTHS), 5
    q, k, v = (torch.randn(n, d, dtype=torch.float64) for _ in range(3))
    qs, ks, vs = (x.scatter_tokens(a).reshape(x.input_ids.shape[0], -1, d) for a in (q, k, v))
    from megatron.core.transformer.utils import attention_mask_func  # masked_fill_(mask, -10000.0)

    scores = attention_mask_func((qs @ ks.transpose(1, 2))[:, None], x.attention_mask)[:, 0]
    packed_out = unpack_per_token(torch.softmax(scores, -1) @ vs, x)
    got = torch.cat(packed_out.unbind())
    ref, start = [], 0
    for length in LENGTHS:
        sl = slice(start, start + length)
        s = (q[sl] @ k[sl].T).masked_fill(torch.ones(length, length, dtype=torch.bool).triu(1), -math.inf)
        ref.append(torch.softmax(s, -1) @ v[sl])
        start += length
    assert_rel_close(got, torch.cat(ref), 1e-12, f"{data_format} masked attention")


# ------------------------------------------------------------------ micro-batching
def test_split_by_count_and_merge():
    td, rows = make_batch()
    snap = snapshot(td)
    flags = parse_step_flags(td)
    mbs, order = split_micro_batches(td, flags, default_micro_batch_size=4)
    assert [mb.batch_size[0] for mb in mbs] == [4, 2] and order == list(range(len(LENGTHS)))
    td.set_non_tensor("micro_batch_size_per_gpu", 5)
    mbs, order = split_micro_batches(td, parse_step_flags(td), default_micro_batch_size=4)
    assert [mb.batch_size[0] for mb in mbs] == [5, 1]
    assert all(mb.get_non_tensor("calculate_entropy") is True for mb in mbs)
    td.del_("micro_batch_size_per_gpu")
    assert_unchanged(td, snap)


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("data_format", ["thd", "bshd"])
def test_dynamic_batching_budget_and_order_restoration(padded, data_format):
    g = torch.Generator().manual_seed(3)
    lengths = torch.randint(1, 12, (13,), generator=g).tolist()
    td, rows = make_batch(lengths, padded=padded, seed=4)
    td.set_non_tensor("use_dynamic_bsz", True)
    td.set_non_tensor("max_token_len_per_gpu", 17)
    snap = snapshot(td)
    mbs, order = split_micro_batches(td, parse_step_flags(td), default_micro_batch_size=2)
    assert sorted(order) == list(range(len(lengths)))
    assert len(mbs) >= math.ceil(sum(lengths) / 17)
    seen = [i for mb in mbs for i in range(mb.batch_size[0])]
    assert len(seen) == len(lengths)
    outs, temps = [], []
    for mb in mbs:
        x = pack_micro_batch(mb, data_format=data_format, temperature=None)
        assert int(x.lengths.sum()) <= 17
        # a per-token output that depends on the token, its position and its sequence's temperature
        y = x.input_ids.double() * 3 + x.position_ids + x.temperature
        outs.append(unpack_per_token(y, x))
        temps.append(mb["temperature"])
    merged = merge_micro_batches(outs, order)
    assert torch.equal(merge_micro_batches(temps, order), td["temperature"])
    for i, n in enumerate(lengths):
        ref = rows["input_ids"][i].double() * 3 + torch.arange(n) + td["temperature"][i]
        if padded:
            keep = td["attention_mask"][i].bool()
            assert torch.equal(merged[i][keep], ref) and bool((merged[i][~keep] == 0).all())
        else:
            assert torch.equal(merged.unbind()[i], ref)
    assert_unchanged(td, snap)
    assert restore_order(["c", "a", "b"], [2, 0, 1]) == ["a", "b", "c"]


def test_balanced_partition_budget_and_errors():
    g = torch.Generator().manual_seed(5)
    for budget in (9, 16, 40):
        lengths = torch.randint(1, 10, (31,), generator=g).tolist()
        groups = balanced_partition(lengths, budget)
        assert sorted(i for grp in groups for i in grp) == list(range(31))
        loads = [sum(lengths[i] for i in grp) for grp in groups]
        assert max(loads) <= budget
        assert len(groups) <= math.ceil(sum(lengths) / budget) + 2
    assert len(balanced_partition([3, 3, 3, 3], 100, min_parts=3)) == 3
    assert balanced_partition([5, 5, 4, 3, 3], 10) == [[0, 2], [1, 3, 4]] or max(
        sum([5, 5, 4, 3, 3][i] for i in grp) for grp in balanced_partition([5, 5, 4, 3, 3], 10)) <= 10
    with pytest.raises(ValueError, match="max_token_len_per_gpu"):
        balanced_partition([3, 12, 2], 10)
    with pytest.raises(ValueError, match="min_num_micro_batches"):
        balanced_partition([3, 2], 10, min_parts=3)
    td, _ = make_batch()
    td.set_non_tensor("use_dynamic_bsz", True)
    td.set_non_tensor("max_token_len_per_gpu", 8)
    with pytest.raises(ValueError, match="max_token_len_per_gpu=8"):
        split_micro_batches(td, parse_step_flags(td), default_micro_batch_size=2)
    td.set_non_tensor("max_token_len_per_gpu", 12)
    mbs, _ = split_micro_batches(td, parse_step_flags(td), default_micro_batch_size=2, pad_multiple=4)
    for mb in mbs:  # the packed thd length, padding included, stays within the budget
        x = pack_micro_batch(mb, data_format="thd", temperature=1.0, pad_multiple=4)
        assert x.input_ids.shape[1] <= 12
    with pytest.raises(ValueError, match="max_token_len_per_gpu"):  # 9 tokens pad to 12 > 11
        td.set_non_tensor("max_token_len_per_gpu", 11)
        split_micro_batches(td, parse_step_flags(td), default_micro_batch_size=2, pad_multiple=4)
    with pytest.raises(ValueError, match="pad_multiple"):
        split_micro_batches(td, parse_step_flags(td), default_micro_batch_size=2, pad_multiple=0)


# ------------------------------------------------------------------ flatten for the loss
@pytest.mark.parametrize("data_format", ["thd", "bshd"])
def test_flatten_per_token_for_loss(data_format):
    td, rows = make_batch(padded=data_format == "bshd")
    snap = snapshot(td)
    x = pack_micro_batch(td, data_format=data_format, temperature=None, pad_multiple=2)
    sample_ids = torch.tensor([11, 4, 7, 0, 2, 9])
    flat = flatten_per_token(td, x, sample_ids=sample_ids)
    num = x.input_ids.numel()
    assert flat.batch_size == torch.Size([num])
    assert set(flat.keys()) == {"loss_mask", "seq_ids", "old_log_probs", "advantages", "teacher_ids",
                                "teacher_logprobs"}
    assert flat["teacher_ids"].data_ptr() == x.teacher_ids.data_ptr()  # a view, not a copy
    assert torch.equal(flat["teacher_logprobs"], x.teacher_logprobs.reshape(num, K))
    assert torch.equal(flat["loss_mask"], x.loss_mask.reshape(-1))
    slots, _, seq_of_slot, _ = _reference_layout(LENGTHS, data_format, 2)
    assert torch.equal(flat["seq_ids"], sample_ids[torch.tensor(seq_of_slot)])
    ref_lp, ref_adv = torch.zeros(num), torch.zeros(num, 2)
    for (i, t), slot in slots.items():
        ref_lp[slot], ref_adv[slot] = rows["old_log_probs"][i][t], rows["advantages"][i][t]
    assert torch.equal(flat["old_log_probs"], ref_lp) and torch.equal(flat["advantages"], ref_adv)
    with pytest.raises(ValueError, match="sample_ids"):
        flatten_per_token(td, x, sample_ids=torch.arange(2))
    assert_unchanged(td, snap)


# ------------------------------------------------------------------ verl's dense response mask
PROMPTS, RESPONSES = [3, 1, 5, 2], [2, 4, 1, 3]


def verl_batch(*, lengths_from="attention_mask", as_loss_mask=False, prompts=PROMPTS,
               responses=RESPONSES) -> tuple[TensorDict, list[torch.Tensor]]:
    """verl's no-padding layout: jagged input_ids of ``p_i + r_i`` tokens, dense ``response_mask
    [B, R]`` (right-padded, an interior zero), dense per-sample fields, the response lengths from the
    left-right padded ``attention_mask [B, P + R]`` (or none); plus the reference
    output-aligned loss mask per sequence (a loop: response token c is predicted at p_i - 1 + c)."""
    g = torch.Generator().manual_seed(3)
    b, width_p, width_r = len(prompts), max(prompts), max(responses)
    lengths = [p + r for p, r in zip(prompts, responses, strict=True)]
    mask = torch.zeros(b, width_r, dtype=torch.int64)
    attention = torch.zeros(b, width_p + width_r, dtype=torch.int64)
    for i, (p, r) in enumerate(zip(prompts, responses, strict=True)):
        mask[i, :r] = 1
        attention[i, width_p - p: width_p + r] = 1
    mask[1, 2] = 0
    refs = []
    for i, (p, r) in enumerate(zip(prompts, responses, strict=True)):
        ref = torch.zeros(p + r)
        for c in range(r):
            ref[p - 1 + c] = float(mask[i, c])
        refs.append(ref)
    fields = {"input_ids": _jag([torch.randint(0, VOCAB, (n,), generator=g) for n in lengths]),
              "response_mask": mask, "old_log_probs": torch.randn(b, width_r, generator=g),
              "prompts": torch.randint(0, VOCAB, (b, width_p), generator=g)}
    if lengths_from == "attention_mask":
        fields["attention_mask"] = attention
    if as_loss_mask:
        fields["loss_mask"] = mask  # verl: data["loss_mask"] = data["response_mask"]
    td = TensorDict(fields, batch_size=[b])
    td.set_non_tensor("batch_num_tokens", 9)
    return td, refs


@pytest.mark.parametrize("as_loss_mask", [False, True])
def test_dense_response_mask_gives_the_next_token_loss_mask(as_loss_mask):
    from mcore_engine.data.layout import loss_mask_values

    td, refs = verl_batch(as_loss_mask=as_loss_mask)
    validate_batch(td, vocab_size=VOCAB, max_sequence_length=64, require_teacher=False)
    assert torch.equal(loss_mask_values(td), torch.cat(refs))
    per_token = TensorDict({"input_ids": td["input_ids"], "loss_mask": _jag(refs)}, batch_size=td.batch_size)
    for fmt in ("thd", "bshd"):
        got = pack_micro_batch(td, data_format=fmt, temperature=1.0, pad_multiple=2)
        want = pack_micro_batch(per_token, data_format=fmt, temperature=1.0, pad_multiple=2)
        assert torch.equal(got.loss_mask, want.loss_mask), fmt
    # dense per-sample fields and non-tensor entries ride along in the micro-batches untouched
    mbs, order = split_micro_batches(td, StepFlags(micro_batch_size_per_gpu=3), default_micro_batch_size=1)
    assert order == [0, 1, 2, 3]
    assert torch.equal(torch.cat([mb["old_log_probs"] for mb in mbs]), td["old_log_probs"])
    assert torch.equal(mbs[1]["prompts"], td["prompts"][3:])
    assert mbs[1].get_non_tensor("batch_num_tokens") == 9


def test_dense_response_mask_errors_name_the_keys():
    def refused(td, match):
        with pytest.raises(ValueError, match=match):
            validate_batch(td, vocab_size=VOCAB, max_sequence_length=64, require_teacher=False)

    td, _ = verl_batch(as_loss_mask=True)
    td["response_mask"] = torch.ones(len(PROMPTS), max(RESPONSES) + 1)
    refused(td, r"loss_mask \(4, 4\) and response_mask \(4, 5\)")
    refused(verl_batch(lengths_from=None)[0], "response_mask .*attention_mask")
    td, _ = verl_batch()
    td["attention_mask"][0, -1] = 1  # one more response token than input_ids holds
    refused(td, "attention_mask")
    td, _ = verl_batch(prompts=[2, 0, 1], responses=[2, 3, 1])
    refused(td, "response_mask: sequence 1 has 3 response tokens of 3")  # no prompt token left
    td, _ = verl_batch()
    td["response_mask"] = td["response_mask"].float()
    td["response_mask"][1, 3] = math.nan  # a real response token
    refused(td, "response_mask must not contain NaN")
    td["response_mask"][1, 3], td["response_mask"][2, 3] = 1.0, math.nan  # padding column: ignored
    validate_batch(td, vocab_size=VOCAB, max_sequence_length=64, require_teacher=False)
    td, _ = verl_batch()
    td["response_mask"] = torch.ones(len(PROMPTS), 2, 2)
    refused(td, "response_mask must be a jagged nested tensor like input_ids .* or a dense response mask")
    padded, _ = make_batch(padded=True)
    del padded["loss_mask"]
    padded["response_mask"] = torch.ones(len(LENGTHS), 2)
    refused(padded, "response_mask .* only beside jagged input_ids")
