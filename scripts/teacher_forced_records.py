"""Teacher-forced conversation records from kept (filtered) prompts: no generation.

Teacher-forced features are cheap extra volume (docs/ARCHITECTURE.md §5): one target forward over text
instead of generating it, the teacher still being the target's own distribution. This renders each
prompt with the target's chat template (its user turns only; nothing is generated) and marks every token
as supervised (loss_mask 1), so `eagle3 extract` turns the records into features that `eagle3 train`
learns from like responses. At equal training steps these features moved held-out τ less than more
epochs on the regenerated responses did, so the pipeline does not use them; the script stays to
reproduce that measurement.

Accounting: read = written + excluded (ids in --exclude, e.g. the prompts already regenerated) +
too_long (over --max-length tokens). Prompts must come from `eagle3 filter` (PII/DLP-checked, train split).

    python scripts/teacher_forced_records.py --target T --in chat.kept.jsonl --exclude D/chat/filtered_prompts/train/kept.jsonl \
        --out chat.rec.jsonl
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", required=True, help="prepared target dir")
    ap.add_argument("--in", dest="in_path", type=Path, required=True, help="kept prompt records (eagle3 filter)")
    ap.add_argument("--exclude", type=Path, default=None, help="records whose ids are left out (JSONL)")
    ap.add_argument("--out", type=Path, required=True, help="conversation records JSONL")
    ap.add_argument("--max-length", type=int, default=2048, help="longer renders are left out (counted)")
    args = ap.parse_args(argv)
    from transformers import AutoTokenizer

    from eagle3_platform.data.chat import render, template_hash
    from eagle3_platform.model.target import read_meta
    from eagle3_platform.store.records import ConversationRecord, PromptRecord, read_jsonl, write_jsonl_atomic

    tok = AutoTokenizer.from_pretrained(args.target)
    target_id = read_meta(args.target)["target_id"]
    excluded_ids = {r["id"] for r in read_jsonl(args.exclude)} if args.exclude else set()
    records, counts = [], {"read": 0, "written": 0, "excluded": 0, "too_long": 0, "tokens": 0}
    for row in read_jsonl(args.in_path):
        counts["read"] += 1
        prompt = PromptRecord(**row)
        if prompt.id in excluded_ids:
            counts["excluded"] += 1
            continue
        ids, _ = render(tok, prompt.messages)          # user (and system) turns; no assistant turn
        if len(ids) > args.max_length:
            counts["too_long"] += 1
            continue
        counts["written"] += 1
        counts["tokens"] += len(ids)
        records.append(ConversationRecord(**prompt.model_dump(), input_ids=ids, loss_mask=[1] * len(ids),
                                          template_hash=template_hash(tok), target_id=target_id,
                                          generation={"teacher_forced": True}).model_dump())
    write_jsonl_atomic(args.out, records)
    print(json.dumps({"out": str(args.out), **counts}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
