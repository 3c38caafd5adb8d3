"""One engine thread running a continuous batch.

Each loop the thread takes up to `prefill_chunk` prompt tokens of waiting requests while the batch
has room (a long prompt is split across loops, so it delays every running stream by at most one
chunk) and runs one batched step over every running request. With requests running, the chunks ride
along that step, one target forward for both, so the weights are read once (at concurrency 8,
prefill forwards of their own take a third of the engine's time).
A step carries up to `mixed_prefill_tokens` of them (0: prompts are prefilled apart): with the
fixed cost of a forward paid by the step anyway, small chunks cost little, and they keep a short
prompt's first token from waiting on a long prompt's tokens in the same forward (at concurrency 8,
median TTFT roughly doubles from 128-token chunks to 1024-token ones). With none
running, prompts are prefilled alone, `prefill_chunk` tokens per forward. A request joins the
batch after the forward that finished its prompt and leaves when it finishes or is cancelled (its
slot is free for the next loop). Only a full queue is refused.

Prefill order: the prompt with the fewest tokens left goes first (shortest remaining first), so a
short chat turn does not wait seconds behind a long document's chunks (in a FIFO on 2 CPU cores,
2-3 s behind a 1000-token prompt). Nobody
starves: a prompt passed by `max_overtaken` later arrivals goes next, in arrival order.

The worker hands results back through each job's thread-safe `emit` callback, one event per chunk:
("tokens", list[int]) …, then exactly one terminal event ("done", info) or ("error", message).
"""
from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

from eagle3_platform.spec.policy import observe_step

log = logging.getLogger("eagle3.serve")


@dataclass
class Job:
    input_ids: list[int]
    max_new_tokens: int
    temperature: float = 0.0
    stop: Sequence[str] = ()
    seed: int | None = None
    emit: Callable[[tuple], None] = print
    cancelled: threading.Event = field(default_factory=threading.Event)
    satisfied: bool = False   # set with `cancelled` when the caller has all it needs (stop string)
    id: int = 0
    request: object = None    # the engine's per-request state once its prefill began
    t0: float = 0.0
    overtaken: int = 0        # later arrivals whose prompts were done before this one's

    def prompt_left(self) -> int:
        return len(self.input_ids) - (self.request.prefilled if self.request is not None else 0)


@dataclass
class Totals:
    """Lifetime counters behind /server_info.

    τ = accepted_tokens / verify_steps (SGLang's definition, bonus token included). The first output
    token comes from the prefill, not from a verify step, so it is in generated_tokens only.
    """
    generated_tokens: int = 0
    accepted_tokens: int = 0
    verify_steps: int = 0
    requests_completed: int = 0
    requests_cancelled: int = 0
    requests_failed: int = 0
    batch_steps: int = 0
    batch_size_hist: Counter = field(default_factory=Counter)  # running batch size -> steps
    prefill_s: float = 0.0  # the engine thread's time in prompt chunks run alone
    step_s: float = 0.0     # ... in batched steps (drafting, verify, bookkeeping, riding chunks)
    mixed_steps: int = 0    # steps that prompt chunks rode along
    lookup_plain_steps: int = 0  # plain steps (draft size 0) that verified a prompt-lookup match


class QueueFull(Exception):
    pass


class EngineWorker:
    def __init__(self, engine, max_queue: int, max_batch: int = 16, prefill_chunk: int = 256,
                 policy=None, max_overtaken: int = 8, mixed_prefill_tokens: int = 128):
        if min(max_batch, prefill_chunk) < 1 or min(max_overtaken, mixed_prefill_tokens) < 0:
            raise ValueError("need max_batch >= 1, prefill_chunk >= 1, max_overtaken >= 0 and "
                             "mixed_prefill_tokens >= 0")
        self.engine, self.max_queue = engine, max_queue
        self.max_batch, self.prefill_chunk, self.policy = max_batch, prefill_chunk, policy
        self.max_overtaken, self.mixed_prefill_tokens = max_overtaken, mixed_prefill_tokens
        self.totals = Totals()
        self._q: queue.Queue[Job | None] = queue.Queue()
        self._lock = threading.Lock()
        self._outstanding = 0          # queued + prefilling + running
        self._waiting: list[Job] = []  # arrival order; a job's request is opened at its first chunk
        self._prefilling: Job | None = None  # the job whose chunk is running (its failure is its own)
        self._riding: list[Job] = []  # jobs whose chunks ride along the running step
        self._running: list[Job] = []
        self._ids = itertools.count(1)
        self._batch = None  # the engine's running batch (the worker thread's; replaced after a failed step)
        self._thread = threading.Thread(target=self._run, name="engine-worker", daemon=True)
        self._stopping = False
        self._stop_reason = "server is shutting down"

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float) -> None:
        """Cancel what is running and queued, then let the thread exit."""
        with self._lock:  # after this, no submit can queue a job behind the end marker
            self._stopping = True
            self._q.put(None)
        self._thread.join(timeout)

    # -- API -----------------------------------------------------------------------------------
    @property
    def outstanding(self) -> int:
        return self._outstanding

    @property
    def in_flight(self) -> int:
        """Requests in the batch or prefilling."""
        return len(self._running) + sum(j.request is not None for j in self._waiting)

    def submit(self, job: Job) -> Job:
        with self._lock:
            if self._stopping:
                raise QueueFull(self._stop_reason)
            if self._outstanding >= self.max_queue:
                raise QueueFull(f"queue full ({self.max_queue} requests waiting or running)")
            self._outstanding += 1
            job.id = next(self._ids)
            self._q.put(job)  # under the lock: stop() queues its end marker after every accepted job
        return job

    def info(self) -> dict:
        t, hist = self.totals, dict(self.totals.batch_size_hist)  # a snapshot: the worker writes
        out = {"max_batch": self.max_batch, "running_batch": len(self._running),
               "prefill_order": "shortest_remaining_first", "max_overtaken": self.max_overtaken,
               "batch_steps": t.batch_steps,
               "mixed_prefill_tokens": self.mixed_prefill_tokens, "mixed_steps": t.mixed_steps,
               "lookup_plain_steps": t.lookup_plain_steps,
               "prefill_s": round(t.prefill_s, 3), "step_s": round(t.step_s, 3),
               "batch_size_hist": {str(b): n for b, n in sorted(hist.items())},
               "mean_batch_size": (sum(b * n for b, n in hist.items()) / sum(hist.values())
                                   if hist else None)}
        return {**out, **(self.policy.info() if self.policy is not None else {})}

    # -- the thread ----------------------------------------------------------------------------
    def _run(self) -> None:
        """The loop; whatever ends it, every held job gets its terminal event and later submits get a
        503: a worker that died of a bug must not leave clients waiting on a queue nobody reads."""
        crashed = False
        try:
            self._batch = self.engine.batch()
            self._loop()
        except Exception:
            log.exception("engine worker stopped by an unexpected error")
            crashed, self._stop_reason = True, "engine worker stopped"
        finally:
            with self._lock:
                self._stopping = True
            self._shutdown(self._batch, crashed)

    def _loop(self) -> None:
        while True:
            batch = self._batch
            idle = not (self._waiting or self._running)
            if not self._pull(block=idle) or self._stopping:
                break
            self._drop_cancelled(batch)
            t0, riders = time.perf_counter(), []
            try:
                riders = self._take_prompts(batch)
            except Exception as e:  # an engine bug fails the request it touched, not the server
                job, self._prefilling = self._prefilling, None
                log.exception("request %s: engine error in prefill", job.id if job else "-")
                if job is not None:
                    self._waiting.remove(job)
                    self._close(batch, job)
                    self._fail(job, f"engine error: {type(e).__name__}")
            t1 = time.perf_counter()
            self.totals.prefill_s += t1 - t0
            try:
                if self._running:
                    self._step(batch, riders)
            except Exception as e:  # the batch's state is suspect: fail its requests, start afresh
                log.exception("engine error in a batched step")
                for job in self._running + self._riding:  # a rider may be the cause: it is not retried
                    self._fail(job, f"engine error: {type(e).__name__}")
                    if job in self._waiting:
                        self._waiting.remove(job)
                self._running, self._riding = [], []
                for job in self._waiting:  # prompts begun in the old batch restart in the new one
                    job.request = None
                self._batch = self.engine.batch()
            self.totals.step_s += time.perf_counter() - t1

    def _pull(self, block: bool) -> bool:
        """Move submitted jobs to the waiting line; False once stop() was called."""
        try:
            job = self._q.get() if block else self._q.get_nowait()
            while True:
                if job is None:
                    return False
                self._waiting.append(job)
                job = self._q.get_nowait()
        except queue.Empty:
            return True

    def _drop_cancelled(self, batch) -> None:
        """A client that left frees its slot now (queued, prefilling or running)."""
        for job in [j for j in self._waiting if j.cancelled.is_set()]:
            self._waiting.remove(job)
            self._end(batch, job)
        for job in [j for j in self._running if j.cancelled.is_set()]:
            self._running.remove(job)
            self._end(batch, job)

    def _take_prompts(self, batch) -> list[tuple[Job, int]]:
        """This loop's prompt work: chunks for the running step to carry, or, with none running (or
        mixed prefill off), prompts prefilled alone now."""
        if self.mixed_prefill_tokens and self._running:
            return self._riders(batch)
        self._prefill(batch)
        return []

    def _prefill(self, batch) -> None:
        """Up to prefill_chunk prompt tokens, over as many waiting requests as fit."""
        for job, n in self._chunks(batch, self.prefill_chunk):
            out = batch.prefill(job.request, n)
            self._prefilling = None
            if out is None:  # prompt left: the budget is spent
                return
            self._joined(batch, job, out)

    def _riders(self, batch) -> list[tuple[Job, int]]:
        """The chunks of this loop's prompt tokens for the step to carry."""
        riders = list(self._chunks(batch, self.mixed_prefill_tokens))
        self._prefilling = None
        return riders

    def _chunks(self, batch, budget: int) -> Iterator[tuple[Job, int]]:
        """Up to `budget` prompt tokens of waiting requests in prefill order -> (job, tokens), each
        job's request opened and `_prefilling` (an error opening or prefilling it is its own). Lazy:
        _prefill runs each chunk, and a prompt done may change the order, before the next is picked."""
        taken: list[Job] = []
        while budget > 0 and (job := self._next_prompt(taken)) is not None:
            self._prefilling = job
            self._open(batch, job)
            n = min(budget, job.prompt_left())
            budget -= n
            taken.append(job)
            yield job, n

    def _open(self, batch, job: Job) -> None:
        if job.request is None:
            job.t0 = time.perf_counter()
            job.request = batch.open(job.input_ids, job.max_new_tokens, job.temperature,
                                     tuple(job.stop), job.seed)

    def _joined(self, batch, job: Job, out: list[int]) -> None:
        """job's prompt is done: it runs from the next step; out = its first tokens."""
        self._waiting.remove(job)
        for other in self._waiting:
            other.overtaken += other.id < job.id
        self._running.append(job)
        self._deliver(batch, job, out)

    def _next_prompt(self, taken: Sequence[Job] = ()) -> Job | None:
        """Shortest remaining prompt first; one passed by max_overtaken later arrivals goes first.
        Prompts already begun always qualify; a new one only while the batch has room for it."""
        room = self.max_batch - self.in_flight
        ready = [j for j in self._waiting if j not in taken and (j.request is not None or room > 0)]
        if not ready:
            return None
        due = [j for j in ready if j.overtaken >= self.max_overtaken]
        if due:
            return due[0]
        return min(ready, key=lambda j: (j.prompt_left(), j.id))

    def _step(self, batch, riders: Sequence[tuple[Job, int]] = ()) -> None:
        jobs = {j.request: j for j in self._running}
        k = self.policy.choose(len(jobs)) if self.policy is not None else None
        self._riding = [j for j, _ in riders]
        out = batch.step(k, [(j.request, n) for j, n in riders])
        self._riding = []
        self.totals.batch_steps += 1
        self.totals.batch_size_hist[len(jobs)] += 1
        self.totals.mixed_steps += bool(riders)
        rows = [(r, toks) for r, toks in out if r in jobs]
        looked_up = k == 0 and any(r.last_drafted for r, _ in rows)  # a plain step verified a match
        self.totals.lookup_plain_steps += looked_up
        if self.policy is not None:  # a step that carried prompt chunks cost more: no cost learnt
            # (a plain step's lookup match is timed: its cost and tokens are plain decoding's, policy.py)
            observe_step(self.policy, batch, k, rows, timed=not riders)
        for r, toks in rows:
            self._deliver(batch, jobs[r], toks)
        riding = {j.request: j for j, _ in riders}
        if batch.failed_prompts:  # the riders' forward failed, the rows' retry did not: theirs alone
            err = batch.prompt_error
            log.error("requests %s: engine error in prefill riding a step: %r",
                      [riding[r].id for r in batch.failed_prompts], err)
            for r in batch.failed_prompts:
                job = riding.pop(r)
                self._waiting.remove(job)
                self._close(batch, job)
                self._fail(job, f"engine error: {type(err).__name__}")
        for r, toks in out:
            if r in riding:
                self._joined(batch, riding[r], toks)

    def _deliver(self, batch, job: Job, toks: list[int]) -> None:
        if toks:
            job.emit(("tokens", [int(t) for t in toks]))
        if job.request.done:
            if job in self._running:
                self._running.remove(job)
            self._end(batch, job)

    # -- endings -------------------------------------------------------------------------------
    def _close(self, batch, job: Job) -> dict | None:
        """Takes job's request out of the batch -> its stats; None when closing it failed (logged)."""
        if job.request is None:
            return {"generated_tokens": 0, "verify_steps": 0}
        try:
            return batch.close(job.request)
        except Exception:
            log.exception("request %s: engine error closing it", job.id)
            return None

    def _end(self, batch, job: Job) -> None:
        """Closes job's request and sends its terminal event: done, or an error if closing failed."""
        stats = self._close(batch, job)
        if stats is None:
            self._fail(job, "engine error closing the request")
        else:
            self._finish(job, stats)

    def _finish(self, job: Job, stats: dict) -> None:
        cancelled = job.cancelled.is_set() and not job.satisfied
        finished = job.request is not None and job.request.done
        gen, steps = int(stats.get("generated_tokens", 0)), int(stats.get("verify_steps", 0))
        info = {"generated_tokens": gen, "accepted_tokens": max(0, gen - 1), "verify_steps": steps,
                "finish_reason": stats.get("finish_reason") if finished else None,
                "cancelled": cancelled, "seconds": time.perf_counter() - job.t0 if job.t0 else 0.0}
        t = self.totals
        t.generated_tokens += gen
        t.accepted_tokens += info["accepted_tokens"]
        t.verify_steps += steps
        if cancelled:
            t.requests_cancelled += 1
        else:
            t.requests_completed += 1
        self._release()
        job.emit(("done", info))

    def _fail(self, job: Job, message: str, count: bool = True) -> None:
        self.totals.requests_failed += int(count)
        self._release()
        job.emit(("error", message))

    def _release(self) -> None:
        with self._lock:
            self._outstanding -= 1

    def _shutdown(self, batch, crashed: bool = False) -> None:
        """Every job still held gets a terminal event so no handler waits forever: what was begun ends
        as cancelled (a shutdown) or failed (the worker crashed), what was queued gets an error."""
        begun = [j for j in self._waiting if j.request is not None]
        for job in self._running + begun:
            job.cancelled.set()
            if crashed:
                self._close(batch, job)
                self._fail(job, self._stop_reason)
            else:
                self._end(batch, job)
        self._running, self._waiting = [], [j for j in self._waiting if j.request is None]
        while True:
            try:
                job = self._q.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                self._waiting.append(job)
        for job in self._waiting:
            self._fail(job, self._stop_reason, count=False)
        self._waiting.clear()

