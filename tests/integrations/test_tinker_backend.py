"""``McoreEngineBackend`` driven directly (no HTTP) with hand-built SkyRL batches, on a tiny Llama folder.

Three gloo launches, in order:

1. TP = 2 (two ranks: the controller drives, rank 1 runs ``control.run_worker``): a fixed script (LoRA
   and full fine-tuning: forward, forward_backward of two loss groups in one call, optim_step with
   clipping and weight decay, forward; a critic's values, ppo_critic loss and step), protocol errors,
   then ``save_state``, one more step.
2. One rank: the same script equals TP = 2 (fp32 1e-5); the TP = 2 checkpoint loads here and the next
   step equals TP = 2's; gradient accumulation (2 calls == 1 call); bad input -> ``ErrorResponse``
   naming field and datum, grads and weights unchanged; optim_step vs ``torch.optim.AdamW`` on PEFT
   (two steps, clip, weight decay; fp32 1e-5) through the exported sampler archives; the sampler hook;
   full fine-tuning vs transformers and its HF / MARKER archives; save -> load -> identical next loss,
   ``optimizer=False`` resets Adam, a mismatched checkpoint refused; the critic; model limits.
3. PP = 2 (two ranks): the script equals the one-rank run.
"""

from __future__ import annotations

import json
import tarfile
from pathlib import Path

import pytest
import torch

import mcore_engine.integrations.tinker.skyrl_types  # noqa: F401  (skyrl on Python 3.11)
from tests.integrations.test_tinker_losses import (
    VOCAB,
    hf_log_probs,
    lora_config,
    make_datum,
    peft_loss,
    prepared,
    tiny_model,
)
from tests.utils import assert_rel_close, run_distributed

TOL = 1e-5
X = [(1, 7), (2, 12)]  # (seed, tokens) of the cross-entropy datums
Y = [(3, 9), (4, 6)]  # of the ppo datums
PPO_CFG = {"clip_low_threshold": 0.9, "clip_high_threshold": 1.15}


def _x() -> list[dict]:
    return [make_datum(s, n) for s, n in X]


def _y() -> list[dict]:
    return [make_datum(s, n, "ppo") for s, n in Y]


def _adam(lr: float = 1e-2, clip: float = 0.0, **kw):
    from mcore_engine.integrations.tinker.backend import types

    class Params(types.AdamParams):  # what _compat's McoreAdamParams adds
        grad_clip_norm: float = 0.0

    class Step(types.OptimStepInput):
        adam_params: Params

    p = dict(learning_rate=lr, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.0) | kw
    return Step(adam_params=Params(**p, grad_clip_norm=clip))


def _out(result, key: str = "logprobs") -> list[torch.Tensor]:
    from mcore_engine.integrations.tinker.backend import types

    assert isinstance(result, types.ForwardBackwardOutput), result
    for o in result.loss_fn_outputs:
        assert o[key]["dtype"] == "float32" and o[key]["shape"] == [len(o[key]["data"])]
    return [torch.tensor(o[key]["data"], dtype=torch.float64) for o in result.loss_fn_outputs]


def _forward(backend, model_id: str, datums: list[dict]) -> list[torch.Tensor]:
    return _out(backend.forward(prepared([("f", model_id, "cross_entropy", None, datums)]))["f"])


def _fb_step(backend, model_id: str, step) -> dict:
    """forward_backward of the cross-entropy and ppo groups in one call, one optim_step."""
    res = backend.forward_backward(prepared([("a", model_id, "cross_entropy", None, _x()),
                                             ("b", model_id, "ppo", PPO_CFG, _y())]))
    metrics = backend.optim_step(model_id, step).metrics
    return {"loss_a": torch.tensor(res["a"].metrics["loss:sum"], dtype=torch.float64),
            "loss_b": torch.tensor(res["b"].metrics["loss:sum"], dtype=torch.float64),
            "ew_b": torch.cat(_out(res["b"], "elementwise_loss")), "lp_b": torch.cat(_out(res["b"])),
            "grad_norm": torch.tensor(metrics["skyrl.ai/grad_norm"], dtype=torch.float64)}


def _critic_data() -> list[dict]:
    return [make_datum(50, 8, critic=True, values=True), make_datum(51, 6, critic=True)]


def _script(backend) -> dict:
    """What every layout runs: LoRA (rank 4, attention + MLP), full fine-tuning and a critic."""
    got = {}
    backend.create_model("lora", lora_config(4, seed=5))
    backend.create_model("full", lora_config(0, seed=5))
    for model_id in ("lora", "full"):
        r = {"f0": torch.cat(_forward(backend, model_id, _x()))}
        r.update(_fb_step(backend, model_id, _adam(lr=2e-2, clip=0.5, weight_decay=0.01)))
        r["f1"] = torch.cat(_forward(backend, model_id, _x()))
        got[model_id] = r
    backend.create_model("value", lora_config(0, seed=5), model_role="critic")
    request = [("c", "value", "ppo_critic", {"value_clip": 0.1}, _critic_data())]
    r = {"v0": torch.cat(_out(backend.forward(prepared(request))["c"], "values"))}
    fb = backend.forward_backward(prepared(request))["c"]
    r["loss"] = torch.tensor(fb.metrics["loss:sum"], dtype=torch.float64)
    metrics = backend.optim_step("value", _adam(lr=1e-2)).metrics
    r["grad_norm"] = torch.tensor(metrics["skyrl.ai/grad_norm"], dtype=torch.float64)
    r["v1"] = torch.cat(_out(backend.forward(prepared(request))["c"], "values"))
    got["value"] = r
    return got


# Outputs after an Adam step: Adam's g / sqrt(v) turns the layouts' 1e-7 rounding of small gradients
# into larger weight differences (measured up to 1.4e-5 under ATEN_CPU_CAPABILITY=avx2)
AFTER_STEP = {"f1", "v1"}


def _same(got: dict, ref: dict, what: str, tol: float = TOL) -> None:
    for model_id, r in ref.items():
        for key, value in r.items():
            bound = max(tol, 1e-4) if key in AFTER_STEP else tol
            assert_rel_close(got[model_id][key], value, bound, f"{what}: {model_id} {key}")


def _next_step(backend, model_id: str) -> dict:
    out = _fb_step(backend, model_id, _adam(lr=1e-2, weight_decay=0.02))
    out["f"] = torch.cat(_forward(backend, model_id, _x()))
    return out


def _layout(rank: int, world_size: int, root: str, name: str) -> None:
    from mcore_engine.integrations.tinker.backend import McoreEngineBackend, run_worker
    from mcore_engine.integrations.tinker.config import McoreBackendConfig

    cfg = McoreBackendConfig(tensor_parallel_size=2 if name == "tp2" else 1,
                             pipeline_parallel_size=2 if name == "pp2" else 1)
    base = tiny_model(Path(root))
    if rank != 0:
        run_worker(base, cfg)
        return
    backend = McoreEngineBackend(base, cfg)
    try:
        got = _script(backend)
        if name == "tp2":
            _check_protocol_errors(backend)
            backend.save_checkpoint(Path(root, "ckpt", "lora", "tp2.tar.gz"), "lora")
            got["next"] = _next_step(backend, "lora")
            torch.save(got, Path(root, "tp2.pt"))
        else:
            _same(got, torch.load(Path(root, "tp1.pt")), name)
    finally:
        backend.shutdown()


def _check_protocol_errors(backend) -> None:
    """A command failing on every rank: one error naming each rank; the ranks stay in step; a bad
    archive is refused on the controller before anything is broadcast."""
    with pytest.raises(RuntimeError, match=r"rank 0: KeyError: 'missing'; rank 1: KeyError: 'missing'"):
        backend._ctrl.call("step", model_id="missing", lr=0.0, beta1=0.9, beta2=0.9, eps=1e-8,
                           weight_decay=0.0, grad_clip_norm=0.0)
    bogus = Path(backend.base_model) / "config.json"
    with pytest.raises(ValueError, match="not a readable checkpoint archive"):
        backend.load_checkpoint(bogus, "lora")
    assert backend.has_model("lora")


# ------------------------------------------------------------------------------- one rank
class RecordingSampler:
    """Stands in for ``sampling.Sampler`` (the backend's ``_sampler`` hook): records what it is given."""

    def __init__(self) -> None:
        self.put_calls: list[tuple[str, str, dict]] = []
        self.dropped: list[str] = []
        self.batches: list = []

    def put(self, model_id: str, checkpoint_id: str, state_dict: dict) -> None:
        self.put_calls.append((model_id, checkpoint_id, state_dict))

    def drop(self, model_id: str) -> None:
        self.dropped.append(model_id)

    def sample(self, batch):
        from mcore_engine.integrations.tinker.backend import types

        self.batches.append(batch)
        empty = types.SampleOutput(sequences=[], prompt_logprobs=None)
        return {s[0]: empty for s in batch.request_batch_slices}


def _grads(engine) -> dict[str, torch.Tensor]:
    return {k: p.main_grad.detach().clone() for chunk in engine.model
            for k, p in chunk.module.named_parameters() if p.requires_grad}


def _unpack(archive: Path, dest: Path) -> list[str]:
    with tarfile.open(archive, "r:gz") as tar:
        tar.extractall(dest, filter="data")
    return sorted(p.name for p in dest.iterdir())


def _bad_requests(model_id: str) -> list[tuple[tuple, str]]:
    """(request, words its error must hold) for every validation rule."""
    from mcore_engine.integrations.tinker.backend import types

    def d(**change):
        out = [make_datum(20, 6), make_datum(21, 5)]
        out[1] = {**out[1], **change}
        return out

    good = make_datum(21, 5)
    long = make_datum(22, 64)
    ce = "cross_entropy"
    return [
        (("oov", model_id, "cross_entropy", None, d(targets=good["targets"][:-1] + [VOCAB])),
         "datum 1: target_tokens[4] = 250 is outside the vocabulary"),
        (("neg", model_id, ce, None, d(inputs=[-1] + good["inputs"][1:])), "datum 1: model_input[0]"),
        (("wlen", model_id, ce, None, d(weights=good["weights"][:-1])), "datum 1: weights must have 5"),
        (("nan", model_id, "cross_entropy", None, d(weights=[float("nan")] + good["weights"][1:])),
         "datum 1: weights[0] is not finite"),
        (("shift", model_id, "cross_entropy", None, d(targets=[good["targets"][1]] + good["targets"][1:])),
         "datum 1: target_tokens[0] != model_input[1]"),
        (("tlen", model_id, ce, None, d(targets=good["targets"] + [3])), "datum 1: target_tokens has 6"),
        (("img", model_id, "cross_entropy", None,
          d(chunks=[types.EncodedTextChunk(tokens=good["inputs"]),
                    types.ImageAssetPointerChunk(format="png", location="x")])), "model_input.chunks[1]"),
        (("adv", model_id, "ppo", None, [{**make_datum(23, 6, "ppo"), "advantages": []}]),
         "datum 0: advantages must have 6 values (one per target token), got missing"),
        (("crit", model_id, "ppo_critic", None, d()), "loss_fn: 'ppo_critic' is only valid for critic"),
        (("nomodel", "nope", "cross_entropy", None, d()), "model_id: model 'nope' not found"),
        (("long", model_id, "cross_entropy", None, [long]), "max_position_embeddings 64"),
    ]


def _check_bad_input(backend) -> None:
    """Gradients accumulated, then bad requests: named errors, grads and the next forward unchanged;
    a good request beside bad ones runs."""
    from mcore_engine.integrations.tinker.backend import types

    engine = backend._impl.engines["acc"]
    backend.forward_backward(prepared([("g", "acc", "cross_entropy", None, _x())]))
    grads, fwd = _grads(engine), _forward(backend, "acc", _x())
    assert any(g.abs().sum() > 0 for g in grads.values())
    cases = _bad_requests("acc")
    res = backend.forward_backward(prepared([c for c, _ in cases]))
    for request, words in cases:
        out = res[request[0]]
        assert isinstance(out, types.ErrorResponse) and out.status == "failed", (request[0], out)
        assert words in out.error, (request[0], out.error)
    after = _grads(engine)
    assert all(torch.equal(after[k], grads[k]) for k in grads), "bad input changed the gradients"
    assert all(torch.equal(a, b) for a, b in zip(_forward(backend, "acc", _x()), fwd, strict=True))
    mixed = backend.forward_backward(prepared([cases[0][0], ("ok", "acc", "cross_entropy", None, _y()[:1])]))
    assert isinstance(mixed["oov"], types.ErrorResponse)
    assert isinstance(mixed["ok"], types.ForwardBackwardOutput)
    assert any(not torch.equal(_grads(engine)[k], grads[k]) for k in grads)


def _check_accumulation(backend) -> None:
    engine = backend._impl.engines["acc"]
    x = _x()
    backend.forward_backward(prepared([("1", "acc", "cross_entropy", None, x[:1])]))
    backend.forward_backward(prepared([("2", "acc", "ppo", PPO_CFG, _y())]))
    backend.forward_backward(prepared([("3", "acc", "cross_entropy", None, x[1:])]))
    two = _grads(engine)
    engine.zero_grad()
    backend.forward_backward(prepared([("4", "acc", "cross_entropy", None, x),
                                       ("5", "acc", "ppo", PPO_CFG, _y())]))
    one = _grads(engine)
    engine.zero_grad()
    got = torch.cat([two[k].flatten() for k in sorted(two)])
    want = torch.cat([one[k].flatten() for k in sorted(one)])
    assert want.norm() > 0
    assert_rel_close(got, want, 1e-6, "3 forward_backward calls vs 1")


def _check_adam_vs_peft(backend, root: Path, sampler: RecordingSampler) -> None:
    """Two steps (ce + ppo accumulated over two calls; weight decay; clip on step 2) vs torch AdamW on
    PEFT, starting from the engine's exported adapters; attention-only LoRA."""
    import peft
    import transformers
    from safetensors.torch import load_file

    from mcore_engine.integrations.tinker.losses import resolve_config

    backend.create_model("p", lora_config(4, seed=9, train_mlp=False, train_unembed=True))
    sampler_dir = root / "ckpt" / "p" / "sampler_weights"
    backend.save_sampler_checkpoint(sampler_dir / "s0.tar.gz", "p", persist=False)  # LoRA: always PEFT
    names = _unpack(sampler_dir / "s0.tar.gz", root / "s0")
    assert names == ["adapter_config.json", "adapter_model.safetensors"], names
    adapter_cfg = json.loads((root / "s0" / "adapter_config.json").read_text())
    assert sorted(adapter_cfg["target_modules"]) == ["k_proj", "o_proj", "q_proj", "v_proj"]
    base = tiny_model(root)
    hf = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    model_id, ckpt_id, state = sampler.put_calls[-1]
    assert (model_id, ckpt_id) == ("p", "s0")
    assert set(state) == set(hf.state_dict()), sorted(set(state) ^ set(hf.state_dict()))[:4]
    model = peft.PeftModel.from_pretrained(hf, root / "s0", is_trainable=True)
    params = [p for p in model.parameters() if p.requires_grad]
    steps = [dict(lr=2e-2, beta1=0.8, beta2=0.9, eps=1e-6, weight_decay=0.05, clip=0.0),
             dict(lr=1e-2, beta1=0.8, beta2=0.9, eps=1e-6, weight_decay=0.05, clip=0.05)]
    opt = torch.optim.AdamW(params, lr=1.0, betas=(0.8, 0.9), eps=1e-6, weight_decay=0.05)
    for i, s in enumerate(steps):
        a = backend.forward_backward(prepared([("a", "p", "cross_entropy", None, _x())]))["a"]
        b = backend.forward_backward(prepared([("b", "p", "ppo", PPO_CFG, _y())]))["b"]
        metrics = backend.optim_step("p", _adam(s["lr"], s["clip"], beta1=s["beta1"], beta2=s["beta2"],
                                                eps=s["eps"], weight_decay=s["weight_decay"])).metrics
        opt.zero_grad()
        la = peft_loss(model, _x(), "cross_entropy", {})
        lb = peft_loss(model, _y(), "ppo", resolve_config("ppo", PPO_CFG))
        (la + lb).backward()
        for name, value, ref in (("ce", a.metrics["loss:sum"], la), ("ppo", b.metrics["loss:sum"], lb)):
            assert abs(value - ref.item()) <= TOL * max(1.0, abs(ref.item())), (i, name, value, ref.item())
        norm = torch.nn.utils.clip_grad_norm_(params, s["clip"] if s["clip"] > 0 else float("inf"))
        assert abs(metrics["skyrl.ai/grad_norm"] - norm.item()) <= TOL * norm.item(), (metrics, norm)
        assert metrics["skyrl.ai/learning_rate"] == s["lr"] and metrics["update_skipped"] == 0.0
        for g in opt.param_groups:
            g["lr"] = s["lr"]
        opt.step()
    backend.save_sampler_checkpoint(sampler_dir / "s2.tar.gz", "p")
    _unpack(sampler_dir / "s2.tar.gz", root / "s2")
    got = load_file(root / "s2" / "adapter_model.safetensors")
    want = peft.get_peft_model_state_dict(model)
    assert set(got) == set(want)
    assert_rel_close(torch.cat([got[k].flatten() for k in sorted(got)]),
                     torch.cat([want[k].detach().flatten() for k in sorted(want)]), TOL,
                     "adapters after 2 steps")
    lps = hf_log_probs(model, _x())
    assert_rel_close(torch.cat(_forward(backend, "p", _x())), torch.cat(lps).double(), TOL, "PEFT log-probs")
    merged = sampler.put_calls[-1][2]
    ref = model.merge_and_unload().state_dict()
    key = "model.layers.1.self_attn.q_proj.weight"
    assert_rel_close(merged[key], ref[key], TOL, "sampler weights (merged LoRA)")


def _check_full_ft(backend, root: Path, sampler: RecordingSampler) -> None:
    """Full fine-tuning: log-probs vs transformers before / after one step of AdamW on every weight
    (weight decay 0: Megatron exempts 1-D parameters); the HF and MARKER sampler archives."""
    import transformers

    base = tiny_model(root)
    hf = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    backend.create_model("ft", lora_config(0, seed=3))
    assert_rel_close(torch.cat(_forward(backend, "ft", _x())), torch.cat(hf_log_probs(hf, _x())).double(),
                     TOL, "full FT log-probs at load")
    backend.forward_backward(prepared([("a", "ft", "cross_entropy", None, _x())]))
    backend.optim_step("ft", _adam(lr=1e-3, eps=1e-3))
    opt = torch.optim.AdamW(hf.parameters(), lr=1e-3, betas=(0.9, 0.95), eps=1e-3, weight_decay=0.0)
    hf.zero_grad()
    peft_loss(hf, _x(), "cross_entropy", {}).backward()
    opt.step()
    with torch.no_grad():
        want = torch.cat(hf_log_probs(hf, _x())).double()
    assert_rel_close(torch.cat(_forward(backend, "ft", _x())), want, TOL, "full FT log-probs after a step")
    out = root / "ckpt" / "ft" / "sampler_weights"
    backend.save_sampler_checkpoint(out / "hot.tar.gz", "ft", persist=False)
    assert _unpack(out / "hot.tar.gz", root / "hot") == ["MARKER"]
    assert sampler.put_calls[-1][:2] == ("ft", "hot")
    backend.save_sampler_checkpoint(out / "cold.tar.gz", "ft", persist=True)
    names = _unpack(out / "cold.tar.gz", root / "cold")
    assert "config.json" in names and any(n.endswith(".safetensors") for n in names), names
    loaded = transformers.AutoModelForCausalLM.from_pretrained(root / "cold", dtype=torch.float32)
    with torch.no_grad():
        assert_rel_close(torch.cat(hf_log_probs(loaded, _x())).double(), want, TOL, "exported HF folder")


def _check_checkpoints(backend, root: Path) -> None:
    """save -> next step == load -> next step (with optimizer); optimizer=False: Adam state cleared, the
    same next loss, another update; a LoRA checkpoint refused by a full fine-tuning model."""
    from mcore_engine.step.optimizer import sub_optimizers

    path = root / "ckpt" / "p" / "state1.tar.gz"
    backend.save_checkpoint(path, "p")
    with tarfile.open(path, "r:") as tar:  # uncompressed, with the metadata
        meta = json.load(tar.extractfile("tinker_meta.json"))
    assert meta["lora"] == {"rank": 4, "alpha": 32.0, "targets": ["q_proj", "k_proj", "v_proj", "o_proj"]}
    first = _next_step(backend, "p")
    backend.load_checkpoint(path, "p")
    again = _next_step(backend, "p")
    _same({"p": again}, {"p": first}, "save -> load (with optimizer)", 1e-6)
    backend.load_checkpoint(path, "p", optimizer=False)
    engine = backend._impl.engines["p"]
    assert all(len(sub.optimizer.state) == 0 for sub in sub_optimizers(engine.optimizer))
    reset = _next_step(backend, "p")
    assert_rel_close(reset["loss_a"], first["loss_a"], 1e-6, "optimizer=False: same weights")
    assert (reset["f"] - first["f"]).abs().max() > 1e-4, "optimizer=False did not reset Adam"
    before = _forward(backend, "ft", _x())
    with pytest.raises(ValueError, match="lora_config.rank: the checkpoint is LoRA rank 4"):
        backend.load_checkpoint(path, "ft")
    assert all(torch.equal(a, b) for a, b in zip(_forward(backend, "ft", _x()), before, strict=True))
    with pytest.raises(ValueError, match="does not exist"):
        backend.load_checkpoint(root / "ckpt" / "p" / "missing.tar.gz", "p")
    backend.checkpoints_base = root / "ckpt"  # as the engine process may set it
    for call in (lambda: backend.save_checkpoint(root / "ckpt" / ".." / "out.tar.gz", "p"),
                 lambda: backend.load_checkpoint(root / "elsewhere.tar.gz", "p"),
                 lambda: backend.save_sampler_checkpoint(Path("/tmp") / "s.tar.gz", "p")):
        with pytest.raises(ValueError, match="outside the checkpoints folder"):
            call()
    assert not (root / "out.tar.gz").exists()
    backend.checkpoints_base = None


def _check_critic(backend, sampler: RecordingSampler, root: Path) -> None:
    from mcore_engine.integrations.tinker.backend import types

    with pytest.raises(ValueError, match="lora_config.rank: a critic"):
        backend.create_model("c4", lora_config(4), model_role="critic")
    backend.create_model("critic", lora_config(0, seed=2), model_role="critic")
    datums = [make_datum(40, 7, critic=True, values=True), make_datum(41, 5, critic=True)]
    res = backend.forward(prepared([("c", "critic", "ppo_critic", {"value_clip": 0.1}, datums)]))["c"]
    values, ew = _out(res, "values"), _out(res, "elementwise_loss")
    total = 0.0
    for d, v, e in zip(datums, values, ew, strict=True):
        ret = torch.tensor(d["returns"], dtype=torch.float64)
        w = torch.tensor(d["weights"], dtype=torch.float64)
        plain = (v - ret) ** 2
        if d["values"]:
            old = torch.tensor(d["values"], dtype=torch.float64)
            plain = torch.maximum(plain, (old + (v - old).clamp(-0.1, 0.1) - ret) ** 2)
        assert_rel_close(e, 0.5 * plain * w, TOL, "critic elementwise_loss")
        total += float(e.sum())
    assert abs(res.metrics["loss:sum"] - total) <= TOL * abs(total)
    fb = backend.forward_backward(prepared([("p", "critic", "ppo", None, datums),
                                            ("x", "critic", "cross_entropy", None, [make_datum(42, 4)])]))
    assert isinstance(fb["p"], types.ForwardBackwardOutput) and "values" in fb["p"].loss_fn_outputs[0]
    assert "loss_fn: a critic model takes" in fb["x"].error
    with pytest.raises(ValueError, match="sampler weights need a policy"):
        backend.save_sampler_checkpoint(root / "ckpt" / "critic" / "s.tar.gz", "critic")
    # sample: a critic's request refused by name, the others handed to the sampler
    params = types.SamplingParams(temperature=1.0, max_tokens=2, seed=0)
    prompt = types.ModelInput(chunks=[types.EncodedTextChunk(tokens=[1, 2])])
    batch = types.PreparedSampleBatch(
        all_model_inputs=[prompt] * 3, all_sampling_params=[params] * 3, all_model_ids=["critic", "p", "p"],
        all_checkpoint_ids=["a", "b", "b"], all_checkpoint_paths=["x", "y", "y"], all_session_ids=[None] * 3,
        needs_prompt_logprobs=True,
        request_batch_slices=[("r0", "critic", 0, 1, True), ("r1", "p", 1, 3, False)])
    out = backend.sample(batch)
    assert "sampling needs a policy model" in out["r0"].error
    assert sampler.batches[-1].request_batch_slices == [("r1", "p", 0, 2, False)]
    assert sampler.batches[-1].all_model_ids == ["p", "p"] and not sampler.batches[-1].needs_prompt_logprobs


def _single(rank: int, world_size: int, root: str) -> None:
    from mcore_engine.integrations.tinker.backend import McoreEngineBackend, types
    from mcore_engine.integrations.tinker.config import McoreBackendConfig

    root_path = Path(root)
    backend = McoreEngineBackend(tiny_model(root_path), McoreBackendConfig(max_models=8))
    sampler = backend._sampler = RecordingSampler()
    got = _script(backend)
    torch.save({k: v for k, v in got.items()}, root_path / "tp1.pt")
    tp2 = torch.load(root_path / "tp2.pt")
    _same(got, {k: v for k, v in tp2.items() if k != "next"}, "TP=2 vs TP=1")
    backend.create_model("resumed", lora_config(4, seed=5))
    backend.load_checkpoint(root_path / "ckpt" / "lora" / "tp2.tar.gz", "resumed")
    _same({"next": _next_step(backend, "resumed")}, {"next": tp2["next"]}, "TP=2 checkpoint at TP=1")
    backend.create_model("acc", lora_config(4, seed=6))
    _check_accumulation(backend)
    _check_bad_input(backend)
    _check_adam_vs_peft(backend, root_path, sampler)
    _check_full_ft(backend, root_path, sampler)
    _check_checkpoints(backend, root_path)
    _check_critic(backend, sampler, root_path)
    assert backend.has_model("critic") and len(backend._impl.specs) == 8
    with pytest.raises(ValueError, match="max_models: this server holds at most 8"):
        backend.create_model("eighth", lora_config(4))
    with pytest.raises(ValueError, match="already exists"):
        backend.create_model("p", lora_config(4))
    backend.delete_model("acc")
    assert not backend.has_model("acc") and sampler.dropped == ["acc"]
    with pytest.raises(ValueError, match="train_attn / train_mlp"):
        backend.create_model("none", lora_config(4, train_attn=False, train_mlp=False))
    with pytest.raises(ValueError, match="model_id: model 'acc' not found"):
        backend.optim_step("acc", _adam())
    assert isinstance(backend.optim_step("p", _adam()), types.OptimStepOutput)
    _check_bf16(root_path)


def _check_bf16(root: Path) -> None:
    """A create that fails in the engine leaves no model; precision="bf16": log-probs within bf16 error
    of fp32 transformers, steps train."""
    import transformers

    from mcore_engine.integrations.tinker.backend import McoreEngineBackend
    from mcore_engine.integrations.tinker.config import McoreBackendConfig

    bad = McoreBackendConfig(engine_overrides={"micro_batch_size": 0})
    broken = McoreEngineBackend(tiny_model(root), bad)
    with pytest.raises(ValueError, match="micro_batch_size"):
        broken.create_model("x", lora_config(4))
    assert not broken.has_model("x") and not broken._impl.engines
    backend = McoreEngineBackend(tiny_model(root), McoreBackendConfig(precision="bf16", max_models=1))
    backend.create_model("b", lora_config(4, seed=5))
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_model(root), dtype=torch.float32)
    with torch.no_grad():
        want = torch.cat(hf_log_probs(hf, _x())).double()
    assert_rel_close(torch.cat(_forward(backend, "b", _x())), want, 2e-2, "bf16 log-probs")
    first = _fb_step(backend, "b", _adam(lr=5e-2))
    assert first["grad_norm"] > 0
    after = _fb_step(backend, "b", _adam(lr=5e-2))
    assert after["loss_a"] < first["loss_a"], (after["loss_a"], first["loss_a"])


@pytest.mark.slow
def test_backend_layouts_and_single_rank_checks(tmp_path):
    root = tmp_path / "tinker" / "state"
    tiny_model(root)  # written once, before any rank reads it
    run_distributed(_layout, 2, str(root), "tp2")
    run_distributed(_single, 1, str(root))
    run_distributed(_layout, 2, str(root), "pp2")


def test_refusals_without_an_engine():
    """Validation and mapping rules that need no engine."""
    from mcore_engine.integrations.tinker.backend import spec_from_lora
    from mcore_engine.integrations.tinker.batch import ModelLimits, group_requests

    spec = spec_from_lora(lora_config(8, seed=4, train_attn=False), "policy", None)
    assert spec.targets == ("gate_proj", "up_proj", "down_proj") and spec.alpha == 32.0
    assert spec_from_lora(lora_config(8), "policy", 16.0).alpha == 16.0
    assert spec_from_lora(lora_config(0), "critic", None).rank == 0
    with pytest.raises(ValueError, match="model_role"):
        spec_from_lora(lora_config(0), "reward", None)
    limits = {"m": ModelLimits(role="policy", vocab_size=VOCAB, max_positions=64,
                               max_tokens_per_micro_batch=16)}
    groups, errors = group_requests(prepared(
        [("a", "m", "cross_entropy", None, [make_datum(1, 5)]),
         ("b", "m", "ppo", None, [make_datum(2, 5, "ppo")]),
         ("c", "m", "cross_entropy", None, [make_datum(3, 4), make_datum(4, 3)]),
         ("d", "m", "cross_entropy", None, [make_datum(5, 16)])]), limits)
    assert [(g.loss_fn, g.requests) for g in groups] == [("cross_entropy", [("a", 0, 1), ("c", 1, 3)]),
                                                        ("ppo", [("b", 0, 1)])]
    assert groups[0].datums[0].tokens == make_datum(1, 5)["inputs"] + [make_datum(1, 5)["targets"][-1]]
    assert "max_token_len_per_gpu 16" in errors["d"] and set(errors) == {"d"}
