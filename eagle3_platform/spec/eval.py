"""`eagle3 eval`: acceptance length and decode speed of a draft head on prompt records, per workload,
optionally checking losslessness against the target's own transformers greedy decoding
(`generate(do_sample=False)` on the checkpoint as transformers loads it: its own attention kernel and
forward, none of the engine's), the reference a user trusts. The speedup is against the engine's plain
decoding, the same code without the head.

Prompts are PromptRecord JSONL (store/records.py). Each conversation is rendered with the target's chat
template + generation prompt up to and including its FIRST user turn (system turns before it kept):
multi-turn records are evaluated on their opening turn only, since later turns would need the
target's own earlier answers.
"""
from __future__ import annotations

import sys
import time
from collections import defaultdict
from pathlib import Path

from eagle3_platform.draft.metrics import acceptance_length
from eagle3_platform.spec.config import PRESETS, SpecConfig
from eagle3_platform.spec.engine import SpecEngine
from eagle3_platform.store.records import PromptRecord, read_jsonl


def first_turn(record: PromptRecord) -> list[dict]:
    """Messages up to and including the first user turn."""
    out = []
    for m in record.messages:
        out.append({"role": m.role, "content": m.content})
        if m.role == "user":
            return out
    raise ValueError(f"prompt record {record.id} has no user turn")


def load_prompts(path: str | Path, tokenizer, limit: int | None = None) -> list[tuple[PromptRecord, list[int]]]:
    from eagle3_platform.data.chat import render_prompt

    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"prompts file {path} not found")
    out = []
    for row in read_jsonl(path):
        rec = PromptRecord.model_validate(row)
        out.append((rec, render_prompt(tokenizer, first_turn(rec))))
        if limit is not None and len(out) >= limit:
            break
    if not out:
        raise ValueError(f"no prompt records in {path}")
    return out


def _run(engine: SpecEngine, ids: list[int], max_new_tokens: int, temperature: float, seed: int):
    t0 = time.perf_counter()
    tokens, stats = engine.generate(ids, max_new_tokens, temperature=temperature, seed=seed)
    return tokens, dict(stats, wall_s=time.perf_counter() - t0)


def _summarise(rows: list[dict]) -> dict:
    """τ pooled over prompts (Σ decoded tokens / Σ verify steps), tok/s = Σ tokens / Σ wall time."""
    gen = sum(r["generated_tokens"] for r in rows)
    steps = sum(r["verify_steps"] for r in rows)
    decoded = sum(max(0, r["generated_tokens"] - 1) for r in rows)
    wall = sum(r["wall_s"] for r in rows)
    out = {"prompts": len(rows), "generated_tokens": gen, "verify_steps": steps,
           "acceptance_length": acceptance_length(decoded, steps) if steps else 1.0,
           "tokens_per_s": gen / wall if wall else 0.0}
    if all("baseline_wall_s" in r for r in rows):
        base_wall = sum(r["baseline_wall_s"] for r in rows)
        base_gen = sum(r["baseline_tokens"] for r in rows)
        out["baseline_tokens_per_s"] = base_gen / base_wall if base_wall else 0.0
        out["speedup"] = out["tokens_per_s"] / out["baseline_tokens_per_s"] if base_gen else 0.0
        out["lossless_mismatches"] = sum(not r["lossless"] for r in rows)
    return out


def reference_model(target_dir, target):
    """The target as transformers alone loads it (its default attention, plain linears) in the
    engine's dtype; a target held only in memory (tests) is its own reference."""
    from eagle3_platform.model.families import causal_lm_class

    if target_dir is None:
        return target.model
    dtype = next(target.model.parameters()).dtype
    return causal_lm_class(target.model.config).from_pretrained(target_dir, dtype=dtype).eval()


def reference_greedy(model, ids: list[int], max_new_tokens: int, eos_ids: set[int]) -> list[int]:
    """transformers' greedy decoding of ids: the new tokens, up to and including the first eos."""
    import torch

    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=sorted(eos_ids),
                             pad_token_id=min(eos_ids) if eos_ids else 0)
    new = out[0, len(ids):].tolist()
    end = next((j for j, t in enumerate(new) if t in eos_ids), None)
    return new if end is None else new[:end + 1]


def evaluate(target_dir, export_dir, prompts_path, cfg: SpecConfig = PRESETS["chain"],
             max_new_tokens: int = 64, verify_lossless: bool = False, limit: int | None = None,
             temperature: float = 0.0, seed: int = 0, target=None) -> dict:
    """Decode every prompt with the draft; returns overall + per-workload τ and tok/s (and, with
    verify_lossless, baseline tok/s, speedup and the number of outputs that differ from the target's
    own transformers greedy decoding — must be 0 at temperature 0)."""
    from eagle3_platform.draft.export import load_export
    from eagle3_platform.model.target import load_target

    if verify_lossless and temperature != 0:
        raise ValueError("--verify-lossless compares greedy outputs: use temperature 0")
    target = target or load_target(target_dir)
    draft = load_export(export_dir, target) if export_dir else None
    engine = SpecEngine(target, draft, cfg if draft is not None else PRESETS["baseline"])
    baseline = SpecEngine(target, None, PRESETS["baseline"]) if verify_lossless else None
    reference = reference_model(target_dir, target) if verify_lossless else None
    prompts = load_prompts(prompts_path, target.tokenizer, limit)
    rows = []
    for i, (rec, ids) in enumerate(prompts):
        tokens, stats = _run(engine, ids, max_new_tokens, temperature, seed + i)
        row = {"id": rec.id, "workload": rec.workload, **stats}
        if baseline is not None:
            plain, bstats = _run(baseline, ids, max_new_tokens, 0.0, seed + i)
            ref = reference_greedy(reference, ids, max_new_tokens, engine.eos_ids)
            row.update(lossless=ref == tokens, baseline_wall_s=bstats["wall_s"], baseline_tokens=len(plain),
                       first_mismatch=next((j for j, (a, b) in enumerate(zip(tokens, ref)) if a != b),
                                           None if len(tokens) == len(ref) else min(len(tokens), len(ref))))
        rows.append(row)
        print(f"[eval] {i + 1}/{len(prompts)} {rec.workload} tau={row['acceptance_length']:.2f} "
              f"tok/s={row['generated_tokens'] / row['wall_s']:.1f}"
              + (f" lossless={row['lossless']}" if baseline is not None else ""), file=sys.stderr, flush=True)
    by_workload = defaultdict(list)
    for r in rows:
        by_workload[r["workload"]].append(r)
    return {**_summarise(rows), "workloads": {w: _summarise(rs) for w, rs in sorted(by_workload.items())},
            "spec": cfg.to_dict() if draft is not None else PRESETS["baseline"].to_dict(),
            "max_new_tokens": max_new_tokens, "temperature": temperature, "per_prompt": rows}
