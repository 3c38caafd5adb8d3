"""Benchmark prompts: a JSONL of PromptRecord rows (docs/ARCHITECTURE.md §4) or {"prompt": str} rows."""
from __future__ import annotations


def prompt_messages(rec: dict) -> list[dict]:
    """The conversation up to and including its first user turn (multi-turn records included)."""
    if "messages" in rec:
        out = []
        for m in rec["messages"]:
            out.append({"role": m["role"], "content": m["content"]})
            if m["role"] == "user":
                return out
        raise ValueError(f"prompt record {rec.get('id')} has no user turn")
    if "prompt" in rec:
        return [{"role": "user", "content": str(rec["prompt"])}]
    raise ValueError(f"prompt record {rec.get('id')} has neither 'messages' nor 'prompt'")
