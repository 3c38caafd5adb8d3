"""The target's forward for the engine's decode and verify steps, Llama-shaped decoders on CPU.

A step of SmolLM2-135M is about half weight reads and half everything else at batch 1, and
transformers' own forward adds to the second part: mask preparation, output-capture wrappers, keyword
plumbing through every layer, and the forward hooks that take the EAGLE-3 features. This loop calls
the same modules and functions in the same order (so the same arithmetic: logits and features equal
transformers' forward, the tests), without that plumbing, and with fewer calls: a decode step is
thousands of small torch ops, each ~1 µs of dispatch. Where load_target fused the siblings
(packed_linear.fuse_siblings), q/k/v and gate/up are one matmul each, called directly; the norms'
forward is called without nn.Module's call machinery; q and k turn together under one RoPE
(rotate_half's sign folded into sin, so a roll replaces slice-negate-concatenate); each layer's parts
are looked up once per model (_Layer), not through nn.Module attributes and calls. Same ops on the
same numbers, so the same values and greedy output; plain engine steps run ~1.1-1.2x faster.

It runs only what a step hands it: an explicit mask over a cache (or one row's one token, which needs
none) on a model whose family entry says its layers look like Llama's (model/families.py: no q/k norms, no
window or chunk on any layer) and attend with attention.py's kernel, plus any prompt chunks that
ride along the step (mixed_forward). A prefill with no step to ride along, and any other model, goes
through transformers.
"""
from __future__ import annotations

import weakref

import torch

from eagle3_platform.model.attention import GROUPED_DECODE, grouped_decode_attention
from eagle3_platform.model.families import UnsupportedTarget, decoder, step_loop
from eagle3_platform.model.packed_linear import FusedProjection, PackedLinear, SharedInput

def supports(model) -> bool:
    """True when `model` is a Llama-shaped *ForCausalLM (its family entry says so, and every layer
    attends fully: families.step_loop) on attention.py's kernel."""
    try:
        if not step_loop(model.config):
            return False
        layers = decoder(model).layers
    except (UnsupportedTarget, AttributeError):
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
    once over the step's B*q tokens and the chunks' (together ~0.7x the time of both apart): the
    weights are read once, and a prefill forward's fixed cost goes. Attention stays per part, each over its own cache.
    -> (logits, aux as step_forward, [(last logits [1,1,V], aux [1,c,3H] | None)] per chunk)."""
    base = decoder(model)
    B, q = ids.shape
    parts = [((B, q), pos, mask, cache, row_groups)]  # (shape, positions, mask, cache, row groups)
    for c_ids, c_cache in prompts:
        past, c = c_cache.get_seq_length(), c_ids.shape[1]
        c_pos = torch.arange(past, past + c)[None]  # [1,c]
        c_mask = None if past == 0 else (torch.arange(past + c)[None] <= c_pos[0, :, None])[None, None]
        parts.append(((1, c), c_pos, c_mask, c_cache, None))  # mask [1,1,c,past+c]; None: causal
    h = base.embed_tokens(ids if not prompts else torch.cat([ids.view(1, -1)] + [i for i, _ in prompts], 1))
    rotary = [rope_factors(*base.rotary_emb(h, p)) for _, p, _, _, _ in parts]  # per part [b,1,q,hd] x2
    bounds = _bounds([b * n for (b, n), *_ in parts])
    kept = {}
    for i, layer in enumerate(_plan(model)):
        qkv = layer.qkv(layer.norm1(h))  # [B,q,(H+2kv)*hd]
        qk_all, v_all = qkv[..., :-layer.v_size], qkv[..., -layer.v_size:]  # q|k side by side, v
        outs = []
        for (shape, _, m, kv_cache, groups), (cos, sin), (a, z) in zip(parts, rotary, bounds):
            qk = rope(_heads(qk_all, a, z, shape, layer.head_dim), cos, sin)  # [b,H+kv,n,hd]
            ks, vs = kv_cache.update(qk[:, layer.n_heads:], _heads(v_all, a, z, shape, layer.head_dim), i)
            qs = qk[:, :layer.n_heads].contiguous()  # as the old separate q was: the same fp32 sums
            o, _ = grouped_decode_attention(layer.attn, qs, ks, vs, m, scaling=layer.scaling,
                                            row_groups=groups)  # ks/vs [b,kv,S,hd] -> o [b,n,H,hd]
            outs.append(o.reshape(z - a, -1))  # [b*n,H*hd]
        o = outs[0] if len(outs) == 1 else torch.cat(outs)
        h = h + layer.o(o.view(*h.shape[:-1], -1))
        gate_up = layer.gate_up(layer.norm2(h))  # [B,q,2I]
        h = h + layer.down(layer.act(gate_up[..., :layer.gate_size]) * gate_up[..., layer.gate_size:])
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


def rope_factors(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [b,n,hd] -> cos [b,1,n,hd] and sin with rotate_half's sign folded in (first half
    negated) [b,1,n,hd], once per step for every layer."""
    half = sin.shape[-1] // 2
    return cos.unsqueeze(1), torch.cat([-sin[..., :half], sin[..., half:]], dim=-1).unsqueeze(1)


def rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x [b,heads,n,hd] -> x rotated: x*cos + rotate_half(x)*sin, exactly (rotate_half(x) is
    roll(x, hd/2) with its first half negated, and -(a*b) = a*(-b) in floating point)."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin


class _Layer:
    """A decoder layer's parts, looked up once per model: an nn.Module attribute costs ~0.7 µs to
    reach, and a step reached ~500 of them."""

    def __init__(self, layer):
        attn, mlp = layer.self_attn, layer.mlp
        self.attn = attn
        self.norm1, self.norm2 = fast_norm(layer.input_layernorm), fast_norm(layer.post_attention_layernorm)
        self.n_heads, self.head_dim, self.scaling = attn.config.num_attention_heads, attn.head_dim, attn.scaling
        self.qkv, self.v_size = fused_matmul(attn.q_proj, attn.k_proj, attn.v_proj), attn.v_proj.out_features
        self.o = fused_matmul(attn.o_proj)
        self.gate_up, self.gate_size = fused_matmul(mlp.gate_proj, mlp.up_proj), mlp.gate_proj.out_features
        self.down, self.act = fused_matmul(mlp.down_proj), mlp.act_fn  # LlamaMLP: down(act(gate) * up)


def fast_norm(module):
    """A Llama RMSNorm's forward; an fp32 one as torch's rms_norm, the same ops (mean of squares, rsqrt,
    two products: bitwise the same output) dispatched from C++, without the forward's no-op casts
    (~10 µs a call of ~29 here; a step makes 61). Also the draft head's RMSNorm (draft/model.py: `eps`)."""
    weight = getattr(module, "weight", None)
    eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
    if weight is None or eps is None or weight.dtype != torch.float32:
        return module.forward
    shape = tuple(weight.shape)
    return lambda h: torch.nn.functional.rms_norm(h, shape, weight, eps) if h.dtype == torch.float32 \
        else module.forward(h)


_PLANS: "weakref.WeakKeyDictionary[torch.nn.Module, list[_Layer]]" = weakref.WeakKeyDictionary()


def _plan(model) -> list[_Layer]:
    """The model's layers' parts, built at its first step: load_target packs and fuses the linears
    before that, and nothing swaps them after (a head's int4/packed copies are other modules)."""
    plan = _PLANS.get(model)
    if plan is None:  # two threads may both build it: the same parts
        plan = _PLANS[model] = [_Layer(layer) for layer in decoder(model).layers]
    return plan


def fused_matmul(*linears):
    """A callable x [..., D] -> the linears' outputs side by side [..., sum of out] in one call: their fused
    matmul where load_target fused them (packed_linear.FusedProjection siblings 0, 1, ... in order,
    q|k|v or gate|up), a PackedLinear's own matmul, or the modules and a concatenation."""
    first = linears[0]
    if len(linears) == 1:
        return first.weight_packed.matmul if isinstance(first, PackedLinear) else first
    group = getattr(first, "shared", None)
    if isinstance(group, SharedInput) and len(group.sizes) == len(linears) and all(
            isinstance(lin, FusedProjection) and lin.shared is group and lin.index == j
            for j, lin in enumerate(linears)):
        return group.weight_packed.matmul
    return lambda x: torch.cat([lin(x) for lin in linears], dim=-1)


def _heads(t: torch.Tensor, a: int, z: int, shape: tuple[int, int], head_dim: int) -> torch.Tensor:
    """Tokens a..z-1 of a projection ([B,q,D] or [1,N,D]) -> [b,heads,n,head_dim] for part shape (b, n)."""
    if a == 0 and z == t.shape[0] * t.shape[1]:  # the whole projection (a step without prompts)
        return t.view(*shape, -1, head_dim).transpose(1, 2)
    return t.reshape(-1, t.shape[-1])[a:z].view(*shape, -1, head_dim).transpose(1, 2)
