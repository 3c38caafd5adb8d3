"""Golden loss masks under every committed family template (eagle3_platform/data/templates/*.jinja).

Each family's real template on the tiny BPE with that family's special tokens (testing/family_templates):
the masked tokens decode to exactly the assistant turns (with and without reasoning) plus their
end-of-turn token, each once, nothing of the system or user text, single- and multi-turn (a template
that rewrites earlier turns gives one record per chain, each turn masked right after the prompt the
target was given for it); an answer the target generated is masked on exactly its generated ids; a
template that refuses a conversation rejects that record with the template's reason and the partition
completes; a split conversation is written, counted and resumed as one input record.
"""
from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from eagle3_platform.data import chat
from eagle3_platform.data.chat import (TemplateError, encode, end_of_turn, generated_turn, reasoning_markers,
                                       render, render_prompt, render_records, sequences, text_turn)
from eagle3_platform.testing.family_templates import FAMILY_TOKENS, TEMPLATES, family_tokenizer

FAMILIES = sorted(FAMILY_TOKENS)
REASONING_FAMILIES = ["gpt-oss", "qwen3", "qwen3-moe"]
SYSTEM, USER1, USER2 = "Be brief and kind.", "What is the capital of France?", "Add 1 and 2."
SINGLE = [{"role": "user", "content": USER1}, {"role": "assistant", "content": "Paris."}]
MULTI = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": USER1},
         {"role": "assistant", "content": "Paris."}, {"role": "user", "content": USER2},
         {"role": "assistant", "content": "The answer is 3."}]
THOUGHTS = ["The user asks for a capital.", "1 + 2 = 3, step by step."]
# turns trained in each record of MULTI: a template that rewrites an earlier turn in later prompts starts a
# record at each such turn (Qwen3: the empty <think> block of the answer is gone from the history;
# GPT-OSS: <|return|> -> <|end|>; Mistral: the system prompt moves to the last user turn)
ONE, SPLIT = [[0, 1]], [[0], [1]]
MULTI_TRAINED = {"gemma3": ONE, "gpt-oss": SPLIT, "llama3": ONE, "llama4": ONE, "mistral": SPLIT,
                 "phi4-mini": ONE, "qwen2.5": ONE, "qwen3": SPLIT, "qwen3-moe": SPLIT}


@pytest.fixture(scope="module")
def toks():
    return {f: family_tokenizer(f) for f in FAMILIES}


def runs(tok, ids, mask) -> list[str]:
    """Decoded text of each maximal run of mask==1."""
    out, cur = [], []
    for i, m in zip(ids + [None], mask + [0]):
        if m:
            cur.append(i)
        elif cur:
            out.append(tok.decode(cur))
            cur = []
    return out


def unmasked(tok, ids, mask) -> str:
    return tok.decode([i for i, m in zip(ids, mask) if not m])


def plain(text: str, family: str) -> str:
    """Mistral writes a space before an answer; it joins the answer's first token (as generated)."""
    return text.removeprefix(" ") if family == "mistral" else text


def with_thoughts(messages, thoughts=THOUGHTS):
    out, k = [], 0
    for m in messages:
        m = dict(m)
        if m["role"] == "assistant":
            m["reasoning_content"], k = thoughts[k], k + 1
        out.append(m)
    return out


def trained_turns(tok, messages, reasoning="keep") -> list[list[int]]:
    turns = [text_turn(tok, messages[:i], m, reasoning) for i, m in enumerate(messages) if m["role"] == "assistant"]
    return [seq.turns for seq in sequences(tok, turns, messages, reasoning)]


def record_runs(tok, records) -> list[list[str]]:
    return [runs(tok, r.input_ids, r.loss_mask) for r in records]


# ------------------------------------------------------------------------------------------- templates

@pytest.mark.parametrize("family", FAMILIES)
def test_every_template_names_its_source_and_renders(family, toks):
    text = (TEMPLATES / f"{family}.jinja").read_text()
    assert text.startswith("{#- source: ") and "#}" in text.splitlines()[0]
    assert "huggingface" in text.splitlines()[0].lower() or "/" in text.splitlines()[0]
    tok = toks[family]
    body = text.split("-#}\n", 1)[1]
    # the header comment changes nothing the template renders
    bare = family_tokenizer(family)
    bare.chat_template = body
    for msgs in (SINGLE, MULTI):
        assert chat.apply_template(tok, msgs) == chat.apply_template(bare, msgs)


def test_qwen3_moe_ships_the_qwen3_template():
    strip = lambda f: (TEMPLATES / f"{f}.jinja").read_text().split("-#}\n", 1)[1]  # noqa: E731
    assert strip("qwen3-moe") == strip("qwen3")


@pytest.mark.parametrize("family", FAMILIES)
def test_end_of_turn_is_the_families_own(family, toks):
    want = {"gemma3": "<end_of_turn>", "gpt-oss": "<|return|>", "llama3": "<|eot_id|>", "llama4": "<|eot|>",
            "mistral": "</s>", "phi4-mini": "<|end|>", "qwen2.5": "<|im_end|>", "qwen3": "<|im_end|>",
            "qwen3-moe": "<|im_end|>"}
    assert end_of_turn(toks[family]) == want[family]


# ---------------------------------------------------------------------------------------- text answers

@pytest.mark.parametrize("family", FAMILIES)
def test_single_turn_mask_is_the_answer_plus_eot(family, toks):
    tok = toks[family]
    ids, mask = render(tok, SINGLE)
    assert [plain(r, family) for r in runs(tok, ids, mask)] == ["Paris." + end_of_turn(tok)]
    assert USER1 in unmasked(tok, ids, mask)
    assert ids[: len(render_prompt(tok, SINGLE[:1]))] == render_prompt(tok, SINGLE[:1])


@pytest.mark.parametrize("family", FAMILIES)
def test_multi_turn_masks_each_turn_once_and_no_system_or_user_text(family, toks):
    tok = toks[family]
    records = render_records(tok, MULTI)
    assert trained_turns(tok, MULTI) == [r.turns for r in records] == MULTI_TRAINED[family]
    answers = ["Paris.", "The answer is 3."]
    for rec, got in zip(records, record_runs(tok, records)):
        assert [plain(r, family) for r in got] == [answers[t] + end_of_turn(tok) for t in rec.turns]
        for text in (SYSTEM, USER1, USER2):
            assert text not in "".join(got)
        assert SYSTEM in tok.decode(rec.input_ids)
    assert USER2 in tok.decode(records[-1].input_ids)
    check_as_seen(tok, MULTI, records)
    if len(records) > 1:  # a conversation that makes several records is refused as one
        with pytest.raises(TemplateError, match="makes 2 records"):
            render(tok, MULTI)
    else:
        assert render(tok, MULTI) == (records[0].input_ids, records[0].loss_mask)


def check_as_seen(tok, messages, records, reasoning="keep") -> None:
    """Every assistant turn is in exactly one record, right after the very prompt the target was given
    for it, masked as that turn's own mask says, with only the record's earlier answers trained before
    it: no record trains a turn on text the target did not see when producing it."""
    replies = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    turns = [text_turn(tok, messages[:i], messages[i], reasoning) for i in replies]
    assert sorted(t for r in records for t in r.turns) == list(range(len(replies)))
    for rec in records:
        trained = 0
        for t in rec.turns:
            p, a = turns[t].prompt, turns[t].answer
            assert p == render_prompt(tok, messages[:replies[t]], reasoning) == rec.input_ids[: len(p)]
            assert sum(rec.loss_mask[: len(p)]) == trained
            end = len(p) + len(a)
            assert rec.input_ids[len(p): end] == a and rec.loss_mask[len(p): end] == turns[t].mask
            trained += sum(turns[t].mask)
        assert sum(rec.loss_mask) == trained


THREE = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": USER1},
         {"role": "assistant", "content": "Paris."}, {"role": "user", "content": USER2},
         {"role": "assistant", "content": "The answer is 3."}, {"role": "user", "content": "And 2 and 2?"},
         {"role": "assistant", "content": "That makes 4."}]
THREE_ANSWERS = ["Paris.", "The answer is 3.", "That makes 4."]
THREE_THOUGHTS = THOUGHTS + ["Two and two, four."]
# rewriting templates, 3 turns: one record per turn, every turn masked once as the target saw it
THREE_CASES = [("qwen3", "keep", True), ("qwen3", "keep", False), ("qwen3", "drop", False),
               ("qwen3-moe", "keep", True), ("gpt-oss", "keep", True), ("gpt-oss", "keep", False),
               ("gpt-oss", "drop", False), ("mistral", "keep", False)]


@pytest.mark.parametrize("family,reasoning,thinking", THREE_CASES)
def test_a_rewriting_template_trains_every_turn_once_each_in_its_own_record(family, reasoning, thinking, toks):
    tok = toks[family]
    msgs = with_thoughts(THREE, THREE_THOUGHTS) if thinking else THREE
    records = render_records(tok, msgs, reasoning)
    assert [r.turns for r in records] == [[0], [1], [2]]
    eot = end_of_turn(tok)
    want = [([thought] if thinking else []) + [answer + eot] for answer, thought in zip(THREE_ANSWERS, THREE_THOUGHTS)]
    assert [[plain(r, family) for r in got] for got in record_runs(tok, records)] == want
    # the union of the masks: every assistant turn (+ its end-of-turn) exactly once, nothing else
    masked = "".join("".join(got) for got in record_runs(tok, records))
    for text in [SYSTEM, USER1, USER2, "And 2 and 2?"]:
        assert text not in masked
    for answer in THREE_ANSWERS + (THREE_THOUGHTS if thinking else []):
        assert masked.count(answer) == 1
    assert masked.count(eot) == 3
    check_as_seen(tok, msgs, records, reasoning)
    if thinking:  # a later record holds the earlier turns as the template rewrote them: no thinking
        assert THOUGHTS[0] not in tok.decode(records[2].input_ids)
    if family == "mistral":  # the system prompt sits in each record's last user turn, as each prompt had it
        for rec, user in zip(records, [USER1, USER2, "And 2 and 2?"]):
            text = tok.decode(rec.input_ids)
            assert text.count(SYSTEM) == 1 and text.index(SYSTEM) < text.index(user)


@pytest.mark.parametrize("family", sorted(set(FAMILIES) - {"qwen3", "qwen3-moe", "gpt-oss", "mistral"}))
def test_a_prefix_stable_template_keeps_one_record_of_the_whole_render(family, toks):
    tok = toks[family]
    (rec,) = render_records(tok, THREE)
    assert rec.turns == [0, 1, 2]
    assert rec.input_ids == encode(tok, chat.apply_template(tok, THREE))  # exactly the template's render
    assert [plain(r, family) for r in runs(tok, rec.input_ids, rec.loss_mask)] == [
        a + end_of_turn(tok) for a in THREE_ANSWERS]
    check_as_seen(tok, THREE, [rec])


def test_mistral_without_a_system_prompt_keeps_one_record(toks):
    tok = toks["mistral"]
    msgs = THREE[1:]
    (rec,) = render_records(tok, msgs)
    assert rec.turns == [0, 1, 2]
    check_as_seen(tok, msgs, [rec])


@pytest.mark.parametrize("family", ["gemma3", "llama3"])
def test_a_template_that_trims_keeps_the_mask_on_the_stored_answer(family, toks):
    """Gemma-3 and Llama-3 trim the content: an answer stored stripped is masked exactly."""
    tok = toks[family]
    ids, mask = render(tok, [SINGLE[0], {"role": "assistant", "content": "  Paris.\n"}])
    assert runs(tok, ids, mask) == ["Paris." + end_of_turn(tok)]


@pytest.mark.parametrize("family", REASONING_FAMILIES)
def test_reasoning_kept_is_trained_and_the_templates_headers_are_not(family, toks):
    tok = toks[family]
    msgs = with_thoughts(MULTI)
    records = render_records(tok, msgs, "keep")
    # one record per turn (later prompts rewrite the earlier answer without its thinking): its thought,
    # then its answer + end-of-turn; the template's opener/separator around them stay unmasked
    assert record_runs(tok, records) == [[THOUGHTS[0], "Paris." + end_of_turn(tok)],
                                         [THOUGHTS[1], "The answer is 3." + end_of_turn(tok)]]
    m = reasoning_markers(tok)
    for rec in records:
        assert m.opener in unmasked(tok, rec.input_ids, rec.loss_mask)
        assert m.separator in unmasked(tok, rec.input_ids, rec.loss_mask)
    assert THOUGHTS[0] not in tok.decode(records[1].input_ids)  # the template drops earlier thinking
    check_as_seen(tok, msgs, records)


@pytest.mark.parametrize("family", REASONING_FAMILIES)
def test_reasoning_dropped_is_nowhere_in_the_record(family, toks):
    tok = toks[family]
    ids, mask = render(tok, with_thoughts(SINGLE), "drop")
    assert runs(tok, ids, mask) == ["Paris." + end_of_turn(tok)]
    assert THOUGHTS[0] not in tok.decode(ids)
    if family.startswith("qwen3"):  # asked not to think: the template's empty block is in the prompt
        assert "<think>\n\n</think>\n\n" in unmasked(tok, ids, mask)
    else:
        assert "<|channel|>final<|message|>" in unmasked(tok, ids, mask)


def test_qwen3_empty_think_block_the_template_inserts_is_not_trained(toks):
    tok = toks["qwen3"]
    ids, mask = render(tok, SINGLE)  # no reasoning: the template writes <think>\n\n</think>\n\n itself
    assert "<think>\n\n</think>\n\n" in tok.decode(ids)
    assert runs(tok, ids, mask) == ["Paris.<|im_end|>"]


@pytest.mark.parametrize("family", sorted(set(FAMILIES) - set(REASONING_FAMILIES)))
def test_reasoning_a_template_cannot_render_is_refused(family, toks):
    with pytest.raises(TemplateError, match="renders no reasoning"):
        render(toks[family], with_thoughts(SINGLE), "keep")
    ids, mask = render(toks[family], with_thoughts(SINGLE), "drop")
    assert [plain(r, family) for r in runs(toks[family], ids, mask)] == ["Paris." + end_of_turn(toks[family])]


def test_generation_block_gives_the_templates_own_mask(toks):
    """A template with {% generation %} is masked by transformers' assistant mask, not by diffing."""
    tok = family_tokenizer("qwen2.5")
    tok.chat_template = (
        "{% for m in messages %}{% if m['role'] == 'assistant' %}{{ '<|im_start|>assistant\n' }}"
        "{% generation %}{{ m['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\n' }}"
        "{% else %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
    ids, mask = render(tok, MULTI)
    assert runs(tok, ids, mask) == ["Paris.<|im_end|>", "The answer is 3.<|im_end|>"]
    assert chat._has_generation_block(tok) and not chat._has_generation_block(toks["qwen2.5"])


# -------------------------------------------------------------------------------- generated answers

def generate(tok, text: str, stop: bool = True) -> list[int]:
    """What a target would emit for `text` (its stop token last)."""
    return encode(tok, text) + ([tok.convert_tokens_to_ids(end_of_turn(tok))] if stop else [])


@pytest.mark.parametrize("family", FAMILIES)
def test_generated_answer_is_masked_on_exactly_its_ids(family, toks):
    tok = toks[family]
    prompt = render_prompt(tok, SINGLE[:1])
    for text in ("Paris.", "  Paris, with spaces the template would trim.  ", " Paris."):
        ids = generate(tok, text)
        turn, thought, content = generated_turn(tok, prompt, ids, True)
        assert (turn.prompt, turn.answer, turn.mask) == (prompt, ids, [1] * len(ids))
        assert (thought, content) == ("", text)
        (seq,) = sequences(tok, [turn])
        assert seq.input_ids[: len(prompt) + len(ids)] == prompt + ids
        assert runs(tok, seq.input_ids, seq.loss_mask) == [text + end_of_turn(tok)]
    cut = generate(tok, "Par", stop=False)  # cut by max_new_tokens: no end-of-turn was generated
    turn, _, _ = generated_turn(tok, prompt, cut, False)
    assert turn.answer == cut and turn.mask == [1] * len(cut)


@pytest.mark.parametrize("family", FAMILIES)
def test_generated_multi_turn_continues_where_the_template_keeps_the_history(family, toks):
    tok = toks[family]
    history, turns = [], []
    for user, answer in ((USER1, "Paris."), (USER2, "The answer is 3.")):
        history.append({"role": "user", "content": user})
        prompt = render_prompt(tok, history)
        turn, _, content = generated_turn(tok, prompt, generate(tok, answer), True)
        turns.append(turn)
        history.append({"role": "assistant", "content": content})
    records = sequences(tok, turns, history)
    # GPT-OSS ends the history's answers with <|end|>, not the generated <|return|>; Mistral writes a space
    # before each answer of the history, which a SentencePiece target generates ("▁Paris") but the
    # byte-level stand-in here does not; Qwen3 keeps an answer without thinking as it was generated
    want = {"gpt-oss": SPLIT, "mistral": SPLIT}.get(family, ONE)
    assert [r.turns for r in records] == want
    answers = ["Paris.", "The answer is 3."]
    assert record_runs(tok, records) == [[answers[t] + end_of_turn(tok) for t in ts] for ts in want]
    for rec in records:  # each record starts with its first turn's prompt and holds its exact ids
        first = turns[rec.turns[0]]
        assert rec.input_ids[: len(first.prompt) + len(first.answer)] == first.prompt + first.answer


GENERATED_THINKING = {
    "qwen3": "<think>\n1 + 2 = 3, step by step.\n</think>\n\nThe answer is 3.",
    "qwen3-moe": "<think>\n1 + 2 = 3, step by step.\n</think>\n\nThe answer is 3.",
    "gpt-oss": "<|channel|>analysis<|message|>1 + 2 = 3, step by step.<|end|><|start|>assistant"
               "<|channel|>final<|message|>The answer is 3.",
}


def thinking_answer(tok, family, reasoning):
    """The target thought, then answered USER2: (generated ids, its Turn, thought, content)."""
    prompt = render_prompt(tok, [{"role": "user", "content": USER2}], reasoning)
    ids = generate(tok, GENERATED_THINKING[family])
    return (ids, *generated_turn(tok, prompt, ids, True, reasoning))


@pytest.mark.parametrize("family", REASONING_FAMILIES)
def test_generated_thinking_kept_is_trained_whole(family, toks):
    ids, turn, thought, content = thinking_answer(toks[family], family, "keep")
    assert turn.answer == ids and turn.mask == [1] * len(ids)  # every generated id, headers included
    assert (thought, content) == (THOUGHTS[1], "The answer is 3.")


def test_generated_qwen3_thinking_is_trained_once_per_turn_in_its_own_record(toks):
    """Qwen3's template drops an earlier turn's thinking from later prompts: that turn, as generated,
    is not what the target saw next, so each turn is its own record, its thinking trained there."""
    tok = toks["qwen3"]
    history, turns = [], []
    for user in (USER1, USER2):
        history.append({"role": "user", "content": user})
        turn, thought, content = generated_turn(tok, render_prompt(tok, history),
                                                generate(tok, GENERATED_THINKING["qwen3"]), True)
        turns.append(turn)
        history.append({"role": "assistant", "content": content, "reasoning_content": thought})
    records = sequences(tok, turns, history)
    assert [r.turns for r in records] == SPLIT
    for rec, turn in zip(records, turns):
        assert runs(tok, rec.input_ids, rec.loss_mask) == [GENERATED_THINKING["qwen3"] + "<|im_end|>"]
        assert rec.input_ids[: len(turn.prompt) + len(turn.answer)] == turn.prompt + turn.answer
        assert tok.decode(rec.input_ids).count("step by step") == 1


@pytest.mark.parametrize("family", REASONING_FAMILIES)
def test_generated_thinking_dropped_is_cut_and_headers_are_not_trained(family, toks):
    tok = toks[family]
    _, turn, thought, content = thinking_answer(tok, family, "drop")
    assert (thought, content) == ("", "The answer is 3.")
    (seq,) = sequences(tok, [turn])
    assert runs(tok, seq.input_ids, seq.loss_mask) == ["The answer is 3." + end_of_turn(tok)]
    assert "step by step" not in tok.decode(seq.input_ids)
    header = reasoning_markers(tok).plain_header  # GPT-OSS's <|channel|>final<|message|>, Qwen3's none
    assert tok.decode(turn.answer).startswith(header)
    assert not header or header not in "".join(runs(tok, seq.input_ids, seq.loss_mask))


# ------------------------------------------------------------------------ rejection, partition goes on

class _Replies(BaseHTTPRequestHandler):
    """An OpenAI-compatible endpoint: an empty answer to 'SAY NOTHING'; reasoning_content beside the
    content for a question holding 'THINK'. Keeps the request bodies."""

    bodies: list[dict] = []

    def do_POST(self):  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.bodies.append(body)
        last = body["messages"][-1]["content"]
        msg = {"role": "assistant", "content": "" if "SAY NOTHING" in last else f"Answer to {last}"}
        if "THINK" in last:
            msg["reasoning_content"] = f"Thinking about {last}"
        out = json.dumps({"choices": [{"message": msg, "finish_reason": "stop"}],
                          "usage": {"completion_tokens": 5}}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    def do_GET(self):  # noqa: N802 - /v1/models: the copied tiny target's id
        out = json.dumps({"object": "list", "data": [{"id": "tiny-random", "object": "model"}]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    def log_message(self, *args):
        pass


@pytest.fixture
def endpoint():
    _Replies.bodies = []
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Replies)
    th = threading.Thread(target=srv.serve_forever, daemon=True)
    th.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()
    th.join()


def family_target(tiny_target_dir, family, tmp_path):
    import shutil

    out = tmp_path / f"target-{family}"
    shutil.copytree(tiny_target_dir, out)
    family_tokenizer(family).save_pretrained(out)
    return out


def regenerate(tmp_path, target, users: list[list[str]], endpoint, reasoning="keep"):
    from dataclasses import replace

    from eagle3_platform.data.regenerate import PRESETS, regenerate_file
    from eagle3_platform.store.records import read_jsonl

    rows = [{"id": f"r{i}", "workload": "multi_turn", "source": "test", "license": "MIT",
             "messages": [{"role": "user", "content": u} for u in us]} for i, us in enumerate(users)]
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    s = regenerate_file(target, inp, tmp_path / "out.jsonl", replace(PRESETS["tiny"], reasoning=reasoning),
                        endpoint=endpoint, scanner=False, rejected_path=tmp_path / "rej.jsonl")
    return s, list(read_jsonl(tmp_path / "out.jsonl")), list(read_jsonl(tmp_path / "rej.jsonl"))


def test_a_record_the_template_refuses_is_rejected_and_the_partition_completes(tiny_target_dir, tmp_path,
                                                                                endpoint):
    """Mistral's template refuses an empty assistant turn: the conversation whose first answer is empty
    is rejected with the template's own reason; the others are written."""
    target = family_target(tiny_target_dir, "mistral", tmp_path)
    s, out, rej = regenerate(tmp_path, target, [["Hi there"], ["SAY NOTHING", "and then?"], ["One", "Two"]],
                             endpoint)
    assert (s["read"], s["written"], s["rejected"]) == (3, 2, 1)
    (reason,) = s["by_reason"]
    assert reason.startswith("template:Assistant message must have") and [r["id"] for r in rej] == ["r1"]
    tok = family_tokenizer("mistral")
    by_id = {r["id"]: r for r in out}
    assert runs(tok, by_id["r0"]["input_ids"], by_id["r0"]["loss_mask"]) == ["Answer to Hi there</s>"]


@pytest.mark.parametrize("reasoning", ["keep", "drop"])
def test_endpoint_reasoning_content_is_kept_or_dropped(tiny_target_dir, tmp_path, endpoint, reasoning):
    target = family_target(tiny_target_dir, "qwen3", tmp_path)
    s, out, _ = regenerate(tmp_path, target, [["Why THINK?"]], endpoint, reasoning)
    assert s["written"] == 1
    (rec,) = out
    tok = family_tokenizer("qwen3")
    got = runs(tok, rec["input_ids"], rec["loss_mask"])
    if reasoning == "keep":
        assert got == ["Thinking about Why THINK?", "Answer to Why THINK?<|im_end|>"]
        assert "chat_template_kwargs" not in _Replies.bodies[-1]
    else:
        assert got == ["Answer to Why THINK?<|im_end|>"] and "Thinking" not in tok.decode(rec["input_ids"])
        assert _Replies.bodies[-1]["chat_template_kwargs"] == {"enable_thinking": False}
        assert rec["generation"]["reasoning"] == "drop"
    assert rec["messages"][-1] == {"role": "assistant", "content": "Answer to Why THINK?"}


def test_the_reasoning_setting_reaches_regeneration_and_is_checked():
    from dataclasses import replace

    from eagle3_platform.data.regenerate import PRESETS
    from eagle3_platform.data.stages import RegenerateRequest, regen_config

    assert {p.reasoning for p in PRESETS.values()} == {"keep"}  # the target's thinking, as served
    req = dict(target="t", in_path="i", out="o", preset="tiny")
    assert regen_config(RegenerateRequest(**req)).reasoning == "keep"
    assert regen_config(RegenerateRequest(**req, reasoning="drop")).reasoning == "drop"
    with pytest.raises(ValueError, match="reasoning must be one of"):
        replace(PRESETS["tiny"], reasoning="maybe")


@pytest.mark.parametrize("family", FAMILIES)
def test_the_filter_measures_multi_turn_prompts_under_templates_that_need_alternating_roles(family, toks):
    """Gemma-3 and Mistral refuse consecutive user turns: the filter's length check renders the prompts
    with a stand-in answer between them, so a multi-turn prompt is measured, not a crash."""
    from eagle3_platform.data.filter import validate
    from eagle3_platform.store.records import BadRecord

    row = {"id": "m", "workload": "multi_turn", "source": "test", "license": "MIT",
           "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": USER1},
                        {"role": "user", "content": USER2}]}
    rec, _ = validate(row, 4096, toks[family], None)
    assert [m.content for m in rec.messages] == [SYSTEM, USER1, USER2]
    with pytest.raises(BadRecord, match="bad:too_long"):
        validate(row, 8, toks[family], None)


# ------------------------------------------------------------------ a split conversation's records

def test_a_split_conversation_is_written_as_one_record_per_chain_and_resumes_whole(tiny_target_dir, tmp_path,
                                                                                     endpoint):
    """GPT-OSS rewrites every earlier answer: a 3-turn conversation is 3 records `<id>#<k>`, each turn
    trained once; the accounting counts it as one conversation. A run killed between its records (one
    written, the next torn) resumes by asking that conversation again whole: the output is the
    uninterrupted run's, byte for byte, with no record lost or repeated."""
    target = family_target(tiny_target_dir, "gpt-oss", tmp_path)
    users = [["Hi there"], ["One", "Two", "Three"]]
    s, out, rej = regenerate(tmp_path, target, users, endpoint)
    assert (s["read"], s["written"], s["records"], s["rejected"]) == (2, 2, 4, 0) and not rej
    assert [r["id"] for r in out] == ["r0", "r1#0", "r1#1", "r1#2"]
    tok = family_tokenizer("gpt-oss")
    for k, row in enumerate(out[1:]):
        gen = row["generation"]
        assert (gen["conversation_id"], gen["chains"], gen["trained_turns"]) == ("r1", 3, [k])
        assert runs(tok, row["input_ids"], row["loss_mask"]) == [f"Answer to {users[1][k]}<|return|>"]
        assert row["input_ids"][: len(p := render_prompt(tok, row["messages"][: 2 * k + 1]))] == p
    assert "conversation_id" not in out[0]["generation"]  # one record: its id and fields as before

    ref = (tmp_path / "out.jsonl").read_bytes()
    lines = ref.splitlines(keepends=True)
    (tmp_path / "out.jsonl").write_bytes(b"".join(lines[:2]) + lines[2][:40])  # killed inside r1#1
    asked = len(_Replies.bodies)
    s2, _, _ = regenerate(tmp_path, target, users, endpoint)
    assert (s2["resumed"], s2["written"], s2["records"]) == (1, 2, 4)
    assert len(_Replies.bodies) - asked == 3  # r1's three turns asked again, r0 kept
    assert (tmp_path / "out.jsonl").read_bytes() == ref


def test_a_record_id_that_would_repeat_another_inputs_id_is_rejected(tiny_target_dir, tmp_path, endpoint):
    target = family_target(tiny_target_dir, "gpt-oss", tmp_path)
    from eagle3_platform.data.regenerate import PRESETS, regenerate_file

    rows = [{"id": i, "workload": "multi_turn", "source": "test", "license": "MIT",
             "messages": [{"role": "user", "content": u} for u in us]}
            for i, us in (("a", ["One", "Two"]), ("a#1", ["Hi"]))]
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    s = regenerate_file(target, inp, tmp_path / "out.jsonl", PRESETS["tiny"], endpoint=endpoint, scanner=False,
                        rejected_path=tmp_path / "rej.jsonl")
    assert (s["read"], s["written"], s["records"], s["by_reason"]) == (2, 1, 1, {"dup:chain_id": 1})
