"""One engine, one worker thread, one FIFO queue.

The CPU engine decodes one sequence at a time, so requests are served in arrival order: concurrent
clients wait in the queue (they are never failed for being concurrent); only a full queue is
refused. The worker hands results back through a thread-safe `emit` callback, one event per chunk:
("tokens", list[int]) …, then exactly one terminal event ("done", info) or ("error", message).
"""
from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

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


class QueueFull(Exception):
    pass


class EngineWorker:
    def __init__(self, engine, max_queue: int):
        self.engine = engine
        self.max_queue = max_queue
        self.totals = Totals()
        self._q: queue.Queue[Job | None] = queue.Queue()
        self._lock = threading.Lock()
        self._outstanding = 0          # queued + running
        self._running: Job | None = None
        self._ids = itertools.count(1)
        self._thread = threading.Thread(target=self._run, name="engine-worker", daemon=True)
        self._stopping = False

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float) -> None:
        """Cancel what is running and queued, then let the thread exit."""
        self._stopping = True
        if self._running is not None:
            self._running.cancelled.set()
        self._q.put(None)
        self._thread.join(timeout)

    # -- API -----------------------------------------------------------------------------------
    @property
    def outstanding(self) -> int:
        return self._outstanding

    @property
    def busy(self) -> bool:
        return self._running is not None

    def submit(self, job: Job) -> Job:
        with self._lock:
            if self._stopping:
                raise QueueFull("server is shutting down")
            if self._outstanding >= self.max_queue:
                raise QueueFull(f"queue full ({self.max_queue} requests waiting or running)")
            self._outstanding += 1
        job.id = next(self._ids)
        self._q.put(job)
        return job

    # -- the thread ----------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            job = self._q.get()
            if job is None:
                break
            try:
                if self._stopping:
                    job.emit(("error", "server is shutting down"))
                elif job.cancelled.is_set():
                    self.totals.requests_cancelled += 1
                    job.emit(("done", {"cancelled": True, "generated_tokens": 0, "verify_steps": 0}))
                else:
                    self._running = job
                    self._serve(job)
            finally:
                self._running = None
                with self._lock:
                    self._outstanding -= 1
        # Anything still queued at shutdown gets a terminal event so no handler waits forever.
        while not self._q.empty():
            job = self._q.get_nowait()
            if job is not None:
                job.emit(("error", "server is shutting down"))

    def _serve(self, job: Job) -> None:
        t0 = time.perf_counter()
        n_tokens = n_chunks = n_first = 0
        if hasattr(self.engine, "last_stats"):
            self.engine.last_stats = {}
        gen = self.engine.stream(job.input_ids, job.max_new_tokens, temperature=job.temperature,
                                 stop=tuple(job.stop), seed=job.seed)
        try:
            for chunk in gen:
                chunk = [int(t) for t in chunk]
                n_first = n_first or len(chunk)
                n_tokens, n_chunks = n_tokens + len(chunk), n_chunks + 1
                job.emit(("tokens", chunk))
                if job.cancelled.is_set():
                    break
        except Exception as e:  # an engine bug must fail this request, not the server
            self.totals.requests_failed += 1
            log.exception("request %d: engine error", job.id)
            job.emit(("error", f"engine error: {type(e).__name__}"))
            return
        finally:
            gen.close()
        info = self._stats(n_tokens, n_chunks, n_first, finished=not job.cancelled.is_set())
        info.update(cancelled=job.cancelled.is_set() and not job.satisfied,
                    seconds=time.perf_counter() - t0)
        t = self.totals
        t.generated_tokens += info["generated_tokens"]
        t.accepted_tokens += info["accepted_tokens"]
        t.verify_steps += info["verify_steps"]
        if info["cancelled"]:
            t.requests_cancelled += 1
        else:
            t.requests_completed += 1
        job.emit(("done", info))

    def _stats(self, n_tokens: int, n_chunks: int, n_first: int, finished: bool) -> dict:
        """Prefer the engine's accounting (SpecEngine: first token from the prefill, then one chunk
        per verify step); for an interrupted stream fall back to what was counted here."""
        stats = getattr(self.engine, "last_stats", None) or {}
        if finished and "generated_tokens" in stats and "verify_steps" in stats:
            gen, steps = int(stats["generated_tokens"]), int(stats["verify_steps"])
            return {"generated_tokens": gen, "accepted_tokens": max(0, gen - 1),
                    "verify_steps": steps, "finish_reason": stats.get("finish_reason")}
        return {"generated_tokens": n_tokens, "accepted_tokens": n_tokens - n_first,
                "verify_steps": max(0, n_chunks - 1), "finish_reason": None}
