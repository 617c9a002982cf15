"""The layout comparison of ``tests.compare`` itself.

On a tiny GPT whose RoPE rotates half of each head's channels (no key norm): the key-bias channels
RoPE leaves alone get a gradient of rounding size only, exactly the entries of ``zero_grad_mask``,
while the rotated ones get real gradients; with a key norm, or with full RoPE, nothing is masked. A
wrong norm-weight gradient (5% off) fails the bf16 per-tensor budget while the whole-model
concatenated 2e-2 check of before let it pass. ``AdamSteps.unresolved`` flags the entries whose
AdamW step an fp32-sized gradient error moves by more than the budget, and only those.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from tests.compare import AdamSteps, Attention, assert_tensors_close, bf16_budget, zero_grad_mask
from tests.utils import rel_err, run_distributed


def _grads(rank: int, world_size: int, path: str) -> None:
    from mcore_engine.engine import MegatronEngine
    from tests.engine_setup import policy_loss
    from tests.parallel_setup import batches, config

    out = {}
    for name, changes in (("partial", dict(rotary_percent=0.5)),
                          ("partial-knorm", dict(rotary_percent=0.5, qk_layernorm=True))):
        cfg = config("dense")
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, **changes))
        engine = MegatronEngine(cfg)
        engine.initialize()
        engine.zero_grad()
        engine.forward_backward_batch(batches()[0], policy_loss)
        (chunk,) = engine.model
        out[name] = {"model": cfg.model,
                     "grads": {k: p.main_grad.detach().clone() for k, p in chunk.module.named_parameters()}}
        del engine
        from mcore_engine.parallel.platform import destroy_distributed

        destroy_distributed()
    torch.save(out, path)


@pytest.fixture(scope="module")
def grads(tmp_path_factory) -> dict:
    path = os.path.join(tmp_path_factory.mktemp("compare"), "grads.pt")
    run_distributed(_grads, 1, path)
    return torch.load(path, weights_only=False)


def test_zero_grad_mask_is_the_unrotated_key_bias(grads):
    run = grads["partial"]
    attn = Attention.of(run["model"])
    assert (attn.head_dim, attn.rotated, attn.key_norm) == (16, 8, False)
    for key, g in run["grads"].items():
        mask = zero_grad_mask(key, g.shape, attn)
        if not key.endswith("linear_qkv.bias"):
            assert mask is None, key
            continue
        assert int(mask.sum()) == 2 * 8, key  # 2 query groups x 8 unrotated key channels
        assert float(g[mask].norm()) < 1e-6 * float(g.norm()), (key, g[mask])
        keys = g.view(2, 4, 16)[:, 2]  # [q, q, k, v] per group
        assert (keys[:, :8].abs() > 1e-6 * float(g.norm())).all(), (key, keys)
    # a key norm after the bias gives those channels a real gradient: nothing masked
    run = grads["partial-knorm"]
    attn = Attention.of(run["model"])
    for key, g in run["grads"].items():
        assert zero_grad_mask(key, g.shape, attn) is None
        if key.endswith("linear_qkv.bias"):
            assert float(g.view(2, 4, 16)[:, 2, 8:].norm()) > 1e-3 * float(g.norm()), key


def test_zero_grad_mask_hugging_face_and_full_rope():
    qwen2 = Attention.of_hf(dict(model_type="qwen2", num_attention_heads=4, num_key_value_heads=2,
                                 hidden_size=64))
    assert zero_grad_mask("model.layers.0.self_attn.k_proj.bias", torch.Size([32]), qwen2) is None
    glm = Attention.of_hf(dict(model_type="glm4_moe", num_attention_heads=4, num_key_value_heads=2,
                               hidden_size=64, head_dim=24, use_qk_norm=False,
                               rope_parameters=dict(partial_rotary_factor=0.5)))
    mask = zero_grad_mask("model.layers.0.self_attn.k_proj.bias", torch.Size([48]), glm)
    assert mask.view(2, 24)[:, 12:].all() and not mask.view(2, 24)[:, :12].any()
    assert zero_grad_mask("model.layers.0.self_attn.q_proj.bias", torch.Size([96]), glm) is None
    assert Attention.of_hf(dict(model_type="qwen3", num_attention_heads=4, hidden_size=64)).key_norm


def test_bf16_budget_catches_a_wrong_norm_weight(grads):
    fp32 = grads["partial-knorm"]["grads"]
    attn = Attention.of(grads["partial-knorm"]["model"])
    bf16_ref = {k: v.bfloat16().float() for k, v in fp32.items()}
    budget = bf16_budget(bf16_ref, fp32)
    layout = {k: (v * (1 + 1e-3)).bfloat16().float() for k, v in fp32.items()}
    assert_tensors_close("bf16 layout", layout, fp32, attn=attn, grads=True, tol=budget)
    norm = "decoder.layers.1.input_layernorm.weight"
    wrong = {**layout, norm: layout[norm] * 1.05}
    with pytest.raises(AssertionError, match=norm):
        assert_tensors_close("bf16 layout, one norm weight off", wrong, fp32, attn=attn, grads=True,
                             tol=budget)
    # the concatenated whole-model check at 2e-2 let it through
    flat = [torch.cat([t[k].reshape(-1) for k in sorted(fp32)]) for t in (wrong, fp32)]
    assert rel_err(*flat) < 2e-2


def test_adam_steps_unresolved_are_the_entries_adam_amplifies():
    torch.manual_seed(0)
    lr, eps, n = 3e-3, 1e-8, 4096
    g = torch.randn(n) * 1e-2
    g[:8] = torch.tensor([1e-8, -2e-8, 5e-9, 3e-8, 1e-7, -1e-6, 1e-5, 0.0])
    w0 = torch.randn(n) * 0.05

    def step(grad: torch.Tensor) -> torch.Tensor:
        w = torch.nn.Parameter(w0.clone())
        opt = torch.optim.AdamW([w], lr=lr, eps=eps, weight_decay=0.01)
        w.grad = grad.clone()
        opt.step()
        return w.detach()

    noise = torch.randn(n) * 1e-6 * float(g.norm()) / n ** 0.5  # an fp32-sized gradient error
    a, b = step(g), step(g + noise * (g != 0))
    unresolved = AdamSteps({"w": g}, lr, eps, 1).unresolved(g, float(a.norm()), 1e-5)
    assert unresolved[:4].all() and not unresolved[7] and int(unresolved.sum()) < 16
    assert rel_err(a[~unresolved], b[~unresolved]) < 1e-5 < rel_err(a, b) * 100
    assert float((a - b)[unresolved].abs().max()) <= 2 * lr
    assert_tensors_close("AdamW, one step", {"w": a}, {"w": b}, attn=None, grads=False,
                         adam=AdamSteps({"w": g}, lr, eps, 1))


def test_refuses_what_it_cannot_judge():
    """A NaN on either side, an empty comparison, a parameter the Adam gradients leave out: failures,
    never passes."""
    w = {"norm.weight": torch.ones(8), "proj.weight": torch.randn(4, 8)}
    nan = {k: v.clone() for k, v in w.items()}
    nan["proj.weight"][0, 0] = float("nan")
    wrong = {**w, "norm.weight": w["norm.weight"] * 1.05}
    for got, want in ((w, nan), (nan, w)):
        with pytest.raises(AssertionError, match="non-finite"):
            assert_tensors_close("nan", got, want, attn=None, grads=True)
    with pytest.raises(AssertionError, match="non-finite"):
        bf16_budget(nan, w)
    with pytest.raises(AssertionError, match="nothing to compare"):
        assert_tensors_close("empty", {}, {}, attn=None, grads=True)
    adam = AdamSteps({"proj.weight": torch.randn(4, 8)}, 1e-3, 1e-8, 1)
    with pytest.raises(AssertionError, match="norm.weight"):
        assert_tensors_close("narrowed", wrong, w, attn=None, grads=False, adam=adam)
    # weights after steps: the exact-zero-gradient entries are bounded by Adam's reach, not dropped
    attn = Attention(heads=2, groups=1, head_dim=4, rotated=2, key_norm=False)
    bias = {"k_proj.bias": torch.randn(4)}
    far = {"k_proj.bias": bias["k_proj.bias"] + torch.tensor([0.0, 0.0, 100.0, 0.0])}
    with pytest.raises(AssertionError, match="cannot pin down"):
        assert_tensors_close("key bias", far, bias, attn=attn, grads=False,
                             adam=AdamSteps({"k_proj.bias": torch.randn(4)}, 1e-3, 1e-8, 1))
