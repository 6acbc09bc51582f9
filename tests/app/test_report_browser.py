"""report.html in a real browser (headless Chromium from the Debian packages, through playwright):
the demo's, SmolLM2's edge-level IOI run's and a multirun's report load offline with no console
error, are not blank, draw the circuit's nodes, redraw when the edge control moves, and show a
node's score on hover. Slow: `make test-slow` installs Chromium and playwright first."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from circuitkit_app.config import compose
from tests.helpers.report_browser import INSTALL, chromium_path, distinct_colours, open_report

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
MAX_BYTES = 5 * 2**20


@pytest.fixture(scope="module")
def browser():
    path = chromium_path()
    if path is None:
        pytest.fail(f"no Chromium on PATH: {INSTALL}")
    playwright_api = pytest.importorskip("playwright.sync_api", reason=f"playwright is not installed: {INSTALL}")
    with playwright_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=path, args=["--no-sandbox"])
        yield b
        b.close()


def _data(path: Path) -> dict:
    html = path.read_text()
    start = html.index('<script id="report-data" type="application/json">') + len(
        '<script id="report-data" type="application/json">')
    return json.loads(html[start:html.index("</script>", start)])


def _check_circuit_page(browser, path: Path) -> None:
    assert path.stat().st_size < MAX_BYTES
    opened = open_report(browser, path)
    state = opened.state()
    assert state["ready"] and state["error"] is None and opened.errors() == []
    assert distinct_colours(opened.page.screenshot(full_page=True)) > 200
    circuit = _data(path)["circuit"]
    kept_heads = set(circuit["kept_heads"])
    # every kept head is a node of the graph, whatever the edge control says
    drawn = set(opened.page.evaluate(
        "document.getElementById('circuit-graph').data.find((t) => t.customdata).customdata"))
    assert kept_heads <= drawn and {"input", "logits"} <= drawn
    assert state["drawnNodes"] == len(drawn)
    # the edge control redraws at once: its lowest and highest settings draw different edge counts
    n_ranked = circuit["graph"]["n_ranked"]
    slider = opened.page.locator("#edge-slider")
    slider.focus()
    opened.page.keyboard.press("End")
    most = opened.state()["drawnEdges"]
    opened.page.keyboard.press("Home")
    fewest = opened.state()["drawnEdges"]
    assert slider.input_value() == "1" and 1 <= fewest < most
    assert opened.page.locator("#circuit-graph").get_attribute("data-drawn-edges") == str(fewest)
    assert most == sum(1 for e in circuit["graph"]["edges"] if e[4] < n_ranked)
    # hovering a kept head shows its score
    head = sorted(kept_heads)[0]
    text = opened.hover_text(head)
    score = circuit["graph"]["node_scores"][head]
    assert head in text and "score" in text and f"{score:.4g}"[:4] in text.replace("−", "-")
    opened.page.context.close()


def test_demo_report_in_chromium(browser, tmp_path, induction_model_dir) -> None:
    from circuitkit_app.stage_list import run_pipeline

    _, cfg = compose([f"grads.data_path={REPO / 'gradian/data/samples/induction_train.jsonl'}"], config_name="demo")
    run_pipeline(cfg, tmp_path / "demo")
    _check_circuit_page(browser, tmp_path / "demo" / "report.html")


def test_smollm2_edge_level_report_in_chromium(browser, tmp_path) -> None:
    """SmolLM2-135M's IOI circuit from edge-level attribution (70,651 edges), as `make demo-real` finds it
    (fewer examples here to keep the suite short)."""
    from circuitkit.models.fetch import fetch
    from circuitkit_app.stage_list import run_pipeline

    fetch("smollm2", log=lambda _: None)
    _, cfg = compose(["discovery.data_params.num_examples=4", "discovery.data_params.eval_examples=4",
                      "discovery.ig_steps=2", "discovery.batch_size=4", "stages=[data,attribution,pruning]",
                      "discovery.data_params.heldout_template_examples=0", "pruning.bootstrap_resamples=20"],
                     config_name="demo_real")
    run_pipeline(cfg, tmp_path / "real")
    path = tmp_path / "real" / "report.html"
    assert _data(path)["circuit"]["graph"]["n_edges_total"] == 70651
    _check_circuit_page(browser, path)


def test_multirun_report_in_chromium(browser, tmp_path) -> None:
    sweep = tmp_path / "sweep"
    proc = subprocess.run([sys.executable, "-m", "circuitkit.run", "-m", "discovery.batch_size=1,4",
                           "stages=[data,attribution,pruning]", f"hydra.sweep.dir={sweep}",
                           "discovery.data_params.num_examples=8", "discovery.data_params.eval_examples=4",
                           "discovery.data_params.seq_len=16", "model.precision=float32"],
                          capture_output=True, text=True, timeout=600, env={**os.environ, "COLUMNS": "160"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    opened = open_report(browser, sweep / "report.html")
    assert opened.state()["ready"] and opened.errors() == []
    assert opened.page.locator(".js-plotly-plot").count() == 3  # time, memory, result against batch_size
    assert distinct_colours(opened.page.screenshot(full_page=True)) > 100
    opened.page.context.close()
    # each job's own page, linked from the sweep's
    job = open_report(browser, sweep / "1" / "report.html")
    assert job.state()["ready"] and job.errors() == []


def test_a_hostile_sweep_page_runs_no_script(browser, tmp_path, induction_model_dir) -> None:
    """A job folder named `javascript:...` and override values holding `<!--<script>`, `</script>`,
    an `<img onerror>` and U+2028: the page draws its charts with no console error, the job link
    is a file link (clicking it runs nothing), and the values show as written."""
    from circuitkit_app.report import write_sweep_report
    from circuitkit_app.stage_list import run_pipeline

    hostile = "<!--<script>it's </script><img src=x onerror=window.X=1>\u2028"
    job_name = "javascript:window.X=1;void(0)"
    _, cfg = compose(["stages=[data,attribution,pruning]"], config_name="demo")
    sweep = tmp_path / "sweep"
    run_pipeline(cfg, sweep / "0")
    shutil.copytree(sweep / "0", sweep / job_name)
    for job, value in (("0", hostile), (job_name, "plain")):
        (sweep / job / ".hydra").mkdir(exist_ok=True)
        (sweep / job / ".hydra" / "overrides.yaml").write_text(json.dumps([f"model.name={value}"]) + "\n")
    opened = open_report(browser, write_sweep_report(sweep))
    assert opened.state()["ready"] and opened.state()["error"] is None and opened.errors() == []
    assert opened.page.locator(".js-plotly-plot").count() >= 1
    assert hostile.replace("\u2028", "") in opened.page.inner_text("body").replace("\u2028", "")
    link = opened.page.locator("a[href*='javascript']")
    assert link.count() == 1 and link.get_attribute("href").startswith("./")
    link.click()
    assert opened.page.evaluate("typeof window.X") == "undefined"
    opened.page.context.close()
