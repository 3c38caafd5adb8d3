"""When a generation ends and which tokens are safe to hand out: EOS, max_new_tokens, stop strings.
Which ids count as EOS is decided by `data.chat.eos_token_ids` (one rule with regeneration).

Stop strings are matched on the incrementally decoded text (special tokens skipped, as a client sees
it). Tokens whose text could still turn out to be the start of a stop string are held back until
that is decided, so a streamed output never contains any part of a stop string; on a match the
output is trimmed to the tokens whose text ends before the stop string.
"""
from __future__ import annotations

from typing import Sequence

class Finisher:
    """Accumulates generated tokens; `push(chunk)` returns the tokens to emit now."""

    def __init__(self, tokenizer, eos_ids: set[int], max_new_tokens: int, stop: Sequence[str] = ()):
        if stop and tokenizer is None:
            raise ValueError("stop strings need a tokenizer")
        self.tok, self.eos_ids, self.max_new = tokenizer, eos_ids, max_new_tokens
        self.stop = [s for s in stop if s]
        self.tokens: list[int] = []
        self.emitted = 0
        self.reason: str | None = None  # "stop" (EOS or stop string) | "length"

    @property
    def done(self) -> bool:
        return self.reason is not None

    def push(self, chunk: Sequence[int]) -> list[int]:
        for t in chunk:
            self.tokens.append(int(t))
            if t in self.eos_ids:
                self.reason = "stop"
                break
            if len(self.tokens) >= self.max_new:
                self.reason = "length"
                break
        safe = self._apply_stop_strings() if self.stop else len(self.tokens)
        out = self.tokens[self.emitted:safe]
        self.emitted = max(self.emitted, safe)
        return out

    def _decode(self, n: int) -> str:
        return self.tok.decode(self.tokens[:n], skip_special_tokens=True)

    def _apply_stop_strings(self) -> int:
        """Trims at a matched stop string; returns how many tokens may be emitted."""
        text = self._decode(len(self.tokens))
        hits = [i for i in (text.find(s) for s in self.stop) if i >= 0]
        if hits:
            keep = self._tokens_within(min(hits))
            del self.tokens[keep:]
            self.reason = "stop"
            return keep
        if self.done:
            return len(self.tokens)
        return self._tokens_within(len(text) - self._pending_prefix(text))

    def _pending_prefix(self, text: str) -> int:
        """Length of the longest suffix of text that is a proper prefix of some stop string."""
        best = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:k]):
                    best = k
                    break
        return best

    def _tokens_within(self, n_chars: int) -> int:
        """Largest token count (≥ emitted) whose decoded text fits in the first n_chars characters."""
        for j in range(len(self.tokens), self.emitted, -1):
            if len(self._decode(j)) <= n_chars:
                return j
        return self.emitted
