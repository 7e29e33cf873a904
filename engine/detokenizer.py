"""Incremental detokenization: the text of a growing list of generated token ids, in O(new
tokens) per step, equal at every step to `tokenizer.decode(all ids, skip_special_tokens=True)`.

Knows: the two-offset scheme vLLM uses. Text is committed up to `read` (ids[:read] decode to
`committed`); each new step decodes only the window ids[prefix:], where ids[prefix:read] is the
last committed chunk, kept as context (a SentencePiece tokenizer drops the leading space of a
window's first token, and a byte-level one may have split a character across tokens). The
window's text beyond the context is the new text. While it ends in U+FFFD (a character whose
bytes have not all arrived) it is shown but not committed, exactly as a full decode shows it.
Doesn't know: stop strings or streaming (engine.py decides what is sent).
"""
from __future__ import annotations

from typing import Any

_INCOMPLETE = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._ids: list[int] = []
        self._prefix = 0             # start of the context window
        self._read = 0               # ids[:read] are committed
        self._committed = ""

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=True)

    def add(self, token: int) -> str:
        """Append one token id; returns the whole text so far."""
        self._ids.append(token)
        context = self._decode(self._ids[self._prefix:self._read])
        window = self._decode(self._ids[self._prefix:])
        if not window.startswith(context):
            # A tokenizer whose window text does not extend its context: decode everything
            # once (correct, O(n) this step) and start a fresh window here.
            self._committed = self._decode(self._ids)
            self._prefix = self._read = len(self._ids)
            return self._committed
        new = window[len(context):]
        if not new or new.endswith(_INCOMPLETE):
            return self._committed + new
        self._committed += new
        self._prefix, self._read = self._read, len(self._ids)
        return self._committed
