"""Warm start: a new head begins from a trained one (`eagle3 train --init-from DRAFT_DIR`).

Why: when the data grows (`eagle3 run --prompts-per-workload`), training from scratch repeats every
step the published head already took. A warm start keeps its weights and trains on the grown data.
The draft vocabulary is rebuilt on the grown data, so lm_head rows are matched by target token id:
a token in both vocabularies keeps its trained row, a new token keeps the fresh (seeded) init.
"""
from __future__ import annotations

from pathlib import Path

import torch

from eagle3_platform.draft.model import DRAFT_WEIGHTS, DraftConfig, Eagle3Draft, read_draft_dir
from eagle3_platform.store.records import sha256_file

VOCAB_KEYS = ("lm_head.weight", "d2t", "t2d")  # matched by token id, not copied


def init_sha256(init_dir) -> str:
    """Identity of a warm start (its weights file): part of a training run's fingerprint."""
    return sha256_file(Path(init_dir) / DRAFT_WEIGHTS)


def read_init(init_dir, expect: dict) -> tuple[DraftConfig, dict[str, torch.Tensor]]:
    """(config, head weights) of a trained draft dir, checked against the target identity `expect`."""
    meta, sd = read_draft_dir(init_dir)
    if meta.get("target") != expect:
        raise ValueError(f"--init-from {init_dir} was trained for another target or capture layers "
                         f"(weights {(meta.get('target') or {}).get('weights_hash', '?')[:12]}); a warm start needs the same one")
    return DraftConfig.from_dict(meta["draft"]), sd


def warm_start(draft: Eagle3Draft, init_dir, expect: dict) -> dict:
    """Copy a trained head's weights into `draft` (whose vocab is already set). Every tensor but the
    vocab-indexed ones must have the same shape; lm_head rows move with their target token.
    Returns {"init_from", "init_sha256", "lm_head_rows_kept", "lm_head_rows_new"}."""
    cfg, sd = read_init(init_dir, expect)
    geometry = lambda c: {k: v for k, v in c.to_dict().items() if k != "draft_vocab_size"}
    if geometry(cfg) != geometry(draft.cfg):
        diff = sorted(k for k, v in geometry(cfg).items() if geometry(draft.cfg).get(k) != v)
        raise ValueError(f"--init-from {init_dir}: head geometry differs ({', '.join(diff)})")
    own = draft.head_state_dict()
    if set(sd) != set(own):
        raise ValueError(f"--init-from {init_dir}: other tensors ({sorted(set(sd) ^ set(own))})")
    with torch.no_grad():
        for name, t in sd.items():
            if name not in VOCAB_KEYS:
                own[name].copy_(t)
        old_ids = sd["d2t"].long() + torch.arange(sd["d2t"].numel())      # [Vd_old] target ids
        new_ids = draft.to_target_ids(torch.arange(draft.cfg.draft_vocab_size))  # [Vd] target ids
        row_of = torch.full((draft.cfg.vocab_size,), -1, dtype=torch.long)
        row_of[old_ids] = torch.arange(old_ids.numel())                    # target id -> old row
        old_row = row_of[new_ids]                                          # [Vd], -1 = new token
        kept = old_row >= 0
        draft.lm_head.weight[kept] = sd["lm_head.weight"].to(draft.lm_head.weight.dtype)[old_row[kept]]
    return {"init_from": str(init_dir), "init_sha256": init_sha256(init_dir),
            "lm_head_rows_kept": int(kept.sum()), "lm_head_rows_new": int((~kept).sum())}
