"""``outputs_on_loss_mask_only``: the lm-head and every output only on the rows whose loss_mask is 1.

One launch of two gloo ranks: TP=2 (thd, bshd, fused lm-head) and PP=2 (thd; bshd with the fused
lm-head; a value head). For every flag set (log-probs; entropy + sum-pi^2 with a per-sample
temperature; top-k KL + log-probs + entropy; ``distillation_only``; a custom
``logits_processor_func``) one ``forward_backward_batch`` runs the full pass and one the selected
rows: outputs equal on the selected rows and exactly 0 elsewhere, loss and every gradient equal
(fp32, relative 1e-6); the custom processor sees only the selected rows.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.engine_setup import flat_values, make_batch, tiny_config
from tests.utils import assert_rel_close, run_distributed

TOL = 1e-6
NUM_SEQS = 6
K = 4
RESPONSE_FRACTION = 0.4


def response_batch(seed: int, **flags):
    """``make_batch`` with a prompt / response loss mask: the last 40% of each sequence."""
    batch = make_batch(seed, NUM_SEQS, teacher_k=K, **flags)
    lengths = [int(n) for n in batch["input_ids"].offsets().diff()]
    masks = [(torch.arange(n) >= int(n * (1 - RESPONSE_FRACTION))).to(torch.int64) for n in lengths]
    batch.set("loss_mask", torch.nested.nested_tensor(masks, layout=torch.jagged))
    return batch


COEF = {"log_probs": 1.0, "entropy": 0.3, "sum_pi_squared": -0.7, "distillation_losses": 0.5,
        "values": 1.0, "custom_lse": 0.01}


def masked_loss(outputs, data, ctx):
    """Every differentiable output, weighted by the loss mask (so only the selected rows matter)."""
    mask, adv = data["loss_mask"], data["advantages"]
    per_token = sum(COEF[k] * v * (adv if k in ("log_probs", "values") else 1.0)
                    for k, v in outputs.items() if k in COEF)
    return (per_token * mask).sum() / ctx.global_num_tokens, {}


SEEN: list[tuple[int, ...]] = []


def custom_processor(student_logits, data, data_format):
    SEEN.append((tuple(student_logits.shape[:-1]), tuple(data["teacher_ids"].shape[:-1])))
    return {"custom_lse": student_logits.float().logsumexp(-1)}


FLAG_SETS = [  # name, step flags, custom processor
    ("log-probs", dict(temperature=0.7), False),
    ("entropy+sum-pi2, per-sample T", dict(calculate_entropy=True, calculate_sum_pi_squared=True), False),
    ("top-k KL + log-probs + entropy", dict(distillation_use_topk=True, calculate_entropy=True,
                                            temperature=1.3), False),
    ("distillation_only", dict(distillation_use_topk=True, distillation_only=True), False),
    ("custom logits_processor_func", dict(distillation_use_topk=True, temperature=0.9), True),
]

LAYOUTS = [  # name, tiny_config kwargs, value head
    ("tp2-thd", dict(tp=2), False),
    ("tp2-bshd", dict(tp=2, data_format="bshd"), False),
    ("tp2-thd-fused", dict(tp=2, fused_lm_head=True), False),
    ("pp2-thd", dict(pp=2), False),
    ("pp2-bshd-fused", dict(pp=2, data_format="bshd", fused_lm_head=True), False),
    ("pp2-thd-value", dict(pp=2), True),
]


def _grads(engine) -> dict[str, torch.Tensor]:
    return {f"{i}.{k}": p.main_grad.detach().clone() for i, chunk in enumerate(engine.model)
            for k, p in chunk.module.named_parameters()}


def _pass(engine, batch, select: bool, custom: bool):
    batch = batch.clone()
    batch.set_non_tensor("outputs_on_loss_mask_only", select)
    engine.zero_grad()
    out = engine.forward_backward_batch(batch, masked_loss,
                                        logits_processor_func=custom_processor if custom else None)
    return out, _grads(engine)


def _check_layout(name: str, kwargs: dict, value: bool) -> None:
    from mcore_engine.engine import MegatronEngine

    cfg = tiny_config(**kwargs)
    if value:
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, head="value"))
    engine = MegatronEngine(cfg)
    engine.initialize()
    flag_sets = [("values", {}, False)] if value else FLAG_SETS
    for i, (what, flags, custom) in enumerate(flag_sets):
        if custom and cfg.model.fused_lm_head:
            continue  # a custom processor needs the logits
        batch = response_batch(100 + i, **flags)
        if "temperature" not in flags and not value:
            batch.set("temperature", torch.linspace(0.6, 1.6, NUM_SEQS))
        label = f"{name}, {what}"
        SEEN.clear()
        full, full_grads = _pass(engine, batch, False, custom)
        seen_full = list(SEEN)
        SEEN.clear()
        sel, sel_grads = _pass(engine, batch, True, custom)
        mask = flat_values(batch["loss_mask"]).bool()
        ends = batch["input_ids"].offsets()[1:] - 1
        mask[ends] = False  # the packed loss mask drops each sequence's last token
        keys = sorted(k for k in full.keys() if k not in ("loss", "metrics", "scores"))
        assert keys == sorted(k for k in sel.keys() if k not in ("loss", "metrics")), label
        assert ("scores" in sel.keys()) is False and ("scores" in full.keys()) is value, label
        for key in keys:
            a, b = flat_values(full[key]), flat_values(sel[key])
            assert_rel_close(b[mask], a[mask], TOL, f"{label}: {key} on the selected rows")
            assert not b[~mask].any(), f"{label}: {key} is not 0 off the loss mask"
        assert_rel_close(sel.get_non_tensor("loss"), full.get_non_tensor("loss"), TOL, f"{label}: loss")
        for key, g in full_grads.items():
            if g.any():
                assert_rel_close(sel_grads[key], g, TOL, f"{label}: grad {key}")
            else:
                assert not sel_grads[key].any(), f"{label}: grad {key}"
        if custom and seen_full:  # last stage only: per micro-batch, [1, n_mb] logits and teacher rows
            ok = all(lg == tc and lg[0] == 1 for lg, tc in SEEN) and len(SEEN) == len(seen_full)
            assert ok and sum(lg[1] for lg, _ in SEEN) == int(mask.sum()), \
                f"{label}: the custom processor saw {SEEN} (selected rows: {int(mask.sum())})"
    del engine


def _all_layouts(rank: int, world_size: int) -> None:
    from mcore_engine.parallel.platform import destroy_distributed

    for name, kwargs, value in LAYOUTS:
        _check_layout(name, kwargs, value)
        destroy_distributed()


@pytest.mark.slow
def test_selected_rows_match_the_full_pass_tp2_pp2():
    run_distributed(_all_layouts, 2)


def test_row_selection_take_put():
    from mcore_engine.processor import RowSelection

    mask = torch.tensor([[1, 0, 1], [0, 0, 1]])
    rows = RowSelection(mask)
    x = torch.arange(6.0).reshape(2, 3).requires_grad_()
    taken = rows.take(x)
    assert taken.tolist() == [[0.0, 2.0, 5.0]]
    assert rows.take(0.7) == 0.7 and rows.take(None) is None
    back = rows.put(taken * 2)
    assert back.tolist() == [[0.0, 0.0, 4.0], [0.0, 0.0, 10.0]]
    back.sum().backward()
    assert x.grad.tolist() == [[2.0, 0.0, 2.0], [0.0, 0.0, 2.0]]
    empty = RowSelection(torch.zeros(2, 3))
    assert empty.take(x).shape == (1, 0) and not empty.put(empty.take(x)).any()
    every = RowSelection(torch.ones(2, 3))  # all rows: views, no copies
    y = torch.randn(2, 3, 4)
    assert every.take(y).shape == (1, 6, 4) and every.take(y).data_ptr() == y.data_ptr()
    assert torch.equal(every.put(every.take(y)), y) and every.put(every.take(y)).data_ptr() == y.data_ptr()
    with pytest.raises(ValueError, match="mask"):
        RowSelection(torch.ones(3))
