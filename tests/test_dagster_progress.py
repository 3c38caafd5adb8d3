"""Progress where the user looks: the long steps' progress lines (eagle3_platform.progress) reach the
run's event log, which the UI shows as a step's log: in process through the managed Python logger the
shipped dagster.yaml names, from a Pipes worker as Pipes log messages, from the benchmark's own process
through the asset. The CLI still prints them on stderr."""
import logging

import pytest
import yaml

from eagle3_platform import progress


def test_lines_read_back_with_their_counts_and_fraction():
    line = progress.format_line("train", 3, 12, "steps", "loss 1.234, 80 tok/s")
    assert line == "[train] 3/12 steps, loss 1.234, 80 tok/s; 25% done"
    got = progress.parse("2026-01-01 - INFO - " + line)  # as a log header prefixes it
    assert (got.stage, got.done, got.total, got.unit, got.detail) == ("train", 3, 12, "steps", "loss 1.234, 80 tok/s")
    assert got.fraction == pytest.approx(0.25)
    assert progress.parse("[extract] 1/1 shards; 100% done").fraction == 1.0
    assert progress.parse("[bench] warm-up, 2 requests one at a time") is None


def test_ticker_reports_the_first_then_at_most_every_interval_and_always_the_last(capsys):
    now = [0.0]
    ticker = progress.Ticker("train", 5, "steps", every_s=10.0, clock=lambda: now[0])
    shown = []
    for done, t in ((1, 0.0), (2, 4.0), (3, 11.0), (4, 12.0), (5, 13.0)):
        now[0] = t
        shown.append(ticker.update(done))
    assert shown == [True, False, True, False, True]
    lines = [progress.parse(x) for x in capsys.readouterr().err.splitlines()]
    assert [(x.done, x.total) for x in lines] == [(1, 5), (3, 5), (5, 5)]  # the CLI's stderr


def test_the_logger_writes_to_the_stderr_of_the_moment_and_not_twice_through_root(capsys):
    root = logging.getLogger()
    extra = logging.StreamHandler()
    root.addHandler(extra)
    try:
        progress.report("extract", 1, 2, "shards")
    finally:
        root.removeHandler(extra)
    err = capsys.readouterr().err
    assert err.count("[extract] 1/2 shards; 50% done") == 1


def shipped_instance():
    """A persistent test instance configured like the project's (resources/dagster.yaml)."""
    from dagster._core.test_utils import instance_for_test

    from resources.instance import TEMPLATE

    cfg = yaml.safe_load(TEMPLATE.read_text())
    assert progress.LOGGER_NAME in cfg["python_logs"]["managed_python_loggers"]
    return instance_for_test(overrides={"python_logs": cfg["python_logs"]})


def progress_events(instance, run_id, stage: str) -> list[progress.Line]:
    """The stage's progress lines among the run's event-log entries (plain log messages)."""
    lines = [progress.parse(e.user_message) for e in instance.all_logs(run_id) if not e.is_dagster_event]
    return [x for x in lines if x and x.stage == stage]


def test_regeneration_and_training_report_progress_in_the_run_event_log(tmp_path, tiny_target_dir):
    from dagster_helpers import meta, run, tiny_resources
    from resources import StorageResource

    storage = StorageResource(root=str(tmp_path / "data"))
    res = tiny_resources(storage, tiny_target_dir)
    with shipped_instance() as instance:
        data = run(["filtered_prompts", "target_responses", "feature_shards"], res, instance, "code")
        tr = meta(data, "target_responses")
        regen = progress_events(instance, data.run_id, "regenerate")
        extract = progress_events(instance, data.run_id, "extract")
        head = run(["draft_vocab", "draft_head"], res, instance)
        steps = meta(head, "draft_head")["steps"]
        train = progress_events(instance, head.run_id, "train")

    # regeneration: both splits end on a line with every conversation done; counts never go back
    finals = [x for x in regen if x.done == x.total]
    assert [x.total for x in finals] == [tr["read"], tr["eval_read"]] and all(x.fraction == 1.0 for x in finals)
    assert all(x.unit == "conversations" and "tok/s" in x.detail for x in regen)
    assert all(0 <= x.done <= x.total for x in regen)
    # extraction: one line a shard, the last of each split at 100%
    assert extract and all(x.unit == "shards" for x in extract)
    assert sum(x.done == x.total for x in extract) == 2
    # training: the first step, then at most one line per interval, and the last step
    assert train[0].done == 1 and (train[-1].done, train[-1].total) == (steps, steps)
    assert train[-1].fraction == 1.0 and "loss" in train[-1].detail
    assert [x.done for x in train] == sorted({x.done for x in train})


def test_a_pipes_worker_sends_its_progress_as_pipes_log_messages(tmp_path, tiny_target_dir):
    """compute mode "pipes": the regeneration runs in `python -m resources.pipes_worker`; its lines
    arrive as the run's log messages all the same."""
    from dagster_helpers import meta, run, tiny_resources
    from resources import StorageResource

    storage = StorageResource(root=str(tmp_path / "data"))
    with shipped_instance() as instance:
        run(["filtered_prompts"], tiny_resources(storage, tiny_target_dir), instance, "code")
        res = run(["target_responses"], tiny_resources(storage, tiny_target_dir, compute="pipes"), instance, "code")
        tr = meta(res, "target_responses")
        regen = progress_events(instance, res.run_id, "regenerate")
    assert [x.total for x in regen if x.done == x.total] == [tr["read"], tr["eval_read"]]


def test_the_benchmark_asset_logs_its_subprocess_progress_lines(capsys):
    from assets.bench import _echo

    class Log:
        def __init__(self):
            self.lines = []

        def info(self, msg):
            self.lines.append(msg)

    class Context:
        log = Log()

    ctx = Context()
    _echo(ctx, "[bench] baseline: warm-up, 2 requests one at a time …\n")
    _echo(ctx, progress.format_line("bench", 3, 10, "cells", "eagle3 c=2: requests=5 failures=0") + "\n")
    assert [progress.parse(x).done for x in ctx.log.lines] == [3]  # only the progress line
    assert capsys.readouterr().out.count("[bench]") == 2  # both still on the step's stdout


def test_echo_off_keeps_the_lines_off_stderr_for_a_host_that_shows_them_and_restores_the_echo(capsys):
    """A Dagster step (resources/compute.py) or a Pipes worker shows each line in its own log: the
    logger's stderr echo is off meanwhile, so a terminal does not see it twice; the line still reaches
    the logger's other handlers."""
    seen = []
    sink = logging.Handler()
    sink.emit = lambda record: seen.append(record.getMessage())
    progress.logger.addHandler(sink)
    try:
        with progress.echo_off():
            progress.report("train", 1, 4, "steps")
        progress.report("train", 2, 4, "steps")
    finally:
        progress.logger.removeHandler(sink)
    err = capsys.readouterr().err
    assert "[train] 1/4 steps" not in err and err.count("[train] 2/4 steps; 50% done") == 1
    assert seen == ["[train] 1/4 steps; 25% done", "[train] 2/4 steps; 50% done"]
