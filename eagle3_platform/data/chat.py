"""The target's own chat template, and THE loss mask (docs/ARCHITECTURE.md §1, §4).

Each assistant turn is trained as the target saw it when it produced that turn:

    prompt_i = template(messages[:i], add_generation_prompt=True)    # what the target was asked
    answer_i = the tokens it generated, its end-of-turn token included  # what it answered

`sequences` joins the turns into records, one per chain: turn i+1 continues turn i's record when its
prompt starts with turn i's prompt + answer token for token (ChatML, Llama-3, Gemma-3: one record, the
whole conversation). A template that rewrites earlier turns (Qwen3 drops their reasoning, GPT-OSS ends
them with `<|end|>` instead of `<|return|>`, Mistral moves the system prompt to the last user turn)
starts a new record there, from that turn's own prompt. So every assistant turn is masked exactly once,
in the record that holds what the target saw when it produced it (`Sequence.turns` names the turns in
each record's mask), and no record holds text the target did not see at that point.

Answer tokens come from the generator itself (the local back end: its exact ids, all trained) or,
for text answers (an endpoint, `render`), from the template: the template's own assistant mask where it
has one (`{% generation %}` + `return_assistant_tokens_mask`), else the render diff of the answer as the
last turn, masked on the answer's own texts (its reasoning, its content + end-of-turn) only: what the
template writes around them (Qwen3's empty `<think>\\n\\n</think>\\n\\n`, GPT-OSS's
`<|channel|>final<|message|>`) stays outside. Text answers are stored stripped, so a template's trim
cannot make the masked text differ from the stored answer; a space a template writes before the answer
(Mistral) joins the answer's first token, as in what the target generates.

Reasoning (`keep` | `drop`): keep trains the thinking the target emits; drop asks the template not to
think (`enable_thinking=False`, Qwen3), cuts any thinking still generated (at the template's own
separator, probed: `reasoning_markers`) and trains the answer without it.

Errors: `TemplateError` (no exact mask for this conversation), `BoundaryError` (a token straddles a turn
boundary) and any jinja error the template raises (`template_reason` names it) reject the one
conversation; only a tokenizer without a usable template fails a run.
"""
from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass

SENTINEL = "\u2063EAGLE3-PROBE\u2063"  # invisible separators: never produced by a template itself
THOUGHT = "\u2063EAGLE3-THOUGHT\u2063"
REASONING = ("keep", "drop")


class TemplateError(ValueError):
    """The chat template cannot give an exact loss mask (for this conversation, or at all)."""


class BoundaryError(TemplateError):
    """This conversation's text makes a token straddle a turn boundary (reject the one conversation)."""


@dataclass(frozen=True)
class Turn:
    """One assistant turn as the target produced it."""

    prompt: list[int]  # ids it was given: the conversation so far + the generation prompt
    answer: list[int]  # ids of its answer, the end-of-turn token included when it stopped
    mask: list[int]  # per answer id: 1 = trained


@dataclass(frozen=True)
class Sequence:
    """One training record: its ids, the mask over them, and which assistant turns the mask holds."""

    input_ids: list[int]
    loss_mask: list[int]
    turns: list[int]  # assistant turns (0-based) whose answers are in the mask


def template_kwargs(reasoning: str = "keep") -> dict:
    if reasoning not in REASONING:
        raise ValueError(f"reasoning must be one of {REASONING}, not {reasoning!r}")
    return {} if reasoning == "keep" else {"enable_thinking": False}


def _msg(m) -> dict:
    d = dict(m) if isinstance(m, dict) else {"role": m.role, "content": m.content}
    if d.get("reasoning_content"):  # Qwen3 reads reasoning_content, GPT-OSS `thinking`
        d.setdefault("thinking", d["reasoning_content"])
    return d


def _msgs(messages) -> list[dict]:
    return [_msg(m) for m in messages]


def apply_template(tokenizer, messages, add_generation_prompt: bool = False, reasoning: str = "keep") -> str:
    if not getattr(tokenizer, "chat_template", None):
        raise TemplateError("the tokenizer has no chat template; the target's own template is required")
    return tokenizer.apply_chat_template(_msgs(messages), tokenize=False,
                                         add_generation_prompt=add_generation_prompt, **template_kwargs(reasoning))


def encode(tokenizer, text: str) -> list[int]:
    # The template already wrote every special token (BOS included): add none.
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def render_prompt(tokenizer, messages, reasoning: str = "keep") -> list[int]:
    """Token ids the target sees when asked to answer `messages` (template + generation prompt)."""
    return encode(tokenizer, apply_template(tokenizer, messages, True, reasoning))


def template_reason(error: Exception) -> str:
    """The rejection reason for a conversation the template cannot render or mask. A template's own
    `raise_exception` message is its author's fixed text (roles at most), never conversation text."""
    import jinja2

    if isinstance(error, BoundaryError):
        return "bad:token_boundary"
    if isinstance(error, TemplateError):
        return "template:mask"
    if type(error) is jinja2.exceptions.TemplateError:  # raise_exception in the template
        return "template:" + re.sub(r"\s+", " ", str(error)).strip()[:100]
    return f"template:{type(error).__name__}"


def template_errors() -> tuple[type[Exception], ...]:
    """What rendering one conversation may raise: caught per conversation (rejected with its reason)."""
    import jinja2

    return (TemplateError, jinja2.TemplateError, TypeError, KeyError, IndexError)


def special_ids(tokenizer) -> set[int]:
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    return set(tokenizer.all_special_ids) | {i for i, t in added.items() if getattr(t, "special", False)}


def special_strings(tokenizer) -> list[str]:
    return sorted({tokenizer.convert_ids_to_tokens(i) for i in special_ids(tokenizer)}, key=len, reverse=True)


_MEMO: dict[tuple[str, str], object] = {}  # (template_hash, what) -> probed value


def _memo(tokenizer, what: str, probe):
    key = (template_hash(tokenizer), what)
    if key not in _MEMO:
        _MEMO[key] = probe(tokenizer)
    return _MEMO[key]


def end_of_turn(tokenizer) -> str:
    """The special token the template writes right after an assistant message (ChatML `<|im_end|>`,
    Llama-3 `<|eot_id|>`, GPT-OSS `<|return|>`). Found by rendering a probe turn: the template's choice."""
    return _memo(tokenizer, "eot", lambda t: t.convert_ids_to_tokens(_probe_trailer(t)[0]))


def trailer_length(tokenizer) -> int:
    """Tokens the template writes after an answer's content (end-of-turn + newline): reserved in budgets."""
    return _memo(tokenizer, "trailer", lambda t: len(_probe_trailer(t)))


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


def _probe_trailer(tokenizer) -> list[int]:
    probe = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": SENTINEL}]
    text = apply_template(tokenizer, probe)
    at = text.rfind(SENTINEL)
    if at < 0:
        raise TemplateError("the chat template drops the assistant's content; cannot build a loss mask")
    trailer = encode(tokenizer, text[at + len(SENTINEL):])
    if not trailer or trailer[0] not in special_ids(tokenizer):
        raise TemplateError("the chat template writes no special end-of-turn token after an assistant "
                            f"message (trailer {text[at + len(SENTINEL):]!r}); cannot mask its end")
    return trailer


# ------------------------------------------------------------------------------------------ reasoning

@dataclass(frozen=True)
class Markers:
    """How the template writes an answer's reasoning: opener + thought + separator + content, and the
    header it writes before an answer without reasoning (empty for most templates)."""

    opener: str  # "<think>" (Qwen3), "<|channel|>analysis<|message|>" (GPT-OSS)
    separator: str  # "</think>", "<|end|><|start|>assistant<|channel|>final<|message|>"
    plain_header: str  # drop mode: GPT-OSS "<|channel|>final<|message|>"; Qwen3 "" (in the prompt)


def reasoning_markers(tokenizer) -> Markers | None:
    """The template's reasoning format, probed (None: the template renders no reasoning)."""
    return _memo(tokenizer, "markers", _probe_markers)


def _probe_markers(tokenizer) -> Markers | None:
    before = [{"role": "user", "content": "hi"}]
    try:
        both = _answer_text(tokenizer, before, {"role": "assistant", "content": SENTINEL,
                                                "reasoning_content": THOUGHT}, "keep")
        plain = _answer_text(tokenizer, before, {"role": "assistant", "content": SENTINEL}, "drop")
    except template_errors():
        return None
    if THOUGHT not in both or SENTINEL not in both or both.index(THOUGHT) > both.index(SENTINEL):
        return None
    t, c = both.index(THOUGHT), both.index(SENTINEL)
    return Markers(both[:t].strip(), both[t + len(THOUGHT):c].strip(), plain[:plain.find(SENTINEL)].strip())


def _answer_text(tokenizer, before, answer: dict, reasoning: str) -> str:
    prompt = apply_template(tokenizer, before, True, reasoning)
    full = apply_template(tokenizer, list(before) + [answer], False, reasoning)
    if not full.startswith(prompt):
        raise TemplateError("rendering the answer as the last turn does not extend its prompt")
    return full[len(prompt):]


def split_answer(tokenizer, text: str) -> tuple[str, str, int]:
    """Generated text (special tokens kept) -> (reasoning, content, char where the content starts).
    Text without the template's separator is all content. Special tokens are dropped from both parts
    (as a chat API returns them); the content keeps its whitespace (the next turn's prompt renders it
    as generated), the reasoning is stripped."""
    m = reasoning_markers(tokenizer)
    at = text.find(m.separator) if m and m.separator else -1
    if at < 0:
        return "", _unspecial(tokenizer, text), 0
    thought = text[:at].lstrip()
    thought = thought[len(m.opener):] if m.opener and thought.startswith(m.opener) else thought
    start = at + len(m.separator)
    start += len(text[start:]) - len(text[start:].lstrip())
    return _unspecial(tokenizer, thought).strip(), _unspecial(tokenizer, text[start:]), start


def _unspecial(tokenizer, text: str) -> str:
    for s in special_strings(tokenizer):
        text = text.replace(s, "")
    return text


# ------------------------------------------------------------------------------------------ answers

def generated_turn(tokenizer, prompt: list[int], tokens: list[int], stopped: bool, reasoning: str = "keep"
                   ) -> tuple[Turn, str, str]:
    """An answer the target generated (exact ids; `stopped`: its last id is the stop token) -> the
    Turn, and its (reasoning, content) for the conversation's history. keep: every generated id is
    trained. drop: the thinking is cut (where the template's separator is found) and the answer is
    the template's plain-answer header (not trained) + the generated content ids."""
    body = tokens[:-1] if stopped else tokens
    text = tokenizer.decode(body, skip_special_tokens=False, clean_up_tokenization_spaces=False)
    thought, content, start = split_answer(tokenizer, text)
    if reasoning == "keep" or not start:
        return Turn(prompt, list(tokens), [1] * len(tokens)), thought, content
    k = _token_at(tokenizer, body, start)
    header = encode(tokenizer, reasoning_markers(tokenizer).plain_header)
    answer = header + list(tokens[k:])
    return Turn(prompt, answer, [0] * len(header) + [1] * (len(tokens) - k)), "", content


def _token_at(tokenizer, ids: list[int], char_pos: int) -> int:
    """Smallest k with len(decode(ids[:k])) >= char_pos (binary search: decoded length grows with k)."""
    lo, hi = 0, len(ids)
    while lo < hi:
        mid = (lo + hi) // 2
        n = len(tokenizer.decode(ids[:mid], skip_special_tokens=False, clean_up_tokenization_spaces=False))
        lo, hi = (mid + 1, hi) if n < char_pos else (lo, mid)
    return lo


def text_turn(tokenizer, before, answer, reasoning: str = "keep") -> Turn:
    """A text answer (an endpoint's reply, a record's message) as the last turn after `before`: the
    template's own assistant mask where it has `{% generation %}`, else the render diff. The mask runs
    from the answer's own text (its reasoning when kept, else its content) through the end-of-turn."""
    answer = _msg(answer)
    if reasoning == "drop":
        answer = {k: v for k, v in answer.items() if k not in ("reasoning_content", "thinking")}
    prompt = render_prompt(tokenizer, before, reasoning)
    if _has_generation_block(tokenizer):
        return _generation_mask_turn(tokenizer, before, answer, prompt, reasoning)
    prompt_text = apply_template(tokenizer, before, True, reasoning)
    text = prompt_text + _answer_text(tokenizer, before, answer, reasoning)
    thought = (answer.get("reasoning_content") or "").strip()
    if thought and reasoning_markers(tokenizer) is None:
        raise TemplateError("the template renders no reasoning, so the answer's thinking has no place in "
                            "it; regenerate with reasoning=drop")
    content = answer["content"].strip()
    at = len(prompt_text)
    spans = []  # char spans of the answer's own texts in `text`: [thought], content
    for piece in ([thought] if thought else []) + [content]:
        found = text.find(piece, at) if piece else at
        if found < 0:
            raise TemplateError("the template rewrites the assistant's text; no exact mask")
        spans.append([found, found + len(piece)])
        at = found + len(piece)
    eot = end_of_turn(tokenizer)
    end = text.find(eot, at)
    if end < 0:
        raise TemplateError(f"the answer has no {eot!r} after its content")
    spans[-1][1] = end + len(eot)  # the content's span runs through the end-of-turn token
    ids = encode(tokenizer, text[: end + len(eot)])
    a = _token_cut(tokenizer, text, ids, len(prompt_text))
    if ids[:a] != prompt:
        raise BoundaryError("the prompt's tokens change when the answer follows them")
    mask = [0] * (len(ids) - a)
    for lo, hi in spans:  # template text between the spans (Qwen3's </think>) is not the answer's
        lo, hi = _answer_start(tokenizer, text, ids, lo), _token_cut(tokenizer, text, ids, hi)
        mask[lo - a:hi - a] = [1] * (hi - lo)
    return Turn(prompt, ids[a:], mask)


def _answer_start(tokenizer, text: str, ids: list[int], start: int) -> int:
    """Token index where the answer's text starts. Whitespace the template writes right before it (Mistral's
    space after `[/INST]`) merges into the answer's first token, as it does in what the target generates
    (a SentencePiece target emits "▁Hello"): that token starts the mask."""
    lead = len(text[:start]) - len(text[:start].rstrip())
    try:
        return _token_cut(tokenizer, text, ids, start)
    except BoundaryError:
        if not lead:
            raise
    return _token_cut(tokenizer, text, ids, start - lead)


def _has_generation_block(tokenizer) -> bool:
    return bool(re.search(r"\{%-?\s*generation\s*-?%\}", tokenizer.chat_template or ""))


def _generation_mask_turn(tokenizer, before, answer: dict, prompt: list[int], reasoning: str) -> Turn:
    out = tokenizer.apply_chat_template(_msgs(list(before) + [answer]), tokenize=True, return_dict=True,
                                        return_assistant_tokens_mask=True, **template_kwargs(reasoning))
    ids, marks = list(out["input_ids"]), list(out["assistant_masks"])
    if ids[: len(prompt)] != prompt:
        raise BoundaryError("the prompt's tokens change when the answer follows them")
    hits = [p for p in range(len(prompt), len(ids)) if marks[p]]
    if not hits:
        raise TemplateError("the template's generation block marks nothing of the answer")
    end = hits[-1] + 1
    eot = tokenizer.convert_tokens_to_ids(end_of_turn(tokenizer))
    if end < len(ids) and ids[end] == eot:  # the end-of-turn token is trained even outside the block
        marks[end], end = 1, end + 1
    return Turn(prompt, ids[len(prompt):end], [int(bool(x)) for x in marks[len(prompt):end]])


# ------------------------------------------------------------------------------------------ records

def sequences(tokenizer, turns: list[Turn], messages=None, reasoning: str = "keep") -> list[Sequence]:
    """The turns as records, one per chain (see the module docstring): a record is its first turn's
    prompt, then each turn's answer (masked as the Turn says) and the next turn's new prompt tokens
    (unmasked). `messages`: the whole conversation; where the template's full render extends the last
    record (a trailing newline after the last end-of-turn), that tail is appended untrained, so a
    prefix-stable template's one record is exactly the template's render."""
    chains: list[tuple[list[int], list[int], list[int]]] = []  # (ids, mask, turns) per record
    for k, t in enumerate(turns):
        if not chains or t.prompt[: len(chains[-1][0])] != chains[-1][0]:  # a rewritten history
            chains.append(([], [], []))
        ids, mask, kept = chains[-1]
        # invariant: ids is a prefix of t.prompt, so the record holds exactly what turn k was given
        mask += [0] * (len(t.prompt) - len(ids)) + list(t.mask)
        ids[:] = list(t.prompt) + list(t.answer)
        kept.append(k)
    chains = chains or [([], [], [])]  # no assistant turn: one record, nothing trained
    if messages is not None:
        ids, mask, _ = chains[-1]
        try:
            full = encode(tokenizer, apply_template(tokenizer, messages, False, reasoning))
        except template_errors():
            full = ids
        if full[: len(ids)] == ids:
            mask += [0] * (len(full) - len(ids))
            ids[:] = full
    return [Sequence(ids, mask, kept) for ids, mask, kept in chains]


def render_records(tokenizer, messages, reasoning: str = "keep") -> list[Sequence]:
    """THE loss-mask function for a text conversation: its records (one, unless the template rewrites
    earlier turns), each assistant turn masked as its text would have been produced (text_turn)."""
    msgs = _msgs(messages)
    turns = [text_turn(tokenizer, msgs[:i], m, reasoning) for i, m in enumerate(msgs) if m["role"] == "assistant"]
    return sequences(tokenizer, turns, msgs, reasoning)


def render(tokenizer, messages, reasoning: str = "keep") -> tuple[list[int], list[int]]:
    """(input_ids, loss_mask) of a conversation that makes one record (render_records); one the template
    rewrites into several is refused, never cut to one of them (which would leave turns untrained)."""
    recs = render_records(tokenizer, messages, reasoning)
    if len(recs) != 1:
        raise TemplateError(f"the template rewrites earlier turns: this conversation makes {len(recs)} "
                            "records (render_records)")
    return recs[0].input_ids, recs[0].loss_mask


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
