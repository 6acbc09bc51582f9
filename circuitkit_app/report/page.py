"""report.html: one self-contained page from a report view (`collect.py`, `ranked.py`, `sweep.py`).

Text (tables, token lists) is rendered here as escaped HTML; the charts are drawn in the browser
by plotly.js from the JSON view embedded in the page (`assets/report.js`). plotly.js is the one
the `plotly` wheel ships (`plotly/package_data/plotly.min.js`, about 4.8 MB): it is stored
gzip-compressed and base64-encoded inside the page (about 1.9 MB) and unpacked by the browser's
own DecompressionStream, so the page needs no network and no server and stays small.
"""

from __future__ import annotations

import base64
import gzip
import json
import time
from functools import lru_cache
from importlib import metadata, resources
from pathlib import Path
from typing import Any

from circuitkit.core import DISTRIBUTION
from circuitkit_app.report.accused import attribute_section
from circuitkit_app.report.markup import Raw, esc, table

GENERATOR = "circuitkit report"


@lru_cache(maxsize=1)
def plotly_gz_b64() -> str:
    """plotly.min.js from the installed plotly wheel, gzip-compressed and base64-encoded (read as a
    file: importing plotly's Python side would cost more than the page)."""
    try:
        js = resources.files("plotly").joinpath("package_data", "plotly.min.js").read_bytes()
    except (ModuleNotFoundError, FileNotFoundError) as err:
        from circuitkit.core.errors import UserError

        raise UserError(f"report.html inlines plotly.js from the plotly package, which is missing or incomplete"
                        f" ({err}); pip install 'plotly>=5.20' (a dependency of this project).", exit_code=1) from None
    return base64.b64encode(gzip.compress(js, compresslevel=6, mtime=0)).decode()


def _asset(name: str) -> str:
    return resources.files("circuitkit_app.report").joinpath("assets", name).read_text()


# Inside <script> the HTML parser ends the element at `</script` and changes state at `<!--` and
# `<script` (the "double escaped" state, in which `</script>` no longer closes it), whatever the
# type: JSON that holds `<` is not inert there. Written as \uXXXX they are the same JSON string.
_SCRIPT_UNSAFE = str.maketrans({"<": "\\u003c", ">": "\\u003e", "&": "\\u0026", "\u2028": "\\u2028",
                                "\u2029": "\\u2029"})


def script_json(obj: Any) -> str:
    """`obj` as JSON that can sit inside <script type="application/json"> whatever its strings hold:
    `<`, `>`, `&` and U+2028/U+2029 written as \\u escapes (JSON.parse gives the same text back)."""
    return json.dumps(obj, allow_nan=False).translate(_SCRIPT_UNSAFE)


def _mib(b: Any) -> str:
    return "-" if not isinstance(b, (int, float)) else f"{b / 2**20:.1f}"


def _num(x: Any, digits: int = 4) -> str:
    if x is None:
        return "n/a"
    if isinstance(x, float):
        return f"{x:.{digits}g}"
    return esc(x)


def badge(status: Any) -> Raw:
    cls = "ok" if status == "ok" else "failed" if status in ("failed", "interrupted") else "other"
    return Raw(f'<span class="badge {cls}">{esc(status)}</span>')


def tokens_html(view: dict[str, Any] | None) -> Raw:
    """Tokens with the supervised ones marked (<mark>)."""
    if not view:
        return Raw('<span class="note">(text not available)</span>')
    parts = [f"<mark>{esc(t)}</mark>" if sup else f"<span>{esc(t)}</span>" for t, sup in view["tokens"]]
    more = f' <span class="note">… {view["more"]} more tokens</span>' if view.get("more") else ""
    return Raw(f'<div class="tokens">{"".join(parts)}{more}</div>')


# --------------------------------------------------------------------------- sections


def _source_html(source: dict[str, Any] | None, prefix: str = "") -> Raw:
    """Where the model came from (manifest `model_source`), one line per recorded fact."""
    if not source:
        return Raw("n/a")
    lines = []
    for key, value in source.items():
        if value in (None, "", [], {}):
            continue
        if isinstance(value, dict):
            lines.append(_source_html(value, f"{prefix}{key}."))
        else:
            lines.append(f"<b>{esc(prefix + key)}</b>: {esc(value)}")
    return Raw("<br>".join(lines))


def run_section(run: dict[str, Any]) -> str:
    stages = [[s["name"], badge(s["status"] + (" (cached)" if s["cached"] else "")),
               "-" if s["wall_s"] is None else f"{s['wall_s']:.2f}", _mib(s["estimated_peak_bytes"]),
               _mib(s["measured_peak_bytes"]), s["error"] or ", ".join(s["artifacts"])] for s in run["stages"]]
    changed = [r for r in run["config"] if r["changed"]]
    config_rows = [[r["key"], json.dumps(r["value"]), json.dumps(r["default"])] for r in run["config"]]
    versions = ", ".join(f"{k} {v}" for k, v in run["versions"].items())
    error = f'<p class="warn">{esc(run["error"])}</p>' if run.get("error") else ""
    return f"""<section id="run"><h2>Run</h2>{error}
{table(["", ""], [["model", run["model"]], ["model source", _source_html(run["model_source"])],
                  ["device", run["device"]], ["run directory", run["run_dir"]], ["command", run["command"]],
                  ["overrides", " ".join(run["overrides"]) or "(none)"], ["versions", versions]])}
<h3>Stages</h3>
{table(["stage", "status", "wall s", "est. peak MiB", "measured peak MiB", "artifacts / error"], stages, {2, 3, 4})}
<p class="note">Peak memory: the preflight's estimate against the measured peak ({esc(next(
        (s["peak_method"] for s in run["stages"] if s["peak_method"]), "n/a"))}).</p>
<div id="memory-terms"></div>
<h3>Config: {len(changed)} keys differ from the schema's defaults (highlighted)</h3>
{table(["key", "value", "default"], [[r["key"], json.dumps(r["value"]), json.dumps(r["default"])] for r in changed])}
<details><summary>every key ({len(config_rows)})</summary>
{table(["key", "value", "default"], config_rows, row_class=["changed" if r["changed"] else "" for r in run["config"]])}
</details></section>"""


def attribution_section(a: dict[str, Any]) -> str:
    info = a["info"]
    nodes = [[n["name"], _num(n["score"])] for n in a["top_nodes"]]
    edges = [[e["from"], e["to"], _num(e["score"])] for e in a["top_edges"]]
    per_ex = (f"per-example scores kept for {a['per_example_shown']} of {a['per_example_total']} examples:"
              " click a head (map or graph) to see them" if a.get("per_example_head") else
              "no per-example scores (discovery.per_example=false or an old run)")
    edge_table = (f"<div><h3>Top edges (of {a['n_edges']})</h3>{table(['from', 'to', 'score'], edges, {2})}</div>"
                  if edges else "<div><h3>Edges</h3><p class=note>node-level attribution: no edge scores</p></div>")
    return f"""<section id="attribution"><h2>Attribution</h2>
<p>{esc(info.get("algorithm"))} at {esc(info.get("level"))} level, metric {esc(info.get("metric"))},
ig_steps {esc(info.get("ig_steps"))}, {esc(a["n_examples"])} examples; metric clean {_num(a["metric_clean"])},
corrupted {_num(a["metric_corrupted"])}; input embedding score {_num(a["embed_score"])}.
<span class="note">{esc(per_ex)}</span></p>
<div id="head-map"></div><div id="head-detail" class="note">Click a head to see its score on every example.</div>
<div class="grid2"><div><h3>Top nodes</h3>{table(["node", "score"], nodes, {1})}</div>{edge_table}</div>
</section>"""


def circuit_section(c: dict[str, Any]) -> str:
    g, m = c["graph"], c["metrics"]
    held = c.get("heldout_templates") or {}
    cards = [("faithfulness", _num(m.get("faithfulness"))), ("heads kept", f"{c['heads_kept']} of {c['heads_total']}"),
             ("CPR / CMD", f"{_num(c['cpr'])} / {_num(c['cmd'])}"), ("selection", c["selection"] or "top_k"),
             ("scope", c["scope"]), ("ablation", c["ablation"])]
    if isinstance(held, dict) and held.get("faithfulness") is not None:
        cards.insert(1, ("faithfulness, held-out templates", _num(held.get("faithfulness"))))
    joint = c.get("corruptions")
    if joint:
        cards.append((f"corruptions ({joint['rule']} faithfulness)",
                      ", ".join(f"{name} {f:.3f}" if isinstance(f, float) else f"{name} n/a"
                                for name, f in joint["by_corruption"].items())))
    elif c.get("corruption"):
        cards.append(("corruption", c["corruption"]))
    headline = "".join(f"<div>{esc(k)}<b>{esc(v)}</b></div>" for k, v in cards)
    embedded = (f"Embedded: the {g['n_ranked']} strongest of {g['n_candidates']} candidate edges (report.top_edges ="
                f" {g['top_edges']}; candidates are the {'kept edges' if g['scope'] == 'edges' else 'edges between kept nodes'},"
                f" without those under 0.5% of the strongest), out of {g['n_edges_total']} edges in the graph; every edge"
                " counts in the per-layer totals below." if g["n_edges_total"] else
                "Node-level attribution: no edge scores, so only the nodes are drawn.")
    stab = c.get("stability") or {}
    stab_text = (f"Stability over {stab.get('n_resamples')} bootstrap resamples of {stab.get('n_examples')} examples:"
                 f" Jaccard mean {_num(stab.get('jaccard_mean'))}, 5th percentile {_num(stab.get('jaccard_p5'))},"
                 f" pairwise {_num(stab.get('pairwise_mean'))} (the bar Meloux et al. propose: 0.8)."
                 if stab else "No stability figure (it needs per-example scores).")
    return f"""<section id="circuit"><h2>Circuit</h2>
<div class="headline">{headline}</div>
<div class="controls"><label for="edge-slider">edges drawn (strongest first)</label>
<input type="range" id="edge-slider" min="1" step="1"><input type="number" id="edge-box" min="1" step="1" style="width:80px">
<span id="circuit-count" class="note"></span></div>
<p class="note">{esc(embedded)} Drag to pan, scroll to zoom, hover a node or edge for its score and its spread over
examples, click a head for its per-example scores. Line: q solid, k dashed, v dotted; blue carries the clean
behaviour, red works against it; width grows with |score|. Layers with nothing drawn are folded.</p>
<div id="circuit-graph" data-kept-heads="{esc(c["heads_kept"])}"></div>
<div id="layer-map"></div>
<h3 id="faithfulness">Faithfulness</h3>
<p>metric full {_num(m.get("full"))}, empty {_num(m.get("empty"))}, circuit {_num(m.get("circuit"))} on
{esc(c.get("n_eval_examples"))} held-out examples. <span class="note">{esc(c.get("curve_definition") or "")}</span></p>
<div id="curve"></div>
<p>{esc(stab_text)}</p><div id="stability-map"></div>
</section>"""


def verdict_section(v: dict[str, Any]) -> str:
    """The verdict table (circuit.pt `verdict`): one row per pillar, with its definition."""
    rows = [[r["pillar"], "not measured" if r["value"] is None else
             f"{r['value']:.1f}" if r["pillar"] == "baseline_random" else f"{r['value']:.3f}",
             r["detail"], r["definition"]] for r in v["rows"]]
    return f"""<section id="verdict"><h2>Verdict</h2>
<p>The circuit against circuits chosen without the task's attribution, whether the model needs it, and how it holds
under other corruptions and prompts: each figure a faithfulness measured like the circuit's own (same held-out pairs,
metric and ablation), on {esc(v.get("scope"))} ({esc(v.get("n_heads"))} heads).</p>
{table(["pillar", "value", "detail", "definition"], rows, {1})}</section>"""


def index_section(index: dict[str, Any]) -> str:
    return (f'<h3>Index {esc(index["index_dir"])}</h3>'
            f'{table(["", ""], index["rows"])}')


def rank_section(rank: dict[str, Any]) -> str:
    parts = [f"<h3>Ranked rows: {esc(rank['rank_file'])}</h3><p class=note>{rank['n_queries']} queries"
             f"{' (first ' + str(len(rank['queries']) - 1) + ' shown)' if rank['n_queries'] > len(rank['queries']) else ''};"
             " supervised tokens (what the loss predicts) are <mark>marked</mark>.</p>"]
    for q in rank["queries"]:
        title = "aggregate over all queries" if q["query"] == "aggregate" else f"query {q['query']}"
        rows = [[r["rank"], _num(r["score"]), r["row_id"], r["source_line"], tokens_html(r)] for r in q["rows"]]
        query_text = "" if q["query"] == "aggregate" else f"<p>query text:</p>{tokens_html(q['text'])}"
        parts.append(f"<details open><summary>{esc(title)}</summary>{query_text}"
                     f"{table(['rank', 'score', 'row', 'line', 'training row'], rows, {0, 1, 2, 3})}</details>")
    return "".join(parts)


def gradian_section(g: dict[str, Any]) -> str:
    body = index_section(g["index"]) if g.get("index") else ""
    if g.get("rank"):
        body += rank_section(g["rank"])
    elif g.get("index"):
        body += ("<p class=note>No ranked rows in this report: <code>gradian rank --index INDEX --queries Q.jsonl"
                 " --out RANK.jsonl --report</code>, or <code>circuitkit report RUN_DIR --rank RANK.jsonl --queries"
                 " Q.jsonl</code>.</p>")
    return f'<section id="gradian"><h2>Gradian</h2>{body}</section>'


def sweep_section(s: dict[str, Any]) -> str:
    rows = [[r["job"], r["overrides"], badge(r["status"]), "-" if r["wall_s"] is None else f"{r['wall_s']:.1f}",
             "-" if r["peak_mib"] is None else f"{r['peak_mib']:.1f}", _num(r["result"]),
             Raw(f'<a href="{esc(r["report"])}">report</a>') if r.get("report") else (r.get("error") or "")]
            for r in s["jobs"]]
    charts = "".join(f'<div class="grid3">{"".join(f"<div id=sweep-{i}-{j}></div>" for j in range(3))}</div>'
                     for i in range(len(s["swept"])))
    return f"""<section id="sweep"><h2>Sweep: {len(s["jobs"])} jobs, {s["failed"]} failed</h2>
<p>swept: {esc(", ".join(s["swept"]) or "(nothing varies)")}; result: {esc(s["result_label"])}</p>
{table(["job", "overrides", "status", "wall s", "peak MiB", "result", ""], rows, {3, 4, 5})}{charts}</section>"""


def render(view: dict[str, Any], title: str) -> str:
    """The whole page for a view (`kind`: run, rank or sweep)."""
    sections, nav = [], []
    for key, label, fn in (("sweep", "Sweep", sweep_section), ("run", "Run", run_section),
                           ("attribution", "Attribution", attribution_section), ("circuit", "Circuit", circuit_section),
                           ("gradian", "Gradian", gradian_section), ("attribute", "Attribute", attribute_section)):
        if view.get(key):
            sections.append(fn(view[key]))
            nav.append(f'<a href="#{key}">{label}</a>')
            if key == "circuit":
                nav.append('<a href="#faithfulness">Faithfulness</a>')
                if view[key].get("verdict"):
                    sections.append(verdict_section(view[key]["verdict"]))
                    nav.append('<a href="#verdict">Verdict</a>')
    notes = "".join(f'<p class="warn">{esc(n)}</p>' for n in view.get("notes") or [])
    charts = {k: view.get(k) for k in ("attribution", "circuit", "sweep")}
    charts["memory"] = {k: (view.get("run") or {}).get(k) for k in ("memory_terms", "free_bytes")}
    data = script_json(charts)
    try:
        version = metadata.version(DISTRIBUTION)
    except metadata.PackageNotFoundError:
        version = "?"
    stamp = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><meta name="generator" content="{GENERATOR} {esc(version)}">
<meta name="viewport" content="width=device-width, initial-scale=1"><title>{esc(title)}</title>
<style>{_asset("report.css")}</style></head>
<body><header><h1>{esc(title)}</h1><p>written {esc(stamp)} by circuitkit {esc(version)}; one file, no network
(plotly.js {esc(_plotly_version())} inlined)</p></header>
<nav>{"".join(nav)}</nav><main><p id="load-error" class="warn" hidden></p>{notes}{"".join(sections)}</main>
<script id="report-data" type="application/json">{data}</script>
<script id="plotly-gz" type="application/octet-stream">{plotly_gz_b64()}</script>
<script>{_asset("report.js")}</script>
</body></html>
"""


def _plotly_version() -> str:
    try:
        return metadata.version("plotly")
    except metadata.PackageNotFoundError:
        return "?"


def write_page(view: dict[str, Any], title: str, out: Path) -> Path:
    """Render and write atomically; returns `out`."""
    from circuitkit.core.io import atomic_write_bytes

    out = Path(out)
    atomic_write_bytes(out, render(view, title).encode())
    return out
