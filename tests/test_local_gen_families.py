"""local_gen's batched decoding on the families whose layers do not all attend fully: sliding windows
(Mistral, Gemma-3's sliding/full layers, GPT-OSS's alternating layers with sinks) and chunks (Llama-4).
Every row of a batch (left padding, rows joining and leaving, long prompts prefilled alone, a reused
prefix) must decode exactly transformers' own greedy `generate` on its prompt alone, fp32. Windows and
chunks of 5-6 tokens, so every prompt + answer runs past them."""
from __future__ import annotations

from collections import deque
from dataclasses import replace

import pytest
import torch

from eagle3_platform.data import local_gen
from eagle3_platform.data.local_gen import Request, decode_stream, generate_batch, middle_padding_exact
from eagle3_platform.model.attention import use_grouped_decode
from eagle3_platform.model.families import attention_layout, grouped_attention
from eagle3_platform.testing.zoo import ZOO, ZooModel, zoo_config, zoo_tokenizer

pytestmark = pytest.mark.usefixtures("one_torch_thread")

WINDOW, CHUNK = 5, 6
SHAPES = {
    "mistral": replace(ZOO["mistral"], text=dict(intermediate_size=64, num_hidden_layers=3, sliding_window=WINDOW)),
    "gemma3_text": replace(ZOO["gemma3_text"], text=dict(
        intermediate_size=64, num_hidden_layers=3, sliding_window=WINDOW, query_pre_attn_scalar=16,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"])),
    "gpt_oss": replace(ZOO["gpt_oss"], text=dict(intermediate_size=64, num_hidden_layers=2, num_local_experts=4,
                                                 num_experts_per_tok=2, sliding_window=WINDOW)),
    "llama4_text": ZooModel("llama4_text", "Llama4TextConfig", dict(
        intermediate_size=64, intermediate_size_mlp=64, num_hidden_layers=4, num_local_experts=2,
        attention_chunk_size=CHUNK), "llama4", "<|eot|>"),
}
N = 10  # tokens per answer at most


@pytest.fixture(scope="module", params=sorted(SHAPES))
def target(request):
    """(model, vocab size, pad id): the family's tiny random decoder, fp32, on the kernel load_target picks."""
    from transformers import AutoModelForCausalLM

    z = SHAPES[request.param]
    tok, _ = zoo_tokenizer(z)
    cfg = zoo_config(z, len(tok), tok.eos_token_id, tok.pad_token_id)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).to(torch.float32).eval()
    if grouped_attention(model.config):
        use_grouped_decode(model)
    kinds = set(attention_layout(model.config).kinds)
    assert kinds - {"full_attention"}, kinds  # the layout under test is not uniform full attention
    assert not middle_padding_exact(model.config)
    return model, len(tok), tok.pad_token_id


def _prompts(vocab: int, lengths, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def _alone(model, prompt: list[int], n: int, pad_id: int) -> list[int]:
    """transformers' greedy decoding of one prompt, n tokens (no stop)."""
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                         eos_token_id=None, pad_token_id=pad_id)
    return out[0, len(prompt):].tolist()


def _assert_alone(model, prompts, outs, budgets, pad_id):
    for p, o, n in zip(prompts, outs, budgets):
        assert len(p) + n > max(WINDOW, CHUNK)  # the window/chunk bounds are live in this row
        assert o.tokens == _alone(model, p, n, pad_id), len(p)


def test_left_padded_batch_equals_alone(target):
    model, vocab, pad = target
    prompts, budgets = _prompts(vocab, (3, 11, 7, 2, 9), 1), [N, 8, N, 7, 9]
    outs = generate_batch(model, prompts, budgets, set(), pad)
    _assert_alone(model, prompts, outs, budgets, pad)


def test_rows_joining_and_leaving_equal_alone(target):
    """At most 2 rows at a time: rows leave as they finish and the next ones join beside them."""
    model, vocab, pad = target
    prompts, budgets = _prompts(vocab, (4, 12, 2, 8, 6), 2), [3, N, 5, 8, 4]
    outs = [None] * len(prompts)
    queue = deque(Request(p, n, tag=i) for i, (p, n) in enumerate(zip(prompts, budgets)))
    decode_stream(model, queue, lambda r, g: outs.__setitem__(r.tag, g), set(), pad, max_rows=2)
    _assert_alone(model, prompts, outs, budgets, pad)


def test_long_prompt_beside_short_equals_alone(target, monkeypatch):
    """A prompt long enough to be prefilled alone (ALONE_FROM lowered to keep it small) beside short ones."""
    monkeypatch.setattr(local_gen, "ALONE_FROM", 8)
    model, vocab, pad = target
    prompts, budgets = _prompts(vocab, (14, 9, 4), 3), [N] * 3
    outs = generate_batch(model, prompts, budgets, set(), pad)
    _assert_alone(model, prompts, outs, budgets, pad)


def test_next_turn_with_cache_handed_back_equals_alone(target):
    """Turn 2 = turn 1's prompt + answer + more, given turn 1's caches (a full-attention target reuses
    them; here the prompts are prefilled whole, and the answers are still each prompt's own)."""
    model, vocab, pad = target
    first = _prompts(vocab, (6, 3, 10), 4)
    turn1 = generate_batch(model, first, [N] * 3, set(), pad, keep_cache=[True] * 3)
    assert all(o.cache is not None for o in turn1)
    more = _prompts(vocab, (2, 7, 4), 5)
    second = [p + o.tokens + m for p, o, m in zip(first, turn1, more)]
    outs = generate_batch(model, second, [N] * 3, set(), pad, prefixes=[o.cache for o in turn1])
    _assert_alone(model, second, outs, [N] * 3, pad)


def test_full_attention_keeps_cache_reuse():
    """The fallback is the layout's, not the family's: a Mistral without a window reuses caches."""
    import transformers

    z = ZOO["mistral"]
    no_window = zoo_config(replace(z, text=dict(z.text, sliding_window=None)), 400, 1, 0)
    assert middle_padding_exact(no_window)
    assert not middle_padding_exact(zoo_config(z, 400, 1, 0))
    assert middle_padding_exact(transformers.LlamaConfig(num_hidden_layers=2))
