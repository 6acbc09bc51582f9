"""report.html without a browser: what a run writes, that it is self-contained, what it holds,
and the report commands' errors. The browser checks are in test_report_browser.py (slow)."""

from __future__ import annotations

import base64
import gzip
import html
import json
import re
import shutil
from html.parser import HTMLParser
from pathlib import Path

import pytest
import torch

from circuitkit_app.config import compose

REPO = Path(__file__).resolve().parents[2]
QUERIES = REPO / "gradian/data/samples/induction_queries.jsonl"
MAX_BYTES = 5 * 2**20


class _Page(HTMLParser):
    """Tags with their attributes, and the text of each <script id=...>."""

    def __init__(self) -> None:
        super().__init__()
        self.tags: list[tuple[str, dict[str, str]]] = []
        self.scripts: dict[str, str] = {}
        self._script: str | None = None

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        self.tags.append((tag, attrs))
        if tag == "script":
            self._script = attrs.get("id") or f"inline{len(self.scripts)}"
            self.scripts[self._script] = ""

    def handle_endtag(self, tag):
        if tag == "script":
            self._script = None

    def handle_data(self, data):
        if self._script is not None:
            self.scripts[self._script] += data


def parse(path: Path) -> _Page:
    page = _Page()
    page.feed(path.read_text())
    return page


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory, induction_model_dir) -> Path:
    """`make demo`'s pipeline (conf/demo.yaml) in a temporary run dir."""
    from circuitkit_app.stage_list import run_pipeline

    run_dir = tmp_path_factory.mktemp("report") / "demo"
    _, cfg = compose([f"grads.data_path={REPO / 'gradian/data/samples/induction_train.jsonl'}"], config_name="demo")
    run_pipeline(cfg, run_dir)
    return run_dir


def test_a_run_writes_one_self_contained_page(demo_run) -> None:
    path = demo_run / "report.html"
    assert path.is_file() and path.stat().st_size < MAX_BYTES
    page = parse(path)
    # nothing is fetched: no external script, style sheet, frame or image; no URL in src/href but anchors
    for tag, attrs in page.tags:
        assert "src" not in attrs, (tag, attrs)
        assert tag not in ("link", "iframe", "img", "object"), tag
        assert not attrs.get("href", "#").startswith(("http:", "https:", "//")), attrs
    plotly_js = gzip.decompress(base64.b64decode(page.scripts["plotly-gz"])).decode()
    assert len(plotly_js) > 1_000_000 and "plotly.js" in plotly_js[:2000]
    data = json.loads(page.scripts["report-data"])
    circuit, attribution = data["circuit"], data["attribution"]
    assert sorted(circuit["kept_heads"]) == ["a0.h2", "a1.h1"]  # the fixture's known circuit
    graph = circuit["graph"]
    assert {"a0.h2", "a1.h1", "input", "logits"} <= set(graph["kept"])
    assert graph["n_edges_total"] == attribution["n_edges"] and 0 < graph["n_ranked"] <= graph["n_candidates"]
    ranks = [e[4] for e in graph["edges"]]
    assert ranks == sorted(ranks)  # strongest first: the edge control shows a prefix
    assert len(graph["edge_spread"]) == 4 and len(graph["edge_spread"][0]) == graph["n_ranked"]
    assert set(graph["node_spread"]) >= {"a0.h2", "a1.h1"}
    assert len(attribution["per_example_head"]) == attribution["per_example_shown"] > 0
    freq = circuit["kept_frequency"]  # per head, how often kept over the stability resamples
    assert freq[0][2] == freq[1][1] == 1.0 and len(freq) == 2 and len(freq[0]) == 4
    assert circuit["curve"] and circuit["cpr"] is not None
    html = path.read_text()
    for section in ('id="run"', 'id="attribution"', 'id="circuit"', 'id="faithfulness"', 'id="gradian"',
                    'id="edge-slider"', 'id="circuit-graph"', 'id="head-map"', 'id="curve"'):
        assert section in html
    # the config keys that differ from the schema's defaults are marked
    assert re.search(r'<tr class="changed"><td>model\.name</td>', html)
    assert "kronecker_orthogonal" in html and "parameter share" in html  # the index header


def test_the_report_reads_each_artifact_checked_against_the_manifest(demo_run, tmp_path) -> None:
    from circuitkit_app.report import write_run_report

    run = tmp_path / "run"
    shutil.copytree(demo_run, run)
    circuit = torch.load(run / "circuit.pt", weights_only=True)
    circuit["model_name"] = "edited"
    torch.save(circuit, run / "circuit.pt")
    out = write_run_report(run)
    data = json.loads(parse(out).scripts["report-data"])
    assert data["circuit"] is None and data["attribution"] is not None
    assert "circuit.pt changed since its stage wrote it" in out.read_text()


def test_report_off_writes_none(tmp_path, tiny_model_dir) -> None:
    from circuitkit_app.stage_list import run_pipeline

    _, cfg = compose(["report.enabled=false", "stages=[data]", "discovery.data_params.num_examples=2",
                      "discovery.data_params.eval_examples=2"])
    run_pipeline(cfg, tmp_path / "off")
    assert (tmp_path / "off" / "manifest.json").is_file() and not (tmp_path / "off" / "report.html").exists()


def test_ranked_rows_page_marks_the_supervised_tokens(demo_run, tmp_path) -> None:
    from circuitkit_app.gradian_cli import main

    out = tmp_path / "ranked.jsonl"
    code = main(["rank", "--index", str(demo_run / "index"), "--queries", str(QUERIES), "--circuit",
                 str(demo_run / "circuit.pt"), "--top-k", "3", "--out", str(out), "--report"])
    assert code == 0
    html = (tmp_path / "ranked.html").read_text()
    n_queries = len(QUERIES.read_text().splitlines())
    assert html.count("<summary>query ") == n_queries and "aggregate over all queries" in html
    assert html.count("<mark>") >= 4 * (n_queries * 3 + n_queries)  # 4 answer tokens per row and per query
    # the same page afterwards, from the JSONL
    assert main(["report", str(out), "--index", str(demo_run / "index"), "--queries", str(QUERIES),
                 "--out", str(tmp_path / "again.html")]) == 0
    assert (tmp_path / "again.html").read_text().count("<mark>") == html.count("<mark>")


def test_run_report_with_ranked_rows(demo_run, tmp_path) -> None:
    from circuitkit_app.cli import main as circuitkit_main
    from circuitkit_app.gradian_cli import main

    ranked = tmp_path / "r.jsonl"
    assert main(["rank", "--index", str(demo_run / "index"), "--queries", str(QUERIES), "--circuit",
                 str(demo_run / "circuit.pt"), "--top-k", "2", "--out", str(ranked)]) == 0
    out = tmp_path / "with-rank.html"
    assert circuitkit_main(["report", str(demo_run), "--out", str(out), "--rank", str(ranked), "--queries",
                            str(QUERIES)]) == 0
    html = out.read_text()
    assert 'id="circuit"' in html and "<summary>query 0</summary>" in html and "<mark>" in html


@pytest.mark.parametrize("args, message", [
    (["report", "{missing}"], "not a directory"),
    (["report", "{empty}"], "holds no manifest.json"),
    (["report", "{run}", "--out", "{run}/circuit.pt/x.html"], "is a file, not a directory"),
    (["report", "{run}", "--queries", "q.jsonl"], "--queries goes with --rank"),
    (["report", "{run}", "--rank", "{run}/manifest.json"], "is not JSON"),
    (["report", "{run}", "--top-edges", "0"], "--top-edges 0"),
    (["report", "{run}", "--top-edges", "1000000000"], "--top-edges 1000000000 is out of range"),
    (["report", "{run}", "--out", "{run}"], "is a directory, but the report is one HTML file"),
    (["report", "{run}", "--out", "{run}/manifest.json"], "which this command reads"),
    (["report", "{run}", "--rank", "{run}/manifest.json", "--queries", "{missing}"], "--queries"),
])
def test_report_errors_are_one_line_and_change_nothing(demo_run, tmp_path, capsys, args, message) -> None:
    from circuitkit_app.cli import main

    (tmp_path / "empty").mkdir()
    before = {p: p.stat().st_mtime_ns for p in demo_run.rglob("*")}
    argv = [a.format(missing=tmp_path / "nope", empty=tmp_path / "empty", run=demo_run) for a in args]
    code = main(argv)
    err = capsys.readouterr().err
    assert code in (1, 2) and message in " ".join(err.split()) and "Traceback" not in err
    assert {p: p.stat().st_mtime_ns for p in demo_run.rglob("*")} == before


def test_gradian_report_errors(demo_run, tmp_path, capsys) -> None:
    from circuitkit_app.gradian_cli import main

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"query": 0, "rank": 1}\n')
    assert main(["report", str(bad), "--index", str(demo_run / "index")]) == 1
    assert "line 1 lacks row_id, score" in capsys.readouterr().err
    far = tmp_path / "far.jsonl"
    far.write_text('{"query": 0, "rank": 1, "row_id": 999, "score": 0.5}\n')
    assert main(["report", str(far), "--index", str(demo_run / "index")]) == 2
    assert "does not hold" in capsys.readouterr().err
    code = main(["rank", "--index", str(demo_run / "index"), "--queries", str(QUERIES), "--report"])
    assert code == 2 and "--report needs --out" in capsys.readouterr().err


def test_sweep_page_compares_the_jobs(demo_run, tmp_path) -> None:
    from circuitkit_app.report import is_sweep_dir, write_sweep_report

    sweep = tmp_path / "sweep"
    for job, size in ((0, 1), (1, 2)):
        shutil.copytree(demo_run, sweep / str(job))
        (sweep / str(job) / ".hydra").mkdir(exist_ok=True)
        (sweep / str(job) / ".hydra" / "overrides.yaml").write_text(f"- discovery.batch_size={size}\n- seed=0\n")
    assert is_sweep_dir(sweep) and not is_sweep_dir(demo_run)
    out = write_sweep_report(sweep)
    data = json.loads(parse(out).scripts["report-data"])
    assert data["sweep"]["swept"] == ["discovery.batch_size"]  # seed is the same in both jobs
    assert [j["status"] for j in data["sweep"]["jobs"]] == ["ok", "ok"]
    assert data["sweep"]["result_label"] == "pruning.faithfulness"
    assert 'href="./0/report.html"' in out.read_text()


def test_edge_scope_circuit_page(tmp_path, induction_model_dir) -> None:
    """An edge-scope circuit: its kept edges are the graph's candidates, each with how often it is kept."""
    from circuitkit_app.stage_list import run_pipeline

    _, cfg = compose(["pruning.scope=edges", "pruning.target_sparsity=0.95", "stages=[data,attribution,pruning]"],
                     config_name="demo")
    run_pipeline(cfg, tmp_path / "edges")
    graph = json.loads(parse(tmp_path / "edges" / "report.html").scripts["report-data"])["circuit"]["graph"]
    circuit = torch.load(tmp_path / "edges" / "circuit.pt", weights_only=True)
    assert graph["scope"] == "edges" and graph["n_candidates"] <= int(circuit["edge_mask"].sum())
    freq = graph["edge_kept_frequency"]
    assert len(freq) == graph["n_ranked"] > 0 and all(0.0 <= f <= 1.0 for f in freq)
    assert freq[0] > 0.5  # the strongest kept edge is kept in most resamples


# Text a hostile run, job or row can hold: a comment/script opener that would put the HTML parser
# in the "double escaped" state, a closing tag, an unbalanced apostrophe, the JS line separators.
HOSTILE = "<!--<script>it's </script><img src=x onerror=window.X=1>\u2028\u2029"
HOSTILE_JOB = "javascript:window.X=1;void(0)"


def _hostile_sweep(demo_run: Path, tmp_path: Path) -> Path:
    sweep = tmp_path / "sweep"
    for job, value in (("0", HOSTILE), (HOSTILE_JOB, "plain")):
        shutil.copytree(demo_run, sweep / job)
        (sweep / job / ".hydra").mkdir(exist_ok=True)
        (sweep / job / ".hydra" / "overrides.yaml").write_text(json.dumps([f"model.name={value}"]) + "\n")
    return sweep


def test_a_hostile_sweep_page_stays_inert(demo_run, tmp_path) -> None:
    """Job folder names and override values reach the page as text: every link is a relative file
    link or an anchor, and the data block is JSON that closes where it should and reads back."""
    from circuitkit_app.report import write_sweep_report

    out = write_sweep_report(_hostile_sweep(demo_run, tmp_path))
    page = parse(out)
    hrefs = [a["href"] for tag, a in page.tags if tag == "a" and "href" in a]
    assert hrefs and all(h.startswith(("./", "#")) for h in hrefs), hrefs
    assert "./javascript%3Awindow.X%3D1%3Bvoid%280%29/report.html" in hrefs
    raw = page.scripts["report-data"]
    assert not any(bad in raw for bad in ("<!--", "<script", "</script", "\u2028", "\u2029"))
    data = json.loads(raw)  # the block ends where it should: it parses as a whole
    values = {j["job"]: j["values"] for j in data["sweep"]["jobs"]}
    assert values["0"]["model.name"] == HOSTILE and values[HOSTILE_JOB]["model.name"] == "plain"
    assert data["sweep"]["swept"] == ["model.name"]
    assert [tag for tag, _ in page.tags].count("img") == 0


def test_a_run_with_hostile_text_keeps_one_data_block(demo_run, tmp_path) -> None:
    """A model name holding `<!--<script>` leaves the page's scripts as written: the data block
    parses and gives the name back."""
    from circuitkit_app.report import write_run_report

    run = tmp_path / "run"
    shutil.copytree(demo_run, run)
    manifest = json.loads((run / "manifest.json").read_text())
    manifest["config"]["model"]["name"] = HOSTILE
    (run / "manifest.json").write_text(json.dumps(manifest))
    out = write_run_report(run, out=tmp_path / "page.html")
    page = parse(out)
    json.loads(page.scripts["report-data"])
    assert html.escape(HOSTILE) in out.read_text()  # shown as written, as text
    assert not any("<!--" in text or "<script" in text for text in page.scripts.values())
    assert [tag for tag, _ in page.tags].count("img") == 0


def test_a_rank_file_of_another_index_is_refused(demo_run, tmp_path, capsys) -> None:
    from circuitkit_app.gradian_cli import main

    ranked = tmp_path / "r.jsonl"
    assert main(["rank", "--index", str(demo_run / "index"), "--queries", str(QUERIES), "--top-k", "2",
                 "--out", str(ranked)]) == 0
    rows = [json.loads(line) for line in ranked.read_text().splitlines()]
    rows[0]["text_preview"] = "a row of another index"
    other = tmp_path / "other.jsonl"
    other.write_text("".join(json.dumps(r) + "\n" for r in rows))
    capsys.readouterr()
    assert main(["report", str(other), "--index", str(demo_run / "index"), "--out", str(tmp_path / "p.html")]) == 1
    err = " ".join(capsys.readouterr().err.split())
    assert "was not ranked against" in err and "Traceback" not in err and not (tmp_path / "p.html").exists()


def test_a_score_too_large_for_a_float_names_the_line(demo_run, tmp_path, capsys) -> None:
    from circuitkit_app.gradian_cli import main

    big = tmp_path / "big.jsonl"
    big.write_text('{"query": 0, "rank": 1, "row_id": 0, "score": 0.5}\n'
                   '{"query": 0, "rank": 2, "row_id": 1, "score": ' + "9" * 400 + "}\n")
    assert main(["report", str(big), "--index", str(demo_run / "index")]) == 1
    err = " ".join(capsys.readouterr().err.split())
    assert f"{big} line 2" in err and "does not fit a float" in err and "Traceback" not in err
