"""Batched decoding on the local target: left padding, one KV cache, finished rows dropped.

Why a loop of our own rather than `model.generate` on a batch: sampling needs one RNG per record (so a
record's response does not depend on which other records share its batch, and a resumed run redraws
the same tokens), and rows that hit their end-of-turn leave the batch instead of decoding padding.

Invariant: with left padding, `position_ids = cumsum(mask) - 1`, so every row sees positions 0..n-1
exactly as if it ran alone; the 2D padding mask hides the pads from attention.

Large batches (64-128 rows in bf16 is where a CPU's matmuls pay off) make two costs matter: the
prefill keeps only the last row of logits (a [B,T,V] logits tensor is GBs), and finished rows leave
the cache in groups (each removal copies the whole cache), decoding a few ignored rows meanwhile.
The cache grows in place (kv_cache.GrowingCache), not by concatenation; on CPU the target decodes with
grouped-query attention (attention.py, set by load_target).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from eagle3_platform.spec.sampling import greedy


@dataclass(frozen=True)
class Sampling:
    do_sample: bool = False
    temperature: float = 1.0
    top_p: float = 1.0


@dataclass
class Generated:
    tokens: list[int]  # generated ids, the stop token included when one was produced
    finish_reason: str  # "stop" (end-of-turn/EOS) | "length" (hit its budget)


def left_pad(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """prompts -> ids [B,T], mask [B,T] (1 = real token), right-aligned."""
    T = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), T), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), T), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, T - len(p):] = torch.tensor(p, dtype=torch.long)
        mask[i, T - len(p):] = 1
    return ids, mask


def pick(logits: torch.Tensor, s: Sampling, gens: list[torch.Generator] | None) -> torch.Tensor:
    """logits [B,V] -> next ids [B]. Greedy argmax, or temperature + top-p with one RNG per row."""
    if not s.do_sample:
        return greedy(logits)
    probs = torch.softmax(logits.float() / s.temperature, dim=-1)  # [B,V]
    if s.top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        # keep the smallest prefix whose mass reaches top_p (the first token always survives)
        drop = sorted_p.cumsum(-1) - sorted_p >= s.top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
    return torch.stack([torch.multinomial(probs[i], 1, generator=g)[0] for i, g in enumerate(gens)])


@torch.no_grad()
def generate_batch(model, prompts: list[list[int]], max_new: list[int], stop_ids: set[int],
                   pad_id: int, sampling: Sampling = Sampling(), seeds: list[int] | None = None
                   ) -> list[Generated]:
    """Decode every prompt until a stop id or its own budget `max_new[i]`."""
    from eagle3_platform.kv_cache import GrowingCache

    device = next(model.parameters()).device
    ids, mask = left_pad(prompts, pad_id)
    ids, mask = ids.to(device), mask.to(device)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)  # [B,T]
    gens = None
    if sampling.do_sample:
        gens = [torch.Generator().manual_seed(s) for s in (seeds or [0] * len(prompts))]
    cache = GrowingCache()
    logits = model(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=cache,
                   use_cache=True, logits_to_keep=1).logits[:, -1]  # [B,V]
    next_pos = pos[:, -1] + 1  # [B]
    out = [Generated([], "") for _ in prompts]
    _decode(model, logits, cache, mask, next_pos, out, max_new, stop_ids, sampling, gens)
    return out


def _decode(model, logits, cache, mask, next_pos, out: list[Generated], max_new: list[int],
            stop_ids: set[int], sampling: Sampling, gens) -> None:
    """The decode loop of generate_batch: one token per live row per step until every row finished."""
    device = mask.device
    rows = list(range(len(out)))  # batch row -> prompt index, shrinks as rows finish
    live = [True] * len(out)  # batch row still decoding (finished rows stay until compaction)
    while rows:
        tok = pick(logits, sampling, [gens[r] for r in rows] if gens else None).tolist()  # [B']
        for b, r in enumerate(rows):
            if not live[b]:
                continue
            out[r].tokens.append(tok[b])
            if tok[b] in stop_ids:
                out[r].finish_reason = "stop"
            elif len(out[r].tokens) >= max_new[r]:
                out[r].finish_reason = "length"
            else:
                continue
            live[b] = False
        keep = [b for b in range(len(rows)) if live[b]]
        if not keep:
            break
        if len(rows) - len(keep) >= max(1, len(rows) // 4):  # compact: drop finished rows from the cache
            idx = torch.tensor(keep, device=device)
            cache.batch_select_indices(idx)
            mask, next_pos = mask[idx], next_pos[idx]
            tok = [tok[b] for b in keep]
            rows, live = [rows[b] for b in keep], [True] * len(keep)
        mask = torch.cat([mask, mask.new_ones((len(rows), 1))], dim=1)  # [B', P+1]
        step = torch.tensor(tok, device=device)[:, None]  # [B',1]
        logits = model(input_ids=step, attention_mask=mask, position_ids=next_pos[:, None],
                       past_key_values=cache, use_cache=True).logits[:, -1]
        next_pos = next_pos + 1
