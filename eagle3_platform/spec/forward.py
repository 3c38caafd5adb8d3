"""The target's forward for the engine's decode and verify steps, Llama-style decoders on CPU.

A step of SmolLM2-135M is ~17 ms of weight reads and ~19 ms of everything else at batch 1 (bf16, 2
threads), and transformers' own forward adds to the second part: mask preparation, output-capture
wrappers, keyword plumbing through every layer, and the forward hooks that take the EAGLE-3 features.
This loop calls the same modules and functions in the same order (so the same arithmetic: logits and
features equal transformers' forward, the tests), without that plumbing: a batch-1 target forward
36.6 -> 33.3 ms, a 5-token verify 43.0 -> 40.7 ms (~/.cache/eagle3-runs/s22/lean.py); engine steps
3-7% faster at batch 1-8, plain and 4-token verify alike, none at 16 (s22/stepab.py).

It runs only what a step hands it: an explicit mask over a cache (or one row's one token, which needs
none) on a model whose layers look like Llama's and attend with attention.py's kernel. Prefill chunks
and any other model go through transformers.
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
    base = model.model
    rope = sys.modules[type(base.layers[0]).__module__].apply_rotary_pos_emb  # the model's own
    B, q = ids.shape
    h = base.embed_tokens(ids)  # [B,q,H]
    cos, sin = base.rotary_emb(h, pos)  # [B,q,hd] each
    kept = {}
    for i, layer in enumerate(base.layers):
        attn = layer.self_attn
        x = layer.input_layernorm(h)
        shape = (B, q, -1, attn.head_dim)
        qs = attn.q_proj(x).view(shape).transpose(1, 2)  # [B,H,q,hd]
        ks = attn.k_proj(x).view(shape).transpose(1, 2)  # [B,kv,q,hd]
        vs = attn.v_proj(x).view(shape).transpose(1, 2)
        qs, ks = rope(qs, ks, cos, sin)
        ks, vs = cache.update(ks, vs, i)  # [B,kv,S,hd]
        o, _ = grouped_decode_attention(attn, qs, ks, vs, mask, scaling=attn.scaling, row_groups=row_groups)
        h = h + attn.o_proj(o.reshape(B, q, -1))  # o [B,q,H,hd] -> [B,q,H*hd]
        h = h + layer.mlp(layer.post_attention_layernorm(h))
        if i in layer_ids:
            kept[i] = h  # the output of layer i (capture.py's convention)
    h = base.norm(h)
    logits = model.lm_head(h[:, -logits_to_keep:] if logits_to_keep else h)
    aux = torch.cat([kept[i] for i in layer_ids], dim=-1) if layer_ids else None  # [B,q,3H]
    return logits, aux
