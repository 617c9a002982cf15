"""process_lm_head_logits: every flag combination vs the float64 reference (1 and 2 gloo ranks), and
the upstream contracts (distillation_only skips log-probs, unit temperature passes the same object,
non-unit scaling is out of place, inputs stay bit-identical)."""

from __future__ import annotations

import itertools
import re
from unittest import mock

import pytest
import torch
import torch.distributed as dist

import mcore_engine.processor as processor
from mcore_engine.ops import stats as ops_stats
from mcore_engine.ops import vocab_parallel_entropy
from mcore_engine.processor import process_lm_head_hidden, process_lm_head_logits
from tests.ops import cases
from tests.ops.cases import Case, case_inputs, shard_of, weighted_sum
from tests.reference import reference_logits_outputs
from tests.utils import REL_TOL, assert_rel_close, rel_err, run_distributed

# (calculate_sum_pi_squared, calculate_entropy, distillation_use_topk, distillation_only), all valid.
COMBOS = [c for c in itertools.product((False, True), repeat=4) if not (c[3] and not c[2])]
TEMPERATURES = ("1", "0.7", "0d", "tok")


def _group(world: int):
    return dist.group.WORLD if world > 1 else None


def _check_combos(rank: int, world: int) -> None:
    for dtype, (i, (s2, ent, topk, only)) in itertools.product((torch.float32, torch.bfloat16),
                                                                enumerate(COMBOS)):
        case = Case(100 + i, ((7,), (1, 9), (2, 4))[i % 3], 17 + i % 4, dtype, pad=3 * (i % 2),
                    temperature=TEMPERATURES[i % 4], k=2 + i % 3, chunk_size=(None, 2, 3)[i % 3])
        inp = case_inputs(case, world)
        batch = {"teacher_ids": inp["teacher_ids"], "teacher_logprobs": inp["teacher_log_probs"]}
        if world == 1 and i % 2:  # a TensorDict batch (imported here: spawned ranks skip its import cost)
            from tensordict import TensorDict

            batch = TensorDict(batch, batch_size=case.lead)
        x = shard_of(inp["full"], rank, case.v_local)
        out = process_lm_head_logits(
            x, inp["labels"], inp["temperature"], calculate_sum_pi_squared=s2, calculate_entropy=ent,
            distillation_use_topk=topk, distillation_only=only, batch=batch, vocab_size=inp["vocab_size"],
            group=_group(world), chunk_size=case.chunk_size)
        full64 = inp["full"].double().requires_grad_()
        ref = reference_logits_outputs(
            full64, labels=None if only else inp["labels"], entropy=ent, sum_pi_squared=s2,
            teacher_ids=inp["teacher_ids"] if topk else None, teacher_log_probs=inp["teacher_log_probs"],
            temperature=inp["temperature"], vocab_size=inp["vocab_size"])
        name = f"combo {(s2, ent, topk, only)} {dtype} rank {rank}/{world}"
        assert set(out) == set(ref), (name, set(out), set(ref))
        tol = REL_TOL[dtype]
        for key in ref:
            assert_rel_close(out[key], ref[key], tol, f"{name} {key}")
        weighted_sum(out, inp["weights"]).backward()
        (g64,) = torch.autograd.grad(weighted_sum(ref, inp["weights"]), full64)
        assert_rel_close(x.grad, g64[..., rank * case.v_local:(rank + 1) * case.v_local], tol, f"{name} grad")


def _check_custom_func(rank: int, world: int) -> None:
    """A custom logits_processor_func gets the scaled shard; the fused outputs come alongside."""
    case = Case(7, (2, 5), 13, temperature="tok")
    inp = case_inputs(case, world)
    x = shard_of(inp["full"], rank, case.v_local)

    def func(student_logits, data, data_format):
        assert data_format == "bshd" and data is batch
        return {"custom_entropy": vocab_parallel_entropy(student_logits, group=_group(world))}

    batch = {"anything": torch.zeros(1)}
    out = process_lm_head_logits(x, inp["labels"], inp["temperature"], calculate_sum_pi_squared=False,
                                 calculate_entropy=True, distillation_use_topk=True, distillation_only=False,
                                 logits_processor_func=func, batch=batch, data_format="bshd",
                                 group=_group(world))
    assert set(out) == {"log_probs", "entropy", "custom_entropy"}
    full64 = inp["full"].double().requires_grad_()
    ref = reference_logits_outputs(full64, labels=inp["labels"], entropy=True, temperature=inp["temperature"])
    assert_rel_close(out["custom_entropy"], ref["entropy"], 1e-5, "custom func entropy")
    assert_rel_close(out["log_probs"], ref["log_probs"], 1e-5, "log_probs beside a custom func")
    w = inp["weights"]["entropy"]
    (out["custom_entropy"].double() * w).sum().backward()
    (g64,) = torch.autograd.grad((ref["entropy"] * w).sum(), full64)
    assert_rel_close(x.grad, g64[..., rank * case.v_local:(rank + 1) * case.v_local], 1e-5, "custom grad")


def check_hard_case(rank: int, world: int, case: cases.HardCase, dtype: torch.dtype, seed: int) -> None:
    """Everything in one call on a ``cases.HardCase`` (no kl_tail in the processor), and distillation_only."""
    group = _group(world)
    inp = cases.hard_case_inputs(case, world, dtype, seed)
    ref = cases.HardReference(case, inp, dtype)
    g = torch.Generator().manual_seed(seed + 1)
    ups = {k: torch.randn(*cases.HARD_LEAD, generator=g) for k in ("log_probs", "entropy", "sum_pi_squared",
                                                            "distillation_losses")}
    x = shard_of(inp["full"], rank, cases.HARD_V_LOCAL)
    batch = {"teacher_ids": inp["tids"], "teacher_logprobs": inp["tlp"]}
    kw = dict(batch=batch, vocab_size=inp["vocab"], group=group, chunk_size=case.chunk,
              log_prob_min_clamp=inp["clamp"])
    out = process_lm_head_logits(x, inp["labels"], inp["temp"], calculate_sum_pi_squared=True,
                                 calculate_entropy=True, distillation_use_topk=True, distillation_only=False,
                                 **kw)
    assert set(out) == {"log_probs", "entropy", "sum_pi_squared", "distillation_losses",
                        "student_mass", "teacher_mass"}, set(out)
    for key in out:
        ref.check(f"proc.{key}", out[key], key)
    (gx,) = torch.autograd.grad(sum((out[k] * u).sum() for k, u in ups.items()), x)
    ref.check_grad("proc.grad", gx, ups, slice(rank * cases.HARD_V_LOCAL, (rank + 1) * cases.HARD_V_LOCAL))
    # distillation_only: no log_probs, label not even needed
    out = process_lm_head_logits(x, None, inp["temp"], calculate_sum_pi_squared=False,
                                 calculate_entropy=False, distillation_use_topk=True, distillation_only=True,
                                 **kw)
    assert set(out) == {"distillation_losses", "student_mass", "teacher_mass"}
    ref.check("proc_donly.kl", out["distillation_losses"], "distillation_losses")


def check_zero_tokens(rank: int, world: int) -> None:
    """Zero tokens: every output empty fp32 of the token shape, backward works."""
    for lead in ((0,), (2, 0)):
        x = torch.randn(*lead, cases.HARD_V_LOCAL, requires_grad=True)
        batch = {"teacher_ids": torch.zeros(lead + (cases.HARD_K,), dtype=torch.int64),
                 "teacher_logprobs": torch.zeros(lead + (cases.HARD_K,))}
        out = process_lm_head_logits(x, torch.zeros(lead, dtype=torch.int64), 1.0,
                                     calculate_sum_pi_squared=True, calculate_entropy=True,
                                     distillation_use_topk=True, distillation_only=False, batch=batch,
                                     group=_group(world))
        assert len(out) == 6 and all(o.shape == lead and o.dtype == torch.float32 for o in out.values())
        (gx,) = torch.autograd.grad(sum(o.sum() for o in out.values() if o.requires_grad), x)
        assert gx.shape == x.shape


def _run_all(rank: int, world: int) -> None:
    _check_combos(rank, world)
    _check_custom_func(rank, world)
    check_zero_tokens(rank, world)
    if world > 1:
        for dtype in (torch.float32, torch.bfloat16):
            for ci, case in enumerate(cases.HARD_CASES):
                if not case.tail:
                    check_hard_case(rank, world, case, dtype, seed=7 + 100 * ci)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("ci", [i for i, c in enumerate(cases.HARD_CASES) if not c.tail],
                         ids=[c.name for c in cases.HARD_CASES if not c.tail])
def test_hard_case_one_shard(ci: int, dtype: torch.dtype) -> None:
    check_hard_case(0, 1, cases.HARD_CASES[ci], dtype, seed=100 * ci)


def test_flag_combinations_one_shard() -> None:
    _run_all(0, 1)


def test_flag_combinations_two_ranks() -> None:
    run_distributed(_run_all, 2)


def _small():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 11, generator=g)
    labels = torch.randint(0, 11, (6,), generator=g)
    batch = {"teacher_ids": torch.rand(6, 11, generator=g).argsort(-1)[:, :3],
             "teacher_logprobs": torch.randn(6, 3, generator=g).log_softmax(-1) - 0.2}
    return logits, labels, batch


def test_distillation_only_never_starts_the_log_prob_path() -> None:
    logits, labels, batch = _small()
    logits.requires_grad_()
    flags = dict(calculate_sum_pi_squared=True, calculate_entropy=True, distillation_use_topk=True)
    returned = []

    real = processor._builtin_inputs

    def inputs_spy(*args, **kwargs):
        returned.append(real(*args, **kwargs)["labels"])
        return real(*args, **kwargs)

    never = mock.Mock(side_effect=AssertionError("log-prob path entered"))
    with mock.patch.object(ops_stats, "label_shifted_logit", never), \
            mock.patch.object(processor, "_builtin_inputs", inputs_spy):
        out = process_lm_head_logits(logits, labels, 0.7, distillation_only=True, batch=batch, **flags)
        sum(o.sum() for o in out.values() if o.requires_grad).backward()
    assert never.call_count == 0 and "log_probs" not in out and returned == [None]
    assert set(out) == {"entropy", "sum_pi_squared", "distillation_losses", "student_mass", "teacher_mass"}
    # Positive control: the same spy fires when log-probs are wanted.
    with mock.patch.object(ops_stats, "label_shifted_logit", wraps=ops_stats.label_shifted_logit) as lp:
        out = process_lm_head_logits(logits, labels, 0.7, distillation_only=False, batch=batch, **flags)
    assert lp.call_count > 0 and "log_probs" in out


def test_unit_temperature_hands_the_same_object_and_grads_reach_the_view_base() -> None:
    base = torch.randn(1, 6, 11, requires_grad=True)
    logits = base.squeeze(0)
    seen = []

    def func(student_logits, data, data_format):
        seen.append(student_logits)
        return {"custom": student_logits.sum(-1)}

    out = process_lm_head_logits(logits, None, 1.0, calculate_sum_pi_squared=False, calculate_entropy=False,
                                 distillation_use_topk=True, distillation_only=True,
                                 logits_processor_func=func, batch={})
    assert seen[0] is logits and set(out) == {"custom"}
    out["custom"].sum().backward()
    assert torch.equal(base.grad, torch.ones_like(base))


def test_non_unit_temperature_is_out_of_place_with_the_right_gradient() -> None:
    base = torch.randn(1, 6, 11, requires_grad=True)
    logits = base.squeeze(0)
    before, version = logits.detach().clone(), logits._version
    seen = []

    def func(student_logits, data, data_format):
        seen.append(student_logits)
        return {"custom": student_logits.sum(-1)}

    out = process_lm_head_logits(logits, None, 0.5, calculate_sum_pi_squared=False, calculate_entropy=False,
                                 distillation_use_topk=True, distillation_only=True,
                                 logits_processor_func=func, batch={})
    assert seen[0] is not logits and torch.equal(seen[0], logits * 2)
    out["custom"].sum().backward()
    assert torch.equal(base.grad, torch.full_like(base, 2.0))
    assert torch.equal(logits, before) and logits._version == version


@pytest.mark.parametrize("temperature", [1.0, 0.7, "0d", "tok"])
def test_logits_and_temperature_are_bit_identical_after_the_call(temperature) -> None:
    logits, labels, batch = _small()
    logits = logits.to(torch.bfloat16).requires_grad_()
    t = {"0d": torch.tensor(0.8), "tok": torch.rand(6) + 0.5}.get(temperature, temperature)
    snapshot = [logits.detach().clone(), t.clone() if torch.is_tensor(t) else t, labels.clone(),
                batch["teacher_ids"].clone(), batch["teacher_logprobs"].clone()]
    versions = [a._version for a in (logits, labels, batch["teacher_ids"], batch["teacher_logprobs"])]
    out = process_lm_head_logits(logits, labels, t, calculate_sum_pi_squared=True, calculate_entropy=True,
                                 distillation_use_topk=True, distillation_only=False, batch=batch)
    sum(o.sum() for o in out.values() if o.requires_grad).backward()
    after = [logits, t, labels, batch["teacher_ids"], batch["teacher_logprobs"]]
    for a, b in zip(after, snapshot, strict=True):
        assert torch.equal(torch.as_tensor(a), torch.as_tensor(b))
    assert [a._version for a in (logits, labels, batch["teacher_ids"], batch["teacher_logprobs"])] == versions
    if torch.is_tensor(t):
        assert t._version == 0


@pytest.mark.parametrize("name, kwargs", [
    ("distillation_use_topk", dict(distillation_use_topk=False, distillation_only=True)),
    ("teacher_ids", dict(distillation_use_topk=True, distillation_only=False, batch={})),
    ("teacher_ids", dict(distillation_use_topk=True, distillation_only=False, batch=None)),
    ("label", dict(distillation_use_topk=False, distillation_only=False, label=None)),
    ("temperature", dict(distillation_use_topk=False, distillation_only=False, temperature=0.0)),
])
def test_processor_bad_input(name: str, kwargs: dict) -> None:
    logits, labels, _ = _small()
    args = dict(label=labels, temperature=1.0, calculate_sum_pi_squared=False, calculate_entropy=True)
    args.update(kwargs)
    with pytest.raises(ValueError, match=name):
        process_lm_head_logits(logits, args.pop("label"), args.pop("temperature"), **args)


def test_process_lm_head_hidden_matches_processor_on_logits():
    g = torch.Generator().manual_seed(7)
    n, h_dim, v, k = 19, 10, 33, 3
    hidden, weight = torch.randn(n, h_dim, generator=g), torch.randn(v, h_dim, generator=g)
    label = torch.randint(0, v, (n,), generator=g)
    batch = {"teacher_ids": torch.rand(n, v, generator=g).argsort(-1)[:, :k],
             "teacher_logprobs": torch.randn(n, k, generator=g).log_softmax(-1) - 0.1}
    for flags in (dict(calculate_sum_pi_squared=True, calculate_entropy=False, distillation_use_topk=True,
                       distillation_only=False),
                  dict(calculate_sum_pi_squared=False, calculate_entropy=True, distillation_use_topk=True,
                       distillation_only=True),
                  dict(calculate_sum_pi_squared=False, calculate_entropy=True, distillation_use_topk=False,
                       distillation_only=False)):
        fused = process_lm_head_hidden(hidden, weight, label, 0.7, **flags, batch=batch, chunk_size=4)
        ref = process_lm_head_logits(hidden @ weight.T, label, 0.7, **flags, batch=batch)
        assert set(fused) == set(ref), flags
        assert ("log_probs" in fused) != flags["distillation_only"]
        for key in ref:
            assert_rel_close(fused[key], ref[key], REL_TOL[torch.float32], f"{flags} {key}")
    off = dict(calculate_sum_pi_squared=False, calculate_entropy=False)
    with pytest.raises(ValueError, match="logits_processor_func"):
        process_lm_head_hidden(hidden, weight, label, 1.0, **off, distillation_use_topk=True,
                               distillation_only=False, logits_processor_func=lambda **kw: {})
    with pytest.raises(ValueError, match="distillation_only"):
        process_lm_head_hidden(hidden, weight, label, 1.0, **off, distillation_use_topk=False,
                               distillation_only=True)


@pytest.mark.parametrize("path", ["logits", "hidden"])
@pytest.mark.parametrize("bad, name", [("ids_list", 'batch["teacher_ids"]'),
                                       ("ids_float", 'batch["teacher_ids"]'),
                                       ("lp_list", 'batch["teacher_logprobs"]')])
def test_teacher_tensors_of_the_wrong_type_name_the_batch_key(path: str, bad: str, name: str) -> None:
    """Both processors refuse a teacher list / float ids with a ValueError naming the batch key."""
    g = torch.Generator().manual_seed(9)
    hidden, weight = torch.randn(6, 5, generator=g), torch.randn(11, 5, generator=g)
    labels = torch.randint(0, 11, (6,), generator=g)
    ids, lp = torch.randint(0, 11, (6, 3), generator=g), torch.randn(6, 3, generator=g).log_softmax(-1)
    batch = {"ids_list": {"teacher_ids": ids.tolist(), "teacher_logprobs": lp},
             "ids_float": {"teacher_ids": ids.float(), "teacher_logprobs": lp},
             "lp_list": {"teacher_ids": ids, "teacher_logprobs": lp.tolist()}}[bad]
    flags = dict(calculate_sum_pi_squared=False, calculate_entropy=False, distillation_use_topk=True,
                 distillation_only=False, batch=batch)
    with pytest.raises(ValueError, match=re.escape(name)):
        if path == "logits":
            process_lm_head_logits(hidden @ weight.T, labels, 1.0, **flags)
        else:
            process_lm_head_hidden(hidden, weight, labels, 1.0, **flags)


def test_custom_func_and_flags() -> None:
    """Custom func: unit temperature hands the very same tensor; others the scaled logits; flags pick keys."""
    x = torch.randn(*cases.HARD_LEAD, cases.HARD_V_LOCAL) * 4
    lab = torch.randint(0, cases.HARD_V_LOCAL, cases.HARD_LEAD)
    seen = {}

    def func(*, student_logits, data, data_format):
        seen.update(logits=student_logits, data=data, fmt=data_format)
        return {"custom": student_logits.float().logsumexp(-1)}

    batch = {"anything": 1}
    out = process_lm_head_logits(x, lab, 1.0, calculate_sum_pi_squared=False, calculate_entropy=True,
                                 distillation_use_topk=True, distillation_only=False,
                                 logits_processor_func=func, batch=batch, data_format="bshd")
    assert seen["logits"] is x and seen["data"] is batch and seen["fmt"] == "bshd"
    assert set(out) == {"log_probs", "entropy", "custom"}
    temp = torch.rand(cases.HARD_LEAD) + 0.5
    t0 = temp.clone()
    out = process_lm_head_logits(x, lab, temp, calculate_sum_pi_squared=True, calculate_entropy=False,
                                 distillation_use_topk=True, distillation_only=True,
                                 logits_processor_func=func, batch=batch)
    assert set(out) == {"sum_pi_squared", "custom"}
    torch.testing.assert_close(seen["logits"], x / temp[..., None])
    assert torch.equal(temp, t0)
    out = process_lm_head_logits(x, lab, 0.3, calculate_sum_pi_squared=False, calculate_entropy=False,
                                 distillation_use_topk=False, distillation_only=False)
    assert set(out) == {"log_probs"}
    ref = (x.double() / 0.3).log_softmax(-1).gather(-1, lab[..., None])[..., 0]
    assert rel_err(out["log_probs"], ref) < 1e-5


def test_temperature_is_checked_once() -> None:
    """With a custom func the scaled logits reuse the pass's temperature check (one device sync)."""
    from mcore_engine.ops import temperature as temp_mod

    x = torch.randn(*cases.HARD_LEAD, cases.HARD_V_LOCAL)
    lab = torch.randint(0, cases.HARD_V_LOCAL, cases.HARD_LEAD)
    temp = torch.rand(cases.HARD_LEAD) + 0.5
    with pytest.MonkeyPatch.context() as mp:
        calls = []
        real = temp_mod._check_temperature
        mp.setattr(temp_mod, "_check_temperature", lambda *a: (calls.append(1), real(*a))[1])
        out = process_lm_head_logits(x, lab, temp, calculate_sum_pi_squared=False, calculate_entropy=True,
                                     distillation_use_topk=True, distillation_only=False,
                                     logits_processor_func=lambda **kw: {"s": kw["student_logits"].sum(-1)})
    assert set(out) == {"log_probs", "entropy", "s"} and len(calls) == 1
    torch.testing.assert_close(out["s"], (x / temp[..., None]).sum(-1))
