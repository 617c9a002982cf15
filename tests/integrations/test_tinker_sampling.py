"""The Tinker backend's CPU sampler (``mcore_engine.integrations.tinker.sampling``) without a server,
and the tiny model folder the Tinker tests share (``tinker_setup.tiny_tinker_model``).

Batches are built by SkyRL's own ``prepare_sample_batch`` (``num_samples`` expanded with ``seed + i``),
references are ``transformers`` full forwards (no KV cache) on the same weights."""

from __future__ import annotations

import copy
import json
import os
import tarfile

import numpy as np
import pytest
import torch

from mcore_engine.integrations.tinker.config import McoreBackendConfig
from mcore_engine.integrations.tinker.sampling import (  # types: skyrl's
    MARKER,
    Sampler,
    filter_logits,
    sampler_checkpoint_id,
    types,
)
from tests.integrations.tinker_setup import VOCAB, tiny_tinker_model, tokenizer_roundtrip

PROMPT = [1, 90, 260, 45, 77, 12, 200, 33, 150]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return tiny_tinker_model(str(tmp_path_factory.mktemp("tinker") / "models" / "tiny"))


@pytest.fixture(scope="module")
def sampler(model_dir) -> Sampler:
    return Sampler(model_dir, McoreBackendConfig())


@pytest.fixture(scope="module")
def hf(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def req(prompt=PROMPT, *, n=1, model_id="", ckpt="", plp=False, base_model=None, **params):
    """``(model_id, SampleInput)`` as SkyRL's API stores a sample request."""
    params = {"temperature": 1.0, "max_tokens": 8, "seed": 0, **params}
    chunks = [types.EncodedTextChunk(tokens=list(prompt))] if prompt else []
    return model_id, types.SampleInput(base_model=base_model, prompt=types.ModelInput(chunks=chunks),
                                       sampling_params=types.SamplingParams(**params), num_samples=n,
                                       checkpoint_id=ckpt, prompt_logprobs=plp)


def run(sampler_: Sampler, base=None, /, **requests) -> dict:
    """``sampler_.sample`` of the batch SkyRL's engine builds from ``requests`` (request id -> req())."""
    from skyrl.tinker.engine import prepare_sample_batch  # after sampling's Python 3.11 TypedDict fix

    return sampler_.sample(prepare_sample_batch(requests, base))


def full_logits(model, ids: list[int]) -> torch.Tensor:
    """[len(ids), V] fp32 logits of one full forward (no cache)."""
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0].float()


def prompt_ref(model, prompt: list[int]) -> torch.Tensor:
    """[n - 1] log_softmax(logits[i - 1])[prompt[i]] of one full forward."""
    lp = torch.log_softmax(full_logits(model, prompt)[:-1], -1)
    return lp.gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]


def check_against(model, prompt, seq: types.GeneratedSequence, *, greedy: bool = False) -> torch.Tensor:
    """The sequence's logprobs are the model's log_softmax at each step (1e-5), greedy tokens its argmax;
    returns the logits at the generated positions [len(tokens), V]."""
    logits = full_logits(model, prompt + seq.tokens)[len(prompt) - 1:-1]
    lp = torch.log_softmax(logits, -1).gather(1, torch.tensor(seq.tokens)[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(seq.logprobs), lp, atol=1e-5, rtol=0)
    if greedy:
        assert seq.tokens == logits.argmax(-1).tolist()
    return logits


def test_tiny_model_folder_and_tokenizer_roundtrip(model_dir):
    """AutoTokenizer (a Qwen2Tokenizer beside a qwen2 config.json) gives the trained ids on ASCII,
    digits, unicode and special tokens, decode round-trips, and the vocabulary is the model's."""
    assert tokenizer_roundtrip(model_dir) == []
    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = json.load(f)
    assert (cfg["vocab_size"], cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_key_value_heads"],
            cfg["max_position_embeddings"], cfg["tie_word_embeddings"]) == (VOCAB, 32, 2, 2, 4096, False)
    with pytest.raises(ValueError, match="path"):
        tiny_tinker_model("/tmp/x:y/models/tiny")


def _ref_filter(z: np.ndarray, k: int, p: float) -> np.ndarray:
    """float64 reference of SkyRL's filters (apply_top_k_batch, apply_top_p_batch)."""
    out = z.copy()
    if k > 0:
        out[np.argsort(-z, kind="stable")[k:]] = -np.inf
    if p < 1.0:
        order = np.argsort(-out, kind="stable")
        probs = np.exp(out[order] - out[order].max())
        probs /= probs.sum()
        before = np.cumsum(probs) - probs
        drop = order[1:][before[1:] >= p]
        out[drop] = -np.inf
    return out


def test_filter_logits_against_reference():
    g = torch.Generator().manual_seed(3)
    for _ in range(5):
        z = torch.randn(37, generator=g, dtype=torch.float32) * 2
        z_before = z.clone()
        for k, p in [(-1, 1.0), (0, 1.0), (1, 1.0), (5, 1.0), (37, 1.0), (50, 1.0), (-1, 0.5), (-1, 0.9),
                     (-1, 1e-4), (8, 0.6), (3, 0.99)]:
            got = filter_logits(z, k, p).numpy()
            want = _ref_filter(z.double().numpy(), k, p)
            np.testing.assert_array_equal(np.isinf(got), np.isinf(want), err_msg=f"k={k} p={p}")
            keep = ~np.isinf(want)
            np.testing.assert_array_equal(got[keep], z.numpy()[keep])
            assert keep.sum() == (min(k, 37) if k > 0 and p == 1.0 else keep.sum()) and keep.sum() >= 1
        assert torch.equal(z, z_before)  # not mutated


def test_seeds_reproduce_and_offset_per_sample(sampler):
    """Same seed -> same tokens and logprobs; sample i of a request is seed + i, i.e. the single sample
    of a request with that seed; the samples of one request differ."""
    a = run(sampler, a=req(n=3, seed=7, max_tokens=12), b=req(seed=8, max_tokens=12))
    again = run(sampler, a=req(n=3, seed=7, max_tokens=12))
    assert a["a"].sequences == again["a"].sequences
    assert a["b"].sequences[0] == a["a"].sequences[1]
    toks = [s.tokens for s in a["a"].sequences]
    assert len({tuple(t) for t in toks}) == 3, toks
    assert a["a"].prompt_logprobs is None


def test_greedy_and_logprobs_equal_transformers(sampler, hf):
    """T = 0 is the argmax of transformers' logits at every step; at T = 1 (and 0.7) each returned
    logprob is the raw log_softmax of the sampled token (the KV-cache loop == a full forward)."""
    out = run(sampler, g=req(temperature=0.0, max_tokens=10), s=req(n=2, seed=1, max_tokens=10),
              t=req(seed=5, temperature=0.7, max_tokens=10))
    check_against(hf, PROMPT, out["g"].sequences[0], greedy=True)
    for seq in out["s"].sequences + out["t"].sequences:
        check_against(hf, PROMPT, seq)
        assert seq.stop_reason == "length" and len(seq.tokens) == 10 or seq.tokens[-1] in sampler.eos_ids


def test_top_k_top_p_keep_sampled_tokens_inside_the_filter(sampler, hf):
    out = run(sampler, k=req(n=4, seed=11, top_k=3, max_tokens=12),
              p=req(n=4, seed=21, top_p=0.3, temperature=0.8, max_tokens=12),
              k1=req(seed=2, top_k=1, max_tokens=12), g=req(temperature=0.0, max_tokens=12))
    for seq in out["k"].sequences:
        logits = check_against(hf, PROMPT, seq)
        top3 = logits.topk(3, dim=-1).indices
        assert all(t in top3[i].tolist() for i, t in enumerate(seq.tokens))
    for seq in out["p"].sequences:
        logits = check_against(hf, PROMPT, seq)
        for i, t in enumerate(seq.tokens):
            assert np.isfinite(_ref_filter((logits[i] / 0.8).double().numpy(), -1, 0.3)[t])
    assert out["k1"].sequences[0].tokens == out["g"].sequences[0].tokens


def test_prompt_logprobs_equal_transformers(sampler, hf):
    """n values for an n-token prompt, the first 0.0, the rest log_softmax(logits[i-1])[prompt[i]]
    (1e-5); only for the requests that ask."""
    out = run(sampler, a=req(n=2, plp=True, max_tokens=1), b=req(max_tokens=1))
    plp = out["a"].prompt_logprobs
    lp = prompt_ref(hf, PROMPT)
    assert len(plp) == len(PROMPT) and plp[0] == 0.0
    torch.testing.assert_close(torch.tensor(plp[1:]), lp, atol=1e-5, rtol=0)
    assert out["b"].prompt_logprobs is None and len(out["a"].sequences) == 2


def test_stop_tokens_stop_strings_and_length(model_dir, hf):
    s = Sampler(model_dir, McoreBackendConfig(stop_on_eos=False))
    greedy = run(s, g=req(temperature=0.0, max_tokens=24))["g"].sequences[0]
    assert greedy.stop_reason == "length" and len(greedy.tokens) == 24
    g = greedy.tokens
    # a stop token: the sequence ends at its first occurrence, the token included
    j = g.index(g[5])
    other = VOCAB - 1 if VOCAB - 1 not in g else next(t for t in range(VOCAB) if t not in g)
    out = run(s, a=req(temperature=0.0, max_tokens=24, stop_tokens=[g[5], other]))
    assert out["a"].sequences[0].tokens == g[:j + 1] and out["a"].sequences[0].stop_reason == "stop"
    # a stop string: the first token whose decoded text contains it ends the sequence
    tok = s.tokenizer
    k = next(i for i in range(3, 24) if (t := tok.decode([g[i]])).strip() and t.isascii() and t.isprintable())
    stop = tok.decode([g[k]])
    first = next(i for i in range(24) if stop in tok.decode(g[:i + 1]))
    assert first <= k
    out = run(s, a=req(temperature=0.0, max_tokens=24, stop_strings=["never-in-it", stop]))
    seq = out["a"].sequences[0]
    assert seq.tokens == g[:first + 1] and seq.stop_reason == "stop" and stop in tok.decode(seq.tokens)
    # each token is decoded once whatever the number of stop strings (a text the output never holds)
    doubled = stop * 2
    assert doubled not in tok.decode(g)
    out = run(s, a=req(temperature=0.0, max_tokens=24, stop_strings=["never-in-it", "nor-this", doubled]))
    assert out["a"].sequences[0].tokens == g and out["a"].sequences[0].stop_reason == "length"
    # stops that never occur, and max_tokens
    out = run(s, a=req(temperature=0.0, max_tokens=6, stop_strings=["\x00zz"], stop_tokens=[]),
              b=req(n=2, seed=4, max_tokens=3))
    assert out["a"].sequences[0].tokens == g[:6] and out["a"].sequences[0].stop_reason == "length"
    assert [len(x.tokens) for x in out["b"].sequences] == [3, 3]


def _eos_first_state_dict(hf, eos: int) -> dict[str, torch.Tensor]:
    """The model's weights with the lm-head row of ``eos`` moved so EOS is the argmax after PROMPT."""
    seen = {}
    h = hf.lm_head.register_forward_hook(lambda m, inp, out: seen.setdefault("h", inp[0][0, -1].detach()))
    full_logits(hf, PROMPT)
    h.remove()
    sd = {k: v.clone() for k, v in hf.state_dict().items()}
    sd["lm_head.weight"][eos] += 50 * seen["h"] / seen["h"].norm()
    return sd


def test_eos_stops_when_configured_and_put_changes_outputs(model_dir, hf):
    eos = 2
    sd = _eos_first_state_dict(hf, eos)
    on = Sampler(model_dir, McoreBackendConfig())
    off = Sampler(model_dir, McoreBackendConfig(stop_on_eos=False))
    assert on.eos_ids == {eos}
    for s in (on, off):
        s.put("m", "c", sd)
    base = run(on, a=req(temperature=0.0, max_tokens=5))["a"].sequences[0]
    assert base.tokens[0] != eos
    a = run(on, a=req(model_id="m", ckpt="c", temperature=0.0, max_tokens=5))["a"].sequences[0]
    assert a.tokens == [eos] and a.stop_reason == "stop"
    b = run(off, a=req(model_id="m", ckpt="c", temperature=0.0, max_tokens=5))["a"].sequences[0]
    assert b.tokens[0] == eos and len(b.tokens) == 5 and b.stop_reason == "length"
    ref = copy.deepcopy(hf)
    ref.load_state_dict(sd)
    check_against(ref, PROMPT, b, greedy=True)


def test_put_random_weights_and_bad_state_dicts(model_dir, hf):
    s = Sampler(model_dir, McoreBackendConfig())
    g = torch.Generator().manual_seed(9)
    sd = {k: (v + 0.05 * torch.randn(v.shape, generator=g)).to(torch.bfloat16)  # the engine's bf16 export
          for k, v in hf.state_dict().items()}
    s.put("m", "c", sd)
    out = run(s, a=req(model_id="m", ckpt="c", n=2, seed=3, max_tokens=8, plp=True), b=req(n=2, seed=3))
    ref = copy.deepcopy(hf)
    ref.load_state_dict({k: v.float() for k, v in sd.items()})
    for seq in out["a"].sequences:
        check_against(ref, PROMPT, seq)
    assert out["a"].sequences[0].logprobs != out["b"].sequences[0].logprobs
    with pytest.raises(ValueError, match="unexpected"):
        s.put("m", "d", {**sd, "model.extra.weight": torch.zeros(1)})
    with pytest.raises(ValueError, match="missing"):
        s.put("m", "d", {k: v for k, v in sd.items() if k != "lm_head.weight"})
    with pytest.raises(ValueError, match="does not match"):
        s.put("m", "d", {**sd, "lm_head.weight": torch.zeros(VOCAB + 1, 32)})
    with pytest.raises(ValueError, match="checkpoint_id"):
        s.put("m", "", sd)
    assert s.loaded == [("m", "c")]


def _archive(path, folder: str | None = None, marker: bool = False) -> None:
    """A gzip tar with ``folder``'s files (or a MARKER file) at its root, as the backend's store writes."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with tarfile.open(path, "w:gz") as tar:
        if marker:
            m = os.path.join(os.path.dirname(path), MARKER)
            open(m, "w").close()
            tar.add(m, arcname=MARKER)
        else:
            for name in sorted(os.listdir(folder)):
                tar.add(os.path.join(folder, name), arcname=name)


def test_sampler_archives_peft_hf_marker(model_dir, hf, tmp_path):
    """Checkpoints not in memory load from checkpoints_base/model_id/sampler_weights/<id>.tar.gz."""
    from peft import LoraConfig, get_peft_model

    base = tmp_path / "checkpoints"
    torch.manual_seed(4)
    peft = get_peft_model(copy.deepcopy(hf), LoraConfig(r=4, lora_alpha=8, init_lora_weights=False,
                                                        target_modules=["q_proj", "v_proj", "down_proj"]))
    peft.save_pretrained(str(tmp_path / "adapter"))
    _archive(str(base / "lora" / "sampler_weights" / "s1.tar.gz"), str(tmp_path / "adapter"))
    merged = peft.merge_and_unload().eval()
    full = copy.deepcopy(hf)
    with torch.no_grad():
        for p in full.parameters():
            p.add_(0.05 * torch.randn_like(p))
    full.save_pretrained(str(tmp_path / "hf"))
    _archive(str(base / "full" / "sampler_weights" / "s2.tar.gz"), str(tmp_path / "hf"))
    _archive(str(base / "full" / "sampler_weights" / "s3.tar.gz"), marker=True)

    assert sampler_checkpoint_id(base / "lora" / "sampler_weights" / "s1.tar.gz") == "s1"
    assert sampler_checkpoint_id("x/sampler_weights/s1") == "s1"
    s = Sampler(model_dir, McoreBackendConfig(sampler_cache_size=2))
    out = run(s, base, a=req(model_id="lora", ckpt="s1", temperature=0.0, max_tokens=6, plp=True),
              b=req(model_id="full", ckpt="s2", n=2, seed=1, max_tokens=6),
              c=req(model_id="full", ckpt="s3"), d=req(model_id="full", ckpt="nope"),
              e=req(temperature=0.0, max_tokens=6))
    check_against(merged, PROMPT, out["a"].sequences[0], greedy=True)
    torch.testing.assert_close(torch.tensor(out["a"].prompt_logprobs[1:]), prompt_ref(merged, PROMPT),
                               atol=1e-5, rtol=0)
    assert out["a"].sequences[0].tokens != out["e"].sequences[0].tokens or \
        out["a"].sequences[0].logprobs != out["e"].sequences[0].logprobs
    for seq in out["b"].sequences:
        check_against(full, PROMPT, seq)
    assert isinstance(out["c"], types.ErrorResponse) and "persist=False" in out["c"].error
    assert isinstance(out["d"], types.ErrorResponse) and "not in memory" in out["d"].error
    assert s.loaded == [("lora", "s1"), ("full", "s2")]
    check_against(hf, PROMPT, out["e"].sequences[0], greedy=True)  # the base: adapters disabled


def _noisy(hf, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in hf.state_dict().items()}


def test_lru_eviction_reuse_and_drop(model_dir, hf):
    """At most cfg.sampler_cache_size models; a put into a full cache overwrites the least recently used
    model in place, and every kept model still samples from its own weights."""
    s = Sampler(model_dir, McoreBackendConfig(sampler_cache_size=2))
    sds = {c: _noisy(hf, i) for i, c in enumerate(("c1", "c2", "c3", "c4"))}
    for c in ("c1", "c2", "c3"):
        s.put("m", c, sds[c])
    assert s.loaded == [("m", "c2"), ("m", "c3")]
    out = run(s, a=req(model_id="m", ckpt="c1"), b=req(model_id="m", ckpt="c2"))
    assert isinstance(out["a"], types.ErrorResponse) and "'c1'" in out["a"].error
    assert isinstance(out["b"], types.SampleOutput)
    assert s.loaded == [("m", "c3"), ("m", "c2")]  # sampling c2 made it the most recent
    s.put("x", "c4", sds["c4"])
    assert s.loaded == [("m", "c2"), ("x", "c4")]
    s.put("x", "c4", sds["c4"])  # the same key again: replaced, nothing evicted
    assert s.loaded == [("m", "c2"), ("x", "c4")]
    out = run(s, b=req(model_id="m", ckpt="c2", seed=1), d=req(model_id="x", ckpt="c4", seed=1))
    for rid, c in (("b", "c2"), ("d", "c4")):
        ref = copy.deepcopy(hf)
        ref.load_state_dict(sds[c])
        check_against(ref, PROMPT, out[rid].sequences[0])
    s.drop("m")
    assert s.loaded == [("x", "c4")]


def test_put_into_a_tied_model(model_dir, tmp_path):
    """A tied base takes a state dict without lm_head.weight (the engine's export of a tied model)."""
    import shutil

    from transformers import AutoModelForCausalLM, Qwen2Config

    folder = tmp_path / "models" / "tied"
    shutil.copytree(model_dir, folder)
    cfg = Qwen2Config.from_pretrained(folder)
    cfg.tie_word_embeddings = True
    torch.manual_seed(1)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(folder)
    tied = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    s = Sampler(str(folder), McoreBackendConfig())
    sd = {k: v for k, v in _noisy(tied, 2).items() if k != "lm_head.weight"}
    s.put("m", "c", sd)
    seq = run(s, a=req(model_id="m", ckpt="c", temperature=0.0))["a"].sequences[0]
    tied.load_state_dict(sd, strict=False)
    assert torch.equal(tied.lm_head.weight, sd["model.embed_tokens.weight"])
    check_against(tied, PROMPT, seq, greedy=True)


def test_bad_input_gives_an_error_per_request(sampler):
    """Each bad request gets an ErrorResponse naming the field; the good one in the batch still samples."""
    image = types.ModelInput(chunks=[types.EncodedTextChunk(tokens=[5, 6]),
                                     types.ImageChunk(data=b"aGVsbG8=", format="png")])
    img_id, img_req = req()
    img_req = img_req.model_copy(update={"prompt": image})
    out = run(sampler, ok=req(max_tokens=3), vocab=req(prompt=[5, VOCAB]), neg=req(prompt=[-1, 5]),
              empty=req(prompt=[]), img=(img_id, img_req), temp=req(temperature=-0.5),
              long=req(max_tokens=4096 - len(PROMPT) + 1), topp=req(top_p=0.0), topk=req(top_k=-2),
              stoptok=req(stop_tokens=[VOCAB]))
    assert isinstance(out["ok"], types.SampleOutput) and len(out["ok"].sequences[0].tokens) >= 1
    want = {"vocab": "prompt token id 300", "neg": "prompt token id -1", "empty": "prompt has no tokens",
            "img": "prompt chunk 1", "temp": "temperature", "long": "max_tokens", "topp": "top_p",
            "topk": "top_k", "stoptok": "stop token id 300"}
    for rid, text in want.items():
        assert isinstance(out[rid], types.ErrorResponse) and out[rid].status == "failed", rid
        assert text in out[rid].error, (rid, out[rid].error)
    ok = run(sampler, a=req(max_tokens=4096 - len(PROMPT), temperature=0.0, stop_tokens=[0]))
    assert isinstance(ok["a"], types.SampleOutput)
