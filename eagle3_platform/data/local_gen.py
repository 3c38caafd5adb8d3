"""Batched decoding on the local target: left padding, one KV cache, a batch that refills.

Why a loop of our own rather than `model.generate` on a batch: sampling needs one RNG per record (so a
record's response does not depend on which other records share its batch, and a resumed run redraws
the same tokens), and rows that hit their end-of-turn leave the batch instead of decoding padding.

Invariant: with left padding, `position_ids = cumsum(mask) - 1`, so every row sees positions 0..n-1
exactly as if it ran alone; the 2D padding mask hides the pads from attention.

Continuous batching (`decode_stream`): when a quarter of the rows have finished they leave together
and the next requests of the queue are prefilled and join, right-aligned beside the rows that stay
(one copy of the cache per turnover, which also drops the columns no row needs any more). A batch
that only drained would spend its last steps on a few long answers (about a quarter of its decode
time at 16 rows or fewer, for a tenth of its tokens).

Large batches (64-128 rows in bf16 is where a CPU's matmuls pay off) make two costs matter: the
prefill keeps only the last row of logits (a [B,T,V] logits tensor is GBs), and finished rows leave
the cache in groups (each turnover copies the whole cache), decoding a few ignored rows meanwhile.
The cache grows in place (kv_cache.GrowingCache), not by concatenation; on CPU the target decodes with
grouped-query attention (model/attention.py, set by load_target).

Left padding makes every row attend over the longest row's width, and a decode step's attention reads
its keys and values from memory: with long prompts in the batch that is most of a step, and much of what
it reads is padding. So decode steps attend per group of rows (`padding_groups`), each over the slots
after its rows' common padding (~1.1x the tok/s with long prompts). A row's sums then run over fewer
masked slots, which moves its last bits: the same greedy tokens in the fp32 tests, 111 of 113 records
the same under `auto` (its 4-bit codes round like bf16, so near-ties can flip, as they do between batch
sizes).

Multi-turn conversations reuse their cache across turns (`Prefix`): turn k+1's prompt is turn k's
prompt + answer + the next user turn, so a row hands back the keys/values it computed, and the next
turn prefills only the tokens past the longest common prefix instead of the whole history (~1.2x the
tok/s on multi-turn ShareGPT conversations; scripts/bench_regen.py).
A reused prefix sits right-aligned before a left-padded suffix, so a row reads
[pad][prefix][pad][suffix] under its 2D mask, with positions counting its real tokens only.

Long prompts are prefilled one at a time, through the same prefix path: a batch-1 forward over all
but the prompt's last token (causal, no padding mask) becomes the row's Prefix, and the batched
forward then runs only the last tokens. Batched, a padded prefill goes through attention under a
padding mask, and for long prompts that costs more than the padding itself (~1.9x the time of
prefilling them one at a time).

Both leave padding in the middle of a row, which only full attention reads exactly: transformers
measures sliding windows (and a chunk's bounds past the leading padding) in cache slots, so pads
between a row's prefix and its suffix would shift them. A target with any sliding or chunked layer
(families.attention_layout) therefore prefills every prompt whole, in one left-padded batch.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Callable

import torch

from eagle3_platform.model.attention import cache_buffer
from eagle3_platform.model.families import FULL, UnsupportedTarget, attention_layout
from eagle3_platform.model.forward import step_forward, supports
from eagle3_platform.model.kv_cache import GrowingCache, slot_capacity
from eagle3_platform.model.ragged import row_groups
from eagle3_platform.model.sampling import greedy
from eagle3_platform.model.target import on_device


ALONE_FROM = 256  # prompt tokens to prefill at which a prompt is prefilled alone (batch 1)
TURNOVER = 4  # finished rows leave (and new ones join) once 1/TURNOVER of the batch has finished
# One more row group of a decode step costs about as much as attending over this many more (row,
# slot) pairs (padding_groups): ~12 small ops a layer (~50 µs on 2 cores) against ~0.15 µs a pair
# a layer (1.5 KB of fp32 keys and values at ~10 GB/s). On the 128 chat prompts, 2.2 groups a step:
# 28% fewer pairs than one group (2048, the engine's bf16 figure: 21% fewer with 1.35 groups).
PADDING_GROUP_OVERHEAD = 512


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
    finish_reason: str  # "stop" (end-of-turn/EOS) | "length" (hit its budget) | "time" (decode_stream closed)
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


@dataclass
class Request:
    """One prompt to answer. prefix: an earlier cache to reuse (only its common prefix with `ids`);
    keep_cache: hand this row's cache back in Generated.cache; tag: the caller's."""
    ids: list[int]
    max_new: int
    seed: int = 0
    prefix: Prefix | None = None
    keep_cache: bool = False
    tag: object = None

    @property
    def reserve(self) -> int:
        """KV slots the row may come to hold: its prompt and every token of its budget."""
        return len(self.ids) + self.max_new


@torch.no_grad()
def generate_batch(model, prompts: list[list[int]], max_new: list[int], stop_ids: set[int],
                   pad_id: int, sampling: Sampling = Sampling(), seeds: list[int] | None = None,
                   prefixes: list[Prefix | None] | None = None, keep_cache: list[bool] | None = None
                   ) -> list[Generated]:
    """Decode every prompt, all in one batch, until a stop id or its own budget `max_new[i]`.
    prefixes[i]: an earlier call's cache of row i (only its common prefix with prompts[i] is used);
    keep_cache[i]: hand row i's cache back in Generated.cache."""
    n = len(prompts)
    queue = deque(Request(p, m, s, pre, keep, tag=i) for i, (p, m, s, pre, keep) in enumerate(
        zip(prompts, max_new, seeds or [0] * n, prefixes or [None] * n, keep_cache or [False] * n)))
    out: list[Generated | None] = [None] * n
    decode_stream(model, queue, lambda r, g: out.__setitem__(r.tag, g), stop_ids, pad_id, sampling)
    return out


@torch.no_grad()
def decode_stream(model, queue: deque[Request], on_done: Callable[[Request, Generated], None],
                  stop_ids: set[int], pad_id: int, sampling: Sampling = Sampling(),
                  max_rows: int | None = None, budget: int | None = None,
                  closed: Callable[[], bool] | None = None) -> None:
    """Answer every request of `queue`, in queue order, as one continuous batch of at most max_rows
    rows and rows x the longest row's reserve <= budget KV slots. Once 1/TURNOVER of the rows have
    finished they leave together (on_done for each; it may queue a follow-up request, e.g. the
    conversation's next turn) and the next requests that fit join in their place: one copy of the
    cache per such turnover, and no batch tail waiting on its longest answer while prompts wait.
    Invariant: a row's tokens do not depend on its companions (positions count its own tokens, the
    mask hides every other slot): exactly per-prompt `generate` in fp32, up to rounding in bf16.
    Once `closed()` (checked before every step), the rows running end where they are (finish_reason
    "time") and the queue is left to the caller.
    Tensors made without a device go to the model's (target.on_device: a GPU's, or the CPU's)."""
    with on_device(next(model.parameters()).device):
        _decode_loop(model, queue, on_done, stop_ids, pad_id, sampling, max_rows, budget, closed)


def _decode_loop(model, queue, on_done, stop_ids, pad_id, sampling, max_rows, budget, closed) -> None:
    rows: _Rows | None = None
    lean = supports(model)  # decode steps through model/forward.step_forward; asked once, not per step
    while True:
        if closed is not None and closed():
            if rows is not None:
                rows.close(on_done)
            return
        new = _admit(queue, rows, max_rows, budget)
        if new or (rows is not None and rows.departed):
            rows = _Rows.rebuild(model, rows, new, pad_id, sampling)
        if rows is None:
            return
        finished = rows.push(pick(rows.logits, sampling, rows.gens), stop_ids)
        if len(finished) >= max(1, rows.size // TURNOVER):
            rows.depart(finished, on_done)
            if rows.size == 0:
                continue
        rows.forward(model, lean)


def _admit(queue: deque[Request], rows: "_Rows | None", max_rows: int | None, budget: int | None
           ) -> list[Request]:
    """The requests at the head of the queue that fit beside the rows staying (one row always fits)."""
    taken: list[Request] = []
    size, longest = (rows.size, rows.longest_reserve()) if rows is not None else (0, 0)
    while queue and (max_rows is None or size + len(taken) < max_rows):
        longest = max(longest, queue[0].reserve)
        if size + len(taken) and budget is not None and (size + len(taken) + 1) * longest > budget:
            break
        taken.append(queue.popleft())
    return taken


class _Rows:
    """The running batch: left-padded (right-aligned) rows over one KV cache and a 2D mask [B,P].
    A finished row stays (fed ignored tokens) until its group departs; departed rows are dropped
    at the next rebuild, which also takes the new rows in."""

    def __init__(self, reqs: list[Request], out: list[Generated], gens, cache, mask, logits, next_pos):
        self.reqs, self.out, self.gens = reqs, out, gens
        self.cache, self.mask, self.logits, self.next_pos = cache, mask, logits, next_pos
        self.departed: list[int] = []  # rows finished and handed to on_done, dropped at the next rebuild
        self.last: torch.Tensor | None = None  # [B] the tokens picked last, fed by the next forward
        self.groups = padding_groups(mask)  # (start, stop, lo): rows start..stop-1 hold no token before lo

    @property
    def size(self) -> int:
        """Rows that stay (departed ones excluded)."""
        return len(self.reqs) - len(self.departed)

    def longest_reserve(self) -> int:
        gone = set(self.departed)
        return max((r.reserve for b, r in enumerate(self.reqs) if b not in gone), default=0)

    @classmethod
    def rebuild(cls, model, rows: "_Rows | None", new: list[Request], pad_id: int,
                sampling: Sampling) -> "_Rows | None":
        """The staying rows, then `new` (prefilled here), as one batch; None if there are none."""
        parts, reqs, out, gens, logits, pos = [], [], [], [], [], []
        if rows is not None:
            gone = set(rows.departed)
            stay = [b for b in range(len(rows.reqs)) if b not in gone]
            if stay:
                idx = torch.tensor(stay)
                parts.append((rows.cache, rows.mask, idx))
                reqs += [rows.reqs[b] for b in stay]
                out += [rows.out[b] for b in stay]
                gens += [rows.gens[b] for b in stay] if rows.gens else []
                logits.append(rows.logits[idx])
                pos.append(rows.next_pos[idx])
        if new:
            device = next(model.parameters()).device
            prompts = [r.ids for r in new]
            prefixes = [r.prefix for r in new]
            if middle_padding_exact(model.config):
                prefixes = _prefill_long_alone(model, prompts, prefixes, device)
            else:  # leading padding only: the whole prompt prefilled, no cache reused
                prefixes = [None] * len(new)
            for r in new:
                r.prefix = None  # the batch's cache holds it from here on
            cache, mask, last_logits = _prefill(model, prompts, prefixes, pad_id, device)
            parts.append((cache, mask, torch.arange(len(new))))
            reqs += new
            out += [Generated([], "") for _ in new]
            gens += [torch.Generator(device).manual_seed(r.seed) for r in new] if sampling.do_sample else []
            logits.append(last_logits)
            pos.append(mask.sum(-1))  # each row's next position = its real tokens
        if not parts:
            return None
        fresh = len(parts) == 1 and new  # only new rows: the prefill's cache as it is
        cache, mask = parts[0][:2] if fresh else _stack(parts)
        return cls(reqs, out, gens or None, cache, mask, torch.cat(logits), torch.cat(pos))

    def push(self, tok: torch.Tensor, stop_ids: set[int]) -> list[int]:
        """Append the picked token of every unfinished row -> the rows finished and not yet departed."""
        self.last = tok
        for t, g, r in zip(tok.tolist(), self.out, self.reqs):
            if g.finish_reason:  # finished: fed ignored tokens until it departs
                continue
            g.tokens.append(t)
            if t in stop_ids:
                g.finish_reason = "stop"
            elif len(g.tokens) >= r.max_new:
                g.finish_reason = "length"
        gone = set(self.departed)
        return [b for b, g in enumerate(self.out) if g.finish_reason and b not in gone]

    def depart(self, finished: list[int], on_done) -> None:
        """Finished rows leave: their caches handed back where asked, then on_done for each."""
        for b in finished:
            r, g = self.reqs[b], self.out[b]
            if r.keep_cache:
                g.cache = self._cache_of(b)
            self.departed.append(b)
            on_done(r, g)

    def close(self, on_done) -> None:
        """Every row that has not departed leaves now: a finished one as it is, one still decoding as
        "time" with the tokens it has (at least one: every step pushes a token to each row it built),
        its cache not kept (nothing will follow it)."""
        gone = set(self.departed)
        for r, g in zip(self.reqs, self.out):
            if not g.finish_reason:
                g.finish_reason, r.keep_cache = "time", False
        self.depart([b for b in range(len(self.reqs)) if b not in gone], on_done)

    def forward(self, model, lean: bool) -> None:
        """One token per row (finished and departed rows too, ignored) -> the next logits. lean (the
        model takes it, forward.supports): through the engine's step forward (model/forward.py: the
        same values as transformers' forward in fewer small ops, ~1.03-1.16x the tok/s)."""
        B = len(self.reqs)
        self.mask = torch.cat([self.mask, self.mask.new_ones((B, 1))], dim=1)  # [B,P+1]
        ids, pos = self.last.to(self.mask.device)[:, None], self.next_pos[:, None]  # [B,1] each
        if lean:
            visible = self.mask.bool()[:, None, None, :]  # [B,1,1,P+1]: one query token sees every real slot
            W = self.mask.shape[1]
            groups = [(a, b, lo, W) for a, b, lo in self.groups] if len(self.groups) > 1 else None
            self.logits = step_forward(model, ids, pos, visible, self.cache, (), logits_to_keep=1,
                                       row_groups=groups)[0][:, -1]
        else:
            self.logits = model(input_ids=ids, attention_mask=self.mask, position_ids=pos,
                                past_key_values=self.cache, use_cache=True).logits[:, -1]  # [B,V]
        self.next_pos = self.next_pos + 1

    def _cache_of(self, b: int) -> Prefix:
        """Row b's prompt and every generated token but the last (never fed back)."""
        r, g = self.reqs[b], self.out[b]
        n = len(r.ids) + len(g.tokens) - 1
        slots = self.mask[b].nonzero()[:n, 0]  # [n] real slots, in order
        return Prefix(ids=list(r.ids) + g.tokens[:-1],
                      keys=[layer.keys[b][:, slots] for layer in self.cache.layers],
                      values=[layer.values[b][:, slots] for layer in self.cache.layers])


def middle_padding_exact(config) -> bool:
    """A row may hold padding between its tokens ([pad][prefix][pad][suffix]) and decode exactly: every
    layer attends fully (a window or chunk is measured in cache slots, so pads inside a row would
    shift it). An unregistered family is taken as not full (exact, without cache reuse)."""
    try:
        return set(attention_layout(config).kinds) == {FULL}
    except UnsupportedTarget:
        return False


def padding_groups(mask: torch.Tensor) -> list[tuple[int, int, int]]:
    """mask [B,P] (1 = real token, rows right-aligned) -> contiguous row groups (start, stop, lo):
    slots before lo are padding in every row of the group, so its rows attend over [lo, P) and on
    (model/ragged.row_groups: the fewest (row, slot) pairs plus PADDING_GROUP_OVERHEAD per group).
    Columns are only appended, so the groups hold until the next rebuild: every row's span grows
    alike, and the pairs the grouping saves stay the same."""
    P = mask.shape[1]
    firsts = mask.argmax(1).tolist()  # each row's first real slot (every row holds a token)
    spans = row_groups([P - f for f in firsts], 0, PADDING_GROUP_OVERHEAD)
    return [(a, b, P - span) for a, b, span in spans]


def _stack(parts: list[tuple]) -> tuple:
    """[(cache, mask [B_i,P_i], row index [b_i])] -> (one cache, mask [sum b_i, W]): the rows in
    order, right-aligned, without leading columns that are padding in every row; one copy, into
    buffers with room to grow (GrowingCache.adopt)."""
    taken = []
    for cache, mask, idx in parts:
        m = mask[idx]
        first = int(m.any(0).long().argmax())  # the first column real in some row
        taken.append((cache, idx, m[:, first:], first))
    B, W = sum(len(idx) for _, idx, _, _ in taken), max(m.shape[1] for _, _, m, _ in taken)
    out = GrowingCache()
    for layer in range(len(parts[0][0].layers)):
        bufs = []
        for kind in ("keys", "values"):
            like = getattr(parts[0][0].layers[layer], kind)  # [b,kv,P,hd]
            buf = cache_buffer(like, (B, like.shape[1], slot_capacity(W), like.shape[3]))  # zeroed
            row = 0
            for cache, idx, m, first in taken:
                buf[row:row + len(idx), :, W - m.shape[1]:W] = getattr(cache.layers[layer], kind)[idx, :, first:]
                row += len(idx)
            bufs.append(buf)
        out.adopt(layer, *bufs, W)
    mask = taken[0][2].new_zeros(B, W)
    row = 0
    for _, idx, m, _ in taken:
        mask[row:row + len(idx), W - m.shape[1]:] = m
        row += len(idx)
    return out, mask


def _prefill_long_alone(model, prompts: list[list[int]], prefixes: list[Prefix | None], device
                        ) -> list[Prefix | None]:
    """A row with no cache to reuse and ALONE_FROM or more tokens to prefill gets one: a batch-1
    forward over its prompt but the last token (the batched prefill runs that one for its logits)."""
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
