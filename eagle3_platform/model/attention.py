"""Decode attention for grouped-query models on CPU, registered with transformers' AttentionInterface.

A decode step has one query token per row. torch's CPU flash kernel and transformers' eager path both
handle that badly for GQA: eager copies every key/value head `n_rep` times (`repeat_kv`, a fresh
multi-MB tensor per layer per step), and the flash kernel reads the cache at a few GB/s. Grouping the
query heads by their key/value head instead makes a step two batched matmuls over the cache as it is
(SmolLM2 bf16, 2 threads, batch 64 over 400 cached tokens: 135 ms per step vs 447 ms sdpa, 257 ms
eager). Verifying a draft (a few query tokens under a tree mask) is grouped the same way: sdpa would
copy every key/value head first. Maskless multi-token queries (causal prefill) go to sdpa unchanged.

Rows of a continuous batch have different lengths (model/ragged.py). Given `row_groups` (contiguous
rows of similar length, each with its own range of slots), attention runs per group over that range
only, so one long prompt does not make every row attend over its length (B 8, one 1000-token row
among 150-token ones: the padded span costs ~4x the attended pairs). The engine's rows start at slot
0 (ranges [0, span)); regeneration's are right-aligned under left padding (data/local_gen.py: ranges
[W - span, W)).

A cache's keys are a prefix view of a buffer with spare slots, and oneDNN's bmm copies any operand
that is not contiguous: a copy of the cache's keys and values per layer per step, more than the
attention itself (B 48, 514 cached tokens, one layer: 2.2 ms, 1.2 ms over contiguous keys; B 1, 300:
0.21 vs 0.08 ms). So where the buffer is at most WIDEN_UP_TO times the span, attention runs over the
rows' whole buffers instead, the spare slots masked out: contiguous, no copy. That needs the spare
slots finite (0 * NaN is NaN), so only buffers made by `cache_buffer` (zeroed) are widened.

That holds for bf16 caches, on oneDNN. An fp32 cache's matmuls (MKL) take the strided views without
a copy, and there widening cost more than it saved (the spare slots, a bias over them, the
bookkeeping): its rows attend over their spans as they are (SPAN_DTYPES).

The cache may hold keys/values in fp32 under a bf16 model (the batch cache does where bf16 matmuls
are slow: compute.kv_cache_dtype); attention then runs in the cache's dtype and hands back the
query's. Its two matmuls per layer are small and dense, and on a CPU without fast bf16 arithmetic they
run 2-4x slower in bf16 than in fp32 (avx512_bf16 without AMX). bf16 values are exact in fp32, so
this only drops the rounding of the softmax weights.
"""
from __future__ import annotations

import functools
import weakref

import torch
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

GROUPED_DECODE = "sdpa_grouped_decode"
MAX_GROUPED_QUERY = 64  # verification trees are ~5-16 tokens; longer queries are prefills
# Attending over a whole buffer up to 1.5x the span costs about what the copy of the view costs
# (bf16: 0.65-0.8x of the view's time at 1.1x, 0.8-1.0x at 1.5x, 0.9-1.2x at 2x).
WIDEN_UP_TO = 1.5
_CACHE_BUFFERS: "weakref.WeakValueDictionary[int, torch.Tensor]" = weakref.WeakValueDictionary()
# Caches of these dtypes are attended over their rows' spans as given, never widened: in fp32 the
# spans are 1.5-2.7x faster than the widened buffer; bf16 loses that way at batch 8-16, so bf16 caches
# keep the widening.
SPAN_DTYPES = (torch.float32,)


def cache_buffer(like: torch.Tensor, shape, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A zeroed KV cache buffer [rows, kv, slots, hd] (like's dtype unless given), registered as safe
    to read past a view's slots."""
    buf = like.new_zeros(shape, dtype=dtype)
    _CACHE_BUFFERS[id(buf)] = buf
    return buf


def grouped_decode_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                             row_groups=None, **kwargs):
    """transformers' attention-function signature -> (out [B,q,H,d], None).

    Grouped when q is one token, or a few tokens under an explicit mask (draft verification: the tree
    mask); a maskless multi-token query is a causal prefill and goes to sdpa."""
    H, q, kv = query.shape[1], query.shape[2], key.shape[1]
    if H % kv or (q > 1 and (attention_mask is None or q > MAX_GROUPED_QUERY)):
        key, value = key.to(query.dtype), value.to(query.dtype)  # sdpa takes one dtype (mostly a no-op)
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling,
                                      dropout=dropout, **kwargs)
    return grouped_attention(query, key, value, attention_mask, scaling, row_groups).transpose(1, 2), None


def grouped_attention(query, key, value, mask=None, scaling=None, row_groups=None):
    """query [B,H,q,d], key/value [B,kv,S,d], mask bool (True = attend) or additive [B|1,1,q,S'] with
    S' >= S, or None (every query sees every key) -> out [B,H,q,d]. Head h reads key/value head
    h // (H/kv), as repeat_kv does, without copying the cache. Softmax in fp32; the matmuls in the
    cache's dtype, the result in the query's.
    row_groups: [(start, stop, lo, hi)] covering rows 0..B-1; rows start..stop-1 attend over slots
    [lo, hi) only (the mask must hide everything of theirs outside it)."""
    if query.dtype != key.dtype:  # an fp32 cache under a bf16 model
        return grouped_attention(query.to(key.dtype), key, value, mask, scaling, row_groups).to(query.dtype)
    B, H, q, d = query.shape
    S = key.shape[-2]
    r = H // key.shape[1]
    scale = d ** -0.5 if scaling is None else scaling
    groups = row_groups or [(0, B, 0, S)]
    parts = [(a, b, lo, key, value) if (a, b, lo, hi) == (0, B, 0, S) else
             (a, b, lo, key[a:b, :, lo:hi], value[a:b, :, lo:hi]) for a, b, lo, hi in groups]
    if key.dtype not in SPAN_DTYPES:  # only ranges from slot 0 can widen to their rows' buffers
        parts = [(a, b, lo, *(_whole_rows(k, v) if lo == 0 else (k, v))) for a, b, lo, k, v in parts]
    width = max(lo + k.shape[-2] for _, _, lo, k, _ in parts)
    if mask is None and width > S:  # every slot visible, but a whole buffer's spare ones
        mask = _all_visible(q, S, query.device)
    bias = None if mask is None else _grouped_bias(mask, r, width)  # [B|1,1,r*q,width]
    if len(parts) == 1:
        _, _, lo, k, v = parts[0]
        return _attend(query, k, v, _rows_bias(bias, 0, B, lo, k), scale)
    out = query.new_empty(B, H, q, d)
    for a, b, lo, k, v in parts:  # rows a..b-1 over their slots (or their whole buffers)
        out[a:b] = _attend(query[a:b], k, v, _rows_bias(bias, a, b, lo, k), scale)
    return out


def _rows_bias(bias, a: int, b: int, lo: int, key) -> torch.Tensor | None:
    """Rows a..b-1 of the bias, over key's slots (from slot lo)."""
    if bias is None:
        return None
    return (bias[a:b] if bias.shape[0] > 1 else bias)[..., lo:lo + key.shape[-2]]


@functools.lru_cache(maxsize=8)
def _all_visible(q: int, S: int, device: torch.device) -> torch.Tensor:
    """bool [1,1,q,S] on `device`, all True; one object per shape, so a forward's layers share its
    bias (made outside inference mode, so it can be remembered)."""
    with torch.inference_mode(False):
        return torch.ones(1, 1, q, S, dtype=torch.bool, device=device)


def _whole_rows(key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """key/value [B,kv,S,d]: views of rows of cache_buffer()s [R,kv,C,d] -> those rows' whole
    buffers [B,kv,C,d] (contiguous) when C <= WIDEN_UP_TO * S; otherwise (or any other tensor) as given."""
    whole = [_whole(t) for t in (key, value)]
    if whole[0] is None or whole[1] is None or whole[0].shape != whole[1].shape:
        return key, value
    return whole[0], whole[1]


def _whole(t: torch.Tensor) -> torch.Tensor | None:
    """The whole rows of t's cache_buffer, or None (a view made under inference_mode keeps no base:
    extraction's prefills are attended as given)."""
    base = t._base
    if base is None or _CACHE_BUFFERS.get(id(base)) is not base or t.is_contiguous():
        return None
    B, S = t.shape[0], t.shape[2]
    if base.dim() != 4 or t.stride() != base.stride() or base.shape[2] > WIDEN_UP_TO * S:
        return None
    row, rest = divmod(t.storage_offset() - base.storage_offset(), base.stride(0))
    if rest or row + B > base.shape[0] or base.shape[1::2] != t.shape[1::2]:
        return None  # not whole rows from slot 0
    return base[row:row + B]


def _attend(query, key, value, bias, scale: float):
    """query [B,H,q,d], key/value [B,kv,S,d], bias additive fp32 [B|1,1,r*q,S] or None -> [B,H,q,d]."""
    if key.dtype == torch.float32 and (bias is None or bias.shape[0] == 1):
        return _attend_flat(query, key, value, bias, scale)
    B, H, q, d = query.shape
    kv = key.shape[1]
    qg = query.reshape(B, kv, H // kv * q, d)  # [B,kv,r*q,d]: row i*q+j is query token j of head i
    scores = _scores(qg, key)
    if scores.dtype != torch.float32:  # (a check, not a no-op cast: a small op costs µs here)
        scores = scores.float()
    scores.mul_(scale)  # [B,kv,r*q,S]; in place: a fresh tensor either way
    if bias is not None:
        scores.add_(bias)
    weights = torch.softmax(scores, dim=-1)  # [B,kv,r*q,S]
    if weights.dtype != value.dtype:
        weights = weights.to(value.dtype)
    return torch.matmul(weights, value).reshape(B, H, q, d)


def _attend_flat(query, key, value, bias, scale: float):
    """_attend over an fp32 cache with a bias shared by every row (or none: a request alone, its
    verify, the head's drafting) as 3D products, the scale and the bias taken into the first one
    (baddbmm): three ops instead of six. Each query row's sums are the same whatever else the query
    holds, so a verify row still equals that token's own 1-token decode (greedy speculation stays
    exact in fp32). ~1.2x faster per layer than the six-op form at 1-5 query tokens."""
    B, H, q, d = query.shape
    kv, S = key.shape[1], key.shape[2]
    m = H // kv * q
    qg = query.reshape(B * kv, m, d)  # [B*kv,r*q,d]: row i*q+j of group g is query token j of head g*r+i
    keys_t = key.reshape(B * kv, S, d).transpose(1, 2)  # [B*kv,d,S]: a cache's view stays a view
    if bias is None:
        scores = torch.bmm(qg, keys_t).mul_(scale)
    else:
        scores = torch.baddbmm(bias[0], qg, keys_t, alpha=scale)  # [B*kv,r*q,S]; bias[0] [1,r*q|1,S] broadcast
    weights = torch.softmax(scores, dim=-1)
    return torch.bmm(weights, value.reshape(B * kv, S, d)).view(B, H, q, d)


def _scores(qg: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """qg [B,kv,m,d] @ keyᵀ -> [B,kv,m,S]. A cache's keys are usually a prefix view of a larger buffer,
    and CPU bf16 matmul against such a view transposed is slow; (key @ qgᵀ)ᵀ, the same sums with the
    view row-major, is 3-5x faster (1 thread, B 16, 1200 cached tokens, one layer: 0.46 vs 2.30 ms;
    a packed key takes 0.23 ms, but packing is a copy of the cache). fp32 takes the view as it is."""
    if key.is_contiguous() or key.dtype == torch.float32:
        return torch.matmul(qg, key.transpose(-1, -2))
    return torch.matmul(key, qg.transpose(-1, -2)).transpose(-1, -2)


# the last two (mask, (version, r, S), bias): a forward's layers share its masks, and a step carrying a
# prompt chunk (model/forward.mixed_forward) alternates two per layer, the rows' and the chunk's
_last_biases: tuple = ()


def _grouped_bias(mask: torch.Tensor, r: int, S: int) -> torch.Tensor:
    """mask bool (True = attend) or additive [B|1,1,q,S'] -> additive fp32 [B|1,1,r*q,S] (slots past
    S' masked: a whole buffer's spare slots), computed once
    per forward: transformers hands every layer the same mask object, so later layers reuse it (the
    version counter catches a mask changed in place; holding the mask keeps its identity unique)."""
    global _last_biases
    tracked = not mask.is_inference()  # inference tensors have no version counter: not memoised
    if tracked:
        for given, key, bias in _last_biases:
            if given is mask and key == (mask._version, r, S):
                return bias
    m = mask[..., :S]
    m = m.repeat(1, 1, r, 1) if m.shape[2] > 1 else m  # row i*q+j is query token j of head i
    if m.dtype == torch.bool:
        # finite, not -inf: a fully masked row (a left-pad query) gets finite garbage, never NaN
        bias = torch.zeros(m.shape, device=m.device).masked_fill_(~m, torch.finfo(torch.float32).min)
    else:
        bias = m.float()
    if bias.shape[-1] < S:
        bias = torch.nn.functional.pad(bias, (0, S - bias.shape[-1]), value=torch.finfo(torch.float32).min)
    if tracked:  # one assignment: atomic for a concurrent reader
        _last_biases = ((mask, (mask._version, r, S), bias),) + _last_biases[:1]
    return bias


AttentionInterface.register(GROUPED_DECODE, grouped_decode_attention)
AttentionMaskInterface.register(GROUPED_DECODE, sdpa_mask)


def use_grouped_decode(model) -> None:
    """Switch a transformers model to this attention (CPU; GPUs keep their fused kernels)."""
    model.set_attn_implementation(GROUPED_DECODE)
