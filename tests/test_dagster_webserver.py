"""A real `dagster dev -w workspace.yaml` (webserver + daemon on 127.0.0.1, DAGSTER_HOME in tmp):
submit a partitioned run through GraphQL, see it succeed, stop the server by PID with SIGINT."""
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
STARTUP_S, RUN_S = 240, 600

LAUNCH = """mutation($p: ExecutionParams!) { launchRun(executionParams: $p) {
  __typename ... on LaunchRunSuccess { run { runId } }
  ... on PythonError { message } ... on InvalidSubsetError { message } ... on RunConfigValidationInvalid { errors { message } } } }"""
STATUS = """query($id: ID!) { runOrError(runId: $id) { __typename ... on Run { status } } }"""
MATS = """query { assetOrError(assetKey: {path: ["filtered_prompts"]}) { ... on Asset {
  assetMaterializations(limit: 5) { partition metadataEntries { label ... on IntMetadataEntry { intValue } } } } } }"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _gql(url, query, variables=None):
    import httpx

    r = httpx.post(f"{url}/graphql", json={"query": query, "variables": variables or {}}, timeout=30)
    r.raise_for_status()
    body = r.json()
    assert "errors" not in body, body
    return body["data"]


@pytest.mark.integration
def test_dagster_dev_runs_a_partition_via_graphql(tmp_path, tiny_target_dir):
    import httpx

    from resources.instance import TEMPLATE

    home = tmp_path / "dagster_home"
    home.mkdir()
    (home / "dagster.yaml").write_text(TEMPLATE.read_text())
    port = _free_port()
    env = {**os.environ, "DAGSTER_HOME": str(home), "EAGLE3_PRESET": "tiny",
           "EAGLE3_TARGET": str(tiny_target_dir), "EAGLE3_DATA_DIR": str(tmp_path / "data"),
           "EAGLE3_CACHE": str(tmp_path / "cache"), "DAGSTER_DISABLE_TELEMETRY": "1"}
    log = open(tmp_path / "dagster_dev.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "dagster", "dev", "-w", "workspace.yaml",
                             "-h", "127.0.0.1", "-p", str(port)], cwd=ROOT, env=env, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + STARTUP_S
        while time.monotonic() < deadline:
            assert proc.poll() is None, (tmp_path / "dagster_dev.log").read_text()[-3000:]
            try:
                if httpx.get(f"{url}/server_info", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(1)
        else:
            pytest.fail("dagster dev did not answer in time")
        params = {"selector": {"repositoryLocationName": "definitions", "repositoryName": "__repository__",
                               "jobName": "workload_refresh", "assetSelection": [{"path": ["filtered_prompts"]}]},
                  "executionMetadata": {"tags": [{"key": "dagster/partition", "value": "code"}]},
                  "runConfigData": {}}
        deadline = time.monotonic() + STARTUP_S  # the code location may still be loading
        while True:
            res = _gql(url, LAUNCH, {"p": params})["launchRun"]
            if res["__typename"] == "LaunchRunSuccess" or time.monotonic() > deadline:
                break
            time.sleep(2)
        assert res["__typename"] == "LaunchRunSuccess", res
        run_id = res["run"]["runId"]
        deadline = time.monotonic() + RUN_S
        status = None
        while time.monotonic() < deadline:
            status = _gql(url, STATUS, {"id": run_id})["runOrError"]["status"]
            if status in ("SUCCESS", "FAILURE", "CANCELED"):
                break
            time.sleep(2)
        assert status == "SUCCESS", (tmp_path / "dagster_dev.log").read_text()[-4000:]
        mats = _gql(url, MATS)["assetOrError"]["assetMaterializations"]
        assert [m["partition"] for m in mats] == ["code"]
        entries = {e["label"]: e.get("intValue") for e in mats[0]["metadataEntries"]}
        assert entries["kept"] + entries["rejected"] == entries["read"]
        assert (tmp_path / "data" / "code" / "filtered_prompts" / "train" / "kept.jsonl").exists()
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)  # dagster dev stops webserver + daemon on SIGINT
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # our own session only (start_new_session)
            proc.wait()
        log.close()
    assert proc.returncode is not None
