"""Draft vocabulary (docs/ARCHITECTURE.md §5): the Vd most frequent response (loss-masked) tokens over
all partitions.

d2t int64 [Vd]: d2t[i] = target_id(i) - i  (SGLang: hot_token_id = d2t + arange(Vd))
t2d bool  [V]:  t2d[j] = target id j is in the draft vocab
Draft ids are assigned in ascending target-id order, so d2t is non-decreasing and ≥ 0.
"""
from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from eagle3_platform.store.records import atomic_write, write_json_atomic


def count_response_tokens(feature_dirs: Sequence[str | Path], vocab_size: int,
                          expect: dict | None = None) -> torch.Tensor:
    """int64 [V] counts of loss-masked tokens over all shards of the dirs. Reads only input_ids and
    loss_mask (the hidden states are never touched); shards are validated by ShardDataset first."""
    from eagle3_platform.features.shards import ShardDataset

    ds = ShardDataset(list(feature_dirs), expect=expect)
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for path in ds.shard_paths:
        with safe_open(str(path), framework="pt") as f:
            ids = f.get_tensor("input_ids").long()        # [N]
            mask = f.get_tensor("loss_mask").bool()       # [N]
        resp = ids[mask]
        if resp.numel() and int(resp.max()) >= vocab_size:
            raise ValueError(f"shard {path}: token id {int(resp.max())} >= target vocab size {vocab_size}")
        counts += torch.bincount(resp, minlength=vocab_size)
    return counts


def build_vocab(token_counts, vocab_size: int, draft_vocab_size: int):
    """token_counts: int tensor [V] (or {id: count}) → (d2t int64 [Vd], t2d bool [V], stats).
    Top Vd by count (ties by lower id); when fewer than Vd tokens occur, pad with the lowest unused ids."""
    if not 0 < draft_vocab_size <= vocab_size:
        raise ValueError(f"draft vocab size {draft_vocab_size} must be in 1..{vocab_size}")
    counts = _as_counts(token_counts, vocab_size)                    # [V]
    seen = int((counts > 0).sum())
    # stable sort by -count keeps ascending id among ties
    order = torch.sort(-counts, stable=True).indices                 # [V]
    chosen = order[:min(seen, draft_vocab_size)]
    n_pad = draft_vocab_size - chosen.numel()
    if n_pad:
        unused = torch.ones(vocab_size, dtype=torch.bool)
        unused[chosen] = False
        chosen = torch.cat([chosen, unused.nonzero().flatten()[:n_pad]])
    target_ids = torch.sort(chosen).values                           # [Vd] ascending
    d2t = target_ids - torch.arange(draft_vocab_size)                # invariant: d2t[i] + i = target id
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[target_ids] = True
    total = int(counts.sum())
    stats = {"vocab_size": vocab_size, "draft_vocab_size": draft_vocab_size,
             "response_tokens": total, "distinct_response_tokens": seen, "padded_ids": n_pad,
             "coverage": (int(counts[target_ids].sum()) / total) if total else 0.0}
    check_vocab(d2t, t2d)
    return d2t, t2d, stats


def _as_counts(token_counts, vocab_size: int) -> torch.Tensor:
    if isinstance(token_counts, dict):
        c = torch.zeros(vocab_size, dtype=torch.int64)
        for k, v in token_counts.items():
            c[int(k)] += int(v)
        return c
    c = torch.as_tensor(token_counts, dtype=torch.int64)
    if c.shape != (vocab_size,):
        raise ValueError(f"token counts shape {tuple(c.shape)} != ({vocab_size},)")
    return c


def check_vocab(d2t: torch.Tensor, t2d: torch.Tensor) -> None:
    """d2t/t2d describe the same set of Vd distinct target ids."""
    if d2t.dtype != torch.int64 or t2d.dtype != torch.bool or d2t.dim() != 1 or t2d.dim() != 1:
        raise ValueError("d2t must be int64 [Vd] and t2d bool [V]")
    tid = d2t + torch.arange(d2t.numel())
    if tid.numel() and (int(tid.min()) < 0 or int(tid.max()) >= t2d.numel()):
        raise ValueError("d2t maps outside the target vocab")
    if int(t2d.sum()) != d2t.numel() or tid.unique().numel() != d2t.numel() or not bool(t2d[tid].all()):
        raise ValueError("d2t and t2d disagree (not the same set of distinct target ids)")


def save_vocab(path: str | Path, d2t, t2d, stats: dict) -> dict:
    """Atomic: <path> (safetensors d2t, t2d) + <path>.json (stats)."""
    path = Path(path)
    atomic_write(path, lambda tmp: save_file({"d2t": d2t.contiguous(), "t2d": t2d.contiguous()}, str(tmp),
                                             metadata={"stats": json.dumps(stats)}))
    stats_path = path.with_name(path.name + ".json")
    write_json_atomic(stats_path, stats, indent=2)
    return {"vocab": str(path), "stats": str(stats_path), **stats}


def load_vocab(path: str | Path):
    """-> (d2t, t2d, stats)."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no draft vocab at {path}")
    t = load_file(str(path))
    with safe_open(str(path), framework="pt") as f:
        stats = json.loads((f.metadata() or {}).get("stats", "{}"))
    check_vocab(t["d2t"], t["t2d"])
    return t["d2t"], t["t2d"], stats


def vocab_from_features(feature_dirs, vocab_size: int, draft_vocab_size: int, expect=None):
    counts = count_response_tokens(feature_dirs, vocab_size, expect)
    if not int(counts.sum()):  # a vocab of padding ids only would look valid and mean nothing
        raise ValueError(f"no response tokens in feature dir(s) {', '.join(map(str, feature_dirs))}: "
                         "cannot build a draft vocab (did extract produce any samples?)")
    return build_vocab(counts, vocab_size, min(draft_vocab_size, vocab_size))
