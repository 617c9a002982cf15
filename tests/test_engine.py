"""MegatronEngine contracts on one rank.

In-process (patched primitives, no model, upstream ``*_on_cpu`` style): the lm-head processor is a
delegation with the true vocab and the configured chunk size; ``distillation_only`` never starts
the log-prob computation; ``optimizer_step`` calls ``empty_cache()`` exactly when the last
forward-backward ran top-k distillation, and before the step.

One gloo rank with a real tiny GPT (one launch, many checks): thd vs bshd vs padded input,
micro-batch count / token-budget invariance, per-sample vs scalar temperature, the flag contract
end to end (``infer_batch`` keeps the ``empty_cache`` hook and the train / eval mode), non-finite
gradients skipping the update with parameters and Adam state untouched, a failing or malformed loss
function (gradients zeroed, parameters untouched), and bad batches rejected with ``ValueError``
before any parameter or gradient changes. In-process also: the loss-result checks and the guard's
stand-in, one host read for all metrics, exact token counts past 2**24.
"""

from __future__ import annotations

import json
import math
import os
import traceback
from functools import partial
from unittest import mock

import pytest
import torch

from tests.engine_setup import (
    distill_loss,
    flat_values,
    full_state,
    make_batch,
    policy_loss,
    tiny_config,
    to_padded,
)
from tests.utils import REL_TOL, assert_rel_close, run_distributed

TOL = REL_TOL[torch.float32]


# ------------------------------------------------------------------ in-process contract tests
def _bare_engine():
    from mcore_engine.engine import MegatronEngine

    engine = MegatronEngine.__new__(MegatronEngine)  # upstream style: no initialize(), no model
    engine.config = tiny_config()
    return engine


def test_lm_head_processor_delegates_with_true_vocab_and_chunk_size():
    engine = _bare_engine()
    logits, labels = torch.randn(1, 5, 256), torch.randint(0, 250, (1, 5))
    with mock.patch("mcore_engine.engine.process_lm_head_logits", return_value={"x": 1}) as spy:
        out = engine._lm_head_logits_processor(
            logits, labels, 0.5, calculate_sum_pi_squared=True, calculate_entropy=False,
            distillation_use_topk=False, distillation_only=False, data_format="bshd")
    assert out == {"x": 1}
    (args, kwargs), = spy.call_args_list
    assert args[0] is logits and args[1] is labels and args[2] == 0.5
    assert kwargs["vocab_size"] == 250 and kwargs["chunk_size"] == 7 and kwargs["data_format"] == "bshd"
    assert kwargs["calculate_sum_pi_squared"] is True and kwargs["calculate_entropy"] is False


def test_distillation_only_never_starts_log_probs():
    import mcore_engine.processor as processor

    engine = _bare_engine()
    logits = torch.randn(1, 9, 256)
    batch = {"teacher_ids": torch.randint(0, 250, (1, 9, 3)),
             "teacher_logprobs": -torch.rand(1, 9, 3) - 0.1}
    real = processor.vocab_parallel_logits_outputs
    with mock.patch.object(processor, "vocab_parallel_logits_outputs", wraps=real) as fused, \
            mock.patch("mcore_engine.ops.log_probs.vocab_parallel_log_probs") as log_probs:
        out = engine._lm_head_logits_processor(
            logits, torch.randint(0, 250, (1, 9)), 1.0, calculate_sum_pi_squared=False,
            calculate_entropy=True, distillation_use_topk=True, distillation_only=True, batch=batch)
        assert fused.call_args.kwargs["labels"] is None
        full = engine._lm_head_logits_processor(
            logits, torch.randint(0, 250, (1, 9)), 1.0, calculate_sum_pi_squared=False,
            calculate_entropy=True, distillation_use_topk=True, distillation_only=False, batch=batch)
    log_probs.assert_not_called()
    assert "log_probs" not in out and {"entropy", "distillation_losses"} <= out.keys()
    assert "log_probs" in full and torch.isfinite(full["log_probs"]).all()


@pytest.mark.parametrize("topk", [True, False])
def test_optimizer_step_empties_cache_exactly_after_topk(topk):
    from mcore_engine.parallel.platform import get_device
    from mcore_engine.step.optimizer import StepResult

    engine = _bare_engine()
    engine.optimizer, engine.global_step, engine.num_skipped_steps = object(), 0, 0
    engine._last_distillation_use_topk, engine._moe = topk, None
    calls = []
    device_cls = type(get_device())
    with mock.patch.object(device_cls, "empty_cache", side_effect=lambda: calls.append("empty_cache")), \
            mock.patch("mcore_engine.engine.step_optimizer",
                       side_effect=lambda opt, clip: calls.append("step") or StepResult(2.5, False)):
        assert engine.optimizer_step() == 2.5
    assert calls == (["empty_cache", "step"] if topk else ["step"])
    assert engine.global_step == 1


def test_loss_result_is_checked():
    from mcore_engine.step.loss_guard import LossGuard, check_loss_result

    x = torch.randn(5, requires_grad=True)
    loss, metrics = check_loss_result((x.sum().reshape(1), {"a": 2, "b": x.sum() * 3}), needs_grad=True)
    assert loss.shape == () and metrics["a"].dtype == torch.float64 and float(metrics["a"]) == 2.0
    assert not metrics["b"].requires_grad
    bad = {"not a pair": (x.sum(),), "vector loss": (x, {}), "int loss": (torch.tensor(3), {}),
           "detached loss": (x.sum().detach(), {}), "per-token metric": (x.sum(), {"m": x.detach()}),
           "metrics not a dict": (x.sum(), [1.0])}
    for name, result in bad.items():
        with pytest.raises(ValueError, match="loss_function"):
            check_loss_result(result, needs_grad=True)
        assert name
    check_loss_result((x.sum().detach(), {}), needs_grad=False)  # forward only: no grad needed

    # a failure: the stand-in (zero gradient into the model), then every later call is skipped
    guard, calls = LossGuard(), []
    output = torch.randn(2, 3, requires_grad=True)

    def failing():
        calls.append(1)
        raise KeyError("advantages")

    loss, metrics, extra = guard.run(failing, output, needs_grad=True)
    loss.backward()
    assert torch.equal(output.grad, torch.zeros(2, 3)) and metrics == {} and extra is None
    guard.run(lambda: calls.append(2) or ((output.sum(), {}), None), output, needs_grad=True)
    assert calls == [1], "a later micro-batch ran the loss function after a failure"
    with pytest.raises(KeyError, match="advantages"):  # one rank: the original exception
        guard.raise_if_failed()


def _one_rank_layout():
    from mcore_engine.step.layout import StepLayout

    return StepLayout(vocab_size=250, max_sequence_length=64, data_format="thd", default_micro_batch_size=1,
                      device=torch.device("cpu"))


def test_gather_results_reads_the_host_once():
    from mcore_engine.step.prepare import gather_results

    store = [{"index": 2, "loss": torch.tensor(0.25), "outputs": {},
              "metrics": {"tokens": torch.tensor(3), "x": torch.tensor(0.5, dtype=torch.float64)}},
             {"index": 0, "loss": torch.tensor(0.5), "outputs": {}, "metrics": {"tokens": torch.tensor(4)}},
             {"index": 1, "loss": torch.tensor(1.0), "outputs": {},
              "metrics": {"tokens": torch.tensor(5), "x": torch.tensor(1.5)}}]
    reads = []
    real_tolist = torch.Tensor.tolist
    with mock.patch.object(torch.Tensor, "tolist", new=lambda t: reads.append(1) or real_tolist(t)), \
            mock.patch.object(torch.Tensor, "item", side_effect=AssertionError("item()")), \
            mock.patch.object(torch.Tensor, "__float__", side_effect=AssertionError("float()")):
        _, loss, metrics = gather_results(None, store, _one_rank_layout())
    assert reads == [1], f"{len(reads)} host reads"
    assert metrics == {"tokens": 12.0, "x": 2.0} and loss.dtype == torch.float32 and float(loss) == 1.75


def test_token_counts_are_exact_beyond_float32():
    """Three micro-batches with 2**24 + 1, 1 and 1 loss tokens: a float32 running sum gives 2**24."""
    import mcore_engine.step.prepare as step_module

    real = step_module.pack_micro_batch
    counts = iter([2**24 + 1, 1, 1])

    def pack(mb, **kwargs):
        inputs = real(mb, **kwargs)
        import dataclasses

        return dataclasses.replace(inputs, loss_mask=torch.ones((), dtype=torch.int64).expand(next(counts)))

    with mock.patch.object(step_module, "pack_micro_batch", side_effect=pack):
        step = step_module.prepare_step(make_batch(3, 3, micro_batch_size_per_gpu=1), _one_rank_layout(),
                                        has_logits_processor_func=False)
    # exact 2**24 + 3, rounded once to float32 (LossContext's dtype)
    assert step.ctx.global_num_tokens.item() == float(torch.tensor(2**24 + 3.0).float())
    assert step.ctx.global_num_tokens.item() != 2**24


# ------------------------------------------------------------------ one real rank
def _expect_value_error(fn, what: str) -> str:
    try:
        fn()
    except ValueError as exc:
        return str(exc)
    raise AssertionError(f"{what}: no ValueError")


def _state(engine):
    """Parameters, gradients and Adam state, cloned."""
    from mcore_engine.step.optimizer import sub_optimizers

    params = {k: v.detach().clone() for k, v in engine.model[0].module.named_parameters()}
    grads = {k: v.main_grad.clone() for k, v in engine.model[0].module.named_parameters()}
    adam = [{k: t.clone() for k, t in s.items()} for sub in sub_optimizers(engine.optimizer)
            for s in sub.optimizer.state.values()]
    return params, grads, adam


def _assert_same_state(a, b, what: str, *, grads: bool = True) -> None:
    for x, y in zip(a[:2] if grads else a[:1], b[:2] if grads else b[:1], strict=True):
        for key in x:
            assert torch.equal(x[key], y[key]), f"{what}: {key} changed"
    assert len(a[2]) == len(b[2]), f"{what}: optimizer state entries changed"
    for x, y in zip(a[2], b[2], strict=True):
        assert all(torch.equal(x[k], y[k]) for k in x), f"{what}: Adam state changed"


# The launched rank runs the checks below in order on one engine (state restored from the initial
# checkpoint where a check needs it) and reports each by name; one pytest case per check.
CHECKS: dict = {}


def _check(fn):
    CHECKS[fn.__name__.removeprefix("_check_")] = fn
    return fn


class _Setup:
    """The engine every check shares, its initial checkpoint and the reference step."""

    FLAGS = dict(calculate_entropy=True, temperature=0.7)

    def __init__(self, tmp: str) -> None:
        self.tmp, self.init = tmp, f"{tmp}/init"
        self.engine = self.fresh()
        self.init_weights = full_state(self.engine)
        self.engine.save_checkpoint(self.init)
        self.batch = make_batch(5, 7, **self.FLAGS)   # thd, 2 sequences per micro-batch, scalar temperature
        out = self.engine.train_batch(self.batch, policy_loss)
        self.ref = dict(lp=flat_values(out["log_probs"]), ent=flat_values(out["entropy"]),
                        loss=out.get_non_tensor("loss"), norm=out.get_non_tensor("metrics")["grad_norm"],
                        weights=full_state(self.engine),
                        grads={k: p.main_grad.detach().float().clone()  # (clipped) gradients of the step
                               for k, p in self.engine.model[0].module.named_parameters()})

    @staticmethod
    def fresh(**kwargs):
        from mcore_engine.engine import MegatronEngine

        engine = MegatronEngine(tiny_config(**kwargs))
        engine.initialize()
        return engine

    def restored(self):
        self.engine.load_checkpoint(self.init)
        return self.engine

    def same_step(self, name, out, engine, mask=None) -> None:
        """``out`` / ``engine`` after one step equal the reference step's."""
        ref = self.ref
        for key, want in (("log_probs", ref["lp"]), ("entropy", ref["ent"])):
            got = out[key][mask] if mask is not None else flat_values(out[key])
            assert_rel_close(got, want, TOL, f"{name}: {key}")
        assert_rel_close(out.get_non_tensor("loss"), ref["loss"], TOL, f"{name}: loss")
        norm = out.get_non_tensor("metrics")["grad_norm"]
        assert abs(norm - ref["norm"]) <= TOL * ref["norm"], f"{name}: grad norm {norm} vs {ref['norm']}"
        from tests.compare import AdamSteps, Attention, assert_tensors_close

        opt = engine.config.optimizer  # entries the gradients cannot pin down: bounded by 2 x lr
        assert_tensors_close(f"{name}: weights after the step", full_state(engine), ref["weights"],
                             attn=Attention.of(engine.config.model), grads=False, tol=TOL,
                             adam=AdamSteps(ref["grads"], opt.lr, opt.adam_eps, 1))


@_check
def _check_reference_step_moves_the_weights(s: _Setup) -> None:
    for key in ("output_layer.weight", "decoder.layers.3.mlp.linear_fc2.weight"):
        assert not torch.equal(s.ref["weights"][key], s.init_weights[key]), f"{key} did not move"


@_check
def _check_same_step_for_other_splits_and_temperature_forms(s: _Setup) -> None:
    flags = s.FLAGS
    variants = {
        "one sequence per micro-batch": make_batch(5, 7, micro_batch_size_per_gpu=1, **flags),
        "one micro-batch": make_batch(5, 7, micro_batch_size_per_gpu=7, **flags),
        "token budget": make_batch(5, 7, use_dynamic_bsz=True, max_token_len_per_gpu=24, **flags),
        "padded input": to_padded(make_batch(5, 7, **flags)),
    }
    per_sample = make_batch(5, 7, calculate_entropy=True)
    per_sample.set("temperature", torch.full((7,), 0.7))
    variants["per-sample temperature"] = per_sample
    for name, variant in variants.items():
        engine = s.restored()
        mask = variant["attention_mask"] if "attention_mask" in variant.keys() else None
        s.same_step(name, engine.train_batch(variant, policy_loss), engine, mask)
    padded_out = s.engine.infer_batch(to_padded(s.batch))
    assert padded_out["log_probs"].shape == to_padded(s.batch)["input_ids"].shape


@_check
def _check_bshd_engine_same_step(s: _Setup) -> None:
    bshd = s.fresh(data_format="bshd")
    bshd.load_checkpoint(s.init)
    s.same_step("bshd", bshd.train_batch(s.batch, policy_loss), bshd)


@_check
def _check_fused_lm_head_same_step_and_refuses_logits_funcs(s: _Setup) -> None:
    fused = s.fresh(fused_lm_head=True)  # hidden states + lm-head weight, the logits never built
    fused.load_checkpoint(s.init)
    s.same_step("fused lm-head", fused.train_batch(s.batch, policy_loss), fused)
    before = _state(fused)
    teach = make_batch(6, 4, teacher_k=3, distillation_use_topk=True)
    message = _expect_value_error(partial(fused.train_batch, teach, distill_loss,
                                          logits_processor_func=lambda **kw: {}), "fused + func")
    assert "fused_lm_head" in message, message
    _assert_same_state(before, _state(fused), "fused lm-head refusing a logits_processor_func")


@_check
def _check_empty_cache_exactly_after_topk_and_infer_leaves_state(s: _Setup) -> None:
    """empty_cache iff top-k distillation ran with gradients; no log_probs under distillation_only;
    infer_batch leaves parameters, gradients and the hook alone."""
    from mcore_engine.parallel.platform import get_device

    engine, flags, calls = s.restored(), s.FLAGS, []
    with mock.patch.object(type(get_device()), "empty_cache", side_effect=lambda: calls.append(1)):
        engine.train_batch(make_batch(6, 4, **flags), policy_loss)
        assert calls == [], "empty_cache without top-k distillation"
        distill = make_batch(6, 4, teacher_k=3, distillation_use_topk=True, distillation_only=True)
        before = _state(engine)
        inferred = engine.infer_batch(distill)
        _assert_same_state(before, _state(engine), "infer_batch")
        assert "log_probs" not in inferred.keys() and "distillation_losses" in inferred.keys()
        assert not inferred["distillation_losses"].requires_grad
        assert (flat_values(inferred["distillation_losses"]) >= -1e-6).all()
        out = engine.train_batch(distill, distill_loss)
        assert calls == [1], f"empty_cache calls after top-k distillation: {calls}"
        assert "log_probs" not in out.keys() and out.get_non_tensor("metrics")["update_skipped"] == 0.0
        engine.zero_grad()
        engine.forward_backward_batch(distill, distill_loss)   # top-k with gradients arms the hook,
        engine.infer_batch(make_batch(7, 4, **flags))           # a forward-only pass leaves it armed
        engine.forward_backward_batch(make_batch(7, 4, **flags), None, forward_only=True)
        engine.optimizer_step()
        assert calls == [1, 1], f"infer_batch reset the empty_cache hook: {calls}"
        engine.train_batch(make_batch(7, 4, **flags), policy_loss)
        assert calls == [1, 1], "empty_cache after a step without top-k distillation"


@_check
def _check_custom_topk_processor_and_distillation_ppo_loss(s: _Setup) -> None:
    """A custom top-k processor equals the built-in one; distillation_ppo_loss runs with and
    without distillation_only."""
    from mcore_engine.losses import distillation_ppo_loss, make_forward_kl_topk

    engine = s.restored()
    func = make_forward_kl_topk(vocab_size=250, compute_overlap=True)
    for only in (True, False):
        teach = make_batch(10, 5, teacher_k=4, distillation_use_topk=True, distillation_only=only)
        builtin = engine.infer_batch(teach)
        custom = engine.infer_batch(teach, logits_processor_func=func)
        assert_rel_close(flat_values(custom["distillation_losses"]),
                         flat_values(builtin["distillation_losses"]), TOL, "custom vs built-in top-k KL")
        assert ("log_probs" in custom.keys()) is not only
        metrics = engine.train_batch(teach, distillation_ppo_loss(), logits_processor_func=func
                                     ).get_non_tensor("metrics")
        assert {"distillation_loss", "topk_overlap", "grad_norm"} <= metrics.keys(), sorted(metrics)
        assert ("pg_clipfrac" in metrics) is not only and metrics["update_skipped"] == 0.0


@_check
def _check_infer_logits_func(s: _Setup) -> None:
    """logits_func runs whatever the flags, on the temperature-scaled logits, merged with the
    built-in outputs or (builtin_outputs=False) alone; infer_batch restores the train / eval mode."""
    import mcore_engine.step.schedule as schedule

    engine = s.restored()

    def row_stats(student_logits, data, data_format):
        return {"max_logit": student_logits.float().amax(-1), "top2": student_logits.float().topk(2).values}

    plain = make_batch(11, 5)                         # no flags at all: temperature 1
    raw = engine.infer_batch(plain, logits_func=row_stats)
    assert {"log_probs", "max_logit", "top2"} <= raw.keys() and "entropy" not in raw.keys()
    assert_rel_close(flat_values(raw["log_probs"]), flat_values(engine.infer_batch(plain)["log_probs"]),
                     TOL, "log_probs next to a logits_func")
    assert raw["top2"].values().shape[-1] == 2
    temps = torch.tensor([0.5, 2.0, 0.7, 1.3, 0.9])
    for name, temperature in (("scalar", 0.7), ("per-sample", temps)):
        hot = make_batch(11, 5)
        if name == "scalar":
            hot.set_non_tensor("temperature", temperature)
        else:
            hot.set("temperature", temperature)
        with mock.patch.object(schedule, "lm_head_outputs", wraps=schedule.lm_head_outputs) as builtin:
            only = engine.infer_batch(hot, logits_func=row_stats, builtin_outputs=False)
        builtin.assert_not_called()
        assert set(only.keys()) - {"loss", "metrics"} == {"max_logit", "top2"}, sorted(only.keys())
        per_token = temperature if name == "scalar" else torch.cat(
            [t.expand(n) for t, n in zip(temps, raw["max_logit"].offsets().diff().tolist(), strict=True)])
        assert_rel_close(flat_values(only["max_logit"]), flat_values(raw["max_logit"]) / per_token, TOL,
                         f"logits_func sees logits / temperature ({name})")
    for training in (False, True):
        engine.model[0].train(training)
        engine.infer_batch(plain)
        assert {m.training for m in engine.model[0].modules()} == {training}, f"mode {training} not kept"
    clash = partial(engine.infer_batch, plain,
                    logits_func=lambda **kw: {"log_probs": kw["student_logits"][..., 0]})
    assert "log_probs" in _expect_value_error(clash, "logits_func key clash")
    assert "logits_func" in _expect_value_error(partial(engine.infer_batch, plain, builtin_outputs=False),
                                                "builtin_outputs=False without logits_func")


@_check
def _check_non_finite_gradients_skip_the_update(s: _Setup) -> None:
    """Update skipped, parameters and Adam state bit-identical; the next step applies."""
    engine, flags = s.restored(), s.FLAGS
    engine.train_batch(make_batch(8, 4, **flags), policy_loss)  # Adam state exists

    def nan_loss(outputs, data, ctx):
        loss, metrics = policy_loss(outputs, data, ctx)
        return loss * float("nan"), metrics

    step, skipped = engine.global_step, engine.num_skipped_steps
    engine.zero_grad()
    before = _state(engine)
    metrics = engine.train_batch(make_batch(8, 4, **flags), nan_loss).get_non_tensor("metrics")
    assert metrics["update_skipped"] == 1.0 and not math.isfinite(metrics["grad_norm"])
    _assert_same_state(before, _state(engine), "skipped step", grads=False)
    assert (engine.global_step, engine.num_skipped_steps) == (step, skipped + 1)
    out = engine.train_batch(make_batch(8, 4, **flags), policy_loss)
    assert out.get_non_tensor("metrics")["update_skipped"] == 0.0 and engine.global_step == step + 1


@_check
def _check_failing_loss_function_zeroes_grads_and_keeps_params(s: _Setup) -> None:
    """The original exception (one rank), parameters and Adam state untouched, no step; a failed
    ``forward_backward_batch`` drops its own gradients and keeps those of earlier calls, a failed
    ``train_batch`` (which starts with ``zero_grad``) leaves them zero."""
    engine, flags = s.restored(), s.FLAGS
    engine.train_batch(make_batch(8, 4, **flags), policy_loss)  # Adam state exists

    def broken_loss(outputs, data, ctx):
        raise KeyError("old_log_probs")

    def detached_loss(outputs, data, ctx):
        return policy_loss(outputs, data, ctx)[0].detach(), {}

    step = engine.global_step
    for loss_fn, error, needle in ((broken_loss, KeyError, "old_log_probs"),
                                   (detached_loss, ValueError, "does not require grad")):
        engine.zero_grad()
        engine.forward_backward_batch(make_batch(8, 4, **flags), policy_loss)  # accumulated gradients
        before = _state(engine)
        assert any(g.abs().sum() > 0 for g in before[1].values())
        with pytest.raises(error, match=needle):
            engine.forward_backward_batch(make_batch(9, 4, **flags), loss_fn)
        _assert_same_state(before, _state(engine), f"{needle}: failed forward_backward_batch")
        with pytest.raises(error, match=needle):
            engine.train_batch(make_batch(8, 4, **flags), loss_fn)
        after = _state(engine)
        assert all(not g.any() for g in after[1].values()), f"{needle}: gradients not zeroed"
        _assert_same_state(before, after, f"{needle}: failed step", grads=False)
    assert engine.global_step == step
    assert engine.train_batch(make_batch(8, 4, **flags), policy_loss).get_non_tensor("metrics")[
        "update_skipped"] == 0.0


@_check
def _check_bad_batches_refused_before_any_change(s: _Setup) -> None:
    """ValueError naming the problem from train / forward_backward / infer, state unchanged."""
    engine, flags = s.restored(), s.FLAGS

    def with_key(key, value, base=None):
        b = (base if base is not None else make_batch(9, 3, **flags)).clone()
        b.set(key, value)
        return b

    good = make_batch(9, 3, **flags)
    ids = good["input_ids"]
    nested = lambda rows: torch.nested.nested_tensor(rows, layout=torch.jagged)  # noqa: E731
    missing = good.clone()
    del missing["input_ids"]
    teacher = make_batch(9, 3, teacher_k=2, distillation_use_topk=True)
    short_teacher = nested([t[:-1] for t in teacher["teacher_ids"].unbind()])
    nan_teacher = nested([t.index_fill(0, torch.tensor([0]), math.nan)
                          for t in teacher["teacher_logprobs"].unbind()])
    bad = {
        "input_ids missing": (missing, "input_ids"),
        "float input_ids": (with_key("input_ids", nested([t.float() for t in ids.unbind()])), "input_ids"),
        "id outside vocab": (with_key("input_ids", nested([t.clamp_max(0) + 250 for t in ids.unbind()])),
                             "input_ids"),
        "negative id": (with_key("input_ids", nested([t - 300 for t in ids.unbind()])), "input_ids"),
        "too long": (make_batch(9, 2, min_len=65, max_len=70, **flags), "max_sequence_length"),
        "teacher too short": (with_key("teacher_ids", short_teacher, teacher), "teacher_ids"),
        "teacher K mismatch": (with_key("teacher_logprobs", nested(
            [t[:, :1] for t in teacher["teacher_logprobs"].unbind()]), teacher), "teacher_logprobs"),
        "NaN teacher log-probs": (with_key("teacher_logprobs", nan_teacher, teacher), "teacher_logprobs"),
        "no teacher": (make_batch(9, 3, distillation_use_topk=True), "teacher_ids"),
        "padded without mask": (to_padded(good).exclude("attention_mask"), "attention_mask"),
        "flag of wrong type": (make_batch(9, 3, calculate_entropy="yes"), "calculate_entropy"),
        "bad temperature": (make_batch(9, 3, temperature=0.0), "temperature"),
        "loss_mask of wrong length": (
            with_key("loss_mask", nested([t[1:] for t in good["loss_mask"].unbind()])), "loss_mask"),
    }
    engine.train_batch(good, policy_loss)  # non-zero gradients in the buffers
    before = _state(engine)
    for name, (batch_, key) in bad.items():
        for call in (partial(engine.train_batch, batch_, policy_loss),
                     partial(engine.forward_backward_batch, batch_, policy_loss),
                     partial(engine.infer_batch, batch_)):
            message = _expect_value_error(call, name)
            assert key in message, f"{name}: error does not name {key!r}: {message}"
        _assert_same_state(before, _state(engine), name)


@_check
def _check_lr_schedule_warms_up_from_zero(s: _Setup) -> None:
    from mcore_engine.engine import MegatronEngine

    warm = MegatronEngine(tiny_config())
    warm.config.optimizer.lr_warmup_steps, warm.config.optimizer.lr_decay_steps = 2, 10
    warm.config.optimizer.lr_decay_style = "cosine"
    warm.initialize()
    lrs = [warm.optimizer.param_groups[0]["lr"]] + [warm.lr_scheduler_step() for _ in range(3)]
    expected = [0.0, 5e-4, 1e-3, 0.5 * (1 + math.cos(math.pi / 8)) * 1e-3]
    assert all(abs(a - b) < 1e-12 for a, b in zip(lrs, expected, strict=True)), lrs


def _mb_policy_loss(model_output, data, ctx, *, seen: list):
    """policy_loss on the "micro_batch" convention: jagged outputs, the user's own rows (its
    loss_mask, which does not yet mask each sequence's last output), metrics no engine can sum."""
    log_probs = model_output["log_probs"]
    mask = data["loss_mask"].values().float().clone()
    mask[log_probs.offsets()[1:] - 1] = 0.0
    per_token = -data["advantages"].values() * log_probs.values() + 0.05 * model_output["entropy"].values()
    seen.append((data["row_id"].clone(), data.get_non_tensor("temperature"), float(ctx.global_num_tokens)))
    return (per_token * mask).sum() / ctx.global_num_tokens, {"tokens": [float(mask.sum())], "tag": object}


def _verl_like(batch, seed: int):
    """``batch``'s ids with verl's dense response mask ``[B, R]`` and left-right padded
    ``attention_mask`` instead of a loss_mask; plus the output-aligned mask it means (a loop)."""
    from tensordict import TensorDict

    g = torch.Generator().manual_seed(seed)
    lengths = batch["input_ids"].offsets().diff().tolist()
    resp = [n // 2 for n in lengths]
    width_p, width_r = max(n - r for n, r in zip(lengths, resp, strict=True)), max(resp)
    mask = torch.zeros(len(lengths), width_r)
    attention = torch.zeros(len(lengths), width_p + width_r, dtype=torch.bool)
    rows = []
    for i, (n, r) in enumerate(zip(lengths, resp, strict=True)):
        mask[i, :r] = (torch.rand(r, generator=g) > 0.3).float()
        attention[i, width_p - (n - r): width_p + r] = True
        row = torch.zeros(n)
        row[n - r - 1: n - 1] = mask[i, :r]
        rows.append(row)
    out = TensorDict({"input_ids": batch["input_ids"], "response_mask": mask, "attention_mask": attention},
                     batch_size=batch.batch_size)
    out.set_non_tensor("temperature", batch.get_non_tensor("temperature"))
    return out, torch.nested.nested_tensor(rows, layout=torch.jagged)


@_check
def _check_micro_batch_loss_convention(s: _Setup) -> None:
    """loss_convention="micro_batch" gives the reference step for the same loss written on jagged
    outputs and the user's rows (a dense field and the flags reach it in micro-batch order); its
    metrics come back per micro-batch, unsummed; a dense response mask gives the loss mask (the
    global token count); the clamp flag reaches the built-in top-k KL; errors name the problem."""
    from mcore_engine.losses import make_forward_kl_topk

    batch, seen = s.batch.clone(), []
    batch.set("row_id", torch.arange(7.0))  # a dense per-sample field
    engine = s.restored()
    out = engine.train_batch(batch, partial(_mb_policy_loss, seen=seen), loss_convention="micro_batch")
    s.same_step("micro_batch convention", out, engine)
    assert torch.equal(torch.cat([row_ids for row_ids, _, _ in seen]), torch.arange(7.0))
    assert {t for _, t, _ in seen} == {0.7} and len(seen) == 4
    per_mb = out.get_non_tensor("micro_batch_metrics")
    assert len(per_mb) == 4 and all(m["tag"] is object for m in per_mb)
    tokens = float(sum(row[:-1].sum() for row in s.batch["loss_mask"].unbind()))  # last outputs: none
    assert sum(m["tokens"][0] for m in per_mb) == tokens == seen[0][2]
    assert set(out.get_non_tensor("metrics")) == {"grad_norm", "update_skipped", "lr"}

    verl_like, mask = _verl_like(s.batch, seed=4)
    seen.clear()
    record = lambda model_output, data, ctx: seen.append(  # noqa: E731
        (float(ctx.global_num_tokens), tuple(data["response_mask"].shape))) or (ctx.global_num_tokens * 0, {})
    got = engine.infer_batch(verl_like, record, loss_convention="micro_batch")
    assert seen[0][0] == float(mask.values().sum()) and seen[0][1] == (2, verl_like["response_mask"].shape[1])
    assert_rel_close(flat_values(got["log_probs"]), flat_values(engine.infer_batch(s.batch)["log_probs"]),
                     TOL, "outputs beside a response mask")

    teach = make_batch(10, 5, teacher_k=4, distillation_use_topk=True)
    plain = flat_values(engine.infer_batch(teach)["distillation_losses"])
    custom = flat_values(engine.infer_batch(teach, logits_processor_func=make_forward_kl_topk(
        vocab_size=250, log_prob_min_clamp=-2.0))["distillation_losses"])
    teach.set_non_tensor("distillation_log_prob_min_clamp", -2.0)
    clamped = flat_values(engine.infer_batch(teach)["distillation_losses"])
    assert_rel_close(clamped, custom, TOL, "clamp flag vs a clamped custom processor")
    assert not torch.allclose(clamped, plain), "the clamp did not bind"

    before = _state(engine)
    message = _expect_value_error(partial(engine.train_batch, batch, _mb_policy_loss,
                                          loss_convention="dense"), "bad convention")
    assert "loss_convention" in message, message
    bad = lambda model_output, data, ctx: (model_output["log_probs"].values().sum(), [1.0])  # noqa: E731
    message = _expect_value_error(partial(engine.train_batch, batch, bad, loss_convention="micro_batch"),
                                  "metrics not a dict")
    assert "metrics must be a dict" in message, message
    _assert_same_state(before, _state(engine), "refused micro_batch losses", grads=False)


def _single_rank(rank: int, world_size: int, tmp: str) -> None:
    """Run every check, recording ``"ok"`` or its traceback by name in ``tmp/results.json``."""
    results: dict[str, str] = {}
    try:
        setup = _Setup(tmp)
    except Exception:
        results = dict.fromkeys(CHECKS, "setup failed:\n" + traceback.format_exc())
        setup = None
    for name, check in CHECKS.items() if setup is not None else ():
        try:
            check(setup)
            results[name] = "ok"
        except Exception:
            results[name] = traceback.format_exc()
    with open(os.path.join(tmp, "results.json"), "w") as f:
        json.dump(results, f)


@pytest.fixture(scope="module")
def single_rank_results(tmp_path_factory) -> dict[str, str]:
    tmp = tmp_path_factory.mktemp("single_rank_engine")
    run_distributed(_single_rank, 1, str(tmp))
    return json.loads((tmp / "results.json").read_text())


@pytest.mark.parametrize("name", list(CHECKS))
def test_single_rank_engine(name, single_rank_results):
    result = single_rank_results.get(name, "not run")
    assert result == "ok", f"{name}:\n{result}"
