"""The engine worker's prefill order, driven step by step on the fake engine (no thread, no HTTP)."""
from __future__ import annotations

import pytest

from eagle3_platform.serve.worker import EngineWorker, Job, QueueFull
from eagle3_platform.testing.serve import FakeEngine


def _worker(**kw):
    engine = FakeEngine(list(range(10, 20)), chunk=1)
    return EngineWorker(engine, max_queue=64, **kw), engine.batch()


def _submit(worker, name: str, n_prompt: int, firsts: list) -> Job:
    def emit(ev, name=name):
        if ev[0] == "tokens" and name not in firsts:
            firsts.append(name)
    return worker.submit(Job(list(range(n_prompt)), max_new_tokens=4, emit=emit))


def _loop(worker, batch) -> None:
    """What the worker thread does each loop before its decode step: take arrivals, prefill."""
    worker._pull(block=False)
    worker._prefill(batch)


def test_short_prompts_are_prefilled_before_a_long_one_already_begun():
    worker, batch = _worker(prefill_chunk=8)
    firsts = []
    long = _submit(worker, "long", 40, firsts)
    _loop(worker, batch)
    assert long.request.prefilled == 8 and worker.in_flight == 1
    _submit(worker, "short", 5, firsts)
    _loop(worker, batch)  # the short prompt first, the rest of the budget to the long one
    assert firsts == ["short"] and long.request.prefilled == 11
    while "long" not in firsts:
        _loop(worker, batch)
    assert firsts == ["short", "long"] and worker.in_flight == 2


def test_a_prompt_is_passed_at_most_max_overtaken_times():
    # FIFO would serve the long prompt first; shortest-first without a bound would serve it last
    worker, batch = _worker(prefill_chunk=8, max_overtaken=2)
    firsts = []
    _submit(worker, "long", 40, firsts)
    for i in range(5):
        _submit(worker, f"s{i}", 4, firsts)
    for _ in range(20):
        _loop(worker, batch)
    assert firsts == ["s0", "s1", "long", "s2", "s3", "s4"]


def test_max_overtaken_0_is_first_come_first_served():
    worker, batch = _worker(prefill_chunk=8, max_overtaken=0)
    firsts = []
    for name, n in (("long", 20), ("s0", 4), ("s1", 4)):
        _submit(worker, name, n, firsts)
    for _ in range(6):
        _loop(worker, batch)
    assert firsts == ["long", "s0", "s1"]


def test_new_prompts_wait_for_room_in_the_batch():
    worker, batch = _worker(prefill_chunk=64, max_batch=2)
    firsts = []
    for i in range(3):
        _submit(worker, f"r{i}", 4, firsts)
    _loop(worker, batch)
    assert firsts == ["r0", "r1"] and worker.in_flight == 2 and worker.outstanding == 3
    assert worker._next_prompt() is None  # r2 is not opened while the batch is full


def _loop_mixed(worker, batch) -> None:
    """A whole loop of the worker thread: with requests running, a step carrying prompt chunks."""
    worker._pull(block=False)
    riders = worker._take_prompts(batch)
    if worker._running:
        worker._step(batch, riders)


def test_running_steps_carry_prompt_chunks_shortest_first_within_their_budget():
    worker, batch = _worker(prefill_chunk=64, mixed_prefill_tokens=8)
    events, firsts = batch.engine.events, []
    _submit(worker, "run", 3, firsts)
    _loop_mixed(worker, batch)  # nothing runs yet: prefilled alone, in one forward of up to 64
    assert firsts == ["run"] and events == [("prefill", 3), ("step", 1)]
    long = _submit(worker, "long", 20, firsts)
    _submit(worker, "short", 5, firsts)
    _loop_mixed(worker, batch)  # the step carries the short prompt, then 3 of the long one's tokens
    assert events[2:] == [("prefill", 5), ("prefill", 3), ("step", 1)]
    assert firsts == ["run", "short"] and long.request.prefilled == 3 and worker.totals.mixed_steps == 1
    while "long" not in firsts:
        _loop_mixed(worker, batch)
    assert [n for kind, n in events[5:] if kind == "prefill"] == [8, 8, 1]  # within the step's budget
    assert worker.totals.mixed_steps == 4 and worker.in_flight <= 3


def test_mixed_prefill_off_prefills_apart_while_requests_run():
    worker, batch = _worker(prefill_chunk=64, mixed_prefill_tokens=0)
    firsts = []
    _submit(worker, "run", 3, firsts)
    _loop_mixed(worker, batch)
    _submit(worker, "next", 5, firsts)
    _loop_mixed(worker, batch)  # a forward of its own, then the step over both
    assert batch.engine.events == [("prefill", 3), ("step", 1), ("prefill", 5), ("step", 2)]
    assert firsts == ["run", "next"] and worker.totals.mixed_steps == 0


@pytest.mark.parametrize("kw", [{"prefill_chunk": 0}, {"max_batch": 0}, {"max_overtaken": -1},
                                {"mixed_prefill_tokens": -1}])
def test_settings_that_would_stall_the_worker_are_refused(kw):
    with pytest.raises(ValueError, match="need max_batch"):
        _worker(**kw)


def _recorder(events: list):
    return lambda ev: events.append(ev)


def test_a_request_whose_close_fails_still_gets_its_terminal_event():
    """An engine error while closing a finished request answers it with an error (a client never
    waits on a request the worker has let go of) and frees its queue slot."""
    worker, batch = _worker(prefill_chunk=64)

    def broken_close(r):
        raise RuntimeError("close bug")
    batch.close = broken_close
    events = []
    worker.submit(Job(list(range(4)), max_new_tokens=1, emit=_recorder(events)))
    _loop(worker, batch)  # the prefill's one token finishes the request
    assert events[0] == ("tokens", [14]) and events[-1][0] == "error"
    assert worker.outstanding == 0 and worker.totals.requests_failed == 1


def test_a_worker_stopped_by_a_bug_answers_held_jobs_and_refuses_new_ones():
    class BrokenEngine(FakeEngine):
        def batch(self):
            raise RuntimeError("engine bug")

    worker = EngineWorker(BrokenEngine(list(range(10, 20))), max_queue=8)
    events = []
    worker.submit(Job(list(range(4)), max_new_tokens=2, emit=_recorder(events)))
    worker.start()
    worker._thread.join(10)
    assert not worker._thread.is_alive()
    assert events == [("error", "engine worker stopped")] and worker.outstanding == 0
    with pytest.raises(QueueFull, match="engine worker stopped"):
        worker.submit(Job(list(range(4)), max_new_tokens=2, emit=_recorder(events)))


def test_a_worker_stopped_by_a_bug_fails_the_requests_it_was_decoding():
    worker = EngineWorker(FakeEngine(list(range(10, 20)), chunk=1), max_queue=8)
    drop, loops = worker._drop_cancelled, []

    def buggy(batch):  # a bug outside the engine calls, on the third loop
        loops.append(1)
        if len(loops) == 3:
            raise RuntimeError("worker bug")
        drop(batch)
    worker._drop_cancelled = buggy
    events = []
    worker.submit(Job(list(range(4)), max_new_tokens=100, emit=_recorder(events)))
    worker.start()
    worker._thread.join(10)
    assert [e[0] for e in events[:-1]] == ["tokens"] * 3  # prefill + two steps
    assert events[-1] == ("error", "engine worker stopped") and worker.outstanding == 0
