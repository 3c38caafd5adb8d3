"""No orphans, and endpoints as they are (serve/launch.py, assets/deploy.py, assets/runs.py).

A transient server dies with the process that started it, however that process dies (SIGKILL here);
a server a killed run left behind (recorded, nobody owns it) is stopped by the next start, and a
recorded pid that now names another process is never signalled. The `deployment` asset says whether
its server is up (persistent) or was transient, records its real pid, and `eagle3 stop` stops a
persistent one. A benchmark step SIGKILLed once its servers are up leaves none running. Tiny target,
servers on 127.0.0.1, every process started here stopped by its test."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from eagle3_platform.serve.launch import REGISTRY_DIR, ServerRegistry, process_identity, start_embedded_server

ROOT = Path(__file__).resolve().parents[1]
GONE_WITHIN_S = 60.0  # a bound on a loaded box, not a timing claim


def gone(pid: int, within: float = GONE_WITHIN_S) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if process_identity(pid) is None:
            return True
        time.sleep(0.2)
    return False


def kill_if_running(pid: int) -> None:
    if process_identity(pid) is not None:
        os.kill(pid, signal.SIGKILL)


# A process that starts a tiny server for a data dir's registry, prints its pid, and waits to be killed
# (or, with "leave", exits without stopping it and without the parent-death tie: an older launcher).
STARTER = """
import os, sys, time
import eagle3_platform.serve.launch as L
target, registry, mode = sys.argv[1:4]
if mode == "leave":
    L.die_with_parent = lambda: None
h = L.start_embedded_server(target, registry=L.ServerRegistry(registry), role="bench-eagle3",
                            extra_args=["--preset", "tiny", "--threads", "1"])
print(h.pid, h.url, flush=True)
if mode == "leave":
    os._exit(0)
time.sleep(600)
"""


def start_in_child(tiny_target_dir, registry: Path, mode: str) -> tuple[subprocess.Popen, int, str]:
    child = subprocess.Popen([sys.executable, "-c", STARTER, str(tiny_target_dir), str(registry), mode],
                             cwd=ROOT, stdout=subprocess.PIPE, text=True)
    line = child.stdout.readline().split()
    assert line, "the starter printed no pid"
    return child, int(line[0]), line[1]


@pytest.mark.integration
def test_a_transient_server_dies_with_its_starter_even_on_sigkill(tmp_path, tiny_target_dir):
    registry = tmp_path / REGISTRY_DIR
    child, pid, url = start_in_child(tiny_target_dir, registry, "wait")
    try:
        assert httpx.get(f"{url}/health", timeout=10).status_code == 200
        (rec,) = ServerRegistry(registry).entries()
        assert rec["pid"] == pid and rec["owned"] and not rec["persistent"] and rec["url"] == url
        assert "serve" in rec["cmdline"] and rec["owner_pid"] == child.pid
        child.kill()  # SIGKILL: no handler, no finally
        child.wait()
        assert gone(pid), f"server {pid} outlived its starter"
        assert ServerRegistry(registry).entries() == []  # the record of a gone process is dropped
    finally:
        kill_if_running(pid)
        child.kill()


@pytest.mark.integration
def test_a_leftover_recorded_server_is_stopped_by_the_next_start_and_a_reused_pid_is_spared(
        tmp_path, tiny_target_dir):
    registry = ServerRegistry(tmp_path / REGISTRY_DIR)
    child, left, _ = start_in_child(tiny_target_dir, registry.dir, "leave")
    child.wait()
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    handle = None
    try:
        assert process_identity(left) is not None  # the leftover: running, its starter gone
        (rec,) = registry.entries()
        assert rec["pid"] == left and not rec["owned"]
        # a record whose pid now names another process (here: one of ours) must not get it killed
        fake = {**rec, "pid": other.pid, "cmdline": rec["cmdline"]}
        (registry.dir / f"{other.pid}.json").write_text(json.dumps(fake))
        handle = start_embedded_server(tiny_target_dir, registry=registry, role="deployment",
                                       extra_args=["--preset", "tiny", "--threads", "1"])
        assert handle.reaped == [left] and gone(left)
        assert other.poll() is None and not (registry.dir / f"{other.pid}.json").exists()
        assert [r["pid"] for r in registry.entries()] == [handle.pid]
    finally:
        if handle is not None:
            handle.stop()
        kill_if_running(left)
        other.kill()
    assert registry.entries() == [] and not list(registry.dir.glob("*.json"))


# ---- the deployment asset: transient or persistent, and `eagle3 stop` --------------------------------
def seed(root: Path, tiny_target_dir) -> None:
    """What deployment and benchmark_report read: an export and held-out prompts."""
    from eagle3_platform.testing.serve import random_export

    random_export(tiny_target_dir, root / "draft" / "export")
    kept = root / "code" / "filtered_prompts" / "eval" / "kept.jsonl"
    kept.parent.mkdir(parents=True, exist_ok=True)
    kept.write_text("".join(json.dumps({"id": f"p{i}", "workload": "code", "source": "t", "license": "mit",
                                        "messages": [{"role": "user", "content": f"Write a loop {i}."}]}) + "\n"
                            for i in range(3)))


def resources_for(root, tiny_target_dir, **serving) -> dict:
    from resources import ComputeResource, PresetResource, ServingResource, StorageResource, TargetResource

    return {"storage": StorageResource(root=str(root)), "preset": PresetResource(name="tiny", torch_threads=1),
            "target": TargetResource(model=str(tiny_target_dir), prepared_dir=str(tiny_target_dir)),
            "compute": ComputeResource(), "serving": ServingResource(mode="embedded", **serving)}


def check_now(data: Path, tiny_target_dir) -> tuple[bool, str]:
    """Run deployment_answers alone (as from the asset page): (passed, description)."""
    from dagster import AssetCheckKey, AssetKey, AssetSelection, DagsterInstance, materialize
    from dagster_helpers import GRAPH

    with DagsterInstance.ephemeral() as inst:
        result = materialize(GRAPH, selection=AssetSelection.checks(AssetCheckKey(AssetKey("deployment"),
                             "deployment_answers")), instance=inst, resources=resources_for(data, tiny_target_dir))
    [evaluation] = result.get_asset_check_evaluations()
    return evaluation.passed, evaluation.description


def deploy(data: Path, tiny_target_dir, keep_running: bool):
    from dagster import DagsterInstance, materialize
    from dagster_helpers import GRAPH, meta

    res = resources_for(data, tiny_target_dir, keep_running=keep_running)
    with DagsterInstance.ephemeral() as inst:
        result = materialize(GRAPH, selection=["deployment"], instance=inst, resources=res)
    assert result.success
    desc = json.loads((data / "deployment" / "deployment.json").read_text())
    return meta(result, "deployment"), desc


@pytest.mark.integration
def test_deployment_says_what_serves_and_eagle3_stop_stops_a_persistent_one(tmp_path, tiny_target_dir, capsys):
    from eagle3_platform.cli import main

    data = tmp_path / "data"
    seed(data, tiny_target_dir)
    m, desc = deploy(data, tiny_target_dir, keep_running=True)
    pid = desc["pid"]
    try:
        assert m["running"] and m["persistent"] and m["pid"] == pid and m["url"] == desc["url"]
        assert m["server"].startswith("persistent:") and f"eagle3 stop --data-dir {data}" in m["server"]
        assert httpx.get(f"{desc['url']}/health", timeout=10).status_code == 200  # up after the run
        assert Path(desc["pid_file"]).is_file() and json.loads(Path(desc["pid_file"]).read_text())["pid"] == pid
        assert check_now(data, tiny_target_dir) == (True, f"persistent: {desc['url']} (pid {pid}) answers /health now")
        assert main(["stop", "--data-dir", str(data), "--list"]) == 0
        listed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["servers"]
        assert [(s["pid"], s["role"], s["persistent"], s["up"]) for s in listed] == [(pid, "deployment", True, True)]
        assert main(["stop", "--data-dir", str(data)]) == 0
        assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["stopped"] == [pid]
        assert gone(pid) and not Path(desc["pid_file"]).exists()
        passed, state = check_now(data, tiny_target_dir)  # the asset page's check now says it is down
        assert not passed and state.endswith("does not answer /health now")
        # transient: the step's own server, stopped with it; its url is not offered as a link
        m2, desc2 = deploy(data, tiny_target_dir, keep_running=False)
        assert not m2["running"] and not m2["persistent"] and m2["server"].startswith("transient:")
        assert m2["url"].endswith("(stopped)") and desc2["pid_file"] is None and gone(desc2["pid"])
        assert check_now(data, tiny_target_dir)[0]  # transient: stopped with its step, as designed
        for key in ("target_dir",):  # no path in the description names a file that is not there
            assert Path(desc2[key]).exists()
    finally:
        kill_if_running(pid)


def test_a_killed_launchers_unfinished_runs_are_marked_failed():
    from dagster import DagsterInstance, DagsterRunStatus, job, op

    from assets.runs import LAUNCHER_TAG, fail_abandoned_runs, launcher_tag

    @op
    def noop():
        return None

    @job
    def j():
        noop()

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    with DagsterInstance.ephemeral() as inst:
        started = DagsterRunStatus.STARTED
        live = inst.create_run_for_job(j, tags=launcher_tag(), status=started)
        lost = inst.create_run_for_job(j, tags={LAUNCHER_TAG: f"{dead.pid}:1"}, status=started)
        foreign = inst.create_run_for_job(j, status=started)  # not one of `eagle3 run`'s: not ours to judge
        assert fail_abandoned_runs(inst) == [lost.run_id]
        status = {r.run_id: inst.get_run_by_id(r.run_id).status for r in (live, lost, foreign)}
        assert status == {live.run_id: DagsterRunStatus.STARTED, lost.run_id: DagsterRunStatus.FAILURE,
                          foreign.run_id: DagsterRunStatus.STARTED}


# ---- a benchmark step killed with its servers up -------------------------------------------------------
STEP = """
import sys
from dagster import DagsterInstance, materialize
sys.path.insert(0, sys.argv[2])
from test_orphans import resources_for
from dagster_helpers import GRAPH
res = resources_for(sys.argv[1], sys.argv[3], bench_duration_s=600)
with DagsterInstance.ephemeral() as inst:
    materialize(GRAPH, selection=["benchmark_report"], instance=inst, resources=res)
"""


@pytest.mark.integration
def test_a_benchmark_step_sigkilled_with_its_servers_up_leaves_none(tmp_path, tiny_target_dir):
    data = tmp_path / "data"
    seed(data, tiny_target_dir)
    step = subprocess.Popen([sys.executable, "-c", STEP, str(data), str(ROOT / "tests"), str(tiny_target_dir)], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    registry, pids = ServerRegistry(data / REGISTRY_DIR), []
    try:
        deadline = time.monotonic() + 600
        while len(pids) < 2 and time.monotonic() < deadline and step.poll() is None:
            pids = [r["pid"] for r in registry.entries()]
            time.sleep(0.5)
        assert len(pids) == 2, "the benchmark's two servers never came up"
        step.kill()  # SIGKILL in the sweep: nothing of the step runs its cleanup
        step.wait()
        assert all(gone(p) for p in pids), [p for p in pids if process_identity(p)]
    finally:
        for p in pids:
            kill_if_running(p)
        step.kill()


@pytest.mark.integration
def test_eagle3_run_sigkilled_in_the_benchmark_leaves_no_server_and_the_rerun_stops_a_leftover(
        tmp_path, tiny_target_dir):
    """The whole graph as users start it, SIGKILLed as soon as the benchmark's servers are up: its
    launcher, `eagle3 bench` and both servers go with it; the rerun marks no run as still going and
    stops a server an older run left recorded."""
    data, home = tmp_path / "data", tmp_path / "dagster_home"
    env = {**os.environ, "EAGLE3_CACHE": str(tmp_path / "cache"), "EAGLE3_WORK_DIR": str(tmp_path / "work"),
           "EAGLE3_ENV": "local", "EAGLE3_SERVING": "embedded", "EAGLE3_BENCH_DURATION_S": "600"}
    for k in ("DAGSTER_HOME", "EAGLE3_KEEP_SERVING"):
        env.pop(k, None)
    cmd = [sys.executable, "-m", "eagle3_platform.cli", "run", "--preset", "tiny", "--target", str(tiny_target_dir),
           "--workloads", "code", "--data-dir", str(data), "--dagster-home", str(home), "--threads", "1"]
    with open(tmp_path / "run.log", "wb") as log:
        run = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    registry, bench = ServerRegistry(data / REGISTRY_DIR), []
    try:
        deadline = time.monotonic() + 1200
        while len(bench) < 2 and time.monotonic() < deadline and run.poll() is None:
            bench = [r for r in registry.entries() if r["role"].startswith("bench")]
            time.sleep(0.5)
        assert len(bench) == 2, (tmp_path / "run.log").read_text()[-3000:]
        launcher = bench[0]["owner_pid"]
        run.kill()
        run.wait()
        for pid in [launcher] + [r["pid"] for r in bench]:
            assert gone(pid, 120), f"pid {pid} outlived the killed `eagle3 run`"
    finally:
        for r in bench:
            kill_if_running(r["pid"])
        run.kill()
    child, left, _ = start_in_child(tiny_target_dir, registry.dir, "leave")  # an older run's leftover
    child.wait()
    try:
        rerun = subprocess.run(cmd + ["--through", "deployment"], cwd=ROOT, env=env, capture_output=True,
                               text=True, timeout=900)
        assert rerun.returncode == 0, rerun.stderr[-3000:]
        assert f"stopped server pid {left}" in rerun.stderr and gone(left)
    finally:
        kill_if_running(left)
    from dagster import DagsterInstance, DagsterRunStatus

    os.environ["DAGSTER_HOME"] = str(home)
    try:
        with DagsterInstance.get() as inst:
            runs = inst.get_runs()
    finally:
        os.environ.pop("DAGSTER_HOME", None)
    bench_run = next(r for r in runs if r.job_name == "deploy_and_benchmark"
                     and "benchmark_report" in {k.to_user_string() for k in r.asset_selection or ()})
    assert bench_run.status == DagsterRunStatus.FAILURE
    assert not [r.run_id for r in runs if not r.is_finished]


HEALTHY = """
import http.server, json, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404); self.end_headers()
    def log_message(self, *a):
        pass
s = http.server.HTTPServer(("127.0.0.1", 0), H)
print(s.server_address[1], flush=True)
s.serve_forever()
"""


def test_keep_serving_redeploys_only_when_no_recorded_deployment_answers(tmp_path):
    """`eagle3 run --keep-serving` after a full run: Dagster reports `deployment` fresh, yet nothing
    serves; the launcher's extra reason (assets/deploy.py not_serving) asks for it while no persistent
    deployment it recorded answers /health."""
    from dagster import AssetKey

    from assets.deploy import ROLE, not_serving, servers
    from resources import ServingResource, StorageResource

    storage, key = StorageResource(root=str(tmp_path)), AssetKey("deployment")
    res = lambda keep: {"storage": storage, "serving": ServingResource(mode="embedded", keep_running=keep)}  # noqa: E731
    assert not_serving(res(False), key) is None and not_serving(res(True), AssetKey("benchmark_report")) is None
    assert not_serving(res(True), key) == "not serving now (--keep-serving)"
    proc = subprocess.Popen([sys.executable, "-c", HEALTHY], stdout=subprocess.PIPE, text=True)
    try:
        url = f"http://127.0.0.1:{int(proc.stdout.readline())}"
        servers(storage).record(proc.pid, url=url, role=ROLE, persistent=True)
        assert not_serving(res(True), key) is None
    finally:
        proc.kill()
        proc.wait()
    assert not_serving(res(True), key) == "not serving now (--keep-serving)"  # its record went with it
    assert servers(storage).entries() == []


def test_the_report_names_its_files_relative_to_its_own_directory(tmp_path):
    """The benchmark writes its report in a scratch directory that publishing moves: results.json must
    not name a file there (no dangling paths), and what it names is found beside it after the move."""
    from eagle3_platform.bench.report import write_report
    from test_dagster_ui import sweep_results

    files = write_report(sweep_results(), tmp_path / "scratch" / "report")
    (tmp_path / "scratch" / "report").rename(tmp_path / "report")  # as storage.publish_from moves it
    text = (tmp_path / "report" / "results.json").read_text()
    assert "scratch" not in text
    named = json.loads(text)["files"]
    assert set(named) == set(files) and named["markdown"] == "report.md"
    for rel in [named["results"], named["markdown"], named["html"], *named["plots"]]:
        assert (tmp_path / "report" / rel).is_file(), rel
