"""Progress of a long step (regeneration, extraction, training, the benchmark sweep): one line at a time
through ONE standard logger, `eagle3_platform.progress`, so whoever runs the step sees it where they look.

- `eagle3 <stage>`: the logger's own handler prints each line on stderr (the stderr of the moment, so
  a caller that captures stderr captures it).
- Dagster: resources/dagster.yaml names the logger under `python_logs.managed_python_loggers`, so the
  run's event log holds each line (the step's log in the UI); a Pipes worker forwards the lines as
  Pipes log messages (resources/pipes_worker.py). The library itself never imports Dagster.

A line reads `[stage] done/total unit, detail; P% done`; `parse` reads one back (the benchmark asset
finds them in its subprocess's output, tests count them). `Ticker` rate-limits a loop's lines.
"""
from __future__ import annotations

import contextlib
import logging
import re
import sys
import time
from dataclasses import dataclass

LOGGER_NAME = "eagle3_platform.progress"
EVERY_S = 10.0  # a loop's lines at most this often (the first and the last always)

logger = logging.getLogger(LOGGER_NAME)
LINE = re.compile(r"^\[(?P<stage>[\w-]+)\] (?P<done>\d+)/(?P<total>\d+) (?P<unit>\w+)(?:, (?P<detail>.*?))?"
                  r"; (?P<pct>[\d.]+)% done$")


class _Stderr(logging.Handler):
    """Prints a record's message on the current sys.stderr (not the one at import)."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            print(self.format(record), file=sys.stderr, flush=True)
        except Exception:  # a closed stream must not fail the step
            self.handleError(record)


def _setup() -> None:
    if not any(isinstance(h, _Stderr) for h in logger.handlers):
        logger.addHandler(_Stderr())
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.INFO)  # the root's WARNING would drop every line
    logger.propagate = False  # a root handler configured by a caller would print each line twice


_setup()


@contextlib.contextmanager
def echo_off():
    """The lines not printed on stderr by the logger itself while a host shows them already (a Dagster
    step: its managed python logger and console; a Pipes worker: its Pipes log), so a terminal does
    not see each line twice."""
    echo = [h for h in logger.handlers if isinstance(h, _Stderr)]
    for h in echo:
        logger.removeHandler(h)
    try:
        yield
    finally:
        for h in echo:
            logger.addHandler(h)


@dataclass(frozen=True)
class Line:
    stage: str
    done: int
    total: int
    unit: str
    detail: str

    @property
    def fraction(self) -> float:
        return self.done / self.total if self.total else 1.0


def format_line(stage: str, done: int, total: int, unit: str, detail: str = "") -> str:
    pct = 100.0 * done / total if total else 100.0
    return f"[{stage}] {done}/{total} {unit}" + (f", {detail}" if detail else "") + f"; {pct:.0f}% done"


def report(stage: str, done: int, total: int, unit: str, detail: str = "") -> str:
    """Log one progress line (INFO); returns it. `unit` is one word (conversations, shards, steps)."""
    line = format_line(stage, done, total, unit, detail)
    logger.info(line, extra={"progress": {"stage": stage, "done": done, "total": total, "unit": unit}})
    return line


def parse(text: str) -> Line | None:
    """The progress line in `text` (a line as `report` wrote it, maybe with a prefix such as a log
    header), else None."""
    start = text.find("[")
    while start >= 0:
        m = LINE.match(text[start:].rstrip("\n"))
        if m:
            return Line(m["stage"], int(m["done"]), int(m["total"]), m["unit"], m["detail"] or "")
        start = text.find("[", start + 1)
    return None


class Ticker:
    """A loop's progress: `update(done)` reports at the first call, then at most every `every_s`
    seconds, and always when done == total."""

    def __init__(self, stage: str, total: int, unit: str, every_s: float = EVERY_S, clock=time.monotonic):
        self.stage, self.total, self.unit, self.every_s, self.clock = stage, total, unit, every_s, clock
        self.last: float | None = None

    def update(self, done: int, detail: str = "") -> bool:
        now = self.clock()
        if self.last is not None and now - self.last < self.every_s and done < self.total:
            return False
        self.last = now
        report(self.stage, done, self.total, self.unit, detail)
        return True
