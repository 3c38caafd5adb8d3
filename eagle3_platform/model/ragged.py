"""The target's KV cache for a running batch of sequences of different lengths (continuous batching).

One buffer per layer, [rows, kv, slots, hd]. Row b holds its committed tokens in slots [0, lengths[b]).
A forward over q new tokens per row writes row b's tokens at slots lengths[b] .. lengths[b]+q-1 and
attends over slots [0, S) with S = max(lengths) + q, under an explicit mask that hides each row's
slots beyond its own tokens. Slot order does not matter to attention (the RoPE position is inside each
key), so rows never need aligning: no left padding, no per-step concatenation, no copy of the cache.

Rows come and go between forwards: `add_row` copies a prefilled sequence in, `drop_row` closes the
hole; rows 0..B-1 are always the running ones, kept longest first.

The buffers may be wider than the model's dtype (fp32 under a bf16 model where bf16 matmuls are
slow: compute.kv_cache_dtype); writes convert, exactly, and attention runs in the buffers' dtype.

Why longest first: one long prompt in the batch would make every row attend over its span (a
1000-token document among 150-token chats: 8 rows x 1100 slots where ~2000 hold tokens). Rows kept
in length order split into contiguous groups of similar length (`row_groups`), and attention runs
per group over that group's own span, each group a view of the buffers (no copy). The order costs
a few row moves per arrival and departure, mostly of the shorter rows (those after the changed one).
"""
from __future__ import annotations

import torch
from transformers.cache_utils import Cache

from eagle3_platform.model.attention import cache_buffer
from eagle3_platform.model.families import CHUNKED, SLIDING, AttentionLayout
from eagle3_platform.model.kv_cache import slot_capacity
# One more group costs about as much as attending over this many more (row, slot) pairs: splitting a
# row a few hundred tokens longer than the rest off made a step slower, two ~1000-token rows split off
# made it faster.
GROUP_OVERHEAD = 2048
# Buffers start zeroed (cache_buffer), not empty: a masked slot gets weight exactly 0, but 0 * NaN is
# NaN, and fresh memory may hold NaN bit patterns.


def row_groups(lengths: list[int], q: int, overhead: int = GROUP_OVERHEAD) -> list[tuple[int, int, int]]:
    """Rows of these committed lengths, each attending over its tokens + q new ones -> contiguous
    groups (start, stop, span), span = the group's longest row + q, minimising the (row, slot) pairs
    attended plus `overhead` per group (dynamic programming over the cut points; B is small)."""
    B = len(lengths)
    best, cut = [0.0] + [float("inf")] * B, [0] * (B + 1)  # best[j]: rows 0..j-1 grouped
    for j in range(1, B + 1):
        span = 0
        for i in range(j - 1, -1, -1):  # last group = rows i..j-1
            span = max(span, lengths[i] + q)
            cost = best[i] + (j - i) * span + overhead
            if cost <= best[j]:  # ties: the longer group (fewer calls)
                best[j], cut[j] = cost, i
    groups, j = [], B
    while j > 0:
        i = cut[j]
        groups.append((i, j, max(lengths[i:j]) + q))
        j = i
    return groups[::-1]


class RaggedCache(Cache):
    group_overhead = GROUP_OVERHEAD  # tests set 0: every row of its own length a group

    def __init__(self, dtype: torch.dtype | None = None, layout: AttentionLayout | None = None):
        """dtype: of the buffers (None: the model's keys'); attention runs in it (attention.py).
        layout: how the model's layers attend (families.attention_layout; None: every layer fully,
        boolean masks): `mask` gives each kind of layer its own mask."""
        super().__init__(layers=[])
        self.kv_dtype = dtype
        self.layout = layout
        self.keys: list[torch.Tensor] = []  # per layer [rows_cap, kv, slots_cap, hd]
        self.values: list[torch.Tensor] = []
        self.lengths = torch.zeros(0, dtype=torch.long)  # [B] committed tokens per row, longest first
        self._slots: torch.Tensor | None = None  # [B,q] where this forward writes
        self._span = 0  # S: slots this forward attends over
        self.groups: list[tuple[int, int, int, int]] = []  # this forward's (start, stop, lo, hi) row groups

    @property
    def rows(self) -> int:
        return int(self.lengths.numel())

    # ---- a forward ------------------------------------------------------------------------------
    def begin(self, q: int) -> int:
        """Before a forward over q new tokens per row; returns S, the attended span."""
        n_max = int(self.lengths.max())
        self._grow_slots(n_max + q)
        self._slots = self.lengths[:, None] + torch.arange(q)  # [B,q]
        self._span = n_max + q
        self._row0 = int(self.lengths[0])  # row 0's committed tokens: a lone row's write slot, per layer
        spans = row_groups(self.lengths.tolist(), q, self.group_overhead)
        self.groups = [(a, b, 0, span) for a, b, span in spans]  # each group's slots [0, span)
        return self._span

    def mask(self, ancestors: torch.Tensor):
        """ancestors bool [B,q,q] (A[b,i,j]: new token j is token i or on its path) -> bool [B,1,q,S]:
        every new token sees its row's committed slots and its own path among the new ones. With a
        layout: each kind of layer's (a sliding window's or a chunk's keys only), one mask where every
        layer attends alike, else {layer type: mask} (transformers' per-type masks); additive
        (0 / fp32 min) where the layout says the kernel adds the mask."""
        B, q, _ = ancestors.shape
        allowed = torch.arange(self._span)[None, None, :] < self.lengths[:, None, None]  # [B,1,S]
        allowed = allowed.expand(B, q, self._span).clone()  # [B,q,S]
        allowed.scatter_(2, self._slots[:, None, :].expand(B, q, q), ancestors)
        if self.layout is None:
            return allowed[:, None]
        masks = {kind: self._layer_mask(allowed, ancestors, kind) for kind in dict.fromkeys(self.layout.kinds)}
        return next(iter(masks.values())) if len(masks) == 1 else masks

    def _layer_mask(self, allowed: torch.Tensor, ancestors: torch.Tensor, kind: str) -> torch.Tensor:
        """allowed bool [B,q,S] -> this kind of layer's mask [B,1,q,S]. Positions: committed slot s
        holds position s (rows start at slot 0); new token i sits at its row's length + its depth."""
        lay = self.layout
        if kind == SLIDING or kind == CHUNKED:
            qpos = self.lengths[:, None] + ancestors.sum(-1) - 1  # [B,q]: depth = ancestors on the path - 1
            kpos = torch.arange(self._span)[None].expand(len(qpos), -1).clone()  # [B,S]
            kpos.scatter_(1, self._slots, qpos)
            if kind == SLIDING:  # transformers' sliding_window_overlay: k > p - window
                allowed = allowed & (kpos[:, None, :] > qpos[:, :, None] - lay.window)
            else:  # chunked_overlay: the query's own chunk
                allowed = allowed & (kpos[:, None, :] // lay.chunk == qpos[:, :, None] // lay.chunk)
        if lay.additive:
            return torch.zeros(allowed.shape).masked_fill_(~allowed, torch.finfo(torch.float32).min)[:, None]
        return allowed[:, None]

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        """(kv length, kv offset) for the masks transformers builds itself (one row's one token, no
        mask given): the span begin() opened, from slot 0."""
        if self._span:
            return self._span, 0
        return (int(self.lengths.max()) if self.rows else 0) + query_length, 0

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        """key/value_states [B,kv,q,hd] -> this layer's keys/values over the span, [B,kv,S,hd]."""
        k_buf, v_buf = self.keys[layer_idx], self.values[layer_idx]
        B, q = self._slots.shape
        if B == 1:  # one row: a slice write (which converts the dtype), no index tensors
            n = self._row0
            k_buf[:1, :, n:n + q] = key_states
            v_buf[:1, :, n:n + q] = value_states
        else:  # [B,1] x [B,q] advanced indices around a slice: the value's layout is [B,q,kv,hd]
            key_states, value_states = key_states.to(k_buf.dtype), value_states.to(v_buf.dtype)
            rows = torch.arange(B)[:, None]
            k_buf[rows, :, self._slots] = key_states.transpose(1, 2)
            v_buf[rows, :, self._slots] = value_states.transpose(1, 2)
        return k_buf[:B, :, :self._span], v_buf[:B, :, :self._span]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return int(self.lengths.max()) if self.rows else 0

    # ---- bookkeeping between forwards -----------------------------------------------------------
    def keep(self, row: int, path: list[int]) -> None:
        """After a verify forward, row `row` keeps new tokens `path` (increasing, path[0] = 0, the
        root): they move to slots n .. n+len(path)-1 and become committed."""
        n = int(self.lengths[row])
        if path != list(range(len(path))):  # a chain's accepted prefix is already in place
            src = torch.tensor(path) + n
            for buf in self.keys + self.values:
                buf[row, :, n:n + len(path)] = buf[row, :, src]  # RHS gathers (copies) first
        self.lengths[row] = n + len(path)

    def add_row(self, cache, n: int) -> int:
        """Copy a prefilled batch-1 transformers cache (n tokens) in, after the rows at least as long
        (the shorter ones move down one); -> its index."""
        B = self.rows
        if not self.keys:  # first row ever: buffers shaped like the source's layers
            for layer in cache.layers:
                _, kv, _, hd = layer.keys.shape
                shape = (1, kv, slot_capacity(n), hd)
                self.keys.append(cache_buffer(layer.keys, shape, self.kv_dtype))
                self.values.append(cache_buffer(layer.values, shape, self.kv_dtype))
        self._grow_rows(B + 1)
        self._grow_slots(n)
        shorter = (self.lengths < n).nonzero()
        row = int(shorter[0]) if len(shorter) else B
        for src in range(B - 1, row - 1, -1):  # from the end, so no row is overwritten before it moved
            self._move(src, src + 1)
        for i, layer in enumerate(cache.layers):
            self.keys[i][row, :, :n] = layer.keys[0, :, :n]
            self.values[i][row, :, :n] = layer.values[0, :, :n]
        self.lengths = torch.cat([self.lengths[:row], torch.tensor([n]), self.lengths[row:]])
        return row

    def drop_row(self, row: int) -> None:
        """Free `row`: the rows after it move up one (row b+1 becomes row b). The last row out frees
        the buffers. They are as wide as the longest prompt since they were made; kept, they hold that
        memory and leave every later short request's attention on views too narrow to read whole
        (attention.py: a copy per layer), ~9% slower per token after one long prompt."""
        for src in range(row + 1, self.rows):
            self._move(src, src - 1)
        self.lengths = torch.cat([self.lengths[:row], self.lengths[row + 1:]])
        if not self.rows:
            self.keys, self.values = [], []

    def _move(self, src: int, dst: int) -> None:
        n = int(self.lengths[src])
        for buf in self.keys + self.values:
            buf[dst, :, :n] = buf[src, :, :n]

    def _grow_rows(self, need: int) -> None:
        if self.keys and self.keys[0].shape[0] < need:
            self._realloc(rows=max(need, 2 * self.keys[0].shape[0]), slots=self.keys[0].shape[2])

    def _grow_slots(self, need: int) -> None:
        if self.keys and self.keys[0].shape[2] < need:
            self._realloc(rows=self.keys[0].shape[0], slots=slot_capacity(need))

    def _realloc(self, rows: int, slots: int) -> None:
        """Fresh buffers [rows, kv, slots, hd] holding what the current rows hold."""
        B, n = self.rows, int(self.lengths.max()) if self.rows else 0
        for bufs in (self.keys, self.values):
            for i, old in enumerate(bufs):
                new = cache_buffer(old, (rows, old.shape[1], slots, old.shape[3]))
                new[:B, :, :n] = old[:B, :, :n]
                bufs[i] = new
