"""The target's forward for the engine's decode and verify steps, Llama-style decoders on CPU.

A step of SmolLM2-135M is ~17 ms of weight reads and ~19 ms of everything else at batch 1 (bf16, 2
threads), and transformers' own forward adds to the second part: mask preparation, output-capture
wrappers, keyword plumbing through every layer, and the forward hooks that take the EAGLE-3 features.
This loop calls the same modules and functions in the same order (so the same arithmetic: logits and
features equal transformers' forward, the tests), without that plumbing: a batch-1 target forward
36.6 -> 33.3 ms, a 5-token verify 43.0 -> 40.7 ms (~/.cache/eagle3-runs/s22/lean.py); engine steps
3-7% faster at batch 1-8, plain and 4-token verify alike, none at 16 (s22/stepab.py).

It runs only what a step hands it: an explicit mask over a cache (or one row's one token, which needs
none) on a model whose layers look like Llama's and attend with attention.py's kernel, plus any prompt
chunks that ride along the step (mixed_forward). A prefill with no step to ride along, and any other
model, goes through transformers.
"""
from __future__ import annotations

import sys

import torch

from eagle3_platform.attention import GROUPED_DECODE, grouped_decode_attention

LLAMA_STYLE = ("llama",)  # pre-norm, rotary, q/k/v/o + gated MLP, no q/k norms, no sliding window


def supports(model) -> bool:
    """True when `model` is a Llama-style *ForCausalLM on attention.py's kernel."""
    base = getattr(model, "model", None)
    layers = getattr(base, "layers", None)
    if getattr(model.config, "model_type", None) not in LLAMA_STYLE or not layers:
        return False
    if getattr(model.config, "_attn_implementation", None) != GROUPED_DECODE:
        return False
    need = ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")
    return all(hasattr(layer, n) for layer in layers for n in need) and hasattr(model, "lm_head")


@torch.no_grad()
def step_forward(model, ids, pos, mask, cache, layer_ids=(), logits_to_keep: int = 0, row_groups=None):
    """ids/pos [B,q], mask bool [B,1,q,S] or None (B = q = 1), cache: the step's (updated in place)
    -> (logits [B,q,V] (the last logits_to_keep positions' if > 0), aux [B,q,len(layer_ids)*H] | None):
    what transformers' forward + features.capture.forward_capture return for the same step."""
    logits, aux, _ = mixed_forward(model, ids, pos, mask, cache, layer_ids, logits_to_keep, row_groups)
    return logits, aux


@torch.no_grad()
def mixed_forward(model, ids, pos, mask, cache, layer_ids=(), logits_to_keep: int = 0, row_groups=None,
                  prompts=()):
    """step_forward, with prompt chunks riding along: prompts = [(ids [1,c], cache)], each chunk
    continuing its prompt's own cache (c tokens after the cached ones, causal). Every linear runs
    once over the step's B*q tokens and the chunks' (a step at batch 7 and an 84-token chunk: 148 ms
    together against 93 + 110 ms apart, ~/.cache/eagle3-runs/s42/fused.py): the weights are read
    once, and a prefill forward's fixed cost goes. Attention stays per part, each over its own cache.
    -> (logits, aux as step_forward, [(last logits [1,1,V], aux [1,c,3H] | None)] per chunk)."""
    base = model.model
    rope = sys.modules[type(base.layers[0]).__module__].apply_rotary_pos_emb  # the model's own
    B, q = ids.shape
    parts = [((B, q), pos, mask, cache, row_groups)]  # (shape, positions, mask, cache, row groups)
    for c_ids, c_cache in prompts:
        past, c = c_cache.get_seq_length(), c_ids.shape[1]
        c_pos = torch.arange(past, past + c)[None]  # [1,c]
        c_mask = None if past == 0 else (torch.arange(past + c)[None] <= c_pos[0, :, None])[None, None]
        parts.append(((1, c), c_pos, c_mask, c_cache, None))  # mask [1,1,c,past+c]; None: causal
    h = base.embed_tokens(ids if not prompts else torch.cat([ids.view(1, -1)] + [i for i, _ in prompts], 1))
    rotary = [base.rotary_emb(h, p) for _, p, _, _, _ in parts]  # cos, sin [b,q,hd] per part
    bounds = _bounds([b * n for (b, n), *_ in parts])
    kept = {}
    for i, layer in enumerate(base.layers):
        attn = layer.self_attn
        x = layer.input_layernorm(h)  # [B,q,H], or [1,N,H] over every part's tokens
        qa, ka, va = attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)
        outs = []
        for (shape, _, m, kv_cache, groups), (cos, sin), (a, z) in zip(parts, rotary, bounds):
            qs, ks, vs = (_heads(t, a, z, shape, attn.head_dim) for t in (qa, ka, va))  # [b,H|kv,n,hd]
            qs, ks = rope(qs, ks, cos, sin)
            ks, vs = kv_cache.update(ks, vs, i)  # [b,kv,S,hd]
            o, _ = grouped_decode_attention(attn, qs, ks, vs, m, scaling=attn.scaling, row_groups=groups)
            outs.append(o.reshape(z - a, -1))  # o [b,n,H,hd] -> [b*n,H*hd]
        o = outs[0] if len(outs) == 1 else torch.cat(outs)
        h = h + attn.o_proj(o.view(*h.shape[:-1], -1))
        h = h + layer.mlp(layer.post_attention_layernorm(h))
        if i in layer_ids:
            kept[i] = h  # the output of layer i (capture.py's convention)
    aux_all = torch.cat([kept[i] for i in layer_ids], dim=-1) if layer_ids else None
    if not prompts:
        logits = model.lm_head(base.norm(h[:, -logits_to_keep:] if logits_to_keep else h))
        return logits, aux_all, []
    rows = h[0, :B * q].view(B, q, -1)
    rows = rows[:, -logits_to_keep:] if logits_to_keep else rows
    lasts = torch.stack([h[0, z - 1] for _, z in bounds[1:]])  # [P,H]: each chunk's last token
    logits = model.lm_head(base.norm(torch.cat([rows.reshape(-1, rows.shape[-1]), lasts])))
    n = rows.shape[0] * rows.shape[1]
    chunk_out = [(logits[n + j].view(1, 1, -1),  # a chunk's features outlive the step's: copied
                  None if aux_all is None else aux_all[:, a:z].clone()) for j, (a, z) in enumerate(bounds[1:])]
    aux = None if aux_all is None else aux_all[0, :B * q].view(B, q, -1)
    return logits[:n].view(B, -1, logits.shape[-1]), aux, chunk_out


def _bounds(sizes: list[int]) -> list[tuple[int, int]]:
    """Token counts per part -> (start, stop) of each in the flattened tokens."""
    ends = [sum(sizes[:j + 1]) for j in range(len(sizes))]
    return [(e - n, e) for n, e in zip(sizes, ends)]


def _heads(t: torch.Tensor, a: int, z: int, shape: tuple[int, int], head_dim: int) -> torch.Tensor:
    """Tokens a..z-1 of a projection ([B,q,D] or [1,N,D]) -> [b,heads,n,head_dim] for part shape (b, n)."""
    return t.reshape(-1, t.shape[-1])[a:z].view(*shape, -1, head_dim).transpose(1, 2)
