"""The draft head's forward while drafting: Eagle3Draft.backbone and .logits (draft/model.py) in the
target step's idioms (model/forward.py).

A chain of 4 runs the head's one layer 4-5 times a step, each a one-row forward of which its five 4-bit
matmuls take about a quarter: the rest is ~110 small ops and a dozen nn.Module calls. Here the head's
parts are looked up once per head (_HeadPlan); q|k|v and gate|up are one matmul each, called directly;
fp32 norms are torch's rms_norm; q and k turn together under one RoPE whose cos and sign-folded sin are
read from a table of positions (one embedding lookup, not the rotary module's per-call matmul, cos and
sin). Same ops on the same numbers as backbone + logits: the same drafts (tests: within rounding).
Attention is the head's own (Eagle3Draft.attend).

Only drafting runs here; training and the exporter's checks call the module's backbone.
"""
from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F

from eagle3_platform.draft.model import Eagle3Draft
from eagle3_platform.model.forward import fast_norm, fused_matmul, rope, rope_factors

ROPE_TABLE_MIN = 1024  # positions the first table holds; it doubles past them


class _HeadPlan:
    """A head's parts, looked up once (an nn.Module attribute or call costs µs; a forward reached ~40).
    Holds no reference to the head itself (the plans' dict is keyed weakly by it)."""

    def __init__(self, draft: Eagle3Draft):
        layer, attn, mlp = draft.midlayer, draft.midlayer.self_attn, draft.midlayer.mlp
        self.dtype = draft.norm.weight.dtype  # a cast of the head (cast_parameters) builds a new plan
        self.embedding = draft.embed_tokens.weight
        self.norm_emb, self.norm_hidden = fast_norm(layer.input_layernorm), fast_norm(layer.hidden_norm)
        self.norm_post, self.norm_out = fast_norm(layer.post_attention_layernorm), fast_norm(draft.norm)
        self.n_heads, self.head_dim = attn.n_heads, attn.head_dim
        self.qkv, self.v_size = fused_matmul(attn.q_proj, attn.k_proj, attn.v_proj), attn.v_proj.out_features
        self.o = fused_matmul(attn.o_proj)
        self.gate_up, self.gate_size = fused_matmul(mlp.gate_proj, mlp.up_proj), mlp.gate_proj.out_features
        self.down, self.lm_head = fused_matmul(mlp.down_proj), fused_matmul(draft.lm_head)
        self.rotary = draft.rotary
        self.table = self._rope_table(ROPE_TABLE_MIN)  # [N, 2hd]: cos | signed sin per position

    def _rope_table(self, n: int) -> torch.Tensor:
        """Positions 0..n-1 -> [n, 2hd] fp32: cos and sin (rotate_half's sign folded in) side by side,
        what the rotary module gives each position (it computes per position alike: a product per
        frequency, then cos and sin)."""
        with torch.inference_mode(False), torch.no_grad():  # a table kept across forwards
            cos, sin = rope_factors(*self.rotary(torch.empty(0), torch.arange(n)[None]))  # [1,1,n,hd] x2
        return torch.cat([cos, sin], dim=-1)[0, 0]

    def rope(self, pos: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """pos [B,T] -> cos, signed sin [B,1,T,hd] in dtype (the rotary module's cast)."""
        try:  # (on a GPU an index past the table is no IndexError but a device assert: checked first)
            if pos.device.type != "cpu" and int(pos.max()) >= len(self.table):
                raise IndexError("a position past the rope table")
            both = F.embedding(pos, self.table)  # [B,T,2hd]
        except IndexError:  # a position past the table: double it until it fits
            n = len(self.table)
            while n <= int(pos.max()):
                n *= 2
            self.table = self._rope_table(n)
            both = F.embedding(pos, self.table)
        if both.dtype != dtype:
            both = both.to(dtype)
        both = both.unsqueeze(1)  # [B,1,T,2hd]
        return both[..., :self.head_dim], both[..., self.head_dim:]


_PLANS: "weakref.WeakKeyDictionary[Eagle3Draft, _HeadPlan]" = weakref.WeakKeyDictionary()


def _plan(draft) -> _HeadPlan | None:
    """The head's plan (built at its first draft, rebuilt after a cast); None for anything but an
    Eagle3Draft, which then runs its own backbone."""
    if not isinstance(draft, Eagle3Draft):
        return None
    plan = _PLANS.get(draft)
    if plan is None or plan.dtype != draft.norm.weight.dtype:
        plan = _PLANS[draft] = _HeadPlan(draft)
    return plan


def head_backbone(draft, ids, hidden, pos, mask=None, past_kv=None):
    """draft.backbone(draft.embed(ids), hidden, pos, mask, past_kv): ids [B,T] the entries' next
    tokens, hidden [B,T,H] their hidden stream -> (h [B,T,H] pre-norm, (k, v) [B,nkv,T,hd] post-RoPE)."""
    p = _plan(draft)
    if p is None:
        return draft.backbone(draft.embed(ids), hidden, pos, mask, past_kv)
    B, T, _ = hidden.shape
    emb = F.embedding(ids, p.embedding)  # [B,T,H]
    if emb.dtype != hidden.dtype:
        emb = emb.to(hidden.dtype)
    x = torch.cat([p.norm_emb(emb), p.norm_hidden(hidden)], dim=-1)  # [B,T,2H]
    qkv = p.qkv(x)  # [B,T,(nh+2nkv)*hd]
    cos, sin = p.rope(pos, hidden.dtype)  # [B,1,T,hd] each
    qk = rope(qkv[..., :-p.v_size].view(B, T, -1, p.head_dim).transpose(1, 2), cos, sin)  # [B,nh+nkv,T,hd]
    q, k = qk[:, :p.n_heads].contiguous(), qk[:, p.n_heads:]  # q contiguous as the module's is
    v = qkv[..., -p.v_size:].view(B, T, -1, p.head_dim).transpose(1, 2)  # [B,nkv,T,hd]
    attn = draft.attend(q, k, v, mask, past_kv)  # [B,nh,T,hd]
    h = hidden + p.o(attn.transpose(1, 2).reshape(B, T, -1))  # residual: the un-normed hidden stream
    gate_up = p.gate_up(p.norm_post(h))  # [B,T,2I]
    return h + p.down(F.silu(gate_up[..., :p.gate_size]) * gate_up[..., p.gate_size:]), (k, v)


def head_logits(draft, h):
    """draft.logits(h): [B,T,H] -> [B,T,Vd]."""
    p = _plan(draft)
    return draft.logits(h) if p is None else p.lm_head(p.norm_out(h))
