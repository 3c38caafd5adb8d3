"""The EAGLE-3 draft head (docs/ARCHITECTURE.md §5): fc(3H→H) + one Llama decoder layer whose attention
reads concat(normed token embedding, normed hidden stream) (2H wide) + norm + lm_head over the draft
vocab.

Parameter and buffer names match SGLang's `LlamaForCausalLMEagle3` checkpoint layout exactly
(`fc.weight`, `midlayer.*`, `norm.weight`, `lm_head.weight`, `d2t`, `t2d`); `embed_tokens` is the
target's frozen embedding and is never exported (head_state_dict() leaves it out).

Interface used by the engine (spec/) and by TTT training (draft/ttt.py):
  embed(ids) → project(aux_hidden) → backbone(emb, hidden, position_ids, ...) → logits(h).
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from eagle3_platform.model.attention import MAX_GROUPED_QUERY, grouped_attention
from eagle3_platform.model.families import checkpoint_names, family_of, text_config

DEFAULT_ROPE_THETA = 10000.0
DRAFT_WEIGHTS, DRAFT_CONFIG = "draft.safetensors", "draft_config.json"  # a trained draft dir (train.save_draft_dir)


@dataclass(frozen=True)
class DraftConfig:
    hidden_size: int                 # H (the target's)
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None        # None = plain RoPE; else the target's scaling dict (rope_type, factor, ...)
    max_position_embeddings: int
    vocab_size: int                  # V (target vocab)
    draft_vocab_size: int            # Vd
    aux_layer_ids: tuple[int, ...]   # target layers whose outputs form g (3 of them)
    hidden_act: str = "silu"         # the head's MLP is SiLU whatever the target's (SGLang's too)

    @classmethod
    def from_target(cls, hf_config, draft_vocab_size: int, aux_layer_ids) -> "DraftConfig":
        """Copy the target's attention/MLP/RoPE geometry (SGLang builds the head from these keys).
        hf_config: the target's config (object or dict; a nested one is read through its text config).
        The head is one Llama layer: SiLU MLP and full rotary, whatever the target's activation and
        rotary fraction (families.py)."""
        c = hf_config if isinstance(hf_config, dict) else hf_config.get_text_config().to_dict()
        theta, scaling = _rope_from_hf(c)
        heads = c["num_attention_heads"]
        return cls(
            hidden_size=c["hidden_size"], intermediate_size=c["intermediate_size"],
            num_attention_heads=heads, num_key_value_heads=c.get("num_key_value_heads") or heads,
            head_dim=c.get("head_dim") or c["hidden_size"] // heads,
            rms_norm_eps=float(c["rms_norm_eps"]), rope_theta=theta, rope_scaling=scaling,
            max_position_embeddings=c["max_position_embeddings"], vocab_size=c["vocab_size"],
            draft_vocab_size=int(draft_vocab_size), aux_layer_ids=tuple(int(i) for i in aux_layer_ids))

    def to_dict(self) -> dict:
        d = asdict(self)
        d["aux_layer_ids"] = list(self.aux_layer_ids)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "DraftConfig":
        d = dict(d)
        d["aux_layer_ids"] = tuple(d["aux_layer_ids"])
        return cls(**d)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2, sort_keys=True))

    @classmethod
    def load(cls, path: str | Path) -> "DraftConfig":
        return cls.from_dict(json.loads(Path(path).read_text()))

    def rope_parameters(self) -> dict:
        """transformers-5 style rope dict (rope_theta inside)."""
        rp = {"rope_type": "default", **(self.rope_scaling or {}), "rope_theta": self.rope_theta}
        rp.setdefault("rope_type", rp.pop("type", "default"))
        return rp


def _rope_from_hf(c: dict) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling) for the head from a transformers 4 (rope_theta/rope_scaling) or 5
    (rope_parameters) config. Per-layer-type parameters (Gemma-3) give the full-attention layers'.
    The head rotates every dimension: a partial rotary fraction (Phi) is not copied, and scaling
    factors sized for the partial rotary (Phi-4's longrope lists) cannot apply: plain RoPE then."""
    rp = dict(c.get("rope_parameters") or c.get("rope_scaling") or {})
    if isinstance(rp.get("full_attention"), dict):
        rp = dict(rp["full_attention"])
    theta = float(rp.pop("rope_theta", c.get("rope_theta") or DEFAULT_ROPE_THETA))
    partial = float(rp.pop("partial_rotary_factor", c.get("partial_rotary_factor") or 1.0))
    rope_type = rp.get("rope_type", rp.get("type", "default"))
    if rope_type == "default" or (partial != 1.0 and any(isinstance(v, list) for v in rp.values())):
        return theta, None
    return theta, rp


def _llama_config(cfg: DraftConfig):
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
                       num_attention_heads=cfg.num_attention_heads,
                       num_key_value_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim,
                       max_position_embeddings=cfg.max_position_embeddings,
                       rms_norm_eps=cfg.rms_norm_eps, rope_parameters=cfg.rope_parameters())


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):  # computed in fp32 like Llama, cast back to the input dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x, cos, sin):
    # x [B,h,T,hd]; cos/sin [B,T,hd] → broadcast over heads
    return x * cos.unsqueeze(1) + rotate_half(x) * sin.unsqueeze(1)


def repeat_kv(x, n_rep: int):
    # [B,n_kv,T,hd] -> [B,n_kv*n_rep,T,hd]  (GQA: each kv head serves n_rep query heads)
    return x if n_rep == 1 else x.repeat_interleave(n_rep, dim=1)


class Attention(nn.Module):
    def __init__(self, cfg: DraftConfig):
        super().__init__()
        h, hd = cfg.hidden_size, cfg.head_dim
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, hd
        # invariant: q/k/v read concat(normed emb, normed hidden) → input width 2H (SGLang's qkv_proj)
        self.q_proj = nn.Linear(2 * h, self.n_heads * hd, bias=False)
        self.k_proj = nn.Linear(2 * h, self.n_kv * hd, bias=False)
        self.v_proj = nn.Linear(2 * h, self.n_kv * hd, bias=False)
        self.o_proj = nn.Linear(self.n_heads * hd, h, bias=False)


class MLP(nn.Module):
    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):  # SiLU-GLU
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Split in two halves (qkv / finish) so TTT can run its own attention pattern in between."""

    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)   # on the token embedding
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)       # on the hidden stream
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def qkv(self, emb, hidden, cos, sin):
        # emb, hidden [B,T,H] -> x [B,T,2H] -> q [B,nh,T,hd], k/v [B,nkv,T,hd] (q,k post-RoPE)
        a = self.self_attn
        x = torch.cat([self.input_layernorm(emb), self.hidden_norm(hidden)], dim=-1)
        B, T, _ = x.shape
        q = a.q_proj(x).view(B, T, a.n_heads, a.head_dim).transpose(1, 2)
        k = a.k_proj(x).view(B, T, a.n_kv, a.head_dim).transpose(1, 2)
        v = a.v_proj(x).view(B, T, a.n_kv, a.head_dim).transpose(1, 2)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def finish(self, hidden, attn):
        # attn [B,nh,T,hd] -> [B,T,H]; residual is the (un-normed) hidden stream, as in SGLang
        B, _, T, _ = attn.shape
        h = hidden + self.self_attn.o_proj(attn.transpose(1, 2).reshape(B, T, -1))
        return h + self.mlp(self.post_attention_layernorm(h))  # pre-norm output of the layer


class Eagle3Draft(nn.Module):
    def __init__(self, cfg: DraftConfig):
        super().__init__()
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        self.cfg = cfg
        H = cfg.hidden_size
        self.embed_tokens = nn.Embedding(cfg.vocab_size, H)
        self.embed_tokens.weight.requires_grad_(False)   # frozen target embedding, not exported
        self.fc = nn.Linear(3 * H, H, bias=False)
        self.midlayer = DecoderLayer(cfg)
        self.norm = RMSNorm(H, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(H, cfg.draft_vocab_size, bias=False)
        # same RoPE as the target, incl. rope_scaling (transformers computes inv_freq / attention scaling)
        self.rotary = LlamaRotaryEmbedding(_llama_config(cfg))
        # identity mapping until a vocab is set: draft id i ↔ target id i
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.int64))
        t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
        t2d[: cfg.draft_vocab_size] = True
        self.register_buffer("t2d", t2d)

    # ---- interface ---------------------------------------------------------------------------
    def embed(self, input_ids):            # [B,T] -> [B,T,H]
        return self.embed_tokens(input_ids)

    def project(self, aux_hidden):         # [B,T,3H] -> [B,T,H]
        return self.fc(aux_hidden.to(self.embed_tokens.weight.dtype))  # the weights' dtype (all cast alike)

    def rope(self, x, position_ids):       # position_ids [B,T] -> cos, sin [B,T,hd] in x's dtype
        return self.rotary(x, position_ids)

    def backbone(self, emb, hidden, position_ids, attn_mask=None, past_kv=None):
        """emb, hidden [B,T,H]; position_ids [B,T]; attn_mask additive [B,1,T,P+T] or None (causal over
        past + new); past_kv (k, v) each [B,nkv,P,hd] post-RoPE, or a buffer whose extend(k, v) writes
        the new entries after its P and returns keys/values [B,nkv,P+T,hd], or None.
        Returns (h [B,T,H] pre-norm, (k_new, v_new) each [B,nkv,T,hd] post-RoPE)."""
        emb = emb.to(hidden.dtype)
        cos, sin = self.rope(hidden, position_ids)
        q, k, v = self.midlayer.qkv(emb, hidden, cos, sin)
        return self.midlayer.finish(hidden, self.attend(q, k, v, attn_mask, past_kv)), (k, v)

    def attend(self, q, k, v, attn_mask=None, past_kv=None):
        """q [B,nh,T,hd] and the new k, v [B,nkv,T,hd] (post-RoPE), after past_kv's entries (see
        backbone) -> attn [B,nh,T,hd]; a DraftKV past_kv gets k, v written in place."""
        k_all, v_all = k, v
        if hasattr(past_kv, "extend"):  # a buffer with room (spec/drafter.DraftKV): written in place
            k_all, v_all = past_kv.extend(k, v)   # [B,nkv,P+T,hd], maybe in another dtype
        elif past_kv is not None:
            k_all = torch.cat([past_kv[0], k], dim=2)   # [B,nkv,P+T,hd]
            v_all = torch.cat([past_kv[1], v], dim=2)
        T = q.shape[2]
        if attn_mask is None and T > 1:  # one query sees every key: no mask needed
            attn_mask = causal_mask(T, k_all.shape[2], q.dtype, q.device)
        if T <= MAX_GROUPED_QUERY:  # drafting: grouped matmuls, no copy of the cache per head
            return grouped_attention(q, k_all, v_all, attn_mask)
        # a prompt's entries
        n_rep = self.cfg.num_attention_heads // self.cfg.num_key_value_heads
        mask = None if attn_mask is None else attn_mask.to(q.dtype)
        k_all, v_all = k_all.to(q.dtype), v_all.to(q.dtype)  # exact: they were q's dtype before
        return F.scaled_dot_product_attention(q, repeat_kv(k_all, n_rep), repeat_kv(v_all, n_rep),
                                              attn_mask=mask)

    def logits(self, h):                   # [B,T,H] -> [B,T,Vd]
        return self.lm_head(self.norm(h))

    def to_target_ids(self, draft_ids):    # draft vocab ids -> target ids
        return draft_ids + self.d2t[draft_ids]

    def cast_parameters(self, dtype) -> "Eagle3Draft":
        """Weights to `dtype` in place; buffers keep theirs (`.to(dtype)` would round RoPE's inv_freq)."""
        for p in self.parameters():
            p.data = p.data.to(dtype)
        return self

    # ---- weights -----------------------------------------------------------------------------
    def head_state_dict(self) -> dict[str, torch.Tensor]:
        """Everything that is trained or exported: all but embed_tokens (and RoPE caches)."""
        return {k: v for k, v in self.state_dict().items() if not k.startswith(("embed_tokens.", "rotary."))}

    def load_head_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        expected = set(self.head_state_dict())
        if set(sd) != expected:
            raise ValueError(f"draft weights mismatch: missing {sorted(expected - set(sd))}, "
                             f"unexpected {sorted(set(sd) - expected)}")
        missing, unexpected = self.load_state_dict(sd, strict=False)
        assert not unexpected and all(m.startswith(("embed_tokens.", "rotary.")) for m in missing)

    def set_vocab(self, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        if d2t.shape != self.d2t.shape or t2d.shape != self.t2d.shape:
            raise ValueError(f"vocab shapes d2t {tuple(d2t.shape)} t2d {tuple(t2d.shape)} do not match the "
                             f"config (Vd={self.cfg.draft_vocab_size}, V={self.cfg.vocab_size})")
        self.d2t.copy_(d2t.to(torch.int64))
        self.t2d.copy_(t2d.to(torch.bool))


def causal_mask(t: int, total: int, dtype, device) -> torch.Tensor:
    """Additive [1,1,t,total]: query i (absolute position total-t+i) sees keys ≤ its own position."""
    q_pos = torch.arange(total - t, total, device=device)[:, None]
    k_pos = torch.arange(total, device=device)[None, :]
    return torch.zeros(t, total, dtype=dtype, device=device).masked_fill(
        k_pos > q_pos, torch.finfo(dtype).min)[None, None]


# ---- target tensors (embedding / lm_head / final norm) read straight from safetensors -----------
def read_target_tensors(target_dir: str | Path, names: list[str]) -> dict[str, torch.Tensor]:
    """Reads only the named tensors (lazy safe_open) from a HF checkpoint dir (single or sharded)."""
    from safetensors import safe_open

    target_dir = Path(target_dir)
    files = sorted(target_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in target dir {target_dir}")
    out = {}
    for f in files:
        with safe_open(f, framework="pt") as sf:
            keys = set(sf.keys())
            for n in names:
                if n in keys and n not in out:
                    out[n] = sf.get_tensor(n)
    return out


def target_head_weights(target_dir: str | Path) -> dict[str, torch.Tensor]:
    """{'embed': [V,H], 'lm_head': [V,H], 'norm': [H]} of the target (lm_head = embed when tied), under
    the names its family's checkpoints use (families.checkpoint_names). 'norm' is the scale the
    final norm applies (a Gemma norm's 1 + w)."""
    cfg = json.loads((Path(target_dir) / "config.json").read_text())
    wanted = {part: checkpoint_names(cfg, part) for part in ("embed_tokens", "lm_head", "norm")}
    t = read_target_tensors(target_dir, [n for names in wanted.values() for n in names])
    found = {part: next((t[n] for n in names if n in t), None) for part, names in wanted.items()}
    if found["embed_tokens"] is None:
        raise ValueError(f"target {target_dir} has none of {list(wanted['embed_tokens'])}")
    emb, norm = found["embed_tokens"], found["norm"]
    if norm is not None:
        norm = norm + family_of(cfg).norm_offset
    return {"embed": emb, "lm_head": emb if found["lm_head"] is None else found["lm_head"], "norm": norm}


def target_hf_config(target_dir: str | Path) -> dict:
    """The target's decoder config as a dict, every key filled in (a nested config's text config:
    config.json keeps only a sub-config's keys that differ from its defaults)."""
    from transformers import AutoConfig

    return text_config(AutoConfig.from_pretrained(target_dir)).to_dict()


def build_draft(target_dir: str | Path, cfg: DraftConfig, init_from_target: bool = True,
                d2t: torch.Tensor | None = None, t2d: torch.Tensor | None = None) -> Eagle3Draft:
    """A draft with the target's frozen embedding; optionally lm_head/norm initialised from the target's
    lm_head rows of the draft vocab and its final norm (a warm start: the head begins by predicting
    what the target would predict from a target-like hidden state)."""
    model = Eagle3Draft(cfg)
    tw = target_head_weights(target_dir)
    if tuple(tw["embed"].shape) != (cfg.vocab_size, cfg.hidden_size):
        raise ValueError(f"target embedding {tuple(tw['embed'].shape)} != (V, H) = "
                         f"({cfg.vocab_size}, {cfg.hidden_size})")
    with torch.no_grad():
        model.embed_tokens.weight.copy_(tw["embed"].float())
        if d2t is not None:
            model.set_vocab(d2t, t2d)
        if init_from_target:
            draft_to_target = model.to_target_ids(torch.arange(cfg.draft_vocab_size))
            model.lm_head.weight.copy_(tw["lm_head"].float()[draft_to_target])
            if tw["norm"] is not None:
                model.norm.weight.copy_(tw["norm"].float())
    return model


def read_draft_dir(draft_dir) -> tuple[dict, dict[str, torch.Tensor]]:
    """(draft_config.json: {"draft": DraftConfig, "target": identity, ...}, head weights) of a draft dir
    written by `eagle3 train`."""
    from safetensors.torch import load_file

    draft_dir = Path(draft_dir)
    for f in (DRAFT_CONFIG, DRAFT_WEIGHTS):
        if not (draft_dir / f).exists():
            raise FileNotFoundError(f"{draft_dir / f} missing (is {draft_dir} a trained draft dir?)")
    return json.loads((draft_dir / DRAFT_CONFIG).read_text()), load_file(str(draft_dir / DRAFT_WEIGHTS))


def param_count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


__all__ = ["DraftConfig", "Eagle3Draft", "build_draft", "causal_mask", "target_head_weights",
           "read_target_tensors", "target_hf_config", "param_count"]
