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

Multi-turn conversations reuse their cache across turns (`Prefix`): turn k+1's prompt is turn k's
prompt + answer + the next user turn, so a row hands back the keys/values it computed, and the next
call prefills only the tokens past the longest common prefix instead of the whole history (48 ShareGPT
multi-turn conversations, cpu preset, 2 cores: 92.5 -> 114.2 tok/s; scripts/bench_regen.py).
A reused prefix sits right-aligned before a left-padded suffix, so a row reads
[pad][prefix][pad][suffix] under its 2D mask, with positions counting its real tokens only.

Long prompts are prefilled one at a time, through the same prefix path: a batch-1 forward over all
but the prompt's last token (causal, no padding mask) becomes the row's Prefix, and the batched
forward then runs only the last tokens. Batched, a padded prefill goes through attention under a
padding mask, and for long prompts that cost more than the padding itself: 13 prompts of 1100-1476
tokens took 35.6 s batched and 19.2 s one at a time (SmolLM2, bf16, 2 threads).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from eagle3_platform.spec.sampling import greedy


ALONE_FROM = 256  # prompt tokens to prefill at which a prompt is prefilled alone (batch 1)


@dataclass(frozen=True)
class Sampling:
    do_sample: bool = False
    temperature: float = 1.0
    top_p: float = 1.0


@dataclass
class Prefix:
    """A row's KV cache handed back by generate_batch: the ids it holds, their keys/values per layer."""
    ids: list[int]
    keys: list[torch.Tensor]  # per layer [kv, n, hd]
    values: list[torch.Tensor]


@dataclass
class Generated:
    tokens: list[int]  # generated ids, the stop token included when one was produced
    finish_reason: str  # "stop" (end-of-turn/EOS) | "length" (hit its budget)
    cache: Prefix | None = None  # prompt + tokens[:-1] (where keep_cache asked for it)


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
                   pad_id: int, sampling: Sampling = Sampling(), seeds: list[int] | None = None,
                   prefixes: list[Prefix | None] | None = None, keep_cache: list[bool] | None = None
                   ) -> list[Generated]:
    """Decode every prompt until a stop id or its own budget `max_new[i]`. prefixes[i]: an earlier
    call's cache of row i (only its common prefix with prompts[i] is used); keep_cache[i]: hand row
    i's cache back in Generated.cache."""
    device = next(model.parameters()).device
    prefixes = _prefill_long_alone(model, prompts, prefixes or [None] * len(prompts), device)
    cache, mask, logits = _prefill(model, prompts, prefixes, pad_id, device)
    next_pos = mask.sum(-1)  # [B] = prompt lengths: each row's next position
    gens = None
    if sampling.do_sample:
        gens = [torch.Generator().manual_seed(s) for s in (seeds or [0] * len(prompts))]
    out = [Generated([], "") for _ in prompts]
    hand_back = None
    if keep_cache and any(keep_cache):
        hand_back = lambda rows, b_idx, m: _hand_back(cache, m, rows, b_idx, prompts, out, keep_cache)
    _decode(model, logits, cache, mask, next_pos, out, max_new, stop_ids, sampling, gens, hand_back)
    return out


def _prefill_long_alone(model, prompts: list[list[int]], prefixes: list[Prefix | None], device
                        ) -> list[Prefix | None]:
    """A row with no cache to reuse and ALONE_FROM or more tokens to prefill gets one: a batch-1
    forward over its prompt but the last token (the batched prefill runs that one for its logits)."""
    from eagle3_platform.kv_cache import GrowingCache

    out = list(prefixes)
    if len(prompts) == 1:  # alone already
        return out
    for i, (p, pre) in enumerate(zip(prompts, prefixes)):
        if pre is not None or len(p) - 1 < ALONE_FROM:
            continue
        cache = GrowingCache()
        model(input_ids=torch.tensor([p[:-1]], device=device), past_key_values=cache, use_cache=True,
              logits_to_keep=1)
        out[i] = Prefix(ids=p[:-1], keys=[layer.keys[0] for layer in cache.layers],
                        values=[layer.values[0] for layer in cache.layers])  # per layer [kv, n, hd]
    return out


def _prefill(model, prompts: list[list[int]], prefixes: list[Prefix | None], pad_id: int, device):
    """-> (cache, mask [B,C+S] (1 = real token), last logits [B,V]). Row i reuses
    n_i = common_prefix(prompts[i], prefixes[i]) cached tokens (at most all but the prompt's last,
    which must run for its logits) and prefills the rest."""
    from eagle3_platform.kv_cache import GrowingCache

    reused = [0 if pre is None else min(common_prefix(p, pre.ids), len(p) - 1) for p, pre in zip(prompts, prefixes)]
    C = max(reused)
    ids, mask = left_pad([p[n:] for p, n in zip(prompts, reused)], pad_id)  # suffixes [B,S]
    cached = torch.zeros(len(prompts), C, dtype=torch.long)
    for i, n in enumerate(reused):
        cached[i, C - n:] = 1
    mask = torch.cat([cached, mask], dim=1).to(device)  # [B,C+S]
    pos = (mask.cumsum(-1) - 1).clamp(min=0)[:, C:]  # [B,S]: row i's suffix at n_i, n_i+1, ...
    cache = GrowingCache()
    if C:
        _load_prefixes(cache, prefixes, reused, C)
    logits = model(input_ids=ids.to(device), attention_mask=mask, position_ids=pos, past_key_values=cache,
                   use_cache=True, logits_to_keep=1).logits[:, -1]  # [B,V]
    return cache, mask, logits


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _load_prefixes(cache, prefixes: list[Prefix | None], reused: list[int], C: int) -> None:
    """Row i's first reused[i] cached keys/values, right-aligned in [B,kv,C,hd] buffers per layer."""
    src = next(p for p, n in zip(prefixes, reused) if n)
    kv, _, hd = src.keys[0].shape
    for layer in range(len(src.keys)):
        k = src.keys[layer].new_zeros(len(prefixes), kv, C, hd)  # zeros: masked slots must not be NaN
        v = torch.zeros_like(k)
        for i, (pre, n) in enumerate(zip(prefixes, reused)):
            if n:
                k[i, :, C - n:] = pre.keys[layer][:, :n]
                v[i, :, C - n:] = pre.values[layer][:, :n]
        cache.update(k, v, layer)


def _hand_back(cache, mask, rows: list[int], batch_idx: list[int], prompts, out: list[Generated],
               keep: list[bool]) -> None:
    """Copy the caches of batch rows batch_idx (prompt indices rows) with keep[r] into out[r].cache:
    the first len(prompt) + len(tokens) - 1 real slots, i.e. the prompt and every generated token but
    the last (which was never fed back; a finished row left in the batch is fed tokens past its end)."""
    for b, r in zip(batch_idx, rows):
        if not keep[r]:
            continue
        n = len(prompts[r]) + len(out[r].tokens) - 1
        slots = mask[b].nonzero()[:n, 0]  # [n] real slots, in order
        out[r].cache = Prefix(ids=list(prompts[r]) + out[r].tokens[:-1],
                              keys=[layer.keys[b][:, slots] for layer in cache.layers],
                              values=[layer.values[b][:, slots] for layer in cache.layers])


def _decode(model, logits, cache, mask, next_pos, out: list[Generated], max_new: list[int],
            stop_ids: set[int], sampling: Sampling, gens, hand_back=None) -> None:
    """The decode loop of generate_batch: one token per live row per step until every row finished.
    hand_back(prompt indices, batch rows, mask): called for rows about to leave the cache."""
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
            if hand_back:
                hand_back(rows, list(range(len(rows))), mask)
            break
        if len(rows) - len(keep) >= max(1, len(rows) // 4):  # compact: drop finished rows from the cache
            if hand_back:
                gone = [b for b in range(len(rows)) if not live[b]]
                hand_back([rows[b] for b in gone], gone, mask)
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
