"""The shipped k3-mini tokenizer files."""

from __future__ import annotations

import json
import random
from pathlib import Path

from tokenizers import Tokenizer

from k3ref.data import tasks
from k3ref.data.template_env import TEMPLATE_PATH

MODEL_DIR = Path(__file__).resolve().parents[2] / "models" / "k3-mini"
SPECIALS = {
    0: "<|pad|>", 1: "<|bos|>", 2: "<|end_of_msg|>", 3: "<|open|>", 4: "<|close|>", 5: "<|sep|>",
    6: "<|kimi_image_placeholder|>", 7: "<|media_pad|>",
}


def test_special_token_ids_and_config():
    tok = Tokenizer.from_file(str(MODEL_DIR / "tokenizer.json"))
    assert tok.get_vocab_size() == 8192
    for i, t in SPECIALS.items():
        assert tok.token_to_id(t) == i and tok.id_to_token(i) == t
    config = json.loads((MODEL_DIR / "tokenizer_config.json").read_text())
    assert config["chat_template"] == TEMPLATE_PATH.read_text()
    assert (config["bos_token"], config["eos_token"], config["pad_token"]) == ("<|bos|>", "<|end_of_msg|>", "<|pad|>")
    assert config["model_max_length"] == 4096 and config["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert {int(k): v["content"] for k, v in config["added_tokens_decoder"].items()} == SPECIALS
    assert all(v["special"] for v in config["added_tokens_decoder"].values())
    raw = json.loads((MODEL_DIR / "tokenizer.json").read_text())
    assert raw["post_processor"] is None


def test_markers_are_single_tokens_digits_split_and_decode_round_trips():
    tok = Tokenizer.from_file(str(MODEL_DIR / "tokenizer.json"))
    ex = tasks.sample_example("tool_use", random.Random(1), thinking=True, effort="max")
    text = tasks.full_text(ex)
    ids = tok.encode(text).ids
    assert ids[0] == 3  # no BOS added; starts with <|open|>
    assert ids.count(2) == text.count("<|end_of_msg|>")
    assert ids.count(3) == text.count("<|open|>") and ids.count(5) == text.count("<|sep|>")
    assert tok.decode(ids, skip_special_tokens=False) == text
    assert tok.encode("12345").tokens == ["1", "2", "3", "4", "5"]
