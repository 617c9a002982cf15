"""Tinker's six losses (``mcore_engine.integrations.tinker.losses``) against float64 references written
from the plan's table, values and gradients, fp32 and bf16 inputs, clip boundaries, dppo masks, the
critic with and without old values; the batch validation's named errors; and the engine's flat loss on
a real tiny engine (LoRA, one gloo rank) against ``transformers`` + PEFT gradients for every policy loss.

The engine's gradient is read through one Adam step with ``beta1 = beta2 = 0``, ``lr = 1e4``,
``eps = 1e6``: the update is ``-lr * g / (|g| + eps)`` (inverted exactly), read from the PEFT-named
adapters.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

import mcore_engine.integrations.tinker.skyrl_types  # noqa: F401  (skyrl on Python 3.11)
from tests.utils import REL_TOL, assert_rel_close, run_distributed

VOCAB = 250  # tests.hf.models
TOL = REL_TOL[torch.float32]


# ------------------------------------------------------------------------------- float64 references
def reference(loss_fn: str, x, cfg, *, q=None, adv=None, old=None, ret=None, has_old=None, critic=False):
    """The plan's section 3.2 table, written out on float64 tensors."""
    if critic:
        plain = 0.5 * (x - ret) ** 2
        if has_old is None:
            return plain
        c = cfg["value_clip"]
        vc = old + torch.clamp(x - old, -c, c)
        return torch.where(has_old != 0, 0.5 * torch.maximum((vc - ret) ** 2, (x - ret) ** 2), plain)
    if loss_fn == "cross_entropy":
        return -x
    if loss_fn == "importance_sampling":
        return -torch.exp(x - q) * adv
    r = torch.exp(torch.clamp(x - q, -20, 20))
    lo, hi = cfg.get("clip_low_threshold"), cfg.get("clip_high_threshold")
    if loss_fn == "ppo":
        return -torch.minimum(r * adv, torch.clamp(r, lo, hi) * adv)
    if loss_fn == "cispo":
        return -torch.clamp(r, lo, hi).detach() * x * adv
    p, mu = torch.exp(x).detach(), torch.exp(q)
    keep = ~(((adv > 0) & (p - mu > cfg["delta_high"])) | ((adv < 0) & (mu - p > cfg["delta_low"])))
    return -r * adv * keep.double()


def _inputs(seed: int, n: int = 37):
    g = torch.Generator().manual_seed(seed)
    lp = -torch.rand(n, generator=g, dtype=torch.float64) * 3 - 0.01
    q = lp + torch.randn(n, generator=g, dtype=torch.float64) * 0.4  # ratios on both sides of the clips
    adv = torch.randn(n, generator=g, dtype=torch.float64)
    w = torch.rand(n, generator=g, dtype=torch.float64) * 2 - 0.5  # negative weights too (custom losses)
    return lp, q, adv, w


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("loss_fn", ["cross_entropy", "importance_sampling", "ppo", "cispo", "dppo"])
def test_policy_losses_match_float64(loss_fn, dtype):
    from mcore_engine.integrations.tinker.losses import elementwise, resolve_config

    cfg = resolve_config(loss_fn, {"clip_low_threshold": 0.7, "clip_high_threshold": 1.3}
                         if loss_fn in ("ppo", "cispo") else {"delta_low": 0.1, "delta_high": 0.15}
                         if loss_fn == "dppo" else None)
    lp, q, adv, w = _inputs(hash(loss_fn) % 1000)
    x = lp.to(dtype).requires_grad_()
    got = elementwise(loss_fn, x, cfg, sampling_logprobs=q.to(dtype), advantages=adv.to(dtype))
    assert got.dtype == torch.float32
    (got * w.float()).sum().backward()
    ref_x = lp.to(dtype).double().requires_grad_()  # the same rounded inputs, in float64
    ref = reference(loss_fn, ref_x, cfg, q=q.to(dtype).double(), adv=adv.to(dtype).double())
    (ref * w).sum().backward()
    tol = TOL if dtype == torch.float32 else 1e-5  # computed in fp32 from the bf16 inputs
    assert_rel_close(got, ref, tol, f"{loss_fn} {dtype} values")
    assert_rel_close(x.grad.double(), ref_x.grad, max(tol, 1e-2 if dtype == torch.bfloat16 else 0),
                     f"{loss_fn} {dtype} gradient")


def test_clip_boundaries_and_dppo_masks():
    from mcore_engine.integrations.tinker.losses import elementwise, resolve_config

    # ratios on both sides of each clip edge (0.8, 1.2) with A = +1 / -1
    r = torch.tensor([0.5, 0.79, 0.81, 1.0, 1.19, 1.21, 2.0], dtype=torch.float64)
    q = torch.full((7,), -1.0, dtype=torch.float64)
    lp = (q + r.log()).requires_grad_()
    cfg = resolve_config("ppo", None)
    for sign in (1.0, -1.0):
        adv = torch.full((7,), sign, dtype=torch.float64)
        x = lp.detach().float().requires_grad_()
        loss = elementwise("ppo", x, cfg, sampling_logprobs=q.float(), advantages=adv.float())
        loss.sum().backward()
        # A > 0: the clipped branch (no gradient) above 1.2; A < 0: below 0.8
        live = r <= 1.2 if sign > 0 else r >= 0.8
        want = torch.where(live, -sign * r, torch.zeros_like(r))
        assert_rel_close(x.grad.double(), want, 1e-6, f"ppo gradient, A={sign}")
        assert_rel_close(loss.double(), -torch.minimum(r * sign, r.clamp(0.8, 1.2) * sign), 1e-6, "ppo value")
    # cispo: the clipped ratio is a constant weight on -lp * A
    x = lp.detach().float().requires_grad_()
    elementwise("cispo", x, resolve_config("cispo", None), sampling_logprobs=q.float(),
                advantages=torch.ones(7)).sum().backward()
    assert_rel_close(x.grad.double(), -r.clamp(0.8, 1.2), 1e-6, "cispo gradient")
    # dppo: p - mu against delta_high for A > 0, mu - p against delta_low for A < 0
    q = torch.log(torch.tensor([0.5, 0.5, 0.5, 0.5]))
    p = torch.tensor([0.75, 0.65, 0.25, 0.35])  # +0.25, +0.15, -0.25, -0.15
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0])
    x = p.log().requires_grad_()
    out = elementwise("dppo", x, resolve_config("dppo", None), sampling_logprobs=q, advantages=adv)
    out.sum().backward()
    mask = torch.tensor([0.0, 1.0, 0.0, 1.0])
    assert torch.equal(x.grad == 0, mask == 0), x.grad
    assert_rel_close(out.double(), (-(p / 0.5) * adv * mask).double(), 1e-6, "dppo values")
    # the mask is on the advantage's sign: A > 0 with p falling, A < 0 with p rising are kept
    out = elementwise("dppo", x.detach(), resolve_config("dppo", None), sampling_logprobs=q, advantages=-adv)
    assert (out != 0).all()
    # a huge log-ratio is clamped (no inf * 0 = nan)
    big = elementwise("ppo", torch.tensor([0.0]), cfg, sampling_logprobs=torch.tensor([-100.0]),
                      advantages=torch.tensor([0.0]))
    assert torch.isfinite(big).all()


@pytest.mark.parametrize("with_old", [True, False])
def test_critic_loss(with_old):
    from mcore_engine.integrations.tinker.losses import elementwise, resolve_config

    g = torch.Generator().manual_seed(5)
    v = torch.randn(29, generator=g, dtype=torch.float64)
    old = v + torch.randn(29, generator=g, dtype=torch.float64) * 0.5  # some beyond the 0.3 clip
    ret = torch.randn(29, generator=g, dtype=torch.float64)
    w = torch.rand(29, generator=g, dtype=torch.float64)
    cfg = resolve_config("ppo_critic", {"value_clip": 0.3})
    has = torch.ones(29) if with_old else None
    for loss_fn in ("ppo_critic", "ppo"):
        x = v.float().requires_grad_()
        got = elementwise(loss_fn, x, {**cfg, "value_clip": 0.3}, critic=True, old_values=old.float(),
                          returns=ret.float(), has_old_values=has)
        (got * w.float()).sum().backward()
        rx = v.clone().requires_grad_()
        ref = reference(loss_fn, rx, cfg, old=old, ret=ret, has_old=has, critic=True)
        (ref * w).sum().backward()
        assert_rel_close(got, ref, TOL, f"critic {loss_fn} values")
        assert_rel_close(x.grad.double(), rx.grad, TOL, f"critic {loss_fn} gradient")
    if with_old:  # the clip matters on this data
        assert not torch.allclose(ref, 0.5 * (v - ret) ** 2)


def test_config_and_role_refusals():
    from mcore_engine.integrations.tinker.losses import elementwise, resolve_config

    with pytest.raises(ValueError, match="loss_fn_config: unknown key 'delta_low'"):
        resolve_config("ppo", {"delta_low": 0.1})
    with pytest.raises(ValueError, match="loss_fn: 'dro' is not supported"):
        resolve_config("dro", None)
    with pytest.raises(ValueError, match="loss_fn_config.value_clip must be finite"):
        resolve_config("ppo_critic", {"value_clip": math.inf})
    assert resolve_config("ppo", {"clip_low_threshold": 0.5})["clip_high_threshold"] == 1.2
    with pytest.raises(ValueError, match="critic model"):
        elementwise("ppo_critic", torch.zeros(2), {"value_clip": 0.2})
    with pytest.raises(ValueError, match="a critic takes"):
        elementwise("cross_entropy", torch.zeros(2), {}, critic=True, returns=torch.zeros(2))


# ------------------------------------------------------------------------------- shared test pieces
def tiny_model(root: Path) -> str:
    """A random fp32 Llama folder (vocab 250, hidden 64, 2 layers, untied) under ``root``."""
    from tests.hf.models import save_tiny_model

    path = root / "models" / "tiny"
    if not (path / "config.json").exists():
        save_tiny_model("llama", path, seed=3)
    return str(path)


def make_datum(seed: int, n: int, loss_fn: str = "cross_entropy", *, critic: bool = False,
               values: bool = False) -> dict:
    """A datum of ``n`` input tokens with next-token targets and fresh random fields (plain lists)."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (n + 1,), generator=g).tolist()
    d = {"inputs": tokens[:-1], "targets": tokens[1:],
         "weights": (torch.rand(n, generator=g) * 1.5 + 0.1).tolist(), "logprobs": [], "advantages": [],
         "values": [], "returns": []}
    if loss_fn in ("importance_sampling", "ppo", "cispo", "dppo") and not critic:
        d["logprobs"] = (-torch.rand(n, generator=g) * 6 - 2).tolist()  # near the random model's
        d["advantages"] = torch.randn(n, generator=g).tolist()
    if critic:
        d["returns"] = torch.randn(n, generator=g).tolist()
        if values:
            d["values"] = (torch.randn(n, generator=g) * 0.5).tolist()
    return d


def prepared(requests: list[tuple[str, str, str, dict | None, list[dict]]]):
    """A ``PreparedModelPassBatch`` of ``(request_id, model_id, loss_fn, loss_fn_config, datums)``."""
    from skyrl.tinker import types

    fields: dict[str, list] = {k: [] for k in ("all_model_inputs", "all_targets", "all_token_weights",
                                               "all_sampling_logprobs", "all_advantages", "all_values",
                                               "all_returns", "all_model_ids", "all_loss_fns",
                                               "all_loss_fn_configs")}
    slices = []
    for request_id, model_id, loss_fn, cfg, datums in requests:
        start = len(fields["all_targets"])
        for d in datums:
            chunks = d.get("chunks") or [types.EncodedTextChunk(tokens=d["inputs"])]
            fields["all_model_inputs"].append(types.ModelInput(chunks=chunks))
            fields["all_targets"].append(d["targets"])
            fields["all_token_weights"].append(d["weights"])
            fields["all_sampling_logprobs"].append(d["logprobs"])
            fields["all_advantages"].append(d["advantages"])
            fields["all_values"].append(d["values"])
            fields["all_returns"].append(d["returns"])
            fields["all_model_ids"].append(model_id)
            fields["all_loss_fns"].append(loss_fn)
            fields["all_loss_fn_configs"].append(cfg)
        slices.append((request_id, model_id, start, len(fields["all_targets"])))
    return types.PreparedModelPassBatch(**fields, request_batch_slices=slices)


def lora_config(rank: int, seed: int = 7, **flags):
    from skyrl.tinker import types

    return types.LoraConfig(rank=rank, alpha=32.0, seed=seed, **flags)


def hf_log_probs(model, datums: list[dict]) -> list[torch.Tensor]:
    """``log p(targets[i] | inputs[:i+1])`` per datum from a transformers (or PEFT) causal LM."""
    out = []
    for d in datums:
        logits = model(input_ids=torch.tensor([d["inputs"]])).logits[0].float()
        out.append(torch.log_softmax(logits, -1).gather(-1, torch.tensor(d["targets"])[:, None])[:, 0])
    return out


def peft_loss(model, datums: list[dict], loss_fn: str, cfg: dict) -> torch.Tensor:
    """``sum w * l`` over ``datums`` on a transformers / PEFT model (differentiable)."""
    from mcore_engine.integrations.tinker.losses import elementwise

    total = 0.0
    for d, lp in zip(datums, hf_log_probs(model, datums), strict=True):
        t = {k: torch.tensor(d[k]) if d[k] else None for k in ("logprobs", "advantages")}
        ell = elementwise(loss_fn, lp, cfg, sampling_logprobs=t["logprobs"], advantages=t["advantages"])
        total = total + (ell * torch.tensor(d["weights"])).sum()
    return total


# ------------------------------------------------------------------------------- the engine's flat loss
POLICY = ["cross_entropy", "importance_sampling", "ppo", "cispo", "dppo"]
LR, EPS = 1e4, 1e6  # one Adam step with beta1 = beta2 = 0: the update is lr * g / (|g| + eps) ~ 1e-2 g


def _engine_gradients(rank: int, world_size: int, root: str) -> None:
    """One LoRA model, warmed up by a cross-entropy step (so B != 0); then per policy loss: its adapters
    exported to PEFT, one forward_backward + an SGD-like Adam step (``beta1 = beta2 = 0``, ``eps >> |g|``),
    the gradient recovered from the adapter change against PEFT's gradient of the same loss."""
    import peft
    import transformers
    from skyrl.tinker import types

    from mcore_engine.integrations.tinker.backend import McoreEngineBackend
    from mcore_engine.integrations.tinker.config import McoreBackendConfig
    from mcore_engine.integrations.tinker.losses import resolve_config

    base = tiny_model(Path(root))
    backend = McoreEngineBackend(base, McoreBackendConfig(max_models=1))
    hf = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    backend.create_model("m", lora_config(4, seed=11))
    engine = backend._impl.engines["m"]
    warm = [make_datum(90 + j, 9) for j in range(2)]
    backend.forward_backward(prepared([("w", "m", "cross_entropy", None, warm)]))
    backend.optim_step("m", types.OptimStepInput(adam_params=types.AdamParams(
        learning_rate=3e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.0)))
    sgd = types.OptimStepInput(adam_params=types.AdamParams(learning_rate=LR, beta1=0.0, beta2=0.0, eps=EPS,
                                                            weight_decay=0.0))
    for i, loss_fn in enumerate(POLICY):
        before = dict(engine.per_tensor_generator(torch.float32, adapter_only=True))
        folder = Path(root) / f"adapter-{loss_fn}"
        engine.export_adapter(folder, torch.float32)
        model = peft.PeftModel.from_pretrained(hf, folder, is_trainable=True)
        datums = [make_datum(100 * i + j, n, loss_fn) for j, n in enumerate((5, 11, 8))]
        cfg = {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1} if loss_fn in ("ppo", "cispo") else None
        out = backend.forward_backward(prepared([("r", "m", loss_fn, cfg, datums)]))["r"]
        assert isinstance(out, types.ForwardBackwardOutput), out
        backend.optim_step("m", sgd)
        after = dict(engine.per_tensor_generator(torch.float32, adapter_only=True))
        loss = peft_loss(model, datums, loss_fn, resolve_config(loss_fn, cfg))
        loss.backward()
        assert abs(out.metrics["loss:sum"] - loss.item()) <= 1e-5 * max(1.0, abs(loss.item())), \
            (loss_fn, out.metrics, loss.item())
        grads = {n.replace(".default", ""): p.grad for n, p in model.named_parameters() if p.grad is not None}
        assert set(grads) == set(before), sorted(set(grads) ^ set(before))[:4]
        delta = torch.cat([(before[k] - after[k]).flatten() for k in sorted(grads)]).double()
        got = delta * EPS / (LR - delta.abs())  # exact inverse of lr * g / (|g| + eps)
        want = torch.cat([grads[k].flatten() for k in sorted(grads)])
        assert want.norm() > 0, loss_fn
        # two implementations' fp32 sums (Megatron vs transformers): 1.4e-5 measured under avx2
        assert_rel_close(got, want, 5e-5, f"{loss_fn}: engine gradient vs PEFT")
        hf = model.unload()


@pytest.mark.slow
def test_engine_flat_loss_matches_peft_gradient(tmp_path):
    run_distributed(_engine_gradients, 1, str(tmp_path))
