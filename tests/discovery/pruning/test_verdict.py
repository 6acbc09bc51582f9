"""The verdict, wired. The pruning stage measures the pillars on its circuit with its own
evaluator and writes them to circuit.pt, the manifest, `circuitkit show` and the report.

On the trained induction model, whose circuit (previous-token head L0H2 -> induction head L1H1) is
known: the circuit beats random circuits of its shape, the model needs it, and it holds under the
task's other corruption. The figures measured through the stage are checked against the same
measures called by hand (`pillars.py`, tested in test_pillars.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from circuitkit.core.circuit_file import Circuit, CircuitFileError, load_circuit, save_circuit
from circuitkit.core.config import ConfigError
from circuitkit.discovery.config import DataParams
from circuitkit.discovery.pruning.pillars import DEFINITIONS, PILLARS
from circuitkit.discovery.pruning.verdict import other_corruptions, robustness_pairs
from circuitkit.discovery.tasks import build_task
from circuitkit_app.config import compose

N_RANDOM = 20
INDUCTION = ["model=induction", "stages=[data,attribution,pruning]", "model.precision=float32",
             "discovery.ig_steps=3", "discovery.batch_size=8", "discovery.data_params.num_examples=8",
             "discovery.data_params.eval_examples=8", "discovery.data_params.seq_len=48",
             "pruning.target_sparsity=0.75", "pruning.graph=false", f"pruning.random_baselines={N_RANDOM}"]


def _run(run_dir: Path, *overrides: str) -> tuple[dict, Circuit]:
    from circuitkit_app.stage_list import run_pipeline

    _, cfg = compose(list(overrides))
    manifest = run_pipeline(cfg, run_dir)
    return manifest, load_circuit(run_dir / "circuit.pt")


@pytest.fixture(scope="module")
def induction_run(tmp_path_factory, induction_model_dir):
    run_dir = tmp_path_factory.mktemp("verdict") / "induction"
    manifest, circuit = _run(run_dir, *INDUCTION)
    return run_dir, manifest, circuit


def _rows(circuit) -> dict[str, dict]:
    return {row["pillar"]: row for row in circuit["verdict"]["rows"]}


def _shown(row: dict, missing: str) -> str:
    """A row's value as show and the report print it: a percentile to 0.1, a faithfulness to 0.001."""
    if row["value"] is None:
        return missing
    return f"{row['value']:.1f}" if row["pillar"] == "baseline_random" else f"{row['value']:.3f}"


def test_the_pruning_stage_writes_every_pillar_with_its_definition(induction_run):
    _, manifest, circuit = induction_run
    kept = {tuple(lh) for lh in circuit["head_mask"].nonzero().tolist()}
    assert kept == {(0, 2), (1, 1)}  # the known circuit
    verdict = circuit["verdict"]
    rows = _rows(circuit)
    assert list(rows) == ["faithfulness", *PILLARS]
    assert all(row["definition"] == DEFINITIONS[name] for name, row in rows.items())
    assert verdict["scope"] == "heads" and verdict["n_heads"] == 2
    # the verdict's faithfulness is the stage's own figure: same evaluator, same pairs
    assert rows["faithfulness"]["value"] == circuit["metrics"]["faithfulness"] > 0.9
    random = verdict["figures"]["baseline_random"]
    assert random["n"] == N_RANDOM and rows["baseline_random"]["value"] == random["percentile"] > 90
    assert random["mean"] < 0.5 and f"{N_RANDOM} random circuits" in rows["baseline_random"]["detail"]
    assert rows["necessity"]["value"] < 0.3  # the model needs the circuit
    # induction (repeat format, swap corruption): robustness under the other one, fresh
    assert set(verdict["figures"]["robustness"]) == {"fresh"} and rows["robustness"]["value"] > 0.8
    assert rows["generalization"]["value"] is None and "no held-out templates" in rows["generalization"]["detail"]
    assert rows["stability"]["value"] == circuit["stability"]["jaccard_mean"]  # reused, not remeasured
    for name in ("baseline_magnitude", "baseline_wanda"):
        assert 0.0 <= rows[name]["value"] <= 1.01 and "of 2 shared with the circuit" in rows[name]["detail"]
    # the manifest records the same figures
    summary = manifest["stages"]["pruning"]["summary"]
    assert summary["verdict"] == {name: row["value"] for name, row in rows.items()}
    assert summary["verdict_wall_s"] > 0


def test_the_random_baseline_of_the_stage_is_the_measure_called_by_hand(induction_run):
    """The stage's figure is `random_baseline` on the held-out pairs with the pruning ablation and the run's seed."""
    from circuitkit.discovery.pruning.heads import Evaluator
    from circuitkit.discovery.pruning.pillars import random_baseline
    from circuitkit.discovery.tasks import TaskData
    from circuitkit.models.loading import load_model

    run_dir, _, circuit = induction_run
    lm = load_model(compose(INDUCTION)[1].model)
    held_out = TaskData.load(run_dir / "data.safetensors")[8:]  # after the 8 attribution pairs
    evaluate = Evaluator(lm.adapter, held_out, "logit_diff", "corrupted", None, 8)
    m = circuit["metrics"]
    by_hand = random_baseline(evaluate, circuit["head_mask"], m["faithfulness"], m["full"], m["empty"], N_RANDOM, 0)
    assert by_hand == pytest.approx(circuit["verdict"]["figures"]["baseline_random"])


def test_show_prints_the_verdict_table(induction_run, capsys, monkeypatch):
    from circuitkit_app.cli import main

    monkeypatch.setenv("COLUMNS", "220")
    run_dir, _, circuit = induction_run
    capsys.readouterr()
    assert main(["show", str(run_dir / "circuit.pt")]) == 0
    out = capsys.readouterr().out
    assert "verdict (heads, 2 heads)" in out
    lines = {line.split("│")[1].strip(): line for line in out.splitlines() if line.count("│") >= 4}
    for name, row in _rows(circuit).items():
        assert _shown(row, "-") in lines[name] and DEFINITIONS[name][:30] in lines[name], (name, lines.get(name))


def test_the_report_has_the_verdict_section(induction_run):
    run_dir, _, circuit = induction_run
    html = (run_dir / "report.html").read_text()
    assert '<section id="verdict">' in html and 'href="#verdict"' in html
    section = html[html.index('<section id="verdict">'):]
    section = section[:section.index("</section>")]
    for name, row in _rows(circuit).items():
        assert f"<td>{name}</td><td class=num>{_shown(row, 'not measured')}</td>" in section
    assert "percentile of the circuit&#x27;s faithfulness among random circuits" in section  # escaped text
    tag = '<script id="report-data" type="application/json">'
    start = html.index(tag) + len(tag)
    data = json.loads(html[start:html.index("</script>", start)])
    assert [r["pillar"] for r in data["circuit"]["verdict"]["rows"]] == ["faithfulness", *PILLARS]


def test_the_verdict_section_escapes_every_text():
    from circuitkit_app.report.page import verdict_section

    hostile = "<script>alert(1)</script>"
    html = verdict_section({"scope": hostile, "n_heads": 2, "rows": [
        {"pillar": hostile, "value": 0.5, "detail": hostile, "definition": hostile},
        {"pillar": "robustness", "value": None, "detail": "why", "definition": "d"}]})
    assert "<script>" not in html and html.count("&lt;script&gt;") == 4 and "not measured" in html


def test_circuit_files_without_a_verdict_still_load_and_show(induction_run, tmp_path, capsys):
    from circuitkit.discovery.circuit import show_circuit

    run_dir, _, _ = induction_run
    raw = torch.load(run_dir / "circuit.pt", weights_only=True)
    del raw["verdict"]
    torch.save(raw, tmp_path / "old.pt")
    assert load_circuit(tmp_path / "old.pt").verdict is None
    show_circuit(tmp_path / "old.pt")
    assert "no verdict" in capsys.readouterr().out


@pytest.mark.parametrize("row", [{"pillar": "necessity", "value": "low", "detail": "", "definition": "d"},
                                 {"pillar": "necessity", "value": 0.1, "detail": ""},
                                 {"pillar": 3, "value": 0.1, "detail": "", "definition": "d"}])
def test_the_reader_checks_the_verdict_rows(induction_run, tmp_path, row):
    run_dir, _, circuit = induction_run
    save_circuit(tmp_path / "ok.pt", circuit)
    assert load_circuit(tmp_path / "ok.pt").verdict["rows"] == circuit["verdict"]["rows"]  # plain types round-trip
    raw = torch.load(run_dir / "circuit.pt", weights_only=True)
    raw["verdict"]["rows"][1] = row
    torch.save(raw, tmp_path / "bad.pt")
    with pytest.raises(CircuitFileError, match="verdict row 1"):
        load_circuit(tmp_path / "bad.pt")


@pytest.mark.parametrize("value", ["-1", "10001"])
def test_random_baselines_is_range_checked(value):
    with pytest.raises(ConfigError, match=r"pruning\.random_baselines.*out of range"):
        compose([f"pruning.random_baselines={value}"])


def test_other_corruptions_per_task():
    assert other_corruptions("ioi", DataParams())[0] == ("abc",)
    assert other_corruptions("ioi", DataParams(ioi_corruption="abc"))[0] == ("s2",)
    assert other_corruptions("induction", DataParams())[0] == ("fresh",)
    assert other_corruptions("induction", DataParams(induction_corruption="fresh"))[0] == ("swap",)
    none, why = other_corruptions("induction", DataParams(induction_format="single"))
    assert none == () and "single format" in why
    none, why = other_corruptions("greater_than", DataParams())
    assert none == () and "greater_than task has one corruption" in why


def test_robustness_pairs_are_the_held_out_prompts_under_the_other_corruption(tiny_model):
    tok = AutoTokenizer.from_pretrained(tiny_model("tiny-gpt2"))
    dp = DataParams()  # s2
    data = build_task("ioi", tok, None, dp, 12, 3)
    pairs, failed = robustness_pairs("ioi", dp, tok, None, 8, 12, 3)
    assert failed == {} and set(pairs) == {"abc"}
    abc = pairs["abc"]
    assert torch.equal(abc.clean_ids, data[8:].clean_ids) and torch.equal(abc.correct, data[8:].correct)
    assert not torch.equal(abc.corrupted_ids, data[8:].corrupted_ids)
    assert robustness_pairs("greater_than", dp, tok, None, 8, 12, 3) == ({}, {"robustness": "the greater_than task"
                                                                               " has one corruption"})


def test_an_edge_circuit_is_judged_by_its_head_set(tmp_path_factory, tiny_model_dir):
    """ioi on the tiny GPT-2 at edge scope: the pillars on the head set, robustness under abc,
    generalization on the held-out templates, and no baselines with random_baselines=0."""
    run_dir = tmp_path_factory.mktemp("verdict") / "edges"
    manifest, circuit = _run(run_dir, "stages=[data,attribution,pruning]", "model.precision=float32",
                             "discovery.task=ioi", "discovery.level=edge", "pruning.scope=edges", "discovery.ig_steps=2",
                             "discovery.data_params.num_examples=4", "discovery.data_params.eval_examples=4",
                             "pruning.graph=false", "pruning.random_baselines=0", "report.enabled=false")
    verdict, rows = circuit["verdict"], _rows(circuit)
    assert verdict["scope"] == "head set of an edge circuit"
    assert verdict["n_heads"] == int(circuit["head_mask"].sum())
    assert "the edge circuit itself" in rows["faithfulness"]["detail"]
    for name in ("baseline_random", "baseline_magnitude", "baseline_wanda"):
        assert rows[name]["value"] is None and "random_baselines=0" in rows[name]["detail"]
    assert set(verdict["figures"]["robustness"]) == {"abc"}
    assert rows["generalization"]["value"] is not None and "4 pairs" in rows["generalization"]["detail"]
    assert "(of the kept edges)" in rows["stability"]["detail"]
    assert set(manifest["stages"]["pruning"]["summary"]["verdict"]) == {"faithfulness", *PILLARS}
