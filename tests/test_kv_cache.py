"""GrowingCache + grouped decode attention give what DynamicCache + sdpa give (fp32, tolerances:
the two compute the same math in another order)."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache

from eagle3_platform.model.attention import GROUPED_DECODE
from eagle3_platform.model.kv_cache import GrowingCache
from eagle3_platform.model.ragged import RaggedCache
from eagle3_platform.spec.tree import ancestor_matrix, depths


@pytest.fixture(scope="module")
def model(tiny_target_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_target_dir, dtype=torch.float32).eval()


@torch.no_grad()
def decode(model, cache, attn: str, steps: int = 40, drop_at: int = 15, crop_at: int = 25) -> list:
    """Greedy decode of 3 padded rows; row 1 leaves the batch at `drop_at`; at `crop_at` a 4-token
    'verify' forward is cut back to its first token (a rejection: the cache keeps a shorter prefix view)."""
    model.set_attn_implementation(attn)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 400, (3, 12), generator=g)
    mask = torch.ones(3, 12, dtype=torch.long)
    mask[2, :4] = 0  # left padding on row 2
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    out = model(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=cache)
    logits, rows, nxt = [out.logits[:, -1]], 3, pos[:, -1] + 1
    for step in range(steps):
        tok = logits[-1].argmax(-1, keepdim=True)  # [B,1]
        if step == drop_at:
            keep = torch.tensor([0, 2])
            cache.batch_select_indices(keep)
            tok, mask, nxt, rows = tok[keep], mask[keep], nxt[keep], 2
        if step == crop_at:
            past = cache.get_seq_length()
            extra = torch.cat([tok, torch.randint(3, 400, (rows, 3), generator=g)], 1)  # [B,4]
            m4 = torch.cat([mask, mask.new_ones(rows, 4)], 1)
            model(input_ids=extra, attention_mask=m4, position_ids=nxt[:, None] + torch.arange(4),
                  past_key_values=cache)
            for layer in cache.layers:  # only the first of the 4 stays
                layer.keys, layer.values = layer.keys[:, :, :past + 1], layer.values[:, :, :past + 1]
        mask = torch.cat([mask, mask.new_ones(rows, 1)], 1)
        logits.append(model(input_ids=tok, attention_mask=mask, position_ids=nxt[:, None],
                            past_key_values=cache).logits[:, -1])
        nxt = nxt + 1
    return logits


@pytest.mark.parametrize("widen_up_to", [None, 100])
def test_growing_cache_and_grouped_decode_match_dynamic_cache_and_sdpa(model, widen_up_to, monkeypatch):
    """widen_up_to 100: every step attends over the cache's whole buffers (their spare slots hold the
    cropped verify's keys and zeros), as long sequences do with the default in bf16 (here fp32 takes
    the widening too, SPAN_DTYPES emptied); None: fp32's own way, the rows' spans as given."""
    if widen_up_to is not None:
        monkeypatch.setattr("eagle3_platform.model.attention.WIDEN_UP_TO", widen_up_to)
        monkeypatch.setattr("eagle3_platform.model.attention.SPAN_DTYPES", ())
    want = decode(model, DynamicCache(), "sdpa")
    got = decode(model, GrowingCache(), GROUPED_DECODE)
    assert len(got) == len(want)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_growing_cache_appends_in_place(model):
    cache = GrowingCache()
    with torch.no_grad():
        model(input_ids=torch.randint(3, 400, (1, 8)), past_key_values=cache)
        buf = cache.layers[0].key_buf.data_ptr()
        model(input_ids=torch.randint(3, 400, (1, 1)), past_key_values=cache,
              position_ids=torch.tensor([[8]]))
    assert cache.layers[0].key_buf.data_ptr() == buf  # no reallocation while there is room
    assert cache.get_seq_length() == 9


@pytest.mark.parametrize("mask_kind", ["tree", "padding"])
@torch.no_grad()
def test_grouped_attention_of_a_verify_forward_matches_sdpa(model, mask_kind):
    """A multi-token query under an explicit mask (a draft tree's additive 4D mask, or a 2D padding
    mask that transformers expands) is grouped too; its logits equal sdpa's."""
    g = torch.Generator().manual_seed(1)
    prompt, nodes = torch.randint(3, 400, (1, 20), generator=g), torch.randint(3, 400, (1, 6), generator=g)
    parents = torch.tensor([-1, 0, 0, 1, 2, 3])  # two branches
    out = {}
    for attn in ("sdpa", GROUPED_DECODE):
        model.set_attn_implementation(attn)
        cache = GrowingCache()
        model(input_ids=prompt, past_key_values=cache)
        if mask_kind == "tree":  # the engine's layout: a ragged cache row and a bool tree mask
            ragged = RaggedCache()
            ragged.add_row(cache, 20)
            ragged.begin(6)
            cache = ragged
            kw = dict(attention_mask=ragged.mask(ancestor_matrix(parents)[None]),
                      position_ids=20 + depths(parents)[None])
        else:
            pad = torch.ones(1, 26, dtype=torch.long)
            pad[0, :2] = 0  # two left pads: transformers must build a mask (all ones would be skipped)
            kw = dict(attention_mask=pad, position_ids=torch.arange(20, 26)[None])
        out[attn] = model(input_ids=nodes, past_key_values=cache, **kw).logits
    torch.testing.assert_close(out[GROUPED_DECODE], out["sdpa"], atol=1e-4, rtol=1e-4)


def test_grouped_mask_bias_is_shared_by_a_forwards_layers_and_follows_in_place_changes():
    """Every layer of one forward gets the same mask object: its additive form is built once; a mask
    changed in place (or another mask) is converted again, never served stale."""
    from eagle3_platform.model.attention import _grouped_bias

    mask = torch.ones(1, 1, 2, 5, dtype=torch.bool)
    first = _grouped_bias(mask, 3, 5)
    assert first.shape == (1, 1, 6, 5) and bool((first == 0).all())
    assert _grouped_bias(mask, 3, 5) is first  # the next layer: reused
    mask[0, 0, 1, 4] = False  # changed in place
    again = _grouped_bias(mask, 3, 5)
    assert again is not first and bool((again[0, 0, 1::2, 4] < -1e30).all())  # query 1 of each head
    assert int((again < 0).sum()) == 3
    assert _grouped_bias(mask.clone(), 3, 5) is not again  # another mask object


def test_grouped_attention_takes_inference_mode_masks():
    """Batched extraction runs under torch.inference_mode, whose tensors have no version counter."""
    from eagle3_platform.model.attention import grouped_attention

    q, k = torch.randn(2, 4, 3, 8), torch.randn(2, 2, 5, 8)
    allowed = torch.rand(2, 1, 3, 5) < 0.8
    allowed[..., 0] = True
    want = grouped_attention(q, k, k, allowed.clone())
    with torch.inference_mode():
        got = grouped_attention(q, k, k, allowed.clone())
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("q_len", [1, 5])
def test_grouped_attention_over_a_cache_view_matches_sdpa(dtype, q_len):
    """Keys that are a prefix view of a larger buffer (every cache here) take the row-major product
    (key @ qᵀ)ᵀ; it must equal sdpa over copied key heads, and the packed-key path."""
    from eagle3_platform.model.attention import grouped_attention

    B, H, kv, S, d = 3, 6, 2, 40, 16
    buf_k, buf_v = torch.randn(B, kv, S + 24, d, dtype=dtype), torch.randn(B, kv, S + 24, d, dtype=dtype)
    k, v = buf_k[:, :, :S], buf_v[:, :, :S]  # strided: the buffer has spare slots
    assert not k.is_contiguous()
    q = torch.randn(B, H, q_len, d, dtype=dtype)
    allowed = torch.rand(B, 1, q_len, S) < 0.7
    allowed[..., 0] = True
    got = grouped_attention(q, k, v, allowed)
    packed = grouped_attention(q, k.contiguous(), v.contiguous(), allowed)
    rep = H // kv
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.float(), k.float().repeat_interleave(rep, 1), v.float().repeat_interleave(rep, 1), attn_mask=allowed)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(got.float(), ref, **tol)
    torch.testing.assert_close(got.float(), packed.float(), **tol)


@pytest.mark.parametrize("q_len", [1, 5])
def test_grouped_attention_over_an_fp32_cache_under_bf16_queries_runs_in_fp32(q_len):
    """A bf16 model over an fp32 cache (compute.kv_cache_dtype): the result is in the query's dtype and
    is fp32 attention over those (bf16-valued) keys, rounded once (tolerance: one bf16 rounding, as
    the fp32 sums may run in another order)."""
    from eagle3_platform.model.attention import grouped_attention

    B, H, kv, S, d = 3, 6, 2, 40, 16
    bf = torch.bfloat16
    k16, v16 = torch.randn(B, kv, S + 24, d, dtype=bf), torch.randn(B, kv, S + 24, d, dtype=bf)
    k32, v32 = k16.float()[:, :, :S], v16.float()[:, :, :S]  # the same values, a view of a wider buffer
    q = torch.randn(B, H, q_len, d, dtype=bf)
    allowed = torch.rand(B, 1, q_len, S) < 0.7
    allowed[..., 0] = True
    got = grouped_attention(q, k32, v32, allowed)
    assert got.dtype is bf
    rep = H // kv
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.float(), k32.repeat_interleave(rep, 1), v32.repeat_interleave(rep, 1), attn_mask=allowed)
    torch.testing.assert_close(got.float(), ref, atol=1e-5, rtol=2 ** -8)


def test_sdpa_fallback_takes_an_fp32_cache_under_a_bf16_query():
    """A maskless multi-token query (a prefill) goes to sdpa, which needs one dtype."""
    from eagle3_platform.model.attention import grouped_decode_attention

    mod = torch.nn.Module()
    mod.is_causal = True
    q = torch.randn(1, 4, 6, 8, dtype=torch.bfloat16)
    k, v = torch.randn(1, 2, 6, 8), torch.randn(1, 2, 6, 8)
    mod.num_key_value_groups = 2
    out, _ = grouped_decode_attention(mod, q, k, v, None)
    want, _ = grouped_decode_attention(mod, q, k.bfloat16(), v.bfloat16(), None)
    assert out.dtype is torch.bfloat16
    torch.testing.assert_close(out, want)


def _spy_attend(monkeypatch) -> list:
    """Record (slots, contiguous) of every key _attend gets."""
    from eagle3_platform.model import attention

    seen, real = [], attention._attend
    monkeypatch.setattr(attention, "_attend", lambda q, k, v, b, s: seen.append((k.shape[-2], k.is_contiguous()))
                        or real(q, k, v, b, s))
    return seen


@pytest.mark.parametrize("q_len", [1, 5])
@pytest.mark.parametrize("masked", [True, False])
def test_attention_reads_whole_cache_buffers_and_masks_their_spare_slots(q_len, masked, monkeypatch):
    """A prefix view of a cache_buffer at most WIDEN_UP_TO times wider than it is attended whole
    (contiguous: no copy inside bmm); the spare slots, here holding stale finite values, are masked
    out, so the output is the view's. Row groups: each group decides for itself. (The dtypes that
    widen: not SPAN_DTYPES, emptied here so fp32 shows it.)"""
    from eagle3_platform.model.attention import cache_buffer, grouped_attention

    monkeypatch.setattr("eagle3_platform.model.attention.SPAN_DTYPES", ())

    B, H, kv, C, d = 4, 6, 2, 48, 16
    buf_k, buf_v = cache_buffer(torch.empty(0), (B + 1, kv, C, d)), cache_buffer(torch.empty(0), (B + 1, kv, C, d))
    buf_k.normal_(), buf_v.normal_()  # every slot, spare ones too: stale keys of dropped tokens
    S = 40
    k, v = buf_k[:B, :, :S], buf_v[:B, :, :S]
    q = torch.randn(B, H, q_len, d)
    allowed = torch.rand(B, 1, q_len, S) < 0.7
    allowed[..., 0] = True
    mask = allowed if masked else None
    want = grouped_attention(q, k.contiguous(), v.contiguous(), mask)

    seen = _spy_attend(monkeypatch)
    got = grouped_attention(q, k, v, mask)
    assert seen == [(C, True)]  # the whole buffer, rows 0..B-1
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)

    if masked:  # a long group (rows 0-1, all 40 slots) widened; a short one (16 slots of 48) not
        allowed[2:, ..., 16:] = False  # rows 2-3 hold fewer tokens
        want = grouped_attention(q, k.contiguous(), v.contiguous(), allowed)
    seen.clear()
    got = grouped_attention(q, k, v, mask, row_groups=[(0, 2, 0, S), (2, B, 0, 16)])
    assert seen == [(C, True), (16, False)]
    if masked:
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)

    seen.clear()  # a buffer over 1.5x the span: the view, as given
    grouped_attention(q, buf_k[:B, :, :30], buf_v[:B, :, :30], None if mask is None else mask[..., :30])
    assert seen == [(30, False)]


@pytest.mark.parametrize("q_len", [1, 5])
def test_an_fp32_cache_is_attended_over_its_spans_as_given(q_len, monkeypatch):
    """SPAN_DTYPES (fp32): rows attend over their spans of the cache_buffer, never the whole buffer,
    with or without a mask; each row group over its own span; the output is the contiguous copy's."""
    from eagle3_platform.model.attention import cache_buffer, grouped_attention

    B, H, kv, C, d, S = 3, 6, 2, 48, 16, 40
    buf_k, buf_v = cache_buffer(torch.empty(0), (B, kv, C, d)), cache_buffer(torch.empty(0), (B, kv, C, d))
    buf_k.normal_(), buf_v.normal_()
    k, v = buf_k[:, :, :S], buf_v[:, :, :S]
    q = torch.randn(B, H, q_len, d)
    allowed = torch.rand(B, 1, q_len, S) < 0.7
    allowed[..., 0] = True
    allowed[1:, ..., 24:] = False  # rows 1-2 hold 24 tokens
    seen = _spy_attend(monkeypatch)
    for mask, groups, spans in ((None, None, [S]), (allowed, None, [S]),
                                (allowed, [(0, 1, 0, S), (1, B, 0, 24)], [S, 24])):
        seen.clear()
        got = grouped_attention(q, k, v, mask, row_groups=groups)
        assert seen == [(n, False) for n in spans]
        torch.testing.assert_close(got, grouped_attention(q, k.contiguous(), v.contiguous(), mask),
                                   atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("widen", [False, True])
def test_left_padded_rows_attend_over_their_own_last_slots(widen, monkeypatch):
    """Regeneration's rows are right-aligned under left padding: a group's range [lo, S) skips the
    slots that are padding in all its rows, and the output is the whole width's (padding masked).
    A range not from slot 0 is never widened to the rows' buffers (widen: the widening dtypes)."""
    from eagle3_platform.model import attention
    from eagle3_platform.model.attention import cache_buffer, grouped_attention

    if widen:
        monkeypatch.setattr(attention, "SPAN_DTYPES", ())
    B, H, kv, C, d, S = 4, 6, 2, 44, 16, 40
    buf_k, buf_v = cache_buffer(torch.empty(0), (B, kv, C, d)), cache_buffer(torch.empty(0), (B, kv, C, d))
    buf_k.normal_(), buf_v.normal_()
    k, v = buf_k[:, :, :S], buf_v[:, :, :S]
    q = torch.randn(B, H, 1, d)
    first = torch.tensor([0, 5, 28, 30])  # each row's first real slot (left padding before it)
    mask = (torch.arange(S) >= first[:, None])[:, None, None, :]  # [B,1,1,S]
    want = grouped_attention(q, k.contiguous(), v.contiguous(), mask)
    seen = _spy_attend(monkeypatch)
    got = grouped_attention(q, k, v, mask, row_groups=[(0, 2, 0, S), (2, B, 28, S)])
    assert seen == [(C if widen else S, widen), (S - 28, False)]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rows,q_len,bias_kind", [(1, 1, "none"), (1, 5, "tree"), (3, 2, "shared"),
                                                   (3, 2, "per_row")])
def test_fp32_attention_with_a_shared_bias_takes_the_flat_path_and_matches_sdpa(rows, q_len, bias_kind,
                                                                                monkeypatch):
    """Over an fp32 cache, no bias or one bias for every row (a request alone, its verify tree, the
    head's drafting) goes through _attend_flat (3D products, scale and bias in the first); a bias per
    row keeps the 4D path. Both equal sdpa over copied key heads."""
    from eagle3_platform.model import attention

    H, kv, S, d = 6, 2, 40, 16
    g = torch.Generator().manual_seed(rows * 10 + q_len)
    buf_k, buf_v = torch.randn(rows, kv, S + 8, d, generator=g), torch.randn(rows, kv, S + 8, d, generator=g)
    k, v = buf_k[:, :, :S], buf_v[:, :, :S]  # a view, as a cache's
    q = torch.randn(rows, H, q_len, d, generator=g)
    allowed = torch.rand(1 if bias_kind in ("tree", "shared") else rows, 1, q_len, S, generator=g) < 0.7
    allowed[..., 0] = True
    mask = None if bias_kind == "none" else allowed
    flat, real = [], attention._attend_flat
    monkeypatch.setattr(attention, "_attend_flat", lambda *a: flat.append(a[1].shape[0]) or real(*a))
    got = attention.grouped_attention(q, k, v, mask)
    assert flat == ([] if bias_kind == "per_row" else [rows])
    rep = H // kv
    want = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1),
        attn_mask=None if mask is None else mask.expand(rows, 1, q_len, S))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_attention_never_reads_past_a_view_of_other_tensors(monkeypatch):
    """Only cache_buffer()s are known to hold finite spare slots: a view of any other tensor is
    attended as given, even with NaN past its end."""
    from eagle3_platform.model.attention import grouped_attention

    buf = torch.randn(2, 2, 24, 8)
    buf[:, :, 20:] = float("nan")
    q = torch.randn(2, 4, 1, 8)
    seen = _spy_attend(monkeypatch)
    out = grouped_attention(q, buf[:, :, :20], buf[:, :, :20], torch.ones(2, 1, 1, 20, dtype=torch.bool))
    assert seen == [(20, False)] and bool(out.isfinite().all())
