"""The official ``tinker`` 0.24.1 client against our server on 127.0.0.1 (a tiny local Qwen2 folder).

Every number the client gets back is checked against a reference computed here: ``transformers``
(+ PEFT on the adapter archive the server wrote) for log-probs, float64 formulas for the losses,
``torch.optim.AdamW`` for the optimizer step, and a second server at TP = 2 for the layout.
"""

from __future__ import annotations

import math
import tarfile
from pathlib import Path

import httpx
import pytest
import torch

tinker = pytest.importorskip("tinker")
pytest.importorskip("skyrl")

from tinker import types  # noqa: E402

from tests.integrations.tinker_server import API_KEY, tinker_server  # noqa: E402
from tests.integrations.tinker_setup import tiny_tinker_model  # noqa: E402

pytestmark = pytest.mark.slow

VOCAB = 300
MANY_MODELS = ("--backend-config", '{"max_models": 64}')   # each test creates its own models


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return tiny_tinker_model(str(tmp_path_factory.mktemp("tinker") / "models" / "tiny"))


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    with tinker_server(model_dir, tmp_path_factory.mktemp("state"), extra_args=MANY_MODELS) as srv:
        yield srv


@pytest.fixture(scope="module")
def service(server):
    svc = tinker.ServiceClient(base_url=server.url, api_key=API_KEY)
    yield svc
    svc.holder.close()  # its heartbeat thread would outlive the server


# ------------------------------------------------------------------------------------------ helpers
def _seqs(seed: int, lengths=(7, 12, 5)) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in lengths]


def _datum(seq: list[int], **fields) -> types.Datum:
    """Tinker's shifted layout: inputs seq[:-1], targets seq[1:], per-token fields of that length."""
    inputs = {"target_tokens": seq[1:]}
    inputs.update({k: [float(x) for x in v] for k, v in fields.items()})
    return types.Datum(model_input=types.ModelInput.from_ints(seq[:-1]), loss_fn_inputs=inputs)


def _weights(seqs, seed: int, signed: bool = False) -> list[list[float]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for s in seqs:
        w = torch.rand(len(s) - 1, generator=g, dtype=torch.float64)
        out.append((2 * w - 1 if signed else w).tolist())
    return out


def _logprobs(result) -> list[torch.Tensor]:
    return [torch.tensor(o["logprobs"].data, dtype=torch.float64) for o in result.loss_fn_outputs]


def _elementwise(result) -> list[torch.Tensor]:
    return [torch.tensor(o["elementwise_loss"].data, dtype=torch.float64) for o in result.loss_fn_outputs]


def _hf_logprobs(model, seqs) -> list[torch.Tensor]:
    out = []
    with torch.no_grad():
        for s in seqs:
            ids = torch.tensor([s])
            logits = model(input_ids=ids).logits[0, :-1].double()
            out.append(torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None])[:, 0])
    return out


def _hf_logprobs_grad(model, seqs) -> list[torch.Tensor]:
    out = []
    for s in seqs:
        ids = torch.tensor([s])
        logits = model(input_ids=ids).logits[0, :-1].float()
        out.append(torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None])[:, 0])
    return out


def _base_model(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def _unpack(archive: Path, dest: Path) -> Path:
    dest.mkdir(parents=True, exist_ok=True)
    with tarfile.open(archive, "r:gz") as tar:
        tar.extractall(dest, filter="data")
    return dest


def _sampler_archive(server, training_client, name: str) -> Path:
    path = training_client.save_weights_for_sampler(name).result().path   # tinker://<model>/[...]/<name>
    parts = path.removeprefix("tinker://").split("/")
    model_id, ckpt = parts[0], parts[-1]
    return server.checkpoints / model_id / "sampler_weights" / f"{ckpt}.tar.gz"


def _peft_model(model_dir, archive: Path, tmp: Path):
    from peft import PeftModel

    return PeftModel.from_pretrained(_base_model(model_dir), str(_unpack(archive, tmp))).eval()


def _close(a: list[torch.Tensor], b: list[torch.Tensor], tol: float) -> float:
    assert [len(x) for x in a] == [len(y) for y in b]
    err = max(float((x - y).abs().max()) for x, y in zip(a, b, strict=True))
    assert err <= tol, err
    return err


ADAM = dict(learning_rate=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.0)


# -------------------------------------------------------------------------------------------- tests
def test_zero_weights_give_zero_loss_and_no_update(service, model_dir):
    tc = service.create_lora_training_client(base_model=model_dir, rank=4, seed=1)
    seqs = _seqs(0)
    data = [_datum(s, weights=[0.0] * (len(s) - 1)) for s in seqs]
    before = _logprobs(tc.forward(data, "cross_entropy").result())
    res = tc.forward_backward(data, "cross_entropy").result()
    assert res.metrics["loss:sum"] == 0.0
    assert all(float(e.abs().max()) == 0.0 for e in _elementwise(res))
    tc.optim_step(types.AdamParams(**ADAM)).result()
    after = _logprobs(tc.forward(data, "cross_entropy").result())
    _close(before, after, 0.0)


def test_logprobs_and_training_match_transformers_peft(service, server, model_dir, tmp_path):
    """Forward log-probs equal transformers + PEFT on the archive the server wrote, before and after
    two Adam steps, and the adapters after the steps equal torch AdamW on the PEFT model."""
    tc = service.create_lora_training_client(base_model=model_dir, rank=4, seed=2)
    seqs = _seqs(1)
    weights = _weights(seqs, 3)
    data = [_datum(s, weights=w) for s, w in zip(seqs, weights, strict=True)]

    ref = _peft_model(model_dir, _sampler_archive(server, tc, "step0"), tmp_path / "step0")
    _close(_logprobs(tc.forward(data, "cross_entropy").result()), _hf_logprobs(ref, seqs), 1e-5)
    # LoRA B starts at zero: the adapter model is the base model
    _close(_hf_logprobs(ref, seqs), _hf_logprobs(_base_model(model_dir), seqs), 1e-6)

    params = [p for n, p in ref.named_parameters() if "lora_" in n]
    for p in ref.parameters():
        p.requires_grad_(any(p is q for q in params))
    opt = torch.optim.AdamW(params, lr=ADAM["learning_rate"], betas=(ADAM["beta1"], ADAM["beta2"]),
                            eps=ADAM["eps"], weight_decay=0.0)
    ref.train()
    for step in range(2):
        res = tc.forward_backward(data, "cross_entropy").result()
        lps = _hf_logprobs_grad(ref, seqs)
        loss = sum(-(lp * torch.tensor(w)).sum() for lp, w in zip(lps, weights, strict=True))
        assert math.isclose(res.metrics["loss:sum"], float(loss), rel_tol=1e-5, abs_tol=1e-5), step
        opt.zero_grad()
        loss.backward()
        opt.step()
        tc.optim_step(types.AdamParams(**ADAM)).result()
    ref.eval()
    got = _logprobs(tc.forward(data, "cross_entropy").result())
    _close(got, _hf_logprobs(ref, seqs), 1e-4)
    after = _peft_model(model_dir, _sampler_archive(server, tc, "step2"), tmp_path / "step2")
    _close(_hf_logprobs(after, seqs), _hf_logprobs(ref, seqs), 1e-4)


def test_custom_loss_equals_cross_entropy(service, model_dir):
    """forward_backward_custom sends weights = -dC/dlogprobs (negative here) through cross_entropy;
    two clients of one seed, one with the built-in loss and one with the custom one, stay equal."""
    seqs = _seqs(4)
    weights = _weights(seqs, 5, signed=True)
    a = service.create_lora_training_client(base_model=model_dir, rank=4, seed=7)
    b = service.create_lora_training_client(base_model=model_dir, rank=4, seed=7)
    data = [_datum(s, weights=w) for s, w in zip(seqs, weights, strict=True)]
    plain = [_datum(s) for s in seqs]

    def custom(batch, logprobs):
        pairs = zip(logprobs, weights, strict=True)
        return sum(-(lp * torch.tensor(w, dtype=lp.dtype)).sum() for lp, w in pairs), {}

    ra = a.forward_backward(data, "cross_entropy").result()
    rb = b.forward_backward_custom(plain, custom).result()
    expected = float(custom(None, _logprobs(ra))[0])
    assert math.isclose(ra.metrics["loss:sum"], expected, rel_tol=1e-6, abs_tol=1e-6)
    for c in (a, b):
        c.optim_step(types.AdamParams(**ADAM)).result()
    _close(_logprobs(a.forward(plain, "cross_entropy").result()),
           _logprobs(b.forward(plain, "cross_entropy").result()), 1e-6)
    assert rb.loss_fn_outputs   # the custom path returns the per-datum outputs too


def _reference_loss(name, lp, w, q, adv, cfg):
    r = torch.exp(torch.clamp(lp - q, -20, 20))
    if name == "cross_entropy":
        ell = -lp
    elif name == "importance_sampling":
        ell = -torch.exp(lp - q) * adv
    elif name == "ppo":
        lo, hi = cfg.get("clip_low_threshold", 0.8), cfg.get("clip_high_threshold", 1.2)
        ell = -torch.minimum(r * adv, r.clamp(lo, hi) * adv)
    elif name == "cispo":
        lo, hi = cfg.get("clip_low_threshold", 0.8), cfg.get("clip_high_threshold", 1.2)
        ell = -r.clamp(lo, hi) * lp * adv
    elif name == "dppo":
        p, mu = lp.exp(), q.exp()
        dl, dh = cfg.get("delta_low", 0.2), cfg.get("delta_high", 0.2)
        masked = ((adv > 0) & (p - mu > dh)) | ((adv < 0) & (mu - p > dl))
        ell = -r * adv * (~masked)
    else:
        raise AssertionError(name)
    return w * ell


@pytest.mark.parametrize("name,cfg", [
    ("cross_entropy", None), ("importance_sampling", None), ("ppo", {"clip_low_threshold": 0.9,
     "clip_high_threshold": 1.1}), ("cispo", None), ("dppo", {"delta_low": 0.05, "delta_high": 0.1})])
def test_every_policy_loss_is_the_weighted_sum(service, model_dir, name, cfg):
    tc = service.create_lora_training_client(base_model=model_dir, rank=4, seed=3)
    seqs = _seqs(6)
    lps = _logprobs(tc.forward([_datum(s) for s in seqs], "cross_entropy").result())
    g = torch.Generator().manual_seed(8)
    fields = []
    for lp in lps:   # sampling log-probs near the learner's so that clips bite on some tokens only
        q = lp + 0.3 * torch.randn(len(lp), generator=g, dtype=torch.float64)
        fields.append({"weights": torch.rand(len(lp), generator=g, dtype=torch.float64) + 0.5,
                       "logprobs": q, "advantages": torch.randn(len(lp), generator=g, dtype=torch.float64)})
    data = [_datum(s, **{k: v.tolist() for k, v in f.items()}) for s, f in zip(seqs, fields, strict=True)]
    res = tc.forward_backward(data, name, cfg).result()
    got_lp = _logprobs(res)
    _close(got_lp, lps, 1e-6)
    # the wire carries float32: the reference takes the fields as the server got them
    ref = [_reference_loss(name, lp, f["weights"].float().double(), f["logprobs"].float().double(),
                           f["advantages"].float().double(), cfg or {})
           for lp, f in zip(got_lp, fields, strict=True)]
    _close(_elementwise(res), ref, 1e-5)
    assert math.isclose(res.metrics["loss:sum"], float(sum(r.sum() for r in ref)), rel_tol=1e-5, abs_tol=1e-5)
    tc.optim_step(types.AdamParams(**ADAM)).result()


def test_save_and_load_state_continue_identically(service, model_dir):
    seqs = _seqs(9)
    data = [_datum(s, weights=w) for s, w in zip(seqs, _weights(seqs, 10), strict=True)]
    tc = service.create_lora_training_client(base_model=model_dir, rank=4, seed=4)
    tc.forward_backward(data, "cross_entropy").result()
    tc.optim_step(types.AdamParams(**ADAM)).result()
    path = tc.save_state("ckpt1").result().path
    for restored in (service.create_training_client_from_state_with_optimizer(path),):
        for c in (tc, restored):
            c.forward_backward(data, "cross_entropy").result()
            c.optim_step(types.AdamParams(**ADAM)).result()
        _close(_logprobs(tc.forward(data, "cross_entropy").result()),
               _logprobs(restored.forward(data, "cross_entropy").result()), 1e-6)
    # without the optimizer state the next step differs (Adam's moments start at zero again)
    fresh = service.create_training_client_from_state(path)
    ref = service.create_training_client_from_state_with_optimizer(path)
    for c in (fresh, ref):
        c.forward_backward(data, "cross_entropy").result()
        c.optim_step(types.AdamParams(**ADAM)).result()
    a = _logprobs(fresh.forward(data, "cross_entropy").result())
    b = _logprobs(ref.forward(data, "cross_entropy").result())
    d = max(float((x - y).abs().max()) for x, y in zip(a, b, strict=True))
    assert d > 1e-4, d


def test_sampling_seeds_stops_and_prompt_logprobs(service, server, model_dir):
    tc = service.create_lora_training_client(base_model=model_dir, rank=4, seed=5)
    seqs = _seqs(11)
    tc.forward_backward([_datum(s) for s in seqs], "cross_entropy").result()
    tc.optim_step(types.AdamParams(**ADAM)).result()
    sc = tc.save_weights_and_get_sampling_client()
    prompt = types.ModelInput.from_ints(seqs[1])

    def sample(n=2, **kw):
        kw.setdefault("max_tokens", 12)
        return sc.sample(prompt, n, types.SamplingParams(**kw)).result()

    a, b = sample(seed=3), sample(seed=3)
    assert [s.tokens for s in a.sequences] == [s.tokens for s in b.sequences]
    assert a.sequences[0].tokens != a.sequences[1].tokens      # sample i draws with seed + i
    assert all(len(s.tokens) == 12 for s in a.sequences if s.stop_reason == "length")
    first = a.sequences[0].tokens
    stop_tok = first[4]
    c = sample(n=1, seed=3, stop=[stop_tok])
    assert c.sequences[0].tokens == first[:first.index(stop_tok) + 1] and c.sequences[0].stop_reason == "stop"

    # the generated log-probs and the prompt log-probs are the model's own (= forward's)
    full = seqs[1] + first
    fwd = _logprobs(tc.forward([_datum(full)], "cross_entropy").result())[0]
    _close([torch.tensor(a.sequences[0].logprobs, dtype=torch.float64)], [fwd[len(seqs[1]) - 1:]], 1e-4)
    p = sc.sample(prompt, 1, types.SamplingParams(max_tokens=1, seed=0),
                  include_prompt_logprobs=True).result()
    plp = p.prompt_logprobs
    assert len(plp) == len(seqs[1])
    assert plp[0] in (0.0, None) or math.isnan(plp[0])
    _close([torch.tensor(plp[1:], dtype=torch.float64)], [fwd[:len(seqs[1]) - 1]], 1e-4)

    # a stop string: the decoded output contains it and ends with the token that completed it
    tok = sc.get_tokenizer()
    texts = [tok.decode([t]).strip() for t in first[2:]]
    needle = next(t for t in texts if t and t.isascii() and t.isprintable())   # whole characters
    s = sample(n=1, seed=3, stop=[needle]).sequences[0]
    assert needle in tok.decode(s.tokens) and needle not in tok.decode(s.tokens[:-1]), (needle, s.tokens)
    assert s.stop_reason == "stop" and s.tokens == first[:len(s.tokens)]

    # the base model = a LoRA model whose B is zero
    base = service.create_sampling_client(base_model=model_dir)
    fresh = service.create_lora_training_client(base_model=model_dir, rank=4, seed=6)
    zero = fresh.save_weights_and_get_sampling_client()
    sp = types.SamplingParams(max_tokens=10, seed=5)
    assert (base.sample(prompt, 1, sp).result().sequences[0].tokens
            == zero.sample(prompt, 1, sp).result().sequences[0].tokens)


def test_full_fine_tuning_changes_base_weights(service, server, model_dir, tmp_path):
    seqs = _seqs(12)
    data = [_datum(s) for s in seqs]
    full = service.create_lora_training_client(base_model=model_dir, rank=0, seed=0)
    lp0 = _logprobs(full.forward(data, "cross_entropy").result())
    _close(lp0, _hf_logprobs(_base_model(model_dir), seqs), 1e-5)
    full.forward_backward(data, "cross_entropy").result()
    full.optim_step(types.AdamParams(**ADAM)).result()
    lp1 = _logprobs(full.forward(data, "cross_entropy").result())
    assert sum(float(x.sum()) for x in lp1) > sum(float(x.sum()) for x in lp0)   # CE went down
    from transformers import AutoModelForCausalLM

    folder = _unpack(_sampler_archive(server, full, "full1"), tmp_path / "full1")
    assert (folder / "config.json").exists()
    exported = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    _close(_hf_logprobs(exported, seqs), lp1, 1e-4)


def test_bad_input_is_refused_and_leaves_state_alone(service, server, model_dir):
    tc = service.create_lora_training_client(base_model=model_dir, rank=4, seed=8)
    seqs = _seqs(13)
    data = [_datum(s) for s in seqs]
    before = _logprobs(tc.forward(data, "cross_entropy").result())

    bad_vocab = [_datum(seqs[0][:-1] + [VOCAB])]
    with pytest.raises(Exception, match="target_tokens"):
        tc.forward_backward(bad_vocab, "cross_entropy").result()
    n = len(seqs[0]) - 1
    short = [types.Datum(model_input=types.ModelInput.from_ints(seqs[0][:-1]),
                         loss_fn_inputs={"target_tokens": seqs[0][1:], "weights": [1.0] * (n - 1)})]
    with pytest.raises(Exception, match="weights"):
        tc.forward_backward(short, "cross_entropy").result()
    with pytest.raises(Exception, match="loss_fn"):
        tc.forward_backward(data, "dro").result()
    # exp(lp - logprobs) overflows: an error (not a reply JSON cannot carry), its gradients dropped
    overflow = [_datum(seqs[0], logprobs=[-200.0] * n, advantages=[1.0] * n)]
    for call in (tc.forward, tc.forward_backward):
        with pytest.raises(Exception, match="not finite"):
            call(overflow, "importance_sampling").result()
    assert tc.optim_step(types.AdamParams(**ADAM)).result().metrics["update_skipped"] == 0.0
    _close(before, _logprobs(tc.forward(data, "cross_entropy").result()), 0.0)

    headers = {"X-API-Key": API_KEY}
    r = httpx.post(f"{server.url}/api/v1/forward", headers=headers, timeout=30, json={
        "model_id": "no-such-model", "forward_input": {"data": [], "loss_fn": "cross_entropy"}})
    assert r.status_code == 404 and "model_id 'no-such-model': model not found" in r.text, r.text
    r = httpx.get(f"{server.url}/api/v1/healthz", timeout=10)
    assert r.status_code == 200
    r = httpx.post(f"{server.url}/api/v1/create_session", headers={"X-API-Key": "tml-wrong"}, timeout=10,
                   json={})
    assert r.status_code == 401, r.text


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)])
def test_two_rank_server_equals_one_rank(service, model_dir, tmp_path, tp, pp):
    """The same script on a TP = 2 or a PP = 2 server gives the losses, log-probs and samples of one
    rank."""
    def script(svc):
        tc = svc.create_lora_training_client(base_model=model_dir, rank=4, seed=9)
        seqs = _seqs(14)
        data = [_datum(s, weights=w) for s, w in zip(seqs, _weights(seqs, 15), strict=True)]
        losses = []
        for _ in range(2):
            losses.append(tc.forward_backward(data, "cross_entropy").result().metrics["loss:sum"])
            tc.optim_step(types.AdamParams(**ADAM)).result()
        lps = _logprobs(tc.forward(data, "cross_entropy").result())
        out = tc.save_weights_and_get_sampling_client().sample(
            types.ModelInput.from_ints(seqs[0]), 2, types.SamplingParams(max_tokens=8, seed=1)).result()
        return losses, lps, [s.tokens for s in out.sequences]

    one = script(service)
    with tinker_server(model_dir, tmp_path / "two", tp=tp, pp=pp, extra_args=MANY_MODELS) as srv:
        svc = tinker.ServiceClient(base_url=srv.url, api_key=API_KEY)
        two = script(svc)
        svc.holder.close()
    for a, b in zip(one[0], two[0], strict=True):
        assert math.isclose(a, b, rel_tol=1e-5, abs_tol=1e-5)
    _close(one[1], two[1], 1e-5)
    assert one[2] == two[2]


def test_rl_example_raises_the_reward(server, model_dir):
    """examples/tinker_rl.py: sample -> group advantages -> importance_sampling -> optim_step."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, TINKER_BASE_URL=server.url, TINKER_API_KEY=API_KEY)
    run = subprocess.run([sys.executable, "examples/tinker_rl.py", "--base-model", model_dir, "--steps", "8"],
                         capture_output=True, text=True, env=env, timeout=600,
                         cwd=Path(__file__).resolve().parents[2])
    assert run.returncode == 0, run.stderr[-3000:]
    first, last = map(float, run.stdout.strip().splitlines()[-1].removeprefix("mean reward ").split(" -> "))
    assert last > first + 0.2, run.stdout


_SHORT_SCRIPT = """
import sys, tinker
svc = tinker.ServiceClient(base_url=sys.argv[1], api_key=sys.argv[2])
svc.create_lora_training_client(base_model=sys.argv[3], rank=2)
"""


def test_models_of_a_script_that_ended_before_its_first_heartbeat_are_freed(model_dir, tmp_path):
    """SkyRL's cleanup misses sessions that never sent a heartbeat (the client's first comes after
    10 s); ours counts them from their creation, so a short script's model is unloaded."""
    import subprocess
    import sys
    import time

    args = ("--session-timeout-sec", "1", "--backend-config", '{"max_models": 1}')
    with tinker_server(model_dir, tmp_path / "short", extra_args=args) as srv:
        for _ in range(2):   # the second would find max_models full if the first stayed
            deadline = time.monotonic() + 60
            while True:
                run = subprocess.run([sys.executable, "-c", _SHORT_SCRIPT, srv.url, API_KEY, model_dir],
                                     capture_output=True, text=True, timeout=120)
                if run.returncode == 0:
                    break
                assert "max_models" in run.stderr, run.stderr[-2000:]
                assert time.monotonic() < deadline, "the ended script's model was never unloaded"
                time.sleep(2)
