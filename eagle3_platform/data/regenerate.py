"""target_responses: the target answers the kept prompts itself (docs/ARCHITECTURE.md §1, §4).

Each conversation is re-asked turn by turn: user turn k is answered given the target's own answers to
turns < k. Two back ends share everything else (budgets, records, masks, scanning, resume):
- local: continuous batched decoding on the prepared target (local_gen.decode_stream: records in
  prompt-length order, a finished answer's row refilled by the next prompt or by the conversation's
  next turn);
- endpoint: any OpenAI-compatible `/v1/chat/completions` with bounded concurrency and retries.
Either way each turn is recorded as the target saw it (its prompt ids + its answer: the generated ids
locally, the template's render of the reply for an endpoint) and `chat.sequences` makes the records'
`input_ids`/`loss_mask`: one record, or, where the template rewrites earlier turns, one per chain of
turns, each under `<id>#<k>` with `generation.conversation_id` and `generation.chains` (every turn is
trained once, as the target saw it). A conversation the template cannot render or mask (a jinja error,
a token across a turn boundary) is rejected with its reason (`template:...`, `bad:token_boundary`); the
run goes on.
Reasoning (RegenConfig.reasoning): keep trains the thinking the target emits, drop asks the template
not to think and trains the answers without it.

Accounting: every input record ends as exactly one conversation (its records in out) or Rejection
(rejected); `read == written + rejected`, `records` counts the rows of out. Resume: both files are
fsynced JSONL appends; a rerun skips conversations already in either (one killed between its records
is dropped and asked again whole), but only when the records there were made by this run's target
(id, weights, template) with its generation settings (before the first record, the key the run left
beside them, `.key.json`), else it refuses (`--restart` discards the old output; `replace_stale`, the
assets' staging, discards only such output, named in the summary). Input lines that cannot be records
(broken JSON, bad encoding, schema, a repeated id) are rejected while reading, under ids unique
per line. Local windows (window_batches x batch_size records) are planned over ALL records (done or not) and
a partially written window is recomputed whole, so a resumed run produces the very same tokens as an
uninterrupted one (sampling draws from one RNG per record and turn, seeded from the record id).
Time budget (RegenConfig.time_budget_s, counted across resumes): once spent, no conversation or turn
starts and the answers being decoded end there (finish_reason "time"); conversations not begun are
rejected as `budget:time`, and begun ones keep their answered turns (`dropped_turns`, as when max_length
ends them; `cut_by_time` in the record's generation). It never leaves an output empty: until a first
record is written it does not stop. A later run with budget left asks both again:
the deferred ones, and the cut ones from their start (their window is redone whole anyway). A
published output (moved away from `out`) is continued only when asked (`continue_from`): copied back
under the same resume key, with the time it spent, without the rows of ids the input no longer holds.
The rows it brings whole are settled (`.settled.json` beside `out`, written before any new row), and
local windows are planned over the other records only: a grown prompt set asks its new prompts
without redoing old ones as their companions, and every resume plans the same windows.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import threading
import time
from collections import Counter, deque
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable

from eagle3_platform.data.chat import (REASONING, Turn, encode, eos_token_ids, generated_turn, render_prompt,
                                       sequences, split_answer, template_errors, template_hash,
                                       template_reason, text_turn, trailer_length)
from eagle3_platform.data.endpoint import ChatClient, EndpointRequestError, check_served, split_endpoints, spread
from eagle3_platform.progress import report as report_progress
from eagle3_platform.store.records import (BadRecord, ConversationRecord, JsonlAppender, PromptRecord, Rejection,
                                     atomic_write, drop_jsonl_rows, ignored_summary, line_rejection, parse_line,
                                     prompt_from_row, read_jsonl, read_lines, top_reasons, unknown_keys,
                                     usable_id, write_json_atomic, write_jsonl_atomic)

STAGE = "target_responses"
DEFERRED = "budget:time"  # a conversation the time budget left unstarted: retried by a run with budget left


@dataclass(frozen=True)
class RegenConfig:
    max_new_tokens: int  # per assistant turn
    batch_size: int  # local: most conversations decoded together (rows of the running batch)
    do_sample: bool
    temperature: float
    top_p: float
    seed: int  # sampling: per-record RNG = hash(seed, record id, turn)
    max_length: int  # prompt + response token budget of a whole rendered conversation
    concurrency: int  # endpoint: conversations in flight, per endpoint
    # local: KV entries (rows x (longest prompt + max_new_tokens)) one batch may hold; capped by RAM.
    # It also bounds the prefill, whose attention temporaries grow with rows x prompt^2: 64 rows of
    # 900-token multi-turn histories in one forward stalled for minutes on 2 cores. More rows do not
    # pay at long contexts: a decode step reads every row's whole cache (23 KB a token, SmolLM2 bf16),
    # padded to the longest row. 48 multi-turn conversations (cpu preset) whose turns were prefilled
    # within this bound but decoded as one batch had 27.0k tokens when the split path had finished
    # all 38.5k (527 s).
    batch_tokens: int = 16384
    # local: records planned together, in batches' worth. Within a window the batch refills as answers
    # end; a resumed run redoes the window it stopped in (same companions, so the same records).
    window_batches: int = 4
    # wall seconds this output may take to regenerate, counted across resumes (a sidecar beside the
    # output keeps what earlier runs spent); None = no limit (the CLI's 0). Once spent, nothing new
    # starts (a conversation not begun is deferred, `budget:time`; one begun keeps the turns answered so
    # far) and the answers being written end where they are (finish_reason "time": finishing them could
    # take max_new_tokens batch steps, ~13 min at 128 rows on a slow box). A later run with budget left
    # retries the deferred.
    time_budget_s: float | None = None
    # records taken in a seeded random order (windows: length order within each) instead of length
    # order: a time budget then leaves a random sample unstarted, not the longest prompts. Its own
    # setting, so lifting the budget to take up what it deferred keeps the plan of the records written.
    random_order: bool = False
    dtype: str = "auto"  # local compute dtype: auto = bf16 where the hardware has it (model/compute.py)
    device: str = "auto"  # local: auto | cpu | cuda | cuda:N (target.pick_device: auto = CUDA where torch sees one)
    torch_threads: int = 0  # local: 0 = all cores (the step runs alone); >0 pins (a shared box)
    # local multi-turn: keep each conversation's KV cache between turns (False re-prefills the whole
    # history every turn: same answers up to rounding, for benchmarks)
    reuse_turn_cache: bool = True
    # local: the target's linear layers on oneDNN's packed layout (model/packed_linear.py; False = torch's
    # row-major kernels, bench_regen's reference path)
    packed_linears: bool = True
    request_timeout_s: float = 600.0
    max_retries: int = 5
    backoff_s: float = 0.5
    progress_every_s: float = 10.0
    # keep: the thinking a reasoning target emits (Qwen3 <think>, GPT-OSS analysis) is part of the
    # trained response, as the target emits it when served; drop: the template is asked not to think
    # (enable_thinking=False) and any thinking is cut from the answers. Targets without reasoning: same.
    reasoning: str = "keep"

    def __post_init__(self):
        if self.reasoning not in REASONING:
            raise ValueError(f"reasoning must be one of {REASONING}, not {self.reasoning!r}")


PRESETS: dict[str, RegenConfig] = {
    # Tests: fp32 so greedy regeneration equals plain greedy `generate` exactly.
    "tiny": RegenConfig(max_new_tokens=16, batch_size=4, do_sample=False, temperature=0.0, top_p=1.0,
                        seed=0, max_length=512, concurrency=2, dtype="float32", torch_threads=1,
                        progress_every_s=2.0),
    # The demo graph must fit in 20 min on 2 CPU cores. bf16 batches of up to 64 on both cores: 4x the
    # turn-1 fp32 batch-8 single-thread path (248 vs 62 tok/s); the step runs alone, so it takes every core.
    # 45 s a partition: where bf16 is native (250-460 tok/s) every partition's answers take less; on a
    # CPU without it (fp32, 20-95 tok/s) multi_turn's alone would take ~3 min and the demo run over
    # 20 min. What the budget cuts short is kept as far as answered.
    "demo": RegenConfig(max_new_tokens=128, batch_size=64, do_sample=False, temperature=0.0, top_p=1.0,
                        seed=0, max_length=1024, concurrency=4, time_budget_s=45),
    # CPU training run: more and longer answers; up to 128 rows where prompts are short (bf16 throughput
    # still grows to batch 128 on 2 cores), fewer for long ones (batch_tokens). 14 min a partition keeps
    # `eagle3 run --preset cpu` within 2 h on a CPU without bf16 (fp32 on the 4-bit codes, 20-140 tok/s:
    # 400 prompts a partition would take ~5 h); on a bf16 CPU (250-460 tok/s) the prompt limit binds
    # first (the eval split's 8 prompts take a minute). Random windows of one batch: what a budget leaves
    # unstarted is a random sample plus the longest of the window in progress, not the longest prompts.
    "cpu": RegenConfig(max_new_tokens=256, batch_size=128, do_sample=False, temperature=0.0, top_p=1.0,
                       seed=0, max_length=1536, concurrency=4, batch_tokens=24576, window_batches=1,
                       time_budget_s=14 * 60, random_order=True),
    # Production: sampled answers (diversity) at the target's usual settings, usually via SGLang/vLLM.
    "full": RegenConfig(max_new_tokens=1024, batch_size=32, do_sample=True, temperature=0.7, top_p=0.95,
                        seed=0, max_length=4096, concurrency=64, reasoning="keep"),
}


def resolve_config(cfg: RegenConfig | str, **overrides) -> RegenConfig:
    """The preset (or config) with the overrides that are not None. time_budget_s: 0 lifts the limit."""
    base = PRESETS[cfg] if isinstance(cfg, str) else cfg
    cfg = replace(base, **{k: v for k, v in overrides.items() if v is not None})
    return replace(cfg, time_budget_s=None) if overrides.get("time_budget_s") == 0 else cfg


@dataclass
class Convo:
    """One conversation being regenerated: the user segments still to answer and what was said."""

    rec: PromptRecord
    segments: list[list[dict]]  # messages appended before each assistant turn (ends with a user turn)
    history: list[dict] = field(default_factory=list)
    finish: list[str] = field(default_factory=list)
    new_tokens: list[int] = field(default_factory=list)
    dropped_turns: int = 0  # user turns left unanswered: the max_length budget ran out
    cut_by_time: bool = False  # an answer cut or a turn left unasked because the time budget was spent
    reject: str | None = None
    asked: list[list[dict]] = field(default_factory=list)  # per answered turn: the messages it answered
    made: list[Turn | None] = field(default_factory=list)  # per answered turn: its ids (None: a text reply)
    thoughts: list[str] = field(default_factory=list)  # per answered turn: its reasoning, where kept


def segment(rec: PromptRecord) -> list[list[dict]]:
    """Split the prompt turns into one segment per user turn; source assistant turns are dropped."""
    segs, cur = [], []
    for m in rec.messages:
        if m.role == "assistant":
            continue
        cur.append({"role": m.role, "content": m.content})
        if m.role == "user":
            segs.append(cur)
            cur = []
    return segs


def turn_seed(seed: int, rec_id: str, turn: int) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}\x1f{rec_id}\x1f{turn}".encode()).digest()[:8], "little") >> 1


class Turns:
    """Prompt + budget of a conversation's next turn, and recording the answer. Shared by both back ends."""

    def __init__(self, tokenizer, cfg: RegenConfig, on_answer=None):
        self.tok, self.cfg, self.on_answer = tokenizer, cfg, on_answer
        self.lock = threading.Lock()  # endpoint workers share the tokenizer
        # tokens the template writes after an answer (EOT + newline): reserved inside max_length. Probed
        # with a non-empty answer: some templates (Mistral's) refuse an empty one.
        self.trailer = trailer_length(tokenizer)
        self.stop_ids = eos_token_ids(tokenizer)

    def prompt(self, msgs: list[dict]) -> list[int]:
        return render_prompt(self.tok, msgs, self.cfg.reasoning)

    def next(self, c: Convo, k: int) -> tuple[list[dict], list[int], int] | None:
        """(messages, prompt ids, max new tokens) for turn k, or None when the budget is spent or the
        template refuses the conversation (then rejected with the template's reason)."""
        msgs = c.history + c.segments[k]
        try:
            ids = self.prompt(msgs)
        except template_errors() as e:
            c.reject = template_reason(e)
            return None
        budget = min(self.cfg.max_new_tokens, self.cfg.max_length - len(ids) - self.trailer)
        if budget >= 1:
            return msgs, ids, budget
        if k == 0:
            c.reject = "bad:too_long"
        else:
            c.dropped_turns = len(c.segments) - k
        return None

    def answer(self, c: Convo, msgs: list[dict], content: str, finish: str, n_tokens: int,
               thought: str = "", made: Turn | None = None) -> None:
        """Records turn k's answer: `made` = its exact ids (local), None = a text reply (endpoint)."""
        reply = {"role": "assistant", "content": content}
        if thought and self.cfg.reasoning == "keep":
            reply["reasoning_content"] = thought
        c.history = msgs + [reply]
        c.asked.append(msgs)
        c.made.append(made)
        c.thoughts.append(reply.get("reasoning_content", ""))
        c.cut_by_time |= finish == "time"
        c.finish.append(finish)
        c.new_tokens.append(n_tokens)
        if self.on_answer is not None:
            self.on_answer(n_tokens)

    def text_reply(self, content: str, thought: str) -> tuple[str, str]:
        """An endpoint's reply -> (reasoning, content), both stripped: a server without a reasoning parser
        returns the thinking inside the content, split here with the template's own markers."""
        if not thought:
            thought, content, _ = split_answer(self.tok, content)
        return thought.strip(), content.strip()


def scan_reason(scanner, texts: list[str], allowed: tuple[str, ...] = ()) -> str | None:
    """`pii_response:TYPE` / `dlp_response:TYPE` for the first offending response; the text is never logged.
    `allowed`: entity types that are not personal data for this record's source (filter.allowed_entities)."""
    if scanner is None or not texts:
        return None
    found = scanner.scan_many(texts) if hasattr(scanner, "scan_many") else [scanner.scan(t) for t in texts]
    for findings in found:
        findings = [f for f in findings if f.entity_type not in allowed]
        if findings:
            f = sorted(findings, key=lambda f: (not getattr(f, "is_secret", False), f.entity_type))[0]
            return f"{'dlp' if getattr(f, 'is_secret', False) else 'pii'}_response:{f.entity_type}"
    return None


def _allowed_entities(source: str) -> tuple[str, ...]:
    from eagle3_platform.data.filter import allowed_entities  # lazy: filter pulls in presidio

    return allowed_entities(source)


def prompt_sha256(rec: PromptRecord) -> str:
    """What a regenerated record was made from: its prompt turns, as the filter kept them."""
    turns = json.dumps([m.model_dump() for m in rec.messages], sort_keys=True, ensure_ascii=False)
    return hashlib.sha256(turns.encode()).hexdigest()


def check_output_prompts(out_path: Path, rejected_path: Path, in_path, prompts: Prompts) -> None:
    """Refuses an output to resume that holds ids the input does not, or records made from other prompts
    than the input now holds under their ids (e.g. redacted since: the old answers must not be kept)."""
    done = {conversation_id(r) for path in (out_path, rejected_path) if path.exists()
            for r in read_jsonl(path, tolerate_torn_tail=True)}
    foreign = done - prompts.ids()
    if foreign:
        raise ValueError(f"{out_path} / {rejected_path} hold {len(foreign)} records that are not in "
                         f"{in_path}; write to a fresh --out")
    changed = changed_prompts(out_path, prompts.convos) if out_path.exists() else 0
    if changed:
        raise ValueError(f"{out_path} holds {changed} records made from other prompts than {in_path} now "
                         "has under their ids; use a fresh --out, or --restart to discard them")


def changed_prompts(out_path: Path, convos: list[Convo]) -> int:
    """Conversations in out_path whose prompt is not the one the input now holds under their id (ids the
    input does not hold, and records from before prompt hashes were written, are not counted)."""
    now = {c.rec.id: prompt_sha256(c.rec) for c in convos}
    return len({conversation_id(row) for row in read_jsonl(out_path, tolerate_torn_tail=True)
                if (made := (row.get("generation") or {}).get("prompt_sha256")) and conversation_id(row) in now
                and now[conversation_id(row)] != made})


def conversation_id(row: dict) -> str | None:
    """The input record a written row was made from: its own id, or, for one of the records of a
    conversation the template splits (chat.sequences), `generation.conversation_id`. Rejections carry
    the input's id."""
    return (row.get("generation") or {}).get("conversation_id") or row.get("id")


def chain_id(conversation: str, k: int) -> str:
    """The id of a conversation's k-th record where it makes more than one (one record keeps the id)."""
    return f"{conversation}#{k}"


def written_conversations(out_path: Path) -> dict[str, list[dict]]:
    """out_path's whole conversations: id -> its records in file order. One a killed run wrote only some
    records of (fewer than its `generation.chains`) is left out: drop_partial removes it."""
    groups: dict[str, list[dict]] = {}
    if out_path.exists():
        for row in read_jsonl(out_path, tolerate_torn_tail=True):
            groups.setdefault(conversation_id(row), []).append(row)
    return {i: rows for i, rows in groups.items()
            if len(rows) == int((rows[0].get("generation") or {}).get("chains", 1))}


def drop_partial(out_path: Path) -> int:
    """Removes the records of conversations out_path holds only in part (a run killed between them), so
    a resume asks them again whole -> rows removed."""
    if not out_path.exists():
        return 0
    whole = written_conversations(out_path)
    return drop_jsonl_rows(out_path, lambda r: conversation_id(r) not in whole)


def finalize(c: Convo, tok, scanner, meta: dict, gen: dict, taken: frozenset[str] | set[str] = frozenset()
             ) -> list[ConversationRecord] | Rejection:
    """The conversation's output rows: its records with ids + masks (one per chain, chat.sequences), or
    a rejection with a reason (a template that cannot render or mask it included: `template:...`,
    `bad:token_boundary`; `dup:chain_id` where a record's id would be another input's, in `taken`)."""
    answers = [m["content"] for m in c.history if m["role"] == "assistant"] + [t for t in c.thoughts if t]
    reason = c.reject or scan_reason(scanner, answers, _allowed_entities(c.rec.source))
    if reason is None:
        try:
            seqs = record_sequences(c, tok, gen.get("reasoning", "keep"))
        except template_errors() as e:
            reason = template_reason(e)
    if reason is None and len(seqs) > 1 and any(chain_id(c.rec.id, k) in taken for k in range(len(seqs))):
        reason = "dup:chain_id"
    if reason is not None:
        return Rejection(id=c.rec.id, workload=c.rec.workload, source=c.rec.source, stage=STAGE, reason=reason)
    generation = {**gen, "finish_reasons": c.finish, "finish_reason": c.finish[-1],
                  "new_tokens": c.new_tokens, "dropped_turns": c.dropped_turns, "cut_by_time": c.cut_by_time,
                  "prompt_sha256": prompt_sha256(c.rec)}
    messages = [{"role": m["role"], "content": m["content"]} for m in c.history]
    fields = c.rec.model_dump(exclude={"messages", "id"})
    split = {"conversation_id": c.rec.id, "chains": len(seqs)} if len(seqs) > 1 else {}
    return [ConversationRecord(**fields, id=chain_id(c.rec.id, k) if split else c.rec.id, messages=messages,
                               input_ids=seq.input_ids, loss_mask=seq.loss_mask, template_hash=template_hash(tok),
                               target_id=meta["target_id"],
                               generation={**generation, "trained_turns": seq.turns, **split})
            for k, seq in enumerate(seqs)]


def record_sequences(c: Convo, tok, reasoning: str):
    """Each answered turn as the target produced it (its exact ids, or the template's render of a text
    reply), joined into records (chat.sequences: trained_turns names each record's turns in its mask)."""
    replies = [m for m in c.history if m["role"] == "assistant"]
    turns = [made if made is not None else text_turn(tok, asked, reply, reasoning)
             for asked, made, reply in zip(c.asked, c.made, replies)]
    return sequences(tok, turns, c.history, reasoning)


class Progress:
    """Periodic one-line progress (eagle3_platform.progress: stderr, and the run's log under Dagster):
    conversations done/total and generated tok/s. Answered
    turns count as they come (`turn`): a batch of long multi-turn conversations is written only when
    its last turn is answered, which can take many minutes."""

    def __init__(self, total: int, done: int, every_s: float):
        self.total, self.done, self.every_s = total, done, every_s
        self.tokens, self.in_flight, self.t0, self.last = 0, 0, time.perf_counter(), 0.0
        self.lock = threading.Lock()  # endpoint workers report turns while the main thread writes rows

    def turn(self, tokens: int) -> None:
        with self.lock:
            self.in_flight += tokens  # answered, in a conversation not written yet
            self._report()

    def add(self, conversations: int, tokens: int) -> None:
        with self.lock:
            self.done += conversations
            self.tokens += tokens
            self.in_flight = max(0, self.in_flight - tokens)
            self._report()

    def _report(self) -> None:
        now = time.perf_counter()
        if now - self.last >= self.every_s or self.done == self.total:
            self.last = now
            flight = f" (+{self.in_flight} in unfinished conversations)" if self.in_flight else ""
            report_progress("regenerate", self.done, self.total, "conversations",
                            f"{self.tokens} new tokens{flight}, {self.tok_per_s():.1f} tok/s")

    def tok_per_s(self) -> float:
        return (self.tokens + self.in_flight) / max(time.perf_counter() - self.t0, 1e-9)


class TimeBudget:
    """The wall time an output may take (RegenConfig.time_budget_s), counted across resumes: what earlier
    runs spent is kept in a sidecar beside the output, saved at least every SAVE_EVERY_S (so a killed
    run loses little of what it spent). `over()` is what the back ends ask before they start a
    conversation or a turn (endpoint workers ask from their threads). It never leaves an output empty:
    while the output holds no record it is not over (on a slow or busy machine a long prompt's prefill
    alone can outlast a small budget), so its first conversations are answered, then it stops."""

    SAVE_EVERY_S = 15.0

    def __init__(self, limit_s: float | None, path: Path):
        self.limit_s, self.path, self.t0 = limit_s, path, time.monotonic()
        self.before, self.saved = 0.0, self.t0
        self.lock = threading.Lock()
        self.empty = True  # the output holds no record yet (regenerate_file keeps this)
        if limit_s is not None and path.exists():
            try:
                self.before = float(json.loads(path.read_text(encoding="utf-8"))["spent_s"])
            except (ValueError, KeyError, TypeError):  # written atomically, so only a hand edit gets here
                print(f"[regenerate] {path} is unreadable: the time budget starts afresh", file=sys.stderr)

    def spent(self) -> float:
        return self.before + time.monotonic() - self.t0

    def over(self) -> bool:
        if self.limit_s is None or self.empty:
            return False
        if time.monotonic() - self.saved >= self.SAVE_EVERY_S:
            self.save()
        return self.spent() >= self.limit_s

    def save(self) -> None:
        if self.limit_s is not None:
            with self.lock:  # one writer at a time: the temp file's name is per process
                self.saved = time.monotonic()
                write_json_atomic(self.path, {"spent_s": round(self.spent(), 3), "limit_s": self.limit_s})


def budget_path(out_path: Path) -> Path:
    return out_path.with_name(out_path.name + ".budget.json")


def key_path(out_path: Path) -> Path:
    """The resume key of the run writing out_path, beside it: what rejections made while generating are
    checked against when no record has been written yet."""
    return out_path.with_name(out_path.name + ".key.json")


def retry_deferred(rejected_path: Path) -> int:
    """Drops the `budget:time` rejections from rejected_path, so this run takes those conversations up
    again; returns how many."""
    return drop_jsonl_rows(rejected_path, lambda r: r.get("reason") == DEFERRED) if rejected_path.exists() else 0


def cut_by_time(row: dict) -> bool:
    """A record the time budget ended early (records from before `cut_by_time`: an answer cut short)."""
    gen = row.get("generation") or {}
    return bool(gen.get("cut_by_time", "time" in (gen.get("finish_reasons") or ())))


def cut_stash_path(out_path: Path) -> Path:
    """Where retry_cut keeps the cut records it took out of out_path while this run asks them again."""
    return out_path.with_name(out_path.name + ".cut.jsonl")


def retry_cut(out_path: Path) -> int:
    """Moves the records a time budget cut from out_path to its stash, so this run asks those
    conversations again from their start; returns how many. restore_cut puts back each one whose retry
    ended no better."""
    cut = [r for r in read_jsonl(out_path, tolerate_torn_tail=True) if cut_by_time(r)] if out_path.exists() else []
    if cut:
        write_jsonl_atomic(cut_stash_path(out_path), cut)  # before the drop: a kill between loses nothing
    return drop_jsonl_rows(out_path, cut_by_time) if cut else 0


def _answered(row: dict) -> int:
    return sum((row.get("generation") or {}).get("new_tokens") or ())


def restore_cut(out_path: Path, rejected_path: Path) -> int:
    """Puts back each stashed cut record whose retry ended no better: deferred again by the time budget,
    never reached (a killed run), or cut again with fewer answered tokens. A retry's better record, or
    its rejection for another reason (a PII finding in a later turn), stands. Safe to run again after a
    kill at any point, as the next run's start does. -> records put back."""
    stash = cut_stash_path(out_path)
    if not stash.exists():
        return 0
    old: dict[str, list[dict]] = {}  # conversation -> its stashed records
    for r in read_jsonl(stash):
        old.setdefault(conversation_id(r), []).append(r)
    # a retry written only in part (killed between its records) counts as never reached
    new = {i: rows[0] for i, rows in written_conversations(out_path).items() if i in old}
    verdict = {r["id"]: r.get("reason") for r in read_jsonl(rejected_path, tolerate_torn_tail=True)
               if r.get("id") in old} if rejected_path.exists() else {}
    back = {i for i, rows in old.items()
            if (i in new and cut_by_time(new[i]) and _answered(new[i]) < _answered(rows[0]))
            or (i not in new and verdict.get(i) in (None, DEFERRED))}
    # the retry's worse outcome goes first, so a kill in between never leaves an id in both files
    if back and out_path.exists():
        drop_jsonl_rows(out_path, lambda r: conversation_id(r) in back)
    if any(i in verdict for i in back):
        drop_jsonl_rows(rejected_path, lambda r: r.get("id") in back)
    if back:
        with JsonlAppender(out_path) as out:
            for i, rows in old.items():  # in the output's old order
                for row in rows if i in back else ():
                    out.append(row)
    stash.unlink()
    return len(back)


@dataclass(frozen=True)
class Published:
    """An output published (moved away) by an earlier run, which this one may continue: its records, its
    rejections and the time budget it spent."""

    out: Path
    rejected: Path | None = None  # None: it rejected nothing
    spent_s: float = 0.0


def regenerate_file(target_dir, in_path, out_path, cfg: RegenConfig | str = "demo",
                    endpoint: str | list[str] | None = None, rejected_path=None, scanner=None,
                    api_key: str | None = None, restart: bool = False, continue_from: Published | None = None,
                    replace_stale: bool = False, served_model: str | None = None) -> dict:
    """Regenerate every kept prompt record in `in_path` into ConversationRecords in `out_path`.

    scanner: None = the default PiiScanner, False = do not scan responses, or any object with
    `.scan(text)` returning findings with `.entity_type` (and `.is_secret` for secrets).
    restart: discard what `out_path`/`rejected_path` hold instead of resuming from it.
    replace_stale: discard what they hold only where it was made with another target or settings
    (named in the summary's `discarded_stale`), instead of refusing it: for a private staging dir (the
    assets'), whose old output cannot be resumed after an upgrade, a new target or another dtype.
    endpoint: one URL, a list, or a comma-separated list: the conversations spread over them
    (cfg.concurrency each); each must list `served_model` (default: the target id) on /v1/models.
    continue_from: where out_path and rejected_path do not exist yet, start from this published output
    (copied, never changed) if it was made under this run's resume key; else start fresh.
    Returns the summary: read, written, rejected, by_reason, resumed, new_tokens, tok_per_s, ...
    Nothing written (every record rejected, or an empty input) is a failed stage: ValueError.
    """
    from eagle3_platform.model.compute import int4_matmul_rows, resolve_dtype
    from eagle3_platform.model.target import pick_device
    from eagle3_platform.model.target import read_meta
    from eagle3_platform.store.checks import distinct_paths

    cfg = resolve_config(cfg)
    endpoints = split_endpoints(endpoint)
    endpoint = ",".join(endpoints) or None
    out_path = Path(out_path)
    rejected_path = Path(rejected_path or default_rejected_path(out_path))
    distinct_paths({"--in": in_path, "--out": out_path, "--rejected": rejected_path})
    meta = read_meta(target_dir)  # raises FileNotFoundError for an unprepared target
    tok = load_tokenizer(target_dir)
    prompts = read_prompts(in_path)
    if scanner is None:
        from eagle3_platform.data.pii import get_scanner
        scanner = get_scanner()
    # with the rest: the resume key. The dtype resolved ('auto' may mean bf16 here, fp32 elsewhere, and
    # fp32 with narrow matmuls on a 4-bit target's codes); an endpoint's dtype is the server's business.
    device = None if endpoint else pick_device(cfg.device)  # one asked for and absent: refused here
    gen = {"mode": "endpoint" if endpoint else "local", **_settings(cfg), "weights_hash": meta.get("weights_hash", ""),
           "dtype": None if endpoint else resolve_dtype(cfg.dtype, device)}
    if device not in (None, "cpu"):
        gen["device"] = device.split(":")[0]  # only off the CPU: older outputs keep their key
    if not endpoint and cfg.packed_linears and (int4_rows := int4_matmul_rows(cfg.dtype, device)):
        gen["int4_rows"] = int4_rows  # only where used: older outputs keep their key
    if cfg.reasoning != "keep":
        gen["reasoning"] = cfg.reasoning  # only where not the default: older outputs keep their key
    if endpoint:
        gen["endpoint"] = ",".join(_public_url(u) for u in endpoints)
    key = resume_key(meta, tok, gen)
    if restart or not (out_path.exists() or rejected_path.exists()):  # nothing a stash could go back to
        cut_stash_path(out_path).unlink(missing_ok=True)
    restored = restore_cut(out_path, rejected_path)  # a killed run's retries: checked with the rest below
    stale = check_resume_key(out_path, rejected_path, key, restart, replace_stale)
    write_json_atomic(key_path(out_path), key, sort_keys=True)
    continued = "no: resumed its own output" if continue_from is not None else None
    if not (out_path.exists() or rejected_path.exists()):  # restarted, or the output moved on (published)
        budget_path(out_path).unlink(missing_ok=True)
        settled_path(out_path).unlink(missing_ok=True)
        if continue_from is not None:
            continued = take_published(continue_from, out_path, rejected_path, key, prompts)
    check_output_prompts(out_path, rejected_path, in_path, prompts)  # before cut records are stashed
    drop_partial(out_path)  # a conversation killed between its records is asked again whole
    clock = TimeBudget(cfg.time_budget_s, budget_path(out_path))
    clock.empty = not written_conversations(out_path)
    retried = recut = 0
    if not clock.over():  # budget left: ask again what an earlier, smaller budget deferred or cut
        retried, recut = retry_deferred(rejected_path), retry_cut(out_path)
    t0 = time.perf_counter()
    pool: dict = {}
    try:
        with JsonlAppender(out_path) as out, JsonlAppender(rejected_path) as rej:
            done = set(written_conversations(out_path)) | rej.done_ids()
            if continued is not None and not continued.startswith("no"):  # before any new row: every resume
                write_json_atomic(settled_path(out_path), {"ids": sorted(done)})  # plans the same windows
            settled = read_settled(out_path)
            for r in prompts.rejected:  # rejected while reading: deterministic, so a resume skips them by id
                if r.id not in done:
                    rej.append(r)
            convos, taken = prompts.convos, prompts.ids()
            progress = Progress(prompts.read, len(done), cfg.progress_every_s)

            def emit(c: Convo) -> None:
                rows = finalize(c, tok, scanner or None, meta, gen, taken)
                for row in rows if isinstance(rows, list) else ():
                    out.append(row)
                    clock.empty = False
                if isinstance(rows, Rejection):
                    rej.append(rows)
                progress.add(1, sum(c.new_tokens))
                clock.save()

            turns = Turns(tok, cfg, on_answer=progress.turn)
            try:
                if endpoint:
                    pool = run_endpoint(endpoints, convos, turns, cfg, done, emit, meta, api_key, clock,
                                        served_model)
                else:
                    run_local(target_dir, convos, turns, cfg, done, emit, clock, settled)
            finally:
                clock.save()
    finally:  # a retried cut record the run did not better goes back (also after an error)
        restored += restore_cut(out_path, rejected_path)
    summary = summarize(prompts, out_path, rejected_path, len(done), progress, time.perf_counter() - t0, meta,
                        tok)
    if cfg.time_budget_s is not None:
        summary.update(time_budget_s=cfg.time_budget_s, time_spent_s=round(clock.spent(), 1))
    if cfg.time_budget_s is not None or retried or recut or restored:
        summary.update(deferred_retried=retried, cut_retried=recut, cut_restored=restored)
    if pool:
        summary.update(endpoints=pool, endpoint_retries=sum(p["retries"] for p in pool.values()))
    if not endpoint:
        summary.update(device=device, dtype=gen["dtype"])
    if continued is not None:
        summary["continued_published"] = continued
    if stale:
        summary["discarded_stale"] = stale
    if not summary["written"]:
        raise ValueError(f"0 of {summary['read']} records written to {out_path}"
                         + (f" ({top_reasons(summary['by_reason'])}; see {rejected_path})" if summary["read"]
                            else f" ({in_path} has no records)")
                         + ("; the time budget was spent before any conversation was answered: rerun with "
                            "a larger one" if summary["by_reason"].get(DEFERRED) else ""))
    return summary


def default_rejected_path(out_path) -> Path:
    out_path = Path(out_path)
    return out_path.with_name(out_path.stem + ".rejected.jsonl")


def resume_key(meta: dict, tok, gen: dict) -> dict:
    """Everything that decides a record's content besides its prompt. Every record carries it (top-level
    target_id/template_hash + `generation`), so a resumed run can check the output it continues."""
    return {"target_id": meta["target_id"], "template_hash": template_hash(tok),
            **{k: v for k, v in gen.items() if k != "endpoint"}}  # a restarted server may move


def resume_key_diff(out_path: Path, key: dict) -> list[str] | None:
    """What differs between `key` and the resume key of out_path's first record ("name old -> new"), or
    None when there is no record to compare with."""
    first = next(read_jsonl(out_path, tolerate_torn_tail=True), None) if out_path.exists() else None
    if first is None:
        return None
    return key_diff({"target_id": first.get("target_id"), "template_hash": first.get("template_hash"),
                     **(first.get("generation") or {})}, key)


def key_diff(old: dict, key: dict) -> list[str]:
    return [f"{k} {old.get(k)!r} -> {v!r}" for k, v in key.items() if old.get(k) != v]


def take_published(src: Published, out_path: Path, rejected_path: Path, key: dict, prompts: Prompts) -> str:
    """Copies a published output to out_path / rejected_path (which do not exist) with the budget it spent,
    when its records were made under `key` from the prompts the input holds now under their ids. Rows of
    ids the input no longer holds (a smaller prompt set) are left out. -> what was taken ("N records",
    with "M dropped" where rows were left out), or "no: <why>" (a fresh start). Order: the budget, the
    records, the rejections. Killed between them, the next run resumes what was copied (a missing
    rejections file only means those conversations are asked again)."""
    diff, why = resume_key_diff(src.out, key), None
    if diff is None:
        why = "it holds no record to check its target and settings against"
    elif diff:
        why = "it was made with " + "; ".join(diff)
    elif changed := changed_prompts(src.out, prompts.convos):
        why = f"{changed} of its records were made from prompts the input no longer holds"
    if why:
        print(f"[regenerate] not continuing {src.out}: {why}; starting afresh", file=sys.stderr)
        return f"no: {why}"
    ids = prompts.ids()
    write_json_atomic(budget_path(out_path), {"spent_s": round(src.spent_s, 3)})
    dropped = copy_rows(src.out, out_path, ids)
    if src.rejected is not None and src.rejected.exists():
        dropped += copy_rows(src.rejected, rejected_path, ids)
    n = len(written_conversations(out_path))  # input records (a split conversation is one)
    gone = f", {dropped} dropped: their prompts are no longer in the input" if dropped else ""
    print(f"[regenerate] continuing {src.out}: {n} records{gone}, {src.spent_s:.0f} s of time budget spent",
          file=sys.stderr)
    return f"{n} records" + (f" ({dropped} dropped)" if dropped else "")


def copy_rows(src: Path, dst: Path, ids: set[str]) -> int:
    """Copies src to dst atomically, without the rows of conversations whose id is not in `ids` (lines
    kept byte for byte) -> conversations left out."""
    gone: set[str] = set()

    def drop(row: dict) -> bool:
        if conversation_id(row) in ids:
            return False
        gone.add(conversation_id(row))
        return True

    atomic_write(dst, lambda tmp: shutil.copyfile(src, tmp))
    drop_jsonl_rows(dst, drop)
    return len(gone)


def settled_path(out_path: Path) -> Path:
    """The ids a continued output took whole from the published one, beside it: later windows are
    planned over the other records only, the same in every resume (see run_local)."""
    return out_path.with_name(out_path.name + ".settled.json")


def read_settled(out_path: Path) -> set[str]:
    path = settled_path(out_path)
    return set(json.loads(path.read_text())["ids"]) if path.exists() else set()


def check_resume_key(out_path: Path, rejected_path: Path, key: dict, restart: bool,
                     replace_stale: bool = False) -> str | None:
    """Resume only output written with the same target and settings; refuse any other with one line naming
    what differs (it would mix two targets' answers under this run's summary). restart: start fresh.
    replace_stale: discard such output instead (logged) and return why; else None."""
    if restart:
        out_path.unlink(missing_ok=True)
        rejected_path.unlink(missing_ok=True)
    why = stale_reason(out_path, rejected_path, key)
    if why is None:
        return None
    if not replace_stale:
        raise ValueError(f"{why}; use a fresh --out, or --restart to discard it")
    print(f"[regenerate] discarding {why}; starting afresh", file=sys.stderr, flush=True)
    out_path.unlink(missing_ok=True)
    rejected_path.unlink(missing_ok=True)
    return why


def stale_reason(out_path: Path, rejected_path: Path, key: dict) -> str | None:
    """Why the output in out_path/rejected_path cannot be resumed under `key` ("<path> was written with
    <what differs>"), or None when it can (or there is none)."""
    diff = resume_key_diff(out_path, key)
    if diff:
        return f"{out_path} was written with another target or settings ({'; '.join(diff)})"
    if diff is not None or not rejected_path.exists() or not any(
            r.get("line") is None and r.get("reason") != DEFERRED
            for r in read_jsonl(rejected_path, tolerate_torn_tail=True)):
        return None
    # no record yet, but rejections made while generating (too long, PII in an answer), which depend on
    # target and settings: checked against the key the run that made them left beside out_path
    old = read_key(key_path(out_path))
    if old is None:
        return (f"{rejected_path} holds rejections from an earlier run whose target and settings cannot be "
                "checked")
    diff = key_diff(old, key)
    return f"{rejected_path} was written with another target or settings ({'; '.join(diff)})" if diff else None


def read_key(path: Path) -> dict | None:
    """A resume key written by key_path's run, or None (absent, or not one)."""
    try:
        key = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return key if isinstance(key, dict) else None


def load_tokenizer(target_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(target_dir)


@dataclass
class Prompts:
    """The input file read: conversations to regenerate, and lines rejected on the way (with reasons)."""

    convos: list[Convo]
    rejected: list[Rejection]
    read: int = 0
    ignored: Counter = field(default_factory=Counter)

    def ids(self) -> set[str]:
        return {c.rec.id for c in self.convos} | {r.id for r in self.rejected}


def read_prompts(in_path) -> Prompts:
    """Kept prompt records -> conversations. A line that cannot be one (broken JSON, bad encoding,
    schema, no user turn, an id already used) is rejected with its reason and line; the run goes on.
    Unknown keys are dropped and counted, as in the filter."""
    origin, p, ids = Path(in_path).name, Prompts([], []), set()
    for n, raw in enumerate(read_lines(in_path), 1):
        if not raw.strip():
            continue
        p.read += 1
        row = None
        try:
            row = parse_line(raw)
            p.ignored.update(unknown_keys(row))
            rid = usable_id(row)
            if rid in ids:  # the filter makes ids unique; a repeat is rejected, never a crash
                p.rejected.append(line_rejection(STAGE, origin, n, row, "dup:id", own_id=False))
                continue
            if rid is not None:
                ids.add(rid)
            rec = prompt_from_row(row)
            segs = segment(rec)
            if not segs:
                raise BadRecord("bad:role_order")
        except BadRecord as e:
            p.rejected.append(line_rejection(STAGE, origin, n, row, e.reason))
            continue
        p.convos.append(Convo(rec, segs))
    return p


def seeded_order(convos: list[Convo], seed: int) -> list[Convo]:
    """The conversations in a seeded random order that depends only on their ids (a resume sees the same)."""
    return sorted(convos, key=lambda c: turn_seed(seed, c.rec.id, -1))


def plan_windows(convos: list[Convo], length: Callable[[Convo], int], size: int, seed: int,
                 shuffled: bool) -> list[list[Convo]]:
    """Windows of `size` records, each in first-prompt length order (rows of like length batch well).
    Unshuffled, the windows cut the length order of all records: the most alike. Shuffled (a time
    budget may stop anywhere), each window is a seeded random draw, so the records a budget leaves
    unstarted are a random sample, but for the longest of the window in progress. Either way the plan
    depends only on the records, so a resumed run plans the same windows."""
    order = seeded_order(convos, seed) if shuffled else sorted(convos, key=length)
    return [sorted(order[i:i + size], key=length) for i in range(0, len(order), size)]


def run_local(target_dir, convos: list[Convo], turns: Turns, cfg: RegenConfig, done: set[str], emit,
              clock: TimeBudget, settled: frozenset[str] | set[str] = frozenset()) -> None:
    """Continuous batched decoding on the local target, window by window (plan_windows): a resumed run
    redoes the window it stopped in with exactly the same companions, so its records come out as an
    uninterrupted run's. Once the time budget is spent, the conversations of later windows are deferred
    without loading the target. `settled`: records a continued published output holds whole; planned
    over the rest only, a grown prompt set asks its new prompts without redoing the old ones'
    windows."""
    from eagle3_platform.model.compute import set_threads
    from eagle3_platform.model.target import load_target

    for c in convos:
        if c.reject is None:
            turns.next(c, 0)  # marks prompts that cannot fit even one answer as bad:too_long
    for c in convos:
        if c.reject is not None and c.rec.id not in done:
            emit(c)
    live = [c for c in convos if c.reject is None and c.rec.id not in settled]
    if all(c.rec.id in done for c in live):
        return
    lengths = {c.rec.id: len(turns.prompt(c.segments[0])) for c in live}
    plan = plan_windows(live, lambda c: lengths[c.rec.id], cfg.window_batches * cfg.batch_size, cfg.seed,
                        shuffled=cfg.random_order)
    target = None

    def emit_new(c: Convo) -> None:  # a redone window's records already written are not written again
        if c.rec.id not in done:
            emit(c)

    for window in plan:
        if all(c.rec.id in done for c in window):
            continue
        if clock.over():
            for c in window:
                c.reject = DEFERRED
                emit_new(c)
            continue
        if target is None:
            set_threads(cfg.torch_threads)
            target = load_target(target_dir, dtype=cfg.dtype, device=cfg.device, pack=cfg.packed_linears)
            budget = min(cfg.batch_tokens, kv_token_budget(target.model))
        decode_conversations(target.model, window, turns, cfg, budget, emit_new, clock.over)


def run_endpoint(endpoints: list[str], convos: list[Convo], turns: Turns, cfg: RegenConfig, done: set[str], emit,
                 meta: dict, api_key: str | None, clock: TimeBudget, served_model: str | None = None) -> dict:
    """The endpoint back end: each endpoint is checked to serve the expected model before any request,
    then cfg.concurrency worker threads per endpoint take conversations from one shared queue, one
    conversation per task, its turns asked in order. Rows are written from the calling thread only (the
    appenders are not shared), in the plan's order whatever the endpoints. Returns, per endpoint, the
    conversations it answered and the retries it needed."""
    # the embedded server names a speculative deployment `<target id>-eagle3`: the same weights, lossless
    expected = [served_model] if served_model else [meta["target_id"], meta["target_id"] + "-eagle3"]
    models = [check_served(u, expected, api_key) for u in endpoints]  # every endpoint, before any work
    clients = [ChatClient(u, m, api_key, cfg.request_timeout_s, cfg.max_retries, cfg.backoff_s)
               for u, m in zip(endpoints, models)]
    todo = [c for c in convos if c.rec.id not in done]
    if cfg.random_order:  # what a time budget leaves unasked is a random sample, not the input's tail
        todo = seeded_order(todo, cfg.seed)
    try:
        counts = spread(clients, todo, lambda client, c: converse(client, c, turns, cfg, clock), emit,
                        cfg.concurrency)
    finally:
        for client in clients:
            client.close()
    return {_public_url(u): {"conversations": n, "retries": cl.retries}
            for u, n, cl in zip(endpoints, counts, clients)}


def converse(client: ChatClient, c: Convo, turns: Turns, cfg: RegenConfig, clock: TimeBudget) -> Convo:
    """Asks the endpoint for each turn of one conversation in order (a worker thread)."""
    temperature = cfg.temperature if cfg.do_sample else 0.0
    for k in range(len(c.segments) if c.reject is None else 0):
        if clock.over():
            stop_for_time(c, k)
            break
        with turns.lock:  # tokenizer + template rendering stay on one thread at a time
            nxt = turns.next(c, k)
        if nxt is None:
            break
        msgs, _, budget = nxt
        try:
            reply = client.chat(msgs, budget, temperature, cfg.top_p,
                                turn_seed(cfg.seed, c.rec.id, k) if cfg.do_sample else None, cfg.reasoning)
        except EndpointRequestError as e:
            c.reject = e.reason
            break
        with turns.lock:
            thought, content = turns.text_reply(reply.content, reply.reasoning)
            n = reply.completion_tokens
            if n is None:
                n = len(encode(turns.tok, thought + content))
        turns.answer(c, msgs, content, reply.finish_reason, n, thought)
    return c


def kv_token_budget(model, fraction: float = 0.25) -> int:
    """KV entries that fit in `fraction` of the machine's RAM (its total, not what is free now, so the
    plan does not change between a run and its resume)."""
    c = model.config.get_text_config()  # a nested (multimodal) config keeps the decoder's sizes inside
    kv_heads = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    itemsize = next(model.parameters()).element_size()
    per_token = 2 * c.num_hidden_layers * kv_heads * head_dim * itemsize  # K and V of every layer
    import torch

    dev = next(model.parameters()).device  # a GPU's cache lives in its memory
    ram = (torch.cuda.get_device_properties(dev).total_memory if dev.type == "cuda"
           else os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    return max(1, int(ram * fraction) // per_token)


def stop_for_time(c: Convo, k: int) -> None:
    """The time budget is spent before turn k: a conversation not begun is deferred; a begun one keeps
    the turns answered (as when max_length runs out)."""
    if k == 0:
        c.reject = DEFERRED
    else:
        c.dropped_turns, c.cut_by_time = len(c.segments) - k, True


def decode_conversations(model, convos: list[Convo], turns: Turns, cfg: RegenConfig, budget: int,
                         finished: Callable[[Convo], None], out_of_time: Callable[[], bool]) -> None:
    """Every turn of these conversations, as one continuous batch (local_gen.decode_stream) of at most
    batch_size rows and `budget` KV slots: a conversation's next turn joins as soon as its answer is
    in, reusing its KV cache (local_gen.Prefix: the turn prefills only the new user message), and
    `finished(c)` runs when a conversation has no turn left. Once `out_of_time()`, no turn starts, the
    answers being decoded end where they are ("time"), and the turns left are stop_for_time's."""
    from eagle3_platform.data.local_gen import Request, Sampling, decode_stream

    sampling = Sampling(cfg.do_sample, cfg.temperature, cfg.top_p)
    pad_id = turns.tok.pad_token_id if turns.tok.pad_token_id is not None else min(turns.stop_ids)

    def request(c: Convo, k: int, prefix=None) -> Request | None:
        nxt = turns.next(c, k)
        if nxt is None:
            return None
        msgs, ids, max_new = nxt
        return Request(ids, max_new, turn_seed(cfg.seed, c.rec.id, k), prefix,
                       keep_cache=cfg.reuse_turn_cache and k + 1 < len(c.segments), tag=(c, k, msgs))

    def answered(r: Request, g) -> None:
        c, k, msgs = r.tag
        # the turn as generated (its stop token included); the history gets its text for the next turn
        made, thought, content = generated_turn(turns.tok, r.ids, g.tokens, g.finish_reason == "stop",
                                                cfg.reasoning)
        turns.answer(c, msgs, content, g.finish_reason, len(g.tokens), thought, made)
        if k + 1 < len(c.segments) and out_of_time():
            stop_for_time(c, k + 1)  # written now: no cache copy held for a turn that will not start
            follow = None
        else:
            follow = request(c, k + 1, g.cache) if k + 1 < len(c.segments) else None
        if follow is None:  # out of turns, of max_length (dropped_turns) or of time
            finished(c)
        else:
            queue.appendleft(follow)  # the conversation goes on first: its cache is held meanwhile

    queue: deque[Request] = deque()
    for c in convos:
        first = request(c, 0)
        if first is None:  # no room for one answer (run_local has rejected these already)
            finished(c)
        else:
            queue.append(first)
    decode_stream(model, queue, answered, turns.stop_ids, pad_id, sampling, cfg.batch_size, budget,
                  closed=out_of_time)
    for r in queue:  # left unstarted by the time budget
        c, k, _ = r.tag
        stop_for_time(c, k)
        finished(c)


def summarize(prompts: Prompts, out_path: Path, rejected_path: Path, resumed: int, progress: Progress,
              elapsed: float, meta: dict, tok) -> dict:
    records = [r["id"] for r in read_jsonl(out_path)]
    convos = written_conversations(out_path)  # whole conversations only: a part is left out
    written, whole = list(convos), sum(len(rows) for rows in convos.values())
    rejections = list(read_jsonl(rejected_path))
    ids = written + [r["id"] for r in rejections]
    if (len(ids) != len(set(ids)) or len(ids) != prompts.read or len(set(records)) != len(records)
            or len(records) != whole):
        raise RuntimeError(f"accounting broken: read {prompts.read}, written {len(written)} "
                           f"({len(records)} records, {whole} in whole conversations), "
                           f"rejected {len(rejections)}, distinct {len(set(ids))}")
    by_reason: dict[str, int] = {}
    for r in rejections:
        by_reason[r["reason"]] = by_reason.get(r["reason"], 0) + 1
    return {"read": prompts.read, "written": len(written), "records": len(records), "rejected": len(rejections),
            "by_reason": dict(sorted(by_reason.items())), "ignored_keys": ignored_summary(prompts.ignored),
            "resumed": resumed, "new_tokens": progress.tokens, "tok_per_s": round(progress.tok_per_s(), 2),
            "elapsed_s": round(elapsed, 2), "out": str(out_path), "rejected_path": str(rejected_path),
            "target_id": meta["target_id"], "template_hash": template_hash(tok)}


def _settings(cfg: RegenConfig) -> dict:
    keys = ("max_new_tokens", "do_sample", "temperature", "top_p", "seed", "max_length")
    return {k: v for k, v in asdict(cfg).items() if k in keys}


def _public_url(url: str) -> str:
    """The endpoint URL without any user:password part (records are shared, secrets are not)."""
    from urllib.parse import urlsplit, urlunsplit

    p = urlsplit(url)
    return urlunsplit(p._replace(netloc=p.hostname + (f":{p.port}" if p.port else ""))) if p.hostname else url
