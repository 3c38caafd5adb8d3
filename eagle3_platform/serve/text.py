"""Token ids → text deltas for streaming, with OpenAI stop-string semantics.

The whole generated sequence is re-decoded on every chunk (outputs are short, and byte-level BPE
pieces only become valid UTF-8 once complete). A delta is released only when it
- does not end in U+FFFD (an incomplete multi-byte character), and
- cannot be the start of a stop string (the last max_stop_len-1 characters are held back),
so streamed text equals the non-streamed text exactly, stop strings excluded.
"""
from __future__ import annotations

from typing import Sequence

REPLACEMENT = "\ufffd"


class TextStream:
    def __init__(self, tokenizer, stop: Sequence[str] = ()):
        self.tokenizer = tokenizer
        self.stop = tuple(s for s in stop if s)
        self.holdback = max((len(s) for s in self.stop), default=1) - 1
        self.ids: list[int] = []
        self.sent = 0              # characters of the final text already released
        self.stopped = False       # a stop string was found: the text is final
        self.text = ""

    def feed(self, ids: Sequence[int]) -> str:
        """Add generated ids; returns the text that is now safe to release."""
        if self.stopped:
            return ""
        self.ids.extend(int(i) for i in ids)
        self.text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        cut = self._find_stop()
        if cut is not None:
            self.text, self.stopped = self.text[:cut], True
            return self._release(len(self.text))
        end = len(self.text) - self.holdback
        if self.text.endswith(REPLACEMENT):
            end = min(end, len(self.text.rstrip(REPLACEMENT)))
        return self._release(end)

    def flush(self) -> str:
        """End of generation: release everything still held back."""
        return self._release(len(self.text))

    def _find_stop(self) -> int | None:
        # Only the region that could contain a new match is searched: [sent - holdback, end).
        start = max(0, self.sent - self.holdback)
        hits = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
        return min(hits) if hits else None

    def _release(self, end: int) -> str:
        if end <= self.sent:
            return ""
        delta, self.sent = self.text[self.sent:end], end
        return delta
