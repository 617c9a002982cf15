"""Temperature (``ops/temperature.py``): the unit check, out-of-place scaling, and the accepted shapes
(``[N]``, ``[N, 1]``, per sequence ``[B, 1]``) in every op, the processors and the fused lm-head."""

from __future__ import annotations

import pytest
import torch

from mcore_engine import ops
from mcore_engine.ops import temperature as temp_mod
from mcore_engine.ops.lm_head import fused_lm_head_outputs
from mcore_engine.processor import process_lm_head_hidden, process_lm_head_logits

LEAD, V = (3, 5), 77
N, H, K = 7, 6, 3


def test_unit_temperature_detection() -> None:
    assert ops.is_scalar_unit_temperature(1) and ops.is_scalar_unit_temperature(1.0)
    # bool is rejected as a temperature (ValueError), so it is consistently not "unit" either
    assert not ops.is_scalar_unit_temperature(True)
    for t in (torch.tensor(1.0), torch.ones(3), 1.0000001, 0.9999999, 2, 0.3, "1", None):
        assert not ops.is_scalar_unit_temperature(t), t


def test_scale_logits_by_temperature() -> None:
    x = torch.randn(*LEAD, V, dtype=torch.float64) * 5
    for unit in (1, 1.0):
        assert ops.scale_logits_by_temperature(x, unit) is x
    x0 = x.clone()
    up = torch.randn(*LEAD, V, dtype=torch.float64)
    for t in (0.3, 3.0, torch.tensor(1.0), torch.tensor(0.7), torch.rand(LEAD) + 0.2, torch.rand(3, 1) + 0.2):
        xl = x.clone().requires_grad_(True)
        y = ops.scale_logits_by_temperature(xl, t)
        assert y is not xl and y.data_ptr() != xl.data_ptr()
        tt = t.double()[..., None] if isinstance(t, torch.Tensor) and t.dim() else t
        torch.testing.assert_close(y, x / tt, rtol=1e-12, atol=0)
        (gx,) = torch.autograd.grad((y * up).sum(), xl)
        torch.testing.assert_close(gx, up / tt, rtol=1e-12, atol=0)
        assert torch.equal(xl.detach(), x0)
    for bad in (0.0, torch.ones(4)):
        with pytest.raises(ValueError, match="temperature"):
            ops.scale_logits_by_temperature(x, bad)


def test_scale_logits_by_temperature_keeps_the_logits_dtype() -> None:
    x = torch.randn(*LEAD, V, dtype=torch.bfloat16)
    for t in (0.7, torch.tensor(0.7), torch.rand(LEAD) + 0.5, torch.rand(LEAD, dtype=torch.float64) + 0.5):
        assert ops.scale_logits_by_temperature(x, t).dtype == torch.bfloat16, t


@pytest.mark.parametrize("t_dtype", [torch.float32, torch.float64])
def test_scale_logits_by_temperature_per_token_rounds_once(t_dtype: torch.dtype) -> None:
    """bf16 logits / a wider per-token t: the promoted quotient rounded once to bf16, value and gradient,
    in chunks (rows > one chunk), for a non-contiguous view too."""
    base = (torch.randn(9, 2, 300, dtype=torch.float64) * 4).to(torch.bfloat16)
    t = torch.rand(2, 9, dtype=t_dtype) + 0.3
    up = torch.randn(2, 9, 300).to(torch.bfloat16)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(temp_mod, "DEFAULT_CHUNK_ELEMENTS", 4 * 300)  # 5 chunks of 4 rows
        for x in (base.transpose(0, 1).contiguous(), base.transpose(0, 1)):
            xl = x.detach().requires_grad_(True)
            y = ops.scale_logits_by_temperature(xl, t)
            assert y.dtype == torch.bfloat16 and y.shape == x.shape
            assert torch.equal(y, (x.to(t_dtype) / t[..., None]).to(torch.bfloat16))
            (gx,) = torch.autograd.grad(y, xl, up)
            assert gx.dtype == torch.bfloat16
            assert torch.equal(gx, (up.to(t_dtype) / t[..., None]).to(torch.bfloat16))


def _inputs():
    g = torch.Generator().manual_seed(5)
    hidden, weight = torch.randn(N, H, generator=g), torch.randn(V, H, generator=g)
    labels = torch.randint(0, V, (N,), generator=g)
    ids = torch.rand(N, V, generator=g).argsort(-1)[:, :K]
    tlp = torch.randn(N, K, generator=g).log_softmax(-1) - 0.2
    return hidden, weight, labels, ids, tlp, torch.rand(N, generator=g) + 0.5


# Every entry point that takes a temperature, as f(hidden, weight, labels, ids, tlp, t) -> tensor.
FLAGS = dict(calculate_sum_pi_squared=True, calculate_entropy=True, distillation_use_topk=True,
             distillation_only=False)
ENTRY_POINTS = {
    "scale_logits_by_temperature": lambda h, w, lab, ids, tlp, t: ops.scale_logits_by_temperature(h @ w.T, t),
    "log_probs": lambda h, w, lab, ids, tlp, t: ops.vocab_parallel_log_probs(h @ w.T, lab, temperature=t),
    "entropy": lambda h, w, lab, ids, tlp, t: ops.vocab_parallel_entropy(h @ w.T, temperature=t),
    "sum_pi_squared": lambda h, w, lab, ids, tlp, t: ops.vocab_parallel_sum_pi_squared(h @ w.T,
                                                                                       temperature=t),
    "forward_kl_topk": lambda h, w, lab, ids, tlp, t: ops.vocab_parallel_forward_kl_topk(
        h @ w.T, ids, tlp, temperature=t, kl_tail=True)["distillation_losses"],
    "topk": lambda h, w, lab, ids, tlp, t: ops.vocab_parallel_topk(h @ w.T, 4, temperature=t)[0],
    "logits_outputs": lambda h, w, lab, ids, tlp, t: torch.stack(list(ops.vocab_parallel_logits_outputs(
        h @ w.T, labels=lab, entropy=True, temperature=t).values())),
    "fused_lm_head": lambda h, w, lab, ids, tlp, t: torch.stack(list(fused_lm_head_outputs(
        h, w, labels=lab, teacher_ids=ids, teacher_log_probs=tlp, entropy=True, temperature=t,
        chunk_size=3).values())),
    "process_lm_head_logits": lambda h, w, lab, ids, tlp, t: torch.stack(list(process_lm_head_logits(
        h @ w.T, lab, t, **FLAGS, batch={"teacher_ids": ids, "teacher_logprobs": tlp}).values())),
    "process_lm_head_hidden": lambda h, w, lab, ids, tlp, t: torch.stack(list(process_lm_head_hidden(
        h, w, lab, t, **FLAGS, batch={"teacher_ids": ids, "teacher_logprobs": tlp}).values())),
}


@pytest.mark.parametrize("entry", sorted(ENTRY_POINTS))
def test_per_token_temperature_with_a_trailing_one_is_per_token(entry: str) -> None:
    """``[N, 1]`` with ``[N, V]`` logits (verl's layout) means per token, exactly as ``[N]``."""
    h, w, lab, ids, tlp, t = _inputs()
    fn = ENTRY_POINTS[entry]
    ref = fn(h, w, lab, ids, tlp, t)
    got = fn(h, w, lab, ids, tlp, t[:, None])
    assert got.shape == ref.shape
    torch.testing.assert_close(got, ref, rtol=0, atol=0)


@pytest.mark.parametrize("entry", sorted(ENTRY_POINTS))
@pytest.mark.parametrize("shape", [(N, 2), (2, N), (1, N, 1, 1), (N + 1,)])
def test_temperature_that_does_not_broadcast_to_the_tokens_is_refused(entry: str, shape) -> None:
    h, w, lab, ids, tlp, _ = _inputs()
    with pytest.raises(ValueError, match=r"temperature.*\(7,\).*" + r"\(" + ", ".join(map(str, shape))):
        ENTRY_POINTS[entry](h, w, lab, ids, tlp, torch.rand(shape) + 0.5)


def test_per_sequence_temperature_broadcasts_over_the_sequence() -> None:
    """``[B, 1]`` with ``[B, S, V]`` logits: one temperature per sequence (broadcast over S)."""
    x = torch.randn(*LEAD, V)
    t = torch.rand(LEAD[0], 1) + 0.5
    got = ops.vocab_parallel_entropy(x, temperature=t)
    torch.testing.assert_close(got, ops.vocab_parallel_entropy(x, temperature=t.expand(LEAD).contiguous()))
