"""The asset pages in a real browser: `dagster-webserver` on 127.0.0.1 over an instance holding a
benchmark_report and a draft_head materialization (their metadata built by the assets' own code from
a small sweep and a short training history), opened by headless Chromium (Debian's package, driven by
Playwright). A plot counts as shown only when the browser decoded its image (naturalWidth > 0, the
PNG's own width). Screenshots of each page land in $EAGLE3_SHOTS_DIR (default /tmp/shots)."""
import os
import re
import signal
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = Path("/usr/bin/chromium")  # Debian's `chromium` package (scripts/setup.sh installs it as root)
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]
STARTUP_S = 240

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(not CHROMIUM.exists(), reason=f"no {CHROMIUM}: apt-get install chromium "
                                 "(scripts/setup.sh does, as root)")]


def shots_dir() -> Path:
    d = Path(os.environ.get("EAGLE3_SHOTS_DIR", "/tmp/shots"))
    d.mkdir(parents=True, exist_ok=True)
    return d


def png_width(data: bytes) -> int:
    return struct.unpack(">I", data[16:20])[0]  # IHDR: width, right after the 8-byte signature + chunk header


def training_history(steps: int = 40) -> list[dict]:
    return [{"step": s, "loss": 6.0 / (1 + 0.1 * s), "acc": [min(0.9, 0.02 * s), min(0.8, 0.015 * s)],
             "simulated_acceptance": 1 + min(1.5, 0.04 * s)} for s in range(5, steps + 1, 5)]


def regeneration_run(home: Path, work: Path, target_dir: Path) -> str:
    """A tiny filtered_prompts + target_responses run (one partition) in this instance; -> its run id."""
    from dagster import DagsterInstance

    from dagster_helpers import run, tiny_resources
    from resources import StorageResource

    res = tiny_resources(StorageResource(root=str(work / "data")), target_dir)
    with DagsterInstance.from_config(str(home)) as instance:
        return run(["filtered_prompts", "target_responses"], res, instance, "code").run_id


def seed(home: Path, work: Path) -> dict[str, dict[str, bytes]]:
    """The two materializations, recorded as the assets record them; -> each asset's plots' PNG bytes."""
    from dagster import AssetMaterialization, DagsterInstance, MetadataValue

    from assets.bench import PLOT_ENTRIES, report_metadata
    from assets.draft import loss_table, training_curves
    from assets.metadata import dict_table
    from eagle3_platform.bench.report import write_report
    from test_dagster_ui import pngs, sweep_results

    write_report(sweep_results(), work / "bench" / "report")
    bench = report_metadata(work / "bench" / "report", str(work / "bench"))
    history, heldout = training_history(), [0.62, 0.41, 0.27]
    head = {"training_curves": training_curves(history, heldout), "loss_curve": MetadataValue.md(loss_table(history)),
            "heldout_acc_k": dict_table({str(k): a for k, a in enumerate(heldout)}, "position k", "acceptance"),
            "final_loss": MetadataValue.float(round(history[-1]["loss"], 4)), "head_sha256": "ab" * 32}
    with DagsterInstance.from_config(str(home)) as instance:
        instance.report_runless_asset_event(AssetMaterialization("benchmark_report", metadata=bench))
        instance.report_runless_asset_event(AssetMaterialization("draft_head", metadata=head))
    return {"benchmark_report": {k: pngs(bench[k].value)[0] for k in PLOT_ENTRIES},
            "draft_head": {"training_curves": pngs(head["training_curves"].value)[0]}}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_for_definitions(url: str, proc, log: Path) -> None:
    """Until the webserver answers and its code location has loaded (the asset has a definition)."""
    import httpx

    query = '{ assetOrError(assetKey: {path: ["benchmark_report"]}) { ... on Asset { definition { description } } } }'
    deadline = time.monotonic() + STARTUP_S
    while time.monotonic() < deadline:
        assert proc.poll() is None, log.read_text()[-3000:]
        try:
            data = httpx.post(f"{url}/graphql", json={"query": query}, timeout=5).json()["data"]
            if (data["assetOrError"].get("definition") or {}).get("description"):
                return
        except (httpx.HTTPError, KeyError, TypeError, ValueError):
            pass
        time.sleep(1)
    pytest.fail(f"dagster-webserver did not load the definitions in {STARTUP_S}s: {log.read_text()[-3000:]}")


def _skip_welcome(url: str) -> None:
    """The UI's first-visit "join the community" dialog covers every page on 127.0.0.1 until the
    instance records it as seen: record that, as its Skip button does."""
    import httpx

    gql = lambda q: httpx.post(f"{url}/graphql", json={"query": q}, timeout=10).json()["data"]  # noqa: E731
    gql("mutation { setNuxSeen }")
    assert gql("{ shouldShowNux }")["shouldShowNux"] is False


@pytest.fixture(scope="module")
def ui(tmp_path_factory, tiny_target_dir):
    """(webserver URL, the seeded plots' PNG bytes, a regeneration's run id); the server is stopped by
    PID at the end."""
    from resources.instance import TEMPLATE

    tmp = tmp_path_factory.mktemp("browser")
    home = tmp / "dagster_home"
    home.mkdir()
    (home / "dagster.yaml").write_text(TEMPLATE.read_text())
    plots = seed(home, tmp)
    run_id = regeneration_run(home, tmp, tiny_target_dir)
    port, log_path = _free_port(), tmp / "webserver.log"
    env = {**os.environ, "DAGSTER_HOME": str(home), "EAGLE3_PRESET": "tiny", "EAGLE3_DATA_DIR": str(tmp / "data"),
           "EAGLE3_CACHE": str(tmp / "cache"), "DAGSTER_DISABLE_TELEMETRY": "1"}
    log = open(log_path, "wb")
    proc = subprocess.Popen([str(Path(sys.executable).with_name("dagster-webserver")), "-w", "workspace.yaml",
                             "-h", "127.0.0.1", "-p", str(port)], cwd=ROOT, env=env, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_for_definitions(url, proc, log_path)
        _skip_welcome(url)
        yield url, plots, run_id
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # our own session only (start_new_session)
            proc.wait()
        log.close()


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=str(CHROMIUM), args=ARGS, headless=True)
        try:
            yield b
        finally:
            b.close()


def open_asset(browser, url: str, asset: str):
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    page.goto(f"{url}/assets/{asset}", wait_until="networkidle", timeout=120_000)
    page.get_by_text("Definition", exact=True).first.wait_for(timeout=60_000)
    return page


def shown_images(page, entry: str, shot: str | None = None) -> list[int]:
    """Open a markdown entry's dialog ("[Show Markdown]"); -> the naturalWidth of each image in it,
    once every one has loaded (or failed: naturalWidth 0)."""
    row = page.get_by_role("row").filter(has=page.get_by_role("cell", name=entry, exact=True))
    row.get_by_text("[Show Markdown]").click()
    dialog = page.get_by_role("dialog")
    dialog.locator("img").first.wait_for(timeout=30_000)
    page.wait_for_function("() => [...document.querySelectorAll('[role=dialog] img')].every(i => i.complete)",
                           timeout=30_000)
    widths = dialog.locator("img").evaluate_all("imgs => imgs.map(i => i.naturalWidth)")
    if shot:
        page.wait_for_timeout(800)  # the dialog's fade-in, for the picture only
        page.screenshot(path=str(shots_dir() / shot))
    dialog.get_by_role("button", name="Close").click()
    dialog.wait_for(state="hidden")
    return widths


def test_benchmark_report_page_shows_every_plot_loaded(ui, browser):
    from assets.bench import PLOT_ENTRIES

    url, plots, _ = ui
    page = open_asset(browser, url, "benchmark_report")
    body = page.inner_text("body")
    assert "Baseline vs EAGLE-3 under a Locust concurrency sweep" in body and "ml-platform" in body
    page.screenshot(path=str(shots_dir() / "benchmark_report_page.png"), full_page=True)
    for entry in PLOT_ENTRIES:
        widths = shown_images(page, entry, f"benchmark_report_{entry}.png")
        assert widths == [png_width(plots["benchmark_report"][entry])], entry  # decoded, at its own size
    report = shown_images(page, "report", "benchmark_report_report.png")
    assert len(report) == len(PLOT_ENTRIES) and all(w > 0 for w in report)  # the report's own images inline
    page.close()


def test_draft_head_page_shows_its_training_curves_loaded(ui, browser):
    url, plots, _ = ui
    page = open_asset(browser, url, "draft_head")
    assert "ml-platform" in page.inner_text("body")
    page.screenshot(path=str(shots_dir() / "draft_head_page.png"), full_page=True)
    widths = shown_images(page, "training_curves", "draft_head_training_curves.png")
    assert len(widths) == 2 and widths[0] == png_width(plots["draft_head"]["training_curves"]) and widths[1] > 0
    page.close()


def test_source_and_catalog_pages_name_owners_and_descriptions(ui, browser):
    url, _, _ = ui
    page = open_asset(browser, url, "workload_sources")
    body = page.inner_text("body")
    assert "Workload prompt sources" in body and "ml-platform" in body
    assert "$EAGLE3_EXTRA_SOURCES/<workload>/" in body  # markdown kept the placeholder (a code span)
    page.screenshot(path=str(shots_dir() / "workload_sources_page.png"), full_page=True)
    page.goto(f"{url}/assets", wait_until="networkidle", timeout=120_000)
    page.get_by_text("benchmark_report").first.wait_for(timeout=60_000)
    page.screenshot(path=str(shots_dir() / "catalog.png"), full_page=True)
    page.close()


def test_a_run_page_shows_the_regeneration_progress(ui, browser):
    """The step's log in the UI holds the progress lines (eagle3_platform.progress) with their counts."""
    from eagle3_platform import progress

    url, _, run_id = ui
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    page.goto(f"{url}/runs/{run_id}", wait_until="networkidle", timeout=120_000)
    lines = page.get_by_text(re.compile(r"\[regenerate\] \d+/\d+ conversations"))
    lines.first.wait_for(timeout=60_000)
    lines.first.scroll_into_view_if_needed()
    page.screenshot(path=str(shots_dir() / "run_progress.png"))
    shown = [progress.parse(t) for t in lines.all_inner_texts()]
    assert shown and all(x and x.stage == "regenerate" and 0 <= x.done <= x.total for x in shown)
    assert any(x.fraction == 1.0 for x in shown)  # a split's last line: every conversation done
    page.close()
