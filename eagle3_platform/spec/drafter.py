"""Tree drafting with an EAGLE-3 head and its own KV cache (docs/ARCHITECTURE.md §5, EAGLE-2 style tree).

Draft entries mirror the target's committed tokens: entry t reads (g_t, emb(x_{t+1})) at RoPE position
t and its output predicts x_{t+2} (the training alignment). Invariant between verify steps: the draft
holds entries for the n tokens in the target's KV cache (appended, or queued until the next draft)
and `h_last` (entry n-1's output) predicts the token after the pending root x_n. The head attends the
whole prefix, as SGLang's EAGLE-3 worker does, so its drafts and τ here are the ones SGLang gets.

Drafting (num_steps = d, eagle_topk = k):
  step 1: top-k of the draft's distribution after the root → k depth-1 nodes (the frontier);
  step s>1: run the frontier as k new entries (each sees the committed prefix + its own ancestors'
    entries), take top-k children per node (k·k candidates, cumulative log-prob = parent + child),
    the best k of them become the next frontier;
  finally keep the best (num_draft_tokens - 1) nodes of the pool by cumulative log-prob. Children never
  score above their parent and the sort is stable with parents created first, so the kept set is
  closed under ancestors (a valid tree). With k = 1 this is a chain of d tokens.
"""
from __future__ import annotations

import math
from typing import Protocol

import torch

from eagle3_platform.spec.config import SpecConfig
from eagle3_platform.spec.head_forward import head_backbone, head_logits
from eagle3_platform.spec.tree import Tree, additive_mask


class Drafter(Protocol):
    """What the engine needs from a proposer (Eagle3 head, or a test oracle)."""

    def prefill(self, aux: torch.Tensor, next_tokens: torch.Tensor) -> None: ...
    # aux [1,P,3H] target features of tokens 0..P-1; next_tokens [P] = x_1..x_P (shifted by one)

    def propose(self, root: int, max_tokens: int | None = None) -> Tree: ...
    # a tree rooted at `root` with at most max_tokens draft nodes (None: as many as the settings say)

    def commit(self, aux: torch.Tensor, next_tokens: torch.Tensor) -> None: ...
    # aux [1,m+1,3H] features of the root + accepted nodes; next_tokens [m+1] = accepted + bonus


class DraftKV:
    """Draft keys/values of B rows in buffers [B,n_kv,cap,hd] with room to grow: entries 0..n-1 are
    committed; `extend` writes new ones in place after the last written (the buffer doubles when
    full) instead of concatenating the whole cache per draft forward, `commit` keeps what was written,
    `rewind` drops it (a draft's speculative entries). Held in `dtype`: the engine's cache dtype, fp32
    where bf16 matmuls are slow (the head's attention then runs in fp32 over exact bf16 values)."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, n: int):
        self.keys, self.values = keys, values  # [B,n_kv,cap,hd]; slots past `end` are zeros or stale
        self.n = self.end = n

    @classmethod
    def empty(cls, rows: int, heads: int, head_dim: int, cap: int, dtype: torch.dtype) -> "DraftKV":
        keys = torch.zeros(rows, heads, cap, head_dim, dtype=dtype)  # zeros: padding is never NaN
        return cls(keys, torch.zeros_like(keys), 0)

    @property
    def k(self) -> torch.Tensor:  # [B,n_kv,n,hd], committed
        return self.keys[:, :, :self.n]

    @property
    def v(self) -> torch.Tensor:
        return self.values[:, :, :self.n]

    def extend(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v [B,n_kv,T,hd] at end..end+T-1 -> everything written, views [B,n_kv,end+T,hd]."""
        end = self.end + k.shape[2]
        if end > self.keys.shape[2]:
            self._grow(end)
        self.keys[:, :, self.end:end], self.values[:, :, self.end:end] = k, v
        self.end = end
        return self.keys[:, :, :end], self.values[:, :, :end]

    def commit(self) -> None:
        self.n = self.end

    def rewind(self) -> None:
        self.end = self.n

    def _grow(self, need: int) -> None:
        B, heads, cap, hd = self.keys.shape
        grown = DraftKV.empty(B, heads, hd, max(need, 2 * cap), self.keys.dtype)
        grown.keys[:, :, :self.end], grown.values[:, :, :self.end] = (t[:, :, :self.end] for t in
                                                                       (self.keys, self.values))
        self.keys, self.values = grown.keys, grown.values


class EagleDrafter:
    """Entries are appended lazily: `commit` only queues (aux, next tokens), and the queue runs as one
    draft forward when the next draft is asked for. A server step that verifies no draft (draft size
    0) then costs the drafter nothing, and entries queued over several steps run together.
    kv_dtype: the dtype of the draft KV (DraftKV; None = the head's)."""

    def __init__(self, draft, cfg: SpecConfig, kv_dtype: torch.dtype | None = None):
        self.draft, self.cfg, self.kv_dtype = draft, cfg, kv_dtype
        self.kv: DraftKV | None = None  # committed draft KV, n entries
        self.h_last = None  # [1,1,H]
        self._queued: list[tuple[torch.Tensor, torch.Tensor]] = []  # (aux [1,T,3H], next tokens [T])

    @property
    def n(self) -> int:
        return 0 if self.kv is None else self.kv.n

    @property
    def k(self) -> torch.Tensor | None:  # [1,n_kv,n,hd]
        return None if self.kv is None else self.kv.k

    @property
    def v(self) -> torch.Tensor | None:
        return None if self.kv is None else self.kv.v

    def prefill(self, aux, next_tokens):
        self.kv = None
        self._queued = [(aux, next_tokens)]

    def commit(self, aux, next_tokens):
        self._queued.append((aux, next_tokens))

    def catch_up(self) -> None:
        """Append the backlog, leaving only the last verify step's entries queued: the prompt, or the
        steps verified without a draft. Prefill-like work a server times apart from the step, so a
        draft size is charged only what drafting at every step costs (spec/policy.py)."""
        keep = 0 if self.kv is None and len(self._queued) == 1 else 1  # a lone prompt: all backlog
        backlog = len(self._queued) - keep
        if backlog > 0:
            self._queued, last = self._queued[:backlog], self._queued[backlog:]
            self._append_queued()
            self._queued = last

    def _queue_tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The queued entries as one (aux [1,T,3H], next tokens [T])."""
        return torch.cat([a for a, _ in self._queued], dim=1), torch.cat([t for _, t in self._queued])

    @torch.no_grad()
    def _append_queued(self):
        """Append entries n..n+T-1 = (g, emb(next token)), causal over the committed prefix."""
        if not self._queued:
            return
        aux, next_tokens = self._queue_tensors()  # [1,T,3H], [T]
        self._queued = []
        d, t = self.draft, aux.shape[1]
        pos = torch.arange(self.n, self.n + t)[None]  # [1,T]
        if self.kv is None:  # room for the prompt and the next few hundred entries
            c = d.cfg
            self.kv = DraftKV.empty(1, c.num_key_value_heads, c.head_dim, t + 256,
                                    self.kv_dtype or d.embed_tokens.weight.dtype)
        self.kv.rewind()
        h, _ = head_backbone(d, next_tokens[None], d.project(aux), pos, None, self.kv)  # writes n..n+T-1
        self.kv.commit()
        self.h_last = h[:, -1:]  # [1,1,H]

    @torch.no_grad()
    def propose(self, root: int, max_tokens: int | None = None) -> Tree:
        self._append_queued()
        budget = draft_budget(self.cfg, max_tokens)
        if self.cfg.eagle_topk == 1:
            return propose_chains([self], [root], budget)[0]
        return self._propose_tree(root, budget)

    def _propose_tree(self, root: int, budget: int) -> Tree:
        pool = _Pool()
        k = self.cfg.eagle_topk
        logp = _log_probs(self.draft, self.h_last)[0]  # [1,Vd] -> [Vd]
        top = logp.topk(k)
        frontier = pool.add(parents=[-1] * k, draft_ids=top.indices, scores=top.values)
        hidden = self.h_last.expand(1, k, -1)  # [1,k,H]: every depth-1 node's parent is the root
        try:
            for step in range(1, min(self.cfg.num_steps, budget)):  # depth > budget cannot be kept
                h, _ = self._run_frontier(pool, frontier, hidden, step)  # tree entries after the prefix
                pool.entry_of.update({node: pool.n_entries + i for i, node in enumerate(frontier)})
                pool.n_entries += len(frontier)
                frontier, hidden = self._expand(pool, frontier, h, k)
        finally:
            self.kv.rewind()  # the tree's entries are speculative
        return pool.to_tree(root, budget, self.draft, self.cfg.min_draft_prob)

    def _run_frontier(self, pool, frontier, hidden, step):
        """One draft forward over the frontier (depth `step` nodes), written as new entries after the
        committed prefix and the tree's earlier entries."""
        d, n = self.draft, self.n
        ids = d.to_target_ids(pool.draft_ids[frontier])[None]  # [1,F] target ids
        pos = torch.full((1, len(frontier)), n - 1 + step)  # a depth-s node sits at pos-1+s
        allowed = torch.zeros(len(frontier), n + pool.n_entries + len(frontier), dtype=torch.bool)
        allowed[:, :n] = True  # the committed prefix
        for row, node in enumerate(frontier):
            for a in pool.ancestors(node):  # earlier tree entries on this node's path
                allowed[row, n + pool.entry_of[a]] = True
            allowed[row, n + pool.n_entries + row] = True  # itself
        mask = additive_mask(allowed, hidden.dtype)[None, None]  # [1,1,F,n+E+F]
        return head_backbone(d, ids, hidden, pos, mask, self.kv)

    def _expand(self, pool, frontier, h, k):
        """Top-k children per frontier node; the best k (cumulative) become the next frontier."""
        logp = _log_probs(self.draft, h)  # [F,Vd]
        top = logp.topk(k, dim=-1)  # [F,k]
        parent_rows = torch.arange(len(frontier)).repeat_interleave(k)  # [F*k]
        scores = (pool.scores[frontier][:, None] + top.values).reshape(-1)  # [F*k]
        parents = [frontier[r] for r in parent_rows.tolist()]
        added = pool.add(parents, top.indices.reshape(-1), scores)
        best = scores.topk(min(k, scores.numel())).indices.sort().values  # keep creation order
        return [added[i] for i in best.tolist()], h[:, parent_rows[best]]  # hidden [1,k,H]


def draft_budget(cfg: SpecConfig, max_tokens: int | None) -> int:
    """Draft nodes a proposal may hold: the settings' size, capped by a server's per-step choice."""
    budget = cfg.num_draft_tokens - 1
    return budget if max_tokens is None else min(max_tokens, budget)


def propose_all(drafters: list, roots: list[int], max_tokens: int | None) -> list[Tree]:
    """Drafts for the rows of a batch: chains of EagleDrafters sharing a head run as one batched
    draft forward per depth; anything else (trees, test drafters) drafts row by row. A drafter with a
    lookup branch (lookup.py) drafts its head's tree here and adds the branch after."""
    heads = [getattr(d, "head", d) for d in drafters]
    first = heads[0] if heads else None
    if len(heads) > 1 and all(isinstance(d, EagleDrafter) and d.cfg.eagle_topk == 1
                              and d.draft is first.draft and d.cfg == first.cfg for d in heads):
        trees = propose_chains(heads, roots, draft_budget(first.cfg, max_tokens))
    else:
        trees = [h.propose(r, max_tokens) for h, r in zip(heads, roots)]
    return [d.extend(t, max_tokens) if d is not h else t for d, h, t in zip(drafters, heads, trees)]


@torch.no_grad()
def propose_chains(drafters: list[EagleDrafter], roots: list[int], budget: int) -> list[Tree]:
    """topk = 1 for B rows at once: each depth is one draft forward over the B rows' newest entries
    (each sees its own committed prefix, padded to the longest, and its own chain so far). Same tokens
    as the tree code with k = 1 (argmax of the logits = argmax of the log-probs; the first `budget`
    steps are the best ones); a row's chain is cut where its path's draft probability falls below
    min_draft_prob."""
    _append_queued_many(drafters)
    d, cfg = drafters[0].draft, drafters[0].cfg
    steps = min(cfg.num_steps, budget)
    pos = torch.tensor([x.n for x in drafters])  # [B] the next entry's position
    past, allowed = _padded_past(drafters, room=steps)  # DraftKV over [B,kv,P,hd], bool [B,P] | None
    try:
        picks = _draft_chains(d, cfg, past, allowed, pos, torch.cat([x.h_last for x in drafters]), steps)
    finally:
        past.rewind()  # the chains' entries are speculative (one row: its own cache)
    trees = []
    for b, root in enumerate(roots):
        kept = [p[b] for p, ok in picks if ok[b]]  # alive only shrinks: a prefix of the chain
        tokens = d.to_target_ids(torch.stack(kept)) if kept else torch.empty(0, dtype=torch.long)
        trees.append(Tree(torch.cat([torch.tensor([root]), tokens.long()]), torch.arange(-1, len(kept))))
    return trees


def _draft_chains(d, cfg, past: "DraftKV", allowed, pos, h, steps: int) -> list:
    """Depth by depth over B rows -> [(draft ids [B], alive [B])] per depth; h [B,1,H] the rows'
    h_last, pos [B] their next entries' positions. Each depth's entries are written into `past` after
    the rows' prefixes."""
    B = h.shape[0]
    picks, alive, path_logp = [], torch.ones(B, dtype=torch.bool), torch.zeros(B)
    for step in range(1, steps + 1):
        logits = head_logits(d, h)[:, -1].float()  # [B,Vd]
        pick = logits.argmax(-1)  # [B] draft ids of the depth-`step` nodes
        if cfg.min_draft_prob > 0:
            path_logp += torch.log_softmax(logits, -1).gather(1, pick[:, None])[:, 0]
            alive &= path_logp >= math.log(cfg.min_draft_prob)
        picks.append((pick, alive.clone()))
        if step == steps or not alive.any():
            break
        mask = None
        if allowed is not None:  # the new entry sees its row's prefix and chain, and itself
            allowed = torch.cat([allowed, torch.ones(B, 1, dtype=torch.bool)], 1)  # [B,P+s]
            mask = additive_mask(allowed[:, None, None, :], h.dtype)  # [B,1,1,P+s]
        ids = d.to_target_ids(pick)[:, None]  # [B,1]
        h, _ = head_backbone(d, ids, h, (pos - 1 + step)[:, None], mask, past)
    return picks


MAX_BATCHED_APPEND = 16  # queued entries per row appended in one batched forward; longer ones alone


def _append_queued_many(drafters: list[EagleDrafter]) -> None:
    """Each drafter's queued entries, the short queues of all rows as one padded draft forward (a
    step's root + accepted nodes); a prompt (or a long backlog) runs alone, not padded to."""
    short = [x for x in drafters if x._queued and x.kv is not None
             and sum(t.numel() for _, t in x._queued) <= MAX_BATCHED_APPEND]
    for x in drafters:
        if x._queued and x not in short:
            x._append_queued()
    if len(short) < 2:
        for x in short:
            x._append_queued()
        return
    d, B = short[0].draft, len(short)
    queued = [x._queue_tensors() for x in short]
    aux = [a[0] for a, _ in queued]  # [T_b,3H]
    toks = [t for _, t in queued]  # [T_b]
    T = torch.tensor([len(t) for t in toks])
    start = torch.tensor([x.n for x in short])
    aux = torch.nn.utils.rnn.pad_sequence(aux, batch_first=True)  # [B,Tm,3H]
    toks = torch.nn.utils.rnn.pad_sequence(toks, batch_first=True)  # [B,Tm]
    Tm = toks.shape[1]
    past, prefix = _padded_past(short, room=Tm)  # prefix bool [B,P]
    j = torch.arange(Tm)
    causal = (j[None, :] <= j[:, None]) & ((j[None, None, :] < T[:, None, None]) | (j[None, :] == j[:, None]))
    allowed = torch.cat([prefix[:, None, :].expand(B, Tm, -1), causal], dim=2)  # [B,Tm,P+Tm]
    pos = start[:, None] + j[None, :]  # [B,Tm]; a padding entry's position is never read
    h, (k, v) = head_backbone(d, toks, d.project(aux), pos, additive_mask(allowed[:, None], aux.dtype), past)
    for b, x in enumerate(short):
        t = int(T[b])
        x.kv.extend(k[b:b + 1, :, :t], v[b:b + 1, :, :t])
        x.kv.commit()
        x.h_last, x._queued = h[b:b + 1, t - 1:t], []


def _padded_past(drafters: list[EagleDrafter], room: int) -> tuple[DraftKV, torch.Tensor | None]:
    """Committed draft KV of B rows -> one DraftKV over [B,kv,P,hd] (P = the longest; zeros after a
    row's own entries, never NaN) with room for `room` more entries, and which slots are real, bool
    [B,P]; one row: its own DraftKV (the caller rewinds it), None."""
    if len(drafters) == 1:
        return drafters[0].kv, None
    n = torch.tensor([x.n for x in drafters])
    P, (_, kv, _, hd) = int(n.max()), drafters[0].kv.keys.shape
    past = DraftKV.empty(len(drafters), kv, hd, P + room, drafters[0].kv.keys.dtype)
    for b, x in enumerate(drafters):
        past.keys[b, :, :x.n], past.values[b, :, :x.n] = x.kv.k[0], x.kv.v[0]
    past.n = past.end = P
    return past, torch.arange(P)[None, :] < n[:, None]


def _log_probs(draft, h):
    """[1,T,H] -> [T,Vd] fp32 log-probs over the draft vocab."""
    return torch.log_softmax(head_logits(draft, h)[0].float(), dim=-1)


class _Pool:
    """All drafted candidates, in creation order (parents before children)."""

    def __init__(self):
        self.parents: list[int] = []  # pool index of the parent, -1 = root
        self.draft_ids = torch.empty(0, dtype=torch.long)
        self.scores = torch.empty(0)
        self.entry_of: dict[int, int] = {}  # pool node -> index of its draft entry (expanded nodes)
        self.n_entries = 0

    def add(self, parents, draft_ids, scores) -> list[int]:
        start = len(self.parents)
        self.parents += list(parents)
        self.draft_ids = torch.cat([self.draft_ids, draft_ids.long()])
        self.scores = torch.cat([self.scores, scores.float()])
        return list(range(start, len(self.parents)))

    def ancestors(self, node: int) -> list[int]:
        out, p = [], self.parents[node]
        while p != -1:
            out.append(p)
            p = self.parents[p]
        return out

    def to_tree(self, root: int, budget: int, draft, min_prob: float = 0.0) -> Tree:
        """Best `budget` nodes by cumulative log-prob (stable: ancestors win ties) + the root, without
        nodes whose path probability is below min_prob (a child never scores above its parent, so
        what is left is still closed under ancestors)."""
        order = torch.sort(self.scores, descending=True, stable=True).indices[:budget]
        if min_prob > 0:
            order = order[self.scores[order] >= math.log(min_prob)]
        keep = sorted(order.tolist())  # creation order: parents precede children
        index = {node: i + 1 for i, node in enumerate(keep)}  # pool node -> tree node (root = 0)
        parents = [-1] + [index[self.parents[n]] if self.parents[n] != -1 else 0 for n in keep]
        tokens = draft.to_target_ids(self.draft_ids[keep]) if keep else torch.empty(0, dtype=torch.long)
        return Tree(torch.cat([torch.tensor([root]), tokens.long()]), torch.tensor(parents))
