"""The Tinker backend's sampler: a plain CPU loop in ``transformers`` on weights synced from the engine.

Runs on the controller only (global rank 0): no TP logits to gather, a KV cache, batch 1 per sample so
a sample's tokens do not depend on what else is in the batch. Weights:

- model id ``""``: the base folder's weights (adapters disabled), loaded once;
- ``put(model_id, checkpoint_id, state_dict)``: the engine's merged weights under HF names (what
  ``save_sampler_checkpoint`` yields), kept in an LRU of ``cfg.sampler_cache_size`` models (each a
  full fp32 copy of the base: ``4 * n_params`` bytes);
- a checkpoint not in memory is read from its sampler archive (``.../sampler_weights/<id>.tar.gz``, a
  gzip tar with, at its root, a PEFT folder -> merged into a copy of the base; an HF folder ->
  ``from_pretrained``; only ``MARKER`` -> an error: ``persist=False`` weights live in memory only).

Per sample (SkyRL has already offset ``seed`` by the sample's index): ``g = Generator(seed)``; per step
``z = logits[-1] / T`` (fp32), top-k (``k > 0``) and top-p (``p < 1``) as SkyRL's
``tx/utils/generator.py`` filters, ``tok = multinomial(softmax(z), g)`` (``T == 0``: ``argmax(logits)``).
The returned logprob is the raw model's ``log_softmax(logits)[tok]`` (no temperature, no filter), as
SkyRL's JAX sampler and vLLM's default; it differs from the sampling distribution only for
``T != 1`` or a filter. Stops: a stop token (kept in the output), the first token whose incrementally
decoded text contains a stop string (kept; the text may run past the string, as SkyRL's), the EOS
tokens (tokenizer's and generation config's) when ``cfg.stop_on_eos`` (vLLM's default): stop_reason
``"stop"``; else ``"length"`` at ``max_tokens``. Prompt log-probs (when the request asks, from its
first sample): ``[0.0] + [log_softmax(logits[i-1])[prompt[i]] for i in 1..n-1]``, n values because
the cookbook indexes them ``[1:]`` against n - 1 targets.
"""

from __future__ import annotations

import copy
import os
import tarfile
import tempfile
from collections import OrderedDict

import torch

from mcore_engine.integrations.tinker.config import McoreBackendConfig
from mcore_engine.integrations.tinker.skyrl_types import types

MARKER = "MARKER"  # the only file of a persist=False full-FT sampler archive


def sampler_checkpoint_id(output_path: str | os.PathLike) -> str:
    """The checkpoint id of a sampler archive path (``.../sampler_weights/<id>.tar.gz`` -> ``<id>``), the
    key ``put`` and SkyRL's ``all_checkpoint_ids`` share."""
    name = os.path.basename(os.fspath(output_path))
    return name[:-len(".tar.gz")] if name.endswith(".tar.gz") else name


def filter_logits(z: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """SkyRL's filters on scaled logits ``z`` ``[V]`` (``z`` untouched; returned as is when neither
    applies): top-k keeps the ``k`` largest (``k <= 0``: all); top-p sorts descending and keeps the
    tokens whose exclusive cumulative softmax is ``< p``, always the first (``p >= 1``: all). Dropped
    entries are ``-inf``."""
    out = z
    if top_k > 0 and top_k < z.numel():
        vals, idx = torch.topk(z, top_k)
        out = torch.full_like(z, float("-inf")).scatter(0, idx, vals)
    if top_p < 1.0:
        sorted_z, order = torch.sort(out, descending=True)
        probs = torch.softmax(sorted_z, dim=-1)
        keep = (torch.cumsum(probs, dim=-1) - probs) < top_p
        keep[0] = True
        out = torch.full_like(z, float("-inf")).scatter(0, order, sorted_z.masked_fill(~keep, float("-inf")))
    return out


def _prompt_ids(model_input: types.ModelInput, vocab_size: int) -> list[int]:
    """The prompt's token ids; ValueError naming ``prompt`` for image chunks, no tokens or ids outside
    ``[0, vocab_size)``."""
    ids: list[int] = []
    for i, chunk in enumerate(model_input.chunks):
        if not isinstance(chunk, types.EncodedTextChunk):
            raise ValueError(f"prompt chunk {i} is of type {chunk.type!r}: this server samples from text "
                             "tokens only (encoded_text chunks)")
        ids.extend(chunk.tokens)
    if not ids:
        raise ValueError("prompt has no tokens")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab_size})")
    return ids


def _check_params(p: types.SamplingParams, prompt_len: int, max_positions: int, vocab_size: int) -> None:
    """ValueError naming the field for sampling parameters this sampler cannot honour."""
    bad = [t for t in p.stop_tokens or [] if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"stop token id {bad[0]} is outside the vocabulary [0, {vocab_size})")
    if not p.temperature >= 0.0:
        raise ValueError(f"temperature must be >= 0 (0 = greedy), got {p.temperature}")
    if p.max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {p.max_tokens}")
    if prompt_len + p.max_tokens > max_positions:
        raise ValueError(f"max_tokens {p.max_tokens} + prompt length {prompt_len} exceeds the model's "
                         f"max_position_embeddings {max_positions}")
    if p.top_k < -1:
        raise ValueError(f"top_k must be -1 (or 0: no limit) or a positive count, got {p.top_k}")
    if not 0.0 < p.top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {p.top_p}")


class Sampler:
    """Samples for the backend's ``sample``; see the module docstring for the contract."""

    def __init__(self, base_model: str, cfg: McoreBackendConfig):
        from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

        self.base_model = base_model
        self.cfg = cfg
        self.tokenizer = AutoTokenizer.from_pretrained(base_model)
        self.base = AutoModelForCausalLM.from_pretrained(base_model, dtype=torch.float32).eval()
        hf = self.base.config.get_text_config()
        self.vocab_size: int = hf.vocab_size
        self.max_positions: int = hf.max_position_embeddings
        self.tied: bool = bool(getattr(hf, "tie_word_embeddings", False))
        eos: set[int] = set()
        if self.tokenizer.eos_token_id is not None:
            eos.add(int(self.tokenizer.eos_token_id))
        try:
            gen_eos = GenerationConfig.from_pretrained(base_model).eos_token_id
        except OSError:  # no generation_config.json
            gen_eos = None
        eos.update([gen_eos] if isinstance(gen_eos, int) else (gen_eos or []))
        self.eos_ids = frozenset(eos)
        self._cache: OrderedDict[tuple[str, str], torch.nn.Module] = OrderedDict()
        self._names = frozenset(self.base.state_dict())

    # --- weights ----------------------------------------------------------------------------------

    @property
    def loaded(self) -> list[tuple[str, str]]:
        """``(model_id, checkpoint_id)`` of the models in memory, least recently used first."""
        return list(self._cache)

    def put(self, model_id: str, checkpoint_id: str, state_dict: dict[str, torch.Tensor]) -> None:
        """Keep ``state_dict`` (HF names, LoRA merged, any dtype: copied into fp32) as the sampler model
        of ``(model_id, checkpoint_id)``, evicting the least recently used beyond
        ``cfg.sampler_cache_size``. ValueError on names the base model does not have, missing ones
        (other than a tied ``lm_head.weight``) or other shapes. Memory: at most
        ``cfg.sampler_cache_size`` fp32 copies of the base; a full cache's least recently used model is
        overwritten in place (no extra copy), so a failed put can cost that entry."""
        if not model_id or not checkpoint_id:
            raise ValueError(f"model_id and checkpoint_id must be non-empty, got {model_id!r}, "
                             f"{checkpoint_id!r}")
        allowed = {"lm_head.weight"} if self.tied else set()
        unexpected, missing = set(state_dict) - self._names, self._names - set(state_dict) - allowed
        if unexpected or missing:
            raise ValueError(f"state_dict does not match the base model: unexpected "
                             f"{sorted(unexpected)[:5]}, missing {sorted(missing)[:5]}")
        key = (model_id, checkpoint_id)
        model = self._cache.pop(key, None)
        if model is None and len(self._cache) >= self.cfg.sampler_cache_size:
            model = self._cache.popitem(last=False)[1]
        if model is None or type(model) is not type(self.base):
            model = copy.deepcopy(self.base)
        try:
            with torch.no_grad():
                model.load_state_dict(state_dict, strict=False)
        except RuntimeError as e:  # a shape mismatch
            raise ValueError(f"state_dict does not match the base model: {e}") from e
        self._remember(key, model)

    def drop(self, model_id: str) -> None:
        """Forget every sampler model of ``model_id``."""
        for key in [k for k in self._cache if k[0] == model_id]:
            del self._cache[key]

    def _remember(self, key: tuple[str, str], model: torch.nn.Module) -> None:
        self._cache[key] = model
        self._cache.move_to_end(key)
        while len(self._cache) > self.cfg.sampler_cache_size:
            self._cache.popitem(last=False)

    def _model(self, model_id: str, checkpoint_id: str, path: str) -> torch.nn.Module:
        """The model to sample from: the base for ``""``, else from memory or the archive at ``path``."""
        if not model_id:
            return self.base
        key = (model_id, checkpoint_id)
        if key in self._cache:
            self._cache.move_to_end(key)
            return self._cache[key]
        model = self._load_archive(checkpoint_id, path)
        self._remember(key, model)
        return model

    def _load_archive(self, checkpoint_id: str, path: str) -> torch.nn.Module:
        """Read a sampler archive (gzip tar, the folder at its root): PEFT adapter -> merged into a copy
        of the base; HF folder -> ``from_pretrained``; only ``MARKER`` -> ValueError (persist=False)."""
        from transformers import AutoModelForCausalLM

        if not path or not os.path.isfile(path):
            raise ValueError(f"sampler checkpoint {checkpoint_id!r} is not in memory and has no archive "
                             f"(looked for {path!r})")
        with tempfile.TemporaryDirectory() as tmp:
            try:
                with tarfile.open(path, "r:gz") as tar:
                    tar.extractall(tmp, filter="data")
            except (tarfile.TarError, OSError) as e:
                raise ValueError(f"sampler checkpoint {checkpoint_id!r}: cannot read {path}: {e}") from e
            names = set(os.listdir(tmp))
            if MARKER in names and not names & {"adapter_config.json", "config.json"}:
                raise ValueError(f"sampler checkpoint {checkpoint_id!r} was saved with persist=False and is "
                                 "no longer in memory: save it again (save_weights_for_sampler)")
            try:
                if "adapter_config.json" in names:
                    from peft import PeftModel

                    model = PeftModel.from_pretrained(copy.deepcopy(self.base), tmp).merge_and_unload()
                elif "config.json" in names:
                    model = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32)
                else:
                    raise ValueError(f"found {sorted(names)[:5]}, neither a PEFT adapter nor an HF folder at "
                                     "the archive's root")
            except (ValueError, RuntimeError, KeyError, OSError) as e:  # e.g. an adapter of another base
                raise ValueError(f"sampler checkpoint {checkpoint_id!r} ({path}) cannot be loaded: "
                                 f"{e}") from e
        return model.to(torch.float32).eval()

    # --- sampling ---------------------------------------------------------------------------------

    def sample(self, batch: types.PreparedSampleBatch) -> dict[str, types.SampleOutput | types.ErrorResponse]:
        """One ``SampleOutput`` per request id (its ``end - start`` samples in order), or an
        ``ErrorResponse`` naming the bad field for that request alone."""
        results: dict[str, types.SampleOutput | types.ErrorResponse] = {}
        for request_id, _model_id, start, end, want_prompt_lp in batch.request_batch_slices:
            try:
                results[request_id] = self._sample_request(batch, start, end, want_prompt_lp)
            except ValueError as e:
                results[request_id] = types.ErrorResponse(error=str(e), status="failed")
        return results

    @torch.no_grad()
    def _sample_request(self, batch: types.PreparedSampleBatch, start: int, end: int,
                        want_prompt_lp: bool) -> types.SampleOutput:
        """The samples ``start:end`` of one request (one prompt, one model): one prefill, whose KV cache
        each sample continues from a copy of."""
        if end <= start:
            raise ValueError("num_samples must be >= 1")
        prompts = [_prompt_ids(batch.all_model_inputs[i], self.vocab_size) for i in range(start, end)]
        if any(p != prompts[0] for p in prompts):
            raise ValueError("prompt differs between the samples of one request")
        prompt = prompts[0]
        for i in range(start, end):
            _check_params(batch.all_sampling_params[i], len(prompt), self.max_positions, self.vocab_size)
        model = self._model(batch.all_model_ids[start], batch.all_checkpoint_ids[start],
                            batch.all_checkpoint_paths[start])

        # --- 1. prefill (all positions' logits only for prompt log-probs) ---
        keep = 0 if want_prompt_lp else 1
        out = model(input_ids=torch.tensor([prompt]), use_cache=True, logits_to_keep=keep)
        prompt_lp = None
        if want_prompt_lp:
            lp = torch.log_softmax(out.logits[0, :-1].float(), dim=-1)
            prompt_lp = [0.0] + lp.gather(1, torch.tensor(prompt[1:])[:, None])[:, 0].tolist()
        last = out.logits[0, -1].float()

        # --- 2. one decode loop per sample, each on its own copy of the prompt's cache ---
        sequences = []
        for i in range(start, end):
            cache = out.cache if i == end - 1 else copy.deepcopy(out.cache)
            sequences.append(self._decode(model, last, cache, batch.all_sampling_params[i]))
        return types.SampleOutput(sequences=sequences, prompt_logprobs=prompt_lp)

    def _decode(self, model: torch.nn.Module, logits: torch.Tensor, cache,
                p: types.SamplingParams) -> types.GeneratedSequence:
        """Sample up to ``p.max_tokens`` tokens after a prefill whose last logits are ``logits`` [V]."""
        g = torch.Generator().manual_seed(p.seed % 2**64)
        stop_tokens = set(p.stop_tokens or [])
        if self.cfg.stop_on_eos:
            stop_tokens |= self.eos_ids
        stream = _TextStream(self.tokenizer) if p.stop_strings else None
        tokens: list[int] = []
        logprobs: list[float] = []
        for step in range(p.max_tokens):
            if p.temperature == 0.0:
                tok = int(torch.argmax(logits))
            else:
                z = filter_logits(logits / p.temperature, p.top_k, p.top_p)
                tok = int(torch.multinomial(torch.softmax(z, dim=-1), 1, generator=g))
            tokens.append(tok)
            logprobs.append(float(torch.log_softmax(logits, dim=-1)[tok]))
            if tok in stop_tokens:
                return types.GeneratedSequence(stop_reason="stop", tokens=tokens, logprobs=logprobs)
            if stream is not None:
                text = stream.add(tok)  # once per token: the stream is stateful
                if any(s in text for s in p.stop_strings):
                    return types.GeneratedSequence(stop_reason="stop", tokens=tokens, logprobs=logprobs)
            if step + 1 < p.max_tokens:
                out = model(input_ids=torch.tensor([[tok]]), cache=cache, use_cache=True)
                logits, cache = out.logits[0, -1].float(), out.cache
        return types.GeneratedSequence(stop_reason="length", tokens=tokens, logprobs=logprobs)


class _TextStream:
    """The generated tokens' text so far, decoded incrementally (special tokens kept): the Rust
    tokenizer's ``DecodeStream`` where there is one (SkyRL's way), else a full decode per token."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.rust = getattr(tokenizer, "backend_tokenizer", None)
        self.text = ""
        self.ids: list[int] = []
        if self.rust is not None:
            from tokenizers.decoders import DecodeStream

            self.stream = DecodeStream(skip_special_tokens=False)

    def add(self, tok: int) -> str:
        if self.rust is not None:
            chunk = self.stream.step(self.rust, tok)
            if chunk is not None:
                self.text += chunk
        else:
            self.ids.append(tok)
            self.text = self.tokenizer.decode(self.ids, skip_special_tokens=False)
        return self.text
