"""Issue 8, item 5: incremental detokenization equals a full decode at every step, with the real
SmolLM2 tokenizer, on random token sequences (multi-byte characters split across tokens, invalid
byte sequences, special tokens) and on real text."""
from __future__ import annotations

import random

import pytest

from engine.detokenizer import IncrementalDetokenizer

TEXTS = ["Grüße aus Köln — naïve café, 東京の天気は晴れです。 🚀🔥 done.",
         "def f(x):\n    return x ** 2  # ∑ over ∞\n\n\tTabs   and   spaces.",
         "Emoji families 👨‍👩‍👧‍👦 and flags 🇫🇷🇯🇵 split across byte tokens."]


@pytest.fixture(scope="module")
def tokenizer(default_model):
    return default_model.tokenizer


def check(tokenizer, ids: list[int]) -> None:
    detok = IncrementalDetokenizer(tokenizer)
    for k, t in enumerate(ids, 1):
        assert detok.add(t) == tokenizer.decode(ids[:k], skip_special_tokens=True), (ids[:k], k)


@pytest.mark.parametrize("text", TEXTS)
def test_real_text_token_by_token(tokenizer, text) -> None:
    check(tokenizer, tokenizer(text)["input_ids"])


def test_random_token_sequences(tokenizer) -> None:
    rng = random.Random(0)
    vocab = len(tokenizer)
    special = list(tokenizer.all_special_ids)
    byte_tokens = [i for i in range(vocab) if tokenizer.convert_ids_to_tokens(i) in tokenizer.byte_decoder][:256] \
        if hasattr(tokenizer, "byte_decoder") else []
    for _ in range(150):
        pool = rng.choice([range(vocab), byte_tokens or range(256), special + list(range(300))])
        check(tokenizer, [rng.choice(pool) for _ in range(rng.randrange(1, 40))])
