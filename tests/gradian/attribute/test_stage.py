"""The pipeline's attribute stage (after grads) on the planted LoRA fixture of test_gradian_attribute.py.

`python -m circuitkit.run stages=[grads,attribute]` indexes the planted tune's rows, measures the
regression on the eval set and accuses the planted rows, writing <run dir>/attribute.json; a rerun with
the same inputs skips it, a changed eval set reruns it (and only it), a missing eval set is one line
before anything runs, and report.html shows the regression, the flipped items and the clusters.
"""

from __future__ import annotations

import html
import json
import shutil
from pathlib import Path

import pytest

import tests.gradian.attribute.test_attribute as planted
from circuitkit.core.io import sha256_file
from circuitkit_app.run import main as run_main
from tests.gradian.attribute.test_attribute import BASE_ROWS, PLANTED_IDS, TUNE_ROWS, WRONG, write_jsonl

models = planted.models  # the planted fixture's base model and adapters, built once per cache


def overrides(models: Path, root: Path, eval_path: Path | None, *extra: str, run_dir: Path | None = None) -> list[str]:
    """The planted tune's pipeline: its rows (root/train.jsonl) indexed through the adapter's linears,
    then attributed on `eval_path`, in `run_dir` (default root/run)."""
    return ["stages=[grads,attribute]", f"model.name={models / 'base'}", f"model.adapter={models / 'lora'}",
            "model.precision=float32", f"grads.data_path={root / 'train.jsonl'}", "grads.module_filter=[adapter]",
            "grads.projection_dim=16", "attribute.top_k=8", f"hydra.run.dir={run_dir or root / 'run'}",
            *([f"attribute.eval_path={eval_path}"] if eval_path is not None else []), *extra]


def run(argv: list[str], capsys) -> tuple[int, str]:
    capsys.readouterr()
    code = run_main(argv)
    return code, capsys.readouterr().err


@pytest.fixture(scope="module")
def pipeline_run(models, tmp_path_factory):
    """One run of the stage, the manifest it wrote, and its stderr."""
    root = tmp_path_factory.mktemp("attribute-stage")
    write_jsonl(root / "train.jsonl", TUNE_ROWS)
    eval_path = write_jsonl(root / "eval.jsonl", BASE_ROWS)
    code = run_main(overrides(models, root, eval_path))
    assert code == 0
    return root, eval_path, json.loads((root / "run" / "manifest.json").read_text())


def test_the_stage_writes_its_result_after_grads(pipeline_run) -> None:
    root, eval_path, manifest = pipeline_run
    entry = manifest["stages"]["attribute"]
    assert list(manifest["stages"]) == ["grads", "attribute"] and entry["status"] == "ok"
    result_path = root / "run" / "attribute.json"
    assert list(entry["artifacts"]) == ["attribute.json"]
    assert entry["artifacts"]["attribute.json"]["sha256"] == sha256_file(result_path)
    # what it read is fingerprinted: the eval set, the index (its manifest), the training data, the model
    inputs = entry["inputs"]
    assert inputs["attribute.eval_path"]["sha256"] == sha256_file(eval_path)
    assert inputs["index"]["path"] == str((root / "run" / "index" / "manifest.json").resolve())
    assert {"model", "model.adapter", "grads.data_path"} <= {k.split("/")[0] for k in inputs}

    from gradian.attribute.result import read_result

    result = read_result(result_path)
    assert result.attributed and result.regression["significant"]
    assert result.regression["flipped"] == list(range(8))  # the eight animal items
    assert result.query["query_loss"] == "contrastive" and result.engines == ["ekfac"]
    assert result.models["base"]["how"] == "the index's model without its adapter"
    assert result.eval_sha256 == sha256_file(eval_path)
    assert len(set(a["row_id"] for a in result.accused[:6]) & PLANTED_IDS) >= 5
    s = entry["summary"]
    assert (s["attributed"], s["flipped"], s["accused"], s["query_loss"], s["engines"]) == (True, 8, 8, "contrastive",
                                                                                           "ekfac")
    assert s["accuracy_drop"] == pytest.approx(8 / 24) and 0 < s["accuracy_ci_low"] < 8 / 24 < s["accuracy_ci_high"]


def test_an_identical_rerun_skips_and_a_changed_eval_set_reruns(pipeline_run, models, capsys) -> None:
    root, eval_path, first = pipeline_run
    result_path = root / "run" / "attribute.json"
    before = sha256_file(result_path)
    code, err = run(overrides(models, root, eval_path), capsys)
    stages = json.loads((root / "run" / "manifest.json").read_text())["stages"]
    assert code == 0 and "stage grads: up to date" in err and "stage attribute: up to date" in err, err[-2000:]
    assert stages["attribute"]["started"] == first["stages"]["attribute"]["started"] and sha256_file(result_path) == before

    write_jsonl(eval_path, BASE_ROWS[:8] + BASE_ROWS[16:])  # animals and opposites: the colours are gone
    code, err = run(overrides(models, root, eval_path), capsys)
    stages = json.loads((root / "run" / "manifest.json").read_text())["stages"]
    assert code == 0 and "stage grads: up to date" in err, err[-2000:]
    assert "stage attribute: input changed since the last run (attribute.eval_path), rerunning" in err
    assert stages["grads"]["started"] == first["stages"]["grads"]["started"]
    assert stages["attribute"]["status"] == "ok" and sha256_file(result_path) != before
    result = json.loads((root / "run" / "attribute.json").read_text())
    assert result["eval_sha256"] == sha256_file(eval_path) and result["regression"]["n_items"] == 16
    assert stages["attribute"]["summary"]["n_items"] == 16


@pytest.mark.parametrize("extra,needle,code", [
    ((), "Config key 'attribute.eval_path' is null, but stages lists attribute", 2),
    (("attribute.eval_path=MISSING",), "attribute.eval_path='", 2),
    (("stages=[grads]", "attribute.eval_path=eval.jsonl"), "stages does not list attribute", 2),
    (("model.adapter=null", "grads.module_filter=null", "attribute.eval_path=eval.jsonl"), "set model.adapter=DIR", 2),
])
def test_a_missing_eval_set_is_one_line_before_anything_runs(models, tmp_path, capsys, monkeypatch, extra, needle,
                                                             code) -> None:
    monkeypatch.delenv("CIRCUITKIT_DEBUG", raising=False)
    write_jsonl(tmp_path / "train.jsonl", TUNE_ROWS)
    write_jsonl(tmp_path / "eval.jsonl", BASE_ROWS)
    extra = tuple(e.replace("MISSING", str(tmp_path / "no-such.jsonl")).replace("=eval.jsonl", f"={tmp_path}/eval.jsonl")
                  for e in extra)
    got, err = run(overrides(models, tmp_path, None, *extra), capsys)
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert got == code and len(lines) == 1 and needle in lines[0], err[-2000:]
    assert "Traceback" not in err and not (tmp_path / "run").exists()


def test_the_report_shows_the_regression_the_flipped_items_and_the_clusters(pipeline_run) -> None:
    root, _, _ = pipeline_run
    page = (root / "run" / "report.html").read_text()
    section = page[page.index('<section id="attribute">'):]
    section = section[:section.index("</section>")]
    result = json.loads((root / "run" / "attribute.json").read_text())
    r = result["regression"]
    assert '<a href="#attribute">' in page
    assert f"{r['accuracy_drop']:+.3f}" in section and f"[{r['accuracy_ci'][0]:+.3f}, {r['accuracy_ci'][1]:+.3f}]" in section
    assert section.count('class="flipped"') == 8 and html.escape(f" {WRONG}.") in section  # what the tuned model says
    planted_cluster = next(c for c in result["clusters"] if set(c["rows"]) & PLANTED_IDS)
    assert f"{100 * planted_cluster['share']:.1f} %" in section and WRONG in planted_cluster["top_terms"]
    assert html.escape(f"The cat says {WRONG}.") in section  # an accused row's text, in its cluster
    assert "missing eos" in section  # the diagnose finding the cluster's rows share
    assert "the base model is the likelier culprit" in section


def _copy_run(root: Path, tmp_path: Path) -> Path:
    run_dir = tmp_path / "run"
    shutil.copytree(root / "run", run_dir, ignore=shutil.ignore_patterns("report.html"))
    return run_dir


def test_hostile_text_in_the_result_stays_inert(pipeline_run, tmp_path) -> None:
    """A prompt, an answer, a training row, a cluster term and a finding holding a script opener are
    shown as written, as text: no element comes of them and the page's scripts are unchanged."""
    from circuitkit_app.report import write_run_report
    from tests.app.test_report import HOSTILE, parse

    run_dir = _copy_run(pipeline_run[0], tmp_path)
    path = run_dir / "attribute.json"
    result = json.loads(path.read_text())
    flipped = next(it for it in result["items"] if it["flipped"])
    flipped["prompt"] = flipped["answer"] = flipped["tuned_says"] = HOSTILE
    result["accused"][0]["text_preview"] = HOSTILE
    result["clusters"][0]["top_terms"] = [HOSTILE]
    result["clusters"][0]["findings"][0]["text"] = HOSTILE
    result["reason"] = result["base_blame"]["summary"] = HOSTILE
    path.write_text(json.dumps(result))
    manifest = json.loads((run_dir / "manifest.json").read_text())
    manifest["stages"]["attribute"]["artifacts"]["attribute.json"]["sha256"] = sha256_file(path)
    (run_dir / "manifest.json").write_text(json.dumps(manifest))

    out = write_run_report(run_dir, out=tmp_path / "page.html")
    text, page = out.read_text(), parse(out)
    assert text.count(html.escape(HOSTILE)) >= 6  # shown as written, as text
    assert [tag for tag, _ in page.tags].count("img") == 0
    assert len(page.scripts) == 3 and {"report-data", "plotly-gz"} <= set(page.scripts)  # and report.js
    json.loads(page.scripts["report-data"])
    assert not any("<!--" in s or "<script" in s for s in page.scripts.values())


def test_no_section_without_a_finished_attribute_stage(pipeline_run, tmp_path) -> None:
    """A run without the stage shows nothing of it; nor does one whose attribute stage failed, though
    an older attribute.json is still on disk."""
    from circuitkit_app.report.collect import collect_run
    from circuitkit_app.report.page import render

    run_dir = _copy_run(pipeline_run[0], tmp_path)
    assert collect_run(run_dir)["attribute"]["attributed"] is True
    manifest = json.loads((run_dir / "manifest.json").read_text())
    manifest["stages"]["attribute"] = {"status": "failed", "error": "boom"}
    (run_dir / "manifest.json").write_text(json.dumps(manifest))
    assert "attribute" not in collect_run(run_dir)
    del manifest["stages"]["attribute"]
    (run_dir / "manifest.json").write_text(json.dumps(manifest))
    view = collect_run(run_dir)
    assert "attribute" not in view and 'id="attribute"' not in render(view, "t")


def test_gradian_attributes_flags_take_the_schemas_defaults_choices_and_ranges() -> None:
    """`gradian attribute --top-k/--query-loss/--bootstrap/--span-min-tokens` are the attribute keys'
    fields: the same default, choices and lower bound, so the command and the stage cannot drift."""
    import dataclasses

    from circuitkit.core.flags import subparser
    from gradian.cli import _parser
    from gradian.settings.attribute import AttributeConfig

    sub = subparser(_parser(), "attribute")
    actions = {a.dest: a for a in sub._actions}  # noqa: SLF001
    fields = {f.name: f for f in dataclasses.fields(AttributeConfig)}
    for key in ("top_k", "query_loss", "bootstrap", "span_min_tokens"):
        action, meta = actions[key], fields[key].metadata
        assert action.default == fields[key].default, key
        assert action.choices == meta["choices"], key
        bounds = getattr(action, "bounds", None)
        assert (bounds.ge if bounds else None) == meta["ge"], key
    assert sub.parse_args(["--index", "i", "--eval-dataset", "e"]).top_k == 40
    assert actions["query_loss"].choices == ("contrastive", "ce", "margin")
    assert actions["top_k"].bounds.le == 100_000  # the key's own upper bound


def test_the_section_shows_verify_and_the_spans_when_the_result_has_them(pipeline_run) -> None:
    """`gradian attribute --verify`'s retrains and the drill-down's sentences, as the result records them."""
    from circuitkit_app.report.accused import attribute_section, collect_attribute

    view = collect_attribute(pipeline_run[0] / "run" / "attribute.json")
    run = {"label": "without the 6 accused rows", "rows_trained": 16, "accuracy": 0.875, "logprob_mean": -1.5,
           "recovered_accuracy": 0.625, "recovered_logprob": 0.92, "flipped_right_again": 5, "flipped": 8,
           "flipped_same_mistake": 0}
    control = {**run, "label": "without 6 random rows <b>", "accuracy": 0.417, "recovered_accuracy": -0.75,
               "recovered_logprob": None, "flipped_right_again": 1, "flipped_same_mistake": 7}
    view["verify"] = {"settings": {"kind": "lora", "lr": 0.01, "steps": 30, "epochs": None, "batch_size": 22,
                                   "seed": 1}, "rows": 22,
                      "reference": {"base": {"accuracy": 1.0, "logprob_mean": -0.1},
                                    "tuned": {"accuracy": 0.667, "logprob_mean": -6.9}},
                      "runs": [run, control], "holds": True, "summary": "the accusation holds."}
    view["spans"] = {"min_tokens": 4, "engine": "ekfac", "note": None, "rows": [
        {"row_id": 8, "line": 9, "top": 1, "sentences": [
            {"text": "The cat purrs.", "share": 0.1, "token_span": [0, 4]},
            {"text": " It says new.", "share": 0.9, "token_span": [4, 8]}]}]}
    section = attribute_section(view)
    for part in ("Verify: the fine-tune redone (lora, lr 0.01, 30 steps, batch 22, seed 1) on 22 rows",
                 "<td class=num>62 %</td>", "<td class=num>-75 %</td>", "5 of 8", "without 6 random rows &lt;b&gt;",
                 "the accusation holds.", "Where the blame sits", " It says new.", "<td class=num>90 %</td>"):
        assert part in section, part


def test_a_failed_rerun_leaves_no_stale_result(pipeline_run, models, tmp_path, capsys) -> None:
    """An eval set changed into one the stage refuses: the rerun fails in one line, and neither the
    run dir nor its report keeps the result of the earlier eval set."""
    root, _, _ = pipeline_run
    run_dir = _copy_run(root, tmp_path)
    bad = write_jsonl(tmp_path / "eval.jsonl", [*BASE_ROWS[:3], {"prompt": "The cat says", "completion": ""}])
    code, err = run(overrides(models, root, bad, run_dir=run_dir), capsys)
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 1 and len(lines) == 1 and "stage 'attribute' failed" in lines[0] and "no answer" in lines[0], err
    assert "stage grads: up to date" in err and not (run_dir / "attribute.json").exists()
    assert json.loads((run_dir / "manifest.json").read_text())["stages"]["attribute"]["status"] == "failed"
    assert 'id="attribute"' not in (run_dir / "report.html").read_text()
