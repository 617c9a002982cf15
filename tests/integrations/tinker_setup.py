"""Assets of the Tinker API tests: a tiny random Qwen2 causal LM with a byte-level BPE tokenizer that
``AutoTokenizer`` loads back with the same ids (what the tinker client and the cookbook do with the
server's ``--base-model`` folder).

The tokenizer is trained with exactly Qwen2's pipeline (NFC, Qwen's split regex, ``ByteLevel`` without
its own regex): beside a Qwen2 ``config.json`` transformers 5 loads any saved tokenizer as a
``Qwen2Tokenizer``, which rebuilds that pipeline from ``vocab.json`` / ``merges``; a tokenizer trained
with another pre-tokenizer would then encode differently after loading (``"123"``: one token saved,
three loaded) although ``decode`` round-trips (plan section 9.1).
"""

from __future__ import annotations

import os

import torch

VOCAB = 300
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
EOS, PAD = "<|im_end|>", "<|endoftext|>"
# Qwen2's pre-tokenizer split (transformers' Qwen2Tokenizer / tokenizer.json of the Qwen2 models)
QWEN2_SPLIT = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
               r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")
# a few lines of chat text: the merges the BPE learns (ids above the 256 bytes and 3 specials)
CORPUS = [
    "<|im_start|>user\nWhat is 12 + 35? Answer with a number.<|im_end|>\n",
    "<|im_start|>assistant\nThe answer is 47.<|im_end|>\n",
    "User: Guess the number between 1 and 100.\n\nAssistant: Is it 50?\n\nUser: Higher.\n\n",
    "The quick brown fox jumps over the lazy dog. I'm sure they'll say it's fine, we've seen it.",
    "System: You are a helpful assistant that thinks step by step and answers in the end.\n",
]
# the check texts of :func:`tokenizer_roundtrip`: ASCII, digits, unicode, newlines, special tokens
CHECK_TEXTS = [
    "Hello world! The answer is 47.",
    "12345 + 678 = 7023",
    "naïve café, 東京, emoji 🙂 and Ωmega",
    "line one\n\nline two\r\n\tindented   spaces  ",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "User: Is it 50?\n\nAssistant: Higher.<|endoftext|>",
]


def make_tokenizer(path: str):
    """Train the byte-level BPE on :data:`CORPUS` with Qwen2's pipeline (at most :data:`VOCAB` ids:
    3 specials, 256 bytes, the merges) and save it as a ``PreTrainedTokenizerFast`` into ``path``
    (eos ``<|im_end|>``, pad ``<|endoftext|>``). Returns the saved tokenizer."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=PAD)
    fast.save_pretrained(path)
    return fast


def make_model(path: str, vocab_size: int, *, eos_token_id: int, pad_token_id: int, seed: int = 0) -> None:
    """A tiny random fp32 ``Qwen2ForCausalLM`` (hidden 32, MLP 64, 2 layers, 4 query / 2 key-value heads
    of 8, 4096 positions, untied lm-head), saved by ``save_pretrained``."""
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                      rms_norm_eps=1e-6, tie_word_embeddings=False, eos_token_id=eos_token_id,
                      pad_token_id=pad_token_id, bos_token_id=None, dtype="float32")
    model = Qwen2ForCausalLM(cfg).to(torch.float32)
    model.generation_config = GenerationConfig(eos_token_id=eos_token_id, pad_token_id=pad_token_id)
    model.save_pretrained(path)


def tiny_tinker_model(path: str, seed: int = 0) -> str:
    """Write the tiny model and its tokenizer into the folder ``path`` and return it (absolute).

    ``path`` must have no ``:`` and at least three ``/`` (e.g. ``<tmp>/tinker/models/tiny``): the tinker
    client derives the tokenizer's name from the base model string and cuts it at ``:`` and to two
    path parts when it has exactly two slashes (plan finding 6). config.json's vocabulary is the
    tokenizer's length, so every id the tokenizer gives is a row of the embedding."""
    path = os.path.abspath(path)
    if ":" in path or path.count("/") < 3:
        raise ValueError(f"path must have no ':' and at least three '/', got {path!r}")
    os.makedirs(path, exist_ok=True)
    tok = make_tokenizer(path)
    make_model(path, len(tok), eos_token_id=tok.convert_tokens_to_ids(EOS),
               pad_token_id=tok.convert_tokens_to_ids(PAD), seed=seed)
    return path


def tokenizer_roundtrip(folder: str) -> list[str]:
    """Problems of the folder's tokenizer as ``AutoTokenizer`` loads it (empty when none): ids equal to
    those of the trained tokenizer (``tokenizer.json`` loaded by ``tokenizers``) on
    :data:`CHECK_TEXTS`, ``decode`` giving the text back, specials one id each, all ids in the model's
    vocabulary."""
    import json

    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    trained = Tokenizer.from_file(os.path.join(folder, "tokenizer.json"))
    loaded = AutoTokenizer.from_pretrained(folder)
    with open(os.path.join(folder, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    problems = []
    if len(loaded) != vocab:
        problems.append(f"len(tokenizer) {len(loaded)} != config vocab_size {vocab}")
    if loaded.eos_token != EOS or loaded.pad_token != PAD:
        problems.append(f"eos / pad {loaded.eos_token!r} / {loaded.pad_token!r}")
    for s in SPECIALS:
        ids = loaded.encode(s, add_special_tokens=False)
        if ids != [trained.token_to_id(s)]:
            problems.append(f"special {s!r} -> {ids}")
    for text in CHECK_TEXTS:
        want = trained.encode(text, add_special_tokens=False).ids
        got = loaded.encode(text, add_special_tokens=False)
        if got != want:
            problems.append(f"{text!r}: loaded {got} != trained {want}")
        if max(got) >= vocab:
            problems.append(f"{text!r}: id {max(got)} >= vocab {vocab}")
        back = loaded.decode(got)
        if back != text:
            problems.append(f"{text!r}: decodes to {back!r}")
    return problems
