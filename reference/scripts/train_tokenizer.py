#!/usr/bin/env python3
"""Train the k3-mini byte-level BPE tokenizer on a seeded sample of the synthetic corpus and write
models/k3-mini/tokenizer.json + tokenizer_config.json (HF style, chat template included).

    python3 reference/scripts/train_tokenizer.py            # 20k conversations, seed 1234
    python3 reference/scripts/train_tokenizer.py --conversations 2000 --out /tmp/tok
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "reference"))

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: E402

from k3ref.data import tasks  # noqa: E402
from k3ref.data.template_env import TEMPLATE_PATH  # noqa: E402

VOCAB_SIZE = 8192
MODEL_MAX_LENGTH = 4096
# Fixed ids 0..7, in this order.
SPECIAL_TOKENS = [
    "<|pad|>",
    "<|bos|>",
    "<|end_of_msg|>",
    "<|open|>",
    "<|close|>",
    "<|sep|>",
    "<|kimi_image_placeholder|>",
    "<|media_pad|>",
]
BOS, EOS, PAD = "<|bos|>", "<|end_of_msg|>", "<|pad|>"


def build_tokenizer(texts: list[str]) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        show_progress=False,
        special_tokens=[AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    for i, t in enumerate(SPECIAL_TOKENS):
        if tok.token_to_id(t) != i:
            raise SystemExit(f"special token {t} got id {tok.token_to_id(t)}, expected {i}")
    return tok


def tokenizer_config() -> dict:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": MODEL_MAX_LENGTH,
        "added_tokens_decoder": {
            str(i): {
                "content": t,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": True,
            }
            for i, t in enumerate(SPECIAL_TOKENS)
        },
        "chat_template": TEMPLATE_PATH.read_text(),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--conversations", type=int, default=20000)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--out", type=Path, default=ROOT / "models" / "k3-mini")
    args = ap.parse_args()

    t0 = time.time()
    rng = random.Random(args.seed)
    examples = [tasks.sample_training_conversation(rng) for _ in range(args.conversations)]
    texts = [tasks.full_text(ex) for ex in examples]
    print(f"rendered {len(texts)} conversations ({sum(map(len, texts)) / 1e6:.1f} M chars) in {time.time() - t0:.1f}s")

    t1 = time.time()
    tok = build_tokenizer(texts)
    print(f"trained vocab {tok.get_vocab_size()} in {time.time() - t1:.1f}s")

    args.out.mkdir(parents=True, exist_ok=True)
    tok.save(str(args.out / "tokenizer.json"))
    (args.out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(), indent=2, ensure_ascii=False) + "\n")
    print(f"wrote {args.out / 'tokenizer.json'} and tokenizer_config.json")

    # Stats: tokens per conversation kind over the training sample, and over eval prompts.
    lengths: dict[str, list[int]] = defaultdict(list)
    for ex, enc in zip(examples, tok.encode_batch(texts)):
        lengths[ex.kind].append(len(enc.ids))
    print("training conversations: kind, count, mean tokens, max tokens")
    for kind in tasks.TASK_KINDS:
        v = lengths.get(kind, [0])
        print(f"  {kind:13s} {len(v):6d} {statistics.mean(v):8.1f} {max(v):6d}")
    kv = lengths["kv_retrieval"]
    print(f"kv_retrieval: max {max(kv)} tokens, {sum(n > 2048 for n in kv)}/{len(kv)} over 2048")
    total = sum(sum(v) for v in lengths.values())
    print(f"total tokens in sample: {total} ({total / len(texts):.1f} per conversation)")


if __name__ == "__main__":
    main()
