"""Golden tests for THE loss mask (`chat.render`) under ChatML, SmolLM2, Llama-3 and Qwen-2.5 templates.

Unit tier: the tiny in-process tokenizer, with each family's template (and special tokens) installed on
it, so no model download. The real SmolLM2 tokenizer golden is e2e (needs the prepared target).
"""
from __future__ import annotations

import copy

import pytest

from eagle3_platform.data.chat import (BoundaryError, TemplateError, end_of_turn, eos_token_ids, render,
                                       render_prompt, template_hash, tokenizer_hash)
from eagle3_platform.model.target import tiny_tokenizer

SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SMOLLM2_DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"

# Llama-3 (3.0 instruct) template: BOS, role headers, content trimmed, <|eot_id|> closes every turn.
LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    " + message['content'] | trim + '<|eot_id|>' %}"
    "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]

# Qwen-2.5 template (tool branches removed): injects its own default system prompt.
QWEN_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}"
    "{%- else %}{{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n' }}"
    "{%- endif %}{%- for message in messages %}"
    "{%- if (message.role == 'user') or (message.role == 'system' and not loop.first) or (message.role == 'assistant') %}"
    "{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}"
    "{%- endif %}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"
)

SINGLE = [{"role": "user", "content": "What is x?"}, {"role": "assistant", "content": "x is 4."}]
MULTI = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
         {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Add 1 and 2."},
         {"role": "assistant", "content": "3"}]
MULTI_NO_SYSTEM = MULTI[1:]


@pytest.fixture(scope="module")
def chatml():
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def smol_style(chatml):
    tok = copy.deepcopy(chatml)
    tok.chat_template = SMOLLM2_TEMPLATE
    return tok


@pytest.fixture(scope="module")
def llama3():
    tok = tiny_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": LLAMA3_SPECIALS})
    tok.bos_token = "<|begin_of_text|>"
    tok.eos_token = "<|eot_id|>"
    tok.chat_template = LLAMA3_TEMPLATE
    return tok


@pytest.fixture(scope="module")
def qwen(chatml):
    tok = copy.deepcopy(chatml)
    tok.chat_template = QWEN_TEMPLATE
    return tok


def masked_runs(tok, ids, mask) -> list[str]:
    """Decoded text of each maximal run of mask==1 (one run per assistant turn)."""
    runs, cur = [], []
    for i, m in zip(ids, mask):
        if m:
            cur.append(i)
        elif cur:
            runs.append(cur)
            cur = []
    if cur:
        runs.append(cur)
    return [tok.decode(r) for r in runs]


def assistant_contents(messages):
    return [m["content"] for m in messages if m["role"] == "assistant"]


# ---------------------------------------------------------------------------------------------- goldens

def test_chatml_single_turn_golden(chatml):
    ids, mask = render(chatml, SINGLE)
    # <|im_start|> user \n W hat Ġis Ġx ? <|im_end|> \n <|im_start|> a ss istant \n x Ġis Ġ4 . <|im_end|> \n
    assert ids == [1, 340, 201, 57, 269, 273, 288, 33, 2, 201, 1, 67, 285, 295, 201, 90, 273, 349, 16, 2, 201]
    assert mask == [0] * 15 + [1] * 5 + [0]
    assert ids == chatml.apply_chat_template(SINGLE, tokenize=True)["input_ids"]


def test_chatml_multi_turn_with_system_golden(chatml):
    ids, mask = render(chatml, MULTI)
    assert ids == [1, 85, 345, 79, 201, 36, 71, 264, 84, 75, 71, 72, 16, 2, 201, 1, 340, 201, 42, 75, 2, 201,
                   1, 67, 285, 295, 201, 42, 71, 78, 78, 81, 3, 2, 201, 1, 340, 201, 35, 310, 223, 19, 259, 80,
                   70, 223, 20, 16, 2, 201, 1, 67, 285, 295, 201, 21, 2, 201]
    assert mask == [0] * 27 + [1] * 7 + [0] * 21 + [1, 1, 0]
    assert masked_runs(chatml, ids, mask) == ["Hello!<|im_end|>", "3<|im_end|>"]


def test_chatml_mask_equals_segmentwise_construction(chatml):
    """Independent construction: encode the template's pieces one by one and label them by hand."""
    enc = lambda s: chatml(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    pieces = [("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n", 0),
              ("Hello!<|im_end|>", 1),
              ("\n<|im_start|>user\nAdd 1 and 2.<|im_end|>\n<|im_start|>assistant\n", 0),
              ("3<|im_end|>", 1), ("\n", 0)]
    want_ids = [i for s, _ in pieces for i in enc(s)]
    want_mask = [m for s, m in pieces for _ in enc(s)]
    assert render(chatml, MULTI) == (want_ids, want_mask)


# ------------------------------------------------------------------------------- template families

@pytest.mark.parametrize("family", ["chatml", "smol_style", "llama3", "qwen"])
@pytest.mark.parametrize("messages", [SINGLE, MULTI, MULTI_NO_SYSTEM], ids=["single", "multi_sys", "multi"])
def test_mask_is_assistant_content_plus_eot(family, messages, request):
    tok = request.getfixturevalue(family)
    eot = end_of_turn(tok)
    ids, mask = render(tok, messages)
    assert len(ids) == len(mask) and set(mask) <= {0, 1}
    assert ids == tok.apply_chat_template(messages, tokenize=True)["input_ids"]  # the template's own ids
    assert masked_runs(tok, ids, mask) == [c + eot for c in assistant_contents(messages)]
    eot_id = tok.convert_tokens_to_ids(eot)
    # every assistant turn's EOT is inside the mask; user/system EOTs are outside it
    eot_positions = [p for p, i in enumerate(ids) if i == eot_id]
    assert [mask[p] for p in eot_positions] == [int(m["role"] == "assistant") for m in _rendered_turns(tok, messages)]
    assert mask[-1] == 0 or ids[-1] == eot_id  # a template's trailing newline after EOT is not trained


def _rendered_turns(tok, messages):
    """The turns the template actually renders, default system prompts included."""
    turns = list(messages)
    if tok.chat_template in (SMOLLM2_TEMPLATE, QWEN_TEMPLATE) and messages[0]["role"] != "system":
        turns = [{"role": "system", "content": "default"}] + turns
    return turns


def test_eot_tokens(chatml, llama3, qwen, smol_style):
    assert [end_of_turn(t) for t in (chatml, llama3, qwen, smol_style)] == \
        ["<|im_end|>", "<|eot_id|>", "<|im_end|>", "<|im_end|>"]


def test_llama3_headers_and_bos_are_not_trained(llama3):
    ids, mask = render(llama3, MULTI)
    assert ids[0] == llama3.convert_tokens_to_ids("<|begin_of_text|>") and mask[0] == 0
    header_ids = {llama3.convert_tokens_to_ids(t) for t in ("<|start_header_id|>", "<|end_header_id|>")}
    assert all(m == 0 for i, m in zip(ids, mask) if i in header_ids)
    assert ids[-1] == llama3.convert_tokens_to_ids("<|eot_id|>") and mask[-1] == 1  # no trailer in Llama-3


def test_default_system_prompt_is_not_trained(smol_style, qwen):
    for tok, default in ((smol_style, SMOLLM2_DEFAULT_SYSTEM), (qwen, "You are Qwen")):
        ids, mask = render(tok, SINGLE)
        assert default in tok.decode(ids)
        assert default not in "".join(masked_runs(tok, ids, mask))
        assert masked_runs(tok, ids, mask) == ["x is 4.<|im_end|>"]


def test_llama3_content_is_trimmed_and_mask_follows_the_render(llama3):
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "  Hello!  "}]
    ids, mask = render(llama3, msgs)
    assert masked_runs(llama3, ids, mask) == ["Hello!<|eot_id|>"]


def test_render_prompt_is_token_prefix_of_render(chatml, llama3, qwen, smol_style):
    for tok in (chatml, llama3, qwen, smol_style):
        prompt = render_prompt(tok, MULTI[:-1])
        ids, mask = render(tok, MULTI)
        assert ids[: len(prompt)] == prompt
        assert mask[len(prompt)] == 1 and not any(mask[len(prompt) - 4: len(prompt)])


def test_conversation_without_assistant_has_empty_mask(chatml):
    ids, mask = render(chatml, [{"role": "user", "content": "Hi"}])
    assert len(ids) > 0 and not any(mask)


# ------------------------------------------------------------------------------------- failures

# Templates that cannot give an exact mask: (template built from the ChatML one, error, message, conversation)
BAD_TEMPLATES = {
    # the number of messages is written up front: the answer's render does not extend its prompt's
    "not_prefix_stable": (lambda chatml: "{{ messages|length }}" + chatml, TemplateError, "does not extend", MULTI),
    "no_special_eot": (lambda _: "{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\n' }}{% endfor %}"
                       "{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}",
                       TemplateError, "end-of-turn", SINGLE),
    # the header ends in a space, so " is" merges into one token across the assistant boundary
    "token_straddles_boundary": (
        lambda _: "{% for m in messages %}{{ '<|im_start|>' + m['role'] + ' ' + m['content'] + '<|im_end|>' }}"
                  "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant ' }}{% endif %}",
        BoundaryError, None, [{"role": "user", "content": "x"}, {"role": "assistant", "content": "is 4"}]),
    "no_template": (lambda _: None, TemplateError, "no chat template", SINGLE),
}


@pytest.mark.parametrize("case", sorted(BAD_TEMPLATES))
def test_template_without_an_exact_mask_fails_loudly(chatml, case):
    make, error, match, messages = BAD_TEMPLATES[case]
    tok = copy.deepcopy(chatml)
    tok.chat_template = make(chatml.chat_template)
    with pytest.raises(error, match=match):
        render(tok, messages)


# ------------------------------------------------------------------------------------------ EOS

def test_eos_ids_are_the_template_eot_plus_declared_ids(chatml):
    """One rule for regeneration and the engine: the probed end-of-turn token + every declared eos id."""
    eot = chatml.convert_tokens_to_ids(end_of_turn(chatml))
    assert eos_token_ids(chatml) == {eot} | {chatml.eos_token_id}

    class Model:  # a base-model eos declared only in the (generation) config still ends an answer
        config = type("C", (), {"eos_token_id": 5})()
        generation_config = type("G", (), {"eos_token_id": [6, 7]})()

    assert eos_token_ids(chatml, Model()) == {eot, chatml.eos_token_id, 5, 6, 7}


# ------------------------------------------------------------------------------------------ hashes

def test_hashes_change_with_template_and_tokens(chatml, qwen, llama3):
    assert template_hash(chatml) == template_hash(tiny_tokenizer())  # deterministic
    assert template_hash(chatml) != template_hash(qwen)  # template differs
    assert tokenizer_hash(chatml) == tokenizer_hash(tiny_tokenizer())
    assert tokenizer_hash(chatml) != tokenizer_hash(qwen)
    assert tokenizer_hash(chatml) != tokenizer_hash(llama3)  # added special tokens
    assert len(template_hash(chatml)) == 64


# ---------------------------------------------------------------------------------------- SmolLM2

@pytest.mark.e2e
def test_smollm2_golden(smollm2_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    msgs = [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello! How can I help?"}]
    ids, mask = render(tok, msgs)
    assert ids == [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411, 407,
                   19712, 8182, 2, 198, 1, 4093, 198, 26843, 665, 2, 198, 1, 520, 9531, 198, 19556, 17, 1073,
                   416, 339, 724, 47, 2, 198]
    assert mask == [0] * 32 + [1] * 8 + [0]
    assert masked_runs(tok, ids, mask) == ["Hello! How can I help?<|im_end|>"]
    ids2, mask2 = render(tok, MULTI)
    assert masked_runs(tok, ids2, mask2) == ["Hello!<|im_end|>", "3<|im_end|>"]
    assert SMOLLM2_DEFAULT_SYSTEM not in tok.decode(ids2)  # a given system prompt replaces the default
