"""The Tinker backend's CPU sampler (``mcore_engine.integrations.tinker.sampling``) without a server,
and the tiny model folder the Tinker tests share (``tinker_setup.tiny_tinker_model``)."""

from __future__ import annotations

import json
import os

import pytest

from tests.integrations.tinker_setup import VOCAB, tiny_tinker_model, tokenizer_roundtrip


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return tiny_tinker_model(str(tmp_path_factory.mktemp("tinker") / "models" / "tiny"))


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
