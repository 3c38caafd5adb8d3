"""The target's own chat template, and THE loss mask (docs/ARCHITECTURE.md §1, §4).

`render` is the one place that turns a conversation into `input_ids` + `loss_mask`. The mask is derived
from the template's own render boundaries, never from hand-written role markers:

    text_i^prefix = template(messages[:i], add_generation_prompt=True)   # ends where assistant turn i starts
    text_i^full   = template(messages[:i+1])                             # ends after turn i's trailer

The assistant span of turn i is [len(text_i^prefix), end of the end-of-turn token inside text_i^full):
the assistant's content plus its end-of-turn token (`<|im_end|>`, `<|eot_id|>`, ...), but not the
template's trailing newline, role headers, user/system turns or an injected default system prompt.

Invariants checked (a violation raises `TemplateError`, never a silently wrong mask):
- prefix stability: every text_i^prefix / text_i^full is a string prefix of the full render, and
  tokenizing a boundary prefix yields a token prefix of the full tokenization (no token straddles a
  boundary), so the mask can be cut in token space exactly where it was cut in text.
"""
from __future__ import annotations

import hashlib
import json

SENTINEL = "\u2063EAGLE3-PROBE\u2063"  # invisible separators: never produced by a template itself


class TemplateError(ValueError):
    """The chat template cannot give an exact loss mask for this tokenizer (fail the run loudly)."""


class BoundaryError(TemplateError):
    """This conversation's text makes a token straddle a turn boundary (reject the one conversation)."""


def _msgs(messages) -> list[dict]:
    return [m if isinstance(m, dict) else {"role": m.role, "content": m.content} for m in messages]


def apply_template(tokenizer, messages, add_generation_prompt: bool = False) -> str:
    if not getattr(tokenizer, "chat_template", None):
        raise TemplateError("the tokenizer has no chat template; the target's own template is required")
    return tokenizer.apply_chat_template(_msgs(messages), tokenize=False,
                                         add_generation_prompt=add_generation_prompt)


def encode(tokenizer, text: str) -> list[int]:
    # The template already wrote every special token (BOS included): add none.
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def render_prompt(tokenizer, messages) -> list[int]:
    """Token ids the target sees when asked to answer `messages` (template + generation prompt)."""
    return encode(tokenizer, apply_template(tokenizer, messages, add_generation_prompt=True))


def special_ids(tokenizer) -> set[int]:
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    return set(tokenizer.all_special_ids) | {i for i, t in added.items() if getattr(t, "special", False)}


_EOT_MEMO: dict[str, str] = {}  # template_hash -> end-of-turn token (probing renders twice)


def end_of_turn(tokenizer) -> str:
    """The special token the template writes right after an assistant message (ChatML `<|im_end|>`,
    Llama-3 `<|eot_id|>`). Found by rendering a probe turn, so it is the template's own choice."""
    key = template_hash(tokenizer)
    if key not in _EOT_MEMO:
        _EOT_MEMO[key] = _probe_end_of_turn(tokenizer)
    return _EOT_MEMO[key]


def eos_token_ids(tokenizer, model=None) -> set[int]:
    """THE end-of-answer rule, shared by regeneration and the decoding engine: the template's own
    end-of-turn token (probed by `end_of_turn`) plus every eos id the tokenizer, the model config and
    its generation config declare (the template's token alone would miss a declared `<|endoftext|>`).
    Without a tokenizer (a bare model in tests) only the model's declared ids remain."""
    ids = set() if tokenizer is None else {tokenizer.convert_tokens_to_ids(end_of_turn(tokenizer))}
    declared = (tokenizer, getattr(model, "config", None), getattr(model, "generation_config", None))
    for value in (getattr(d, "eos_token_id", None) for d in declared):
        ids.update([value] if isinstance(value, int) else (value or []))
    return ids


def _probe_end_of_turn(tokenizer) -> str:
    probe = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": SENTINEL}]
    text = apply_template(tokenizer, probe)
    at = text.rfind(SENTINEL)
    if at < 0:
        raise TemplateError("the chat template drops the assistant's content; cannot build a loss mask")
    trailer = encode(tokenizer, text[at + len(SENTINEL):])
    if not trailer or trailer[0] not in special_ids(tokenizer):
        raise TemplateError("the chat template writes no special end-of-turn token after an assistant "
                            f"message (trailer {text[at + len(SENTINEL):]!r}); cannot mask its end")
    return tokenizer.convert_ids_to_tokens(trailer[0])


def assistant_spans(tokenizer, messages) -> tuple[str, list[tuple[int, int]]]:
    """Full rendered text and the char spans [start, end) of each assistant turn's content + EOT."""
    msgs = _msgs(messages)
    text = apply_template(tokenizer, msgs)
    eot = end_of_turn(tokenizer)
    spans = []
    for i, m in enumerate(msgs):
        if m["role"] != "assistant":
            continue
        prefix = apply_template(tokenizer, msgs[:i], add_generation_prompt=True)
        upto = apply_template(tokenizer, msgs[: i + 1])
        if not (upto.startswith(prefix) and text.startswith(upto)):
            raise TemplateError(f"chat template is not prefix-stable at assistant turn {i}: rendering a "
                                "conversation prefix does not give a prefix of the full render")
        end = upto.rfind(eot)
        if end < len(prefix):
            raise TemplateError(f"assistant turn {i} has no {eot!r} after its content")
        spans.append((len(prefix), end + len(eot)))
    return text, spans


def render(tokenizer, messages) -> tuple[list[int], list[int]]:
    """THE loss-mask function: (input_ids, loss_mask), mask 1 exactly on assistant content + EOT."""
    text, spans = assistant_spans(tokenizer, messages)
    ids = encode(tokenizer, text)
    mask = [0] * len(ids)
    for start, end in spans:
        a, b = _token_cut(tokenizer, text, ids, start), _token_cut(tokenizer, text, ids, end)
        mask[a:b] = [1] * (b - a)
    return ids, mask


def _token_cut(tokenizer, text: str, ids: list[int], char_pos: int) -> int:
    """Token index where `text[:char_pos]` ends; raises if a token straddles char_pos."""
    head = encode(tokenizer, text[:char_pos])
    if ids[: len(head)] != head:
        # the message names the position only: conversation text may hold PII and errors get logged
        raise BoundaryError(f"a token straddles the turn boundary at char {char_pos}; the mask would be wrong")
    return len(head)


def template_hash(tokenizer) -> str:
    """sha256 of the chat template and the special tokens: changes whenever rendering can change."""
    payload = {"chat_template": tokenizer.chat_template or "",
               "special_tokens": _special_tokens(tokenizer)}
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def tokenizer_hash(tokenizer) -> str:
    """sha256 of the whole tokenizer (model, normalizer, added tokens) plus its template hash."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    body = backend.to_str() if backend is not None else json.dumps(tokenizer.get_vocab(), sort_keys=True)
    return hashlib.sha256((body + template_hash(tokenizer)).encode()).hexdigest()


def _special_tokens(tokenizer) -> dict:
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    return {"map": {k: str(v) for k, v in tokenizer.special_tokens_map.items()},
            "added": {str(i): str(t) for i, t in sorted(added.items())}}
