"""MIB's folder names as MIB's own code builds and reads them, and what the MIB export writes.

The name lists below are copies of MIB's, with their source:

* MODEL_NAME_TO_FULLNAME: hannamw/MIB-circuit-track, MIB_circuit_track/utils.py (module constant; the
  same keys in the leaderboard's mttk/MIB-circuit-track-autoeval, MIB_circuit_track/utils.py).
* TASKS: hannamw/MIB-circuit-track README.md ("each entry of TASKS should be in {...}") = the keys of
  TASKS_TO_HF_NAMES in hannamw's MIB_circuit_track/utils.py.
* AUTOEVAL_TASK_KEYS: mttk/MIB-circuit-track-autoeval, MIB_circuit_track/utils.py, TASKS_TO_HF_NAMES
  keys (both spellings), in their order.
* COL_MAPPING: hannamw/MIB-circuit-track, MIB_circuit_track/utils.py (keys).
* folder(): run_attribution.py, main(), the end of the task loop (hannamw's, as in gsarti and mwmlo's
  copies; cisnlp scripts/run_attribution.py method_to_path()):
  os.path.join(circuit_dir, method, f"{task.replace('_', '-')}_{model_name}").
* mib_outcome(): the autoeval driver (mttk/MIB-circuit-track-autoeval eval_submissions.py main(): the
  folder matcher, last matching key wins; run_evaluation.py run_evaluation(): COL_MAPPING filter;
  the aggregation's `task, model, _, _ = filename.split("_")` over f"{task}_{model}_{split}_abs-{a}.pkl").
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from circuitkit.discovery.attribution import AttributionScores, save_scores
from circuitkit.discovery.attribution.graph import Graph
from circuitkit.discovery.export.interop import to_eap_ig
from circuitkit.discovery.export.mib import (
    MIB_MODELS,
    MIB_SCORED,
    MIB_TASKS,
    MIB_UNSCORED_MODELS,
    check_mib,
    check_name,
    mib_folder_name,
    mib_match,
)
from circuitkit_app.cli import main

MODEL_NAME_TO_FULLNAME = {"gpt2": "gpt2-small", "qwen2.5": "Qwen/Qwen2.5-0.5B", "gemma2": "google/gemma-2-2b",
                          "llama3": "meta-llama/Llama-3.1-8B"}
TASKS = ("ioi", "mcqa", "arithmetic_subtraction", "arithmetic_addition", "arc_easy", "arc_challenge")
README_MODELS = ("interpbench", "gpt2", "qwen2.5", "gemma2", "llama3")  # hannamw README: MODELS
AUTOEVAL_TASK_KEYS = ("ioi", "mcqa", "arithmetic_addition", "arithmetic-addition", "arithmetic_subtraction",
                      "arithmetic-subtraction", "arc_easy", "arc-easy", "arc_challenge", "arc-challenge")
COL_MAPPING = ("ioi_gpt2", "ioi_qwen2.5", "ioi_gemma2", "ioi_llama3", "mcqa_qwen2.5", "mcqa_gemma2", "mcqa_llama3",
               "arithmetic-addition_llama3", "arithmetic-subtraction_llama3", "arc-easy_gemma2", "arc-easy_llama3",
               "arc-challenge_llama3")


def folder(task: str, model_name: str) -> str:
    return f"{task.replace('_', '-')}_{model_name}"


def mib_outcome(dir_name: str) -> str:
    """What the leaderboard does with a folder: 'scored', 'skipped' or 'crash' (written from its code)."""
    task = model = None
    for t in AUTOEVAL_TASK_KEYS:
        if dir_name.startswith(t) or f"_{t}" in dir_name:
            task = t
    for m in MODEL_NAME_TO_FULLNAME:
        if dir_name.startswith(m) or f"_{m}" in dir_name:
            model = m
    if task is None or model is None:
        return "skipped"  # "could not find valid model or task name"
    if f"{task.replace('_', '-')}_{model}" not in COL_MAPPING:
        return "skipped"  # run_evaluation returns None
    if len(f"{task}_{model}_test_abs-True.pkl".split("_")) != 4:
        return "crash"  # task_name, model_name, _, is_absolute = results_file.split("_")
    return "scored"


def _importances(path: Path) -> None:
    g = Graph(2, 2, 2, False)
    gen = torch.Generator().manual_seed(0)
    edges = torch.randn(g.edge_mask().shape, generator=gen) * g.edge_mask()
    obj = to_eap_ig(g, 8, torch.zeros(2, 2), torch.zeros(2), 0.0, edges, {n: True for n in g.upstream},
                    g.edge_mask(), node_scores=False)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj))


def test_our_lists_are_mibs():
    assert set(MIB_MODELS) == set(MODEL_NAME_TO_FULLNAME)
    assert set(MIB_TASKS) == set(TASKS)
    assert set(MIB_SCORED) == set(COL_MAPPING)
    assert set(MIB_MODELS) | set(MIB_UNSCORED_MODELS) == set(README_MODELS)


@pytest.mark.parametrize("model", README_MODELS)
@pytest.mark.parametrize("task", TASKS)
def test_every_folder_name_is_built_as_mib_builds_it(task, model):
    assert mib_folder_name(task, model) == folder(task, model)
    assert mib_folder_name(task.replace("_", "-"), model) == folder(task, model)  # both spellings accepted
    assert mib_folder_name(task.upper(), model) == folder(task, model)


def _names() -> list[str]:
    canonical = [folder(t, m) for t in TASKS for m in README_MODELS]
    underscored = [f"{t}_{m}" for t in TASKS for m in MODEL_NAME_TO_FULLNAME if "_" in t]
    other = ["ioi_qwen2_5", "mcqa_qwen2_5", "foo_gpt2", "ioi-gpt2", "ioi_smollm2", "IOI_gpt2", "ioi_gpt2_v2",
             "run1_ioi_gpt2", "mcqa_gpt2", "arc-easy_qwen2.5", "ioi", "gpt2"]
    return canonical + underscored + other


def test_check_mib_agrees_with_mibs_matcher_on_every_name(tmp_path):
    names = _names()
    for name in names:
        _importances(tmp_path / name / "one" / name / "importances.json")
    outcomes = {}
    for name in names:
        problems = check_mib(tmp_path / name / "one")
        outcomes[name] = (mib_outcome(name), problems)
        assert (problems == []) == (mib_outcome(name) == "scored"), (name, problems)
    assert sorted(n for n, (o, _) in outcomes.items() if o == "scored") == sorted(COL_MAPPING + ("ioi_gpt2_v2",
                                                                                               "run1_ioi_gpt2"))
    # the matcher we use is MIB's on every name
    for name in names:
        task, model = mib_match(name)
        assert mib_outcome(name) != "scored" or folder(task, model) in COL_MAPPING


def test_the_wrong_names_are_flagged_with_the_right_one():
    (p,) = check_name("ioi_qwen2_5")
    assert "skips the folder" in p and "name it ioi_qwen2.5" in p
    assert check_name("ioi_qwen2.5") == []
    (p,) = check_name("arithmetic_addition_llama3")
    assert "splits" in p and "name it arithmetic-addition_llama3" in p
    (p,) = check_name("arc_easy_gemma2")
    assert "name it arc-easy_gemma2" in p
    (p,) = check_name("mcqa_gpt2")
    assert "does not score mcqa_gpt2" in p
    (p,) = check_name("ioi_interpbench")
    assert "not scored by the leaderboard" in p and "interpbench_graph.json" in p
    assert any("more than one" in p for p in check_name("ioi_gpt2_llama3"))  # MIB's versions disagree on it


def _scores(tmp_path: Path, model: str, d_model: int = 8) -> Path:
    g = Graph(2, 2, 2, False)
    gen = torch.Generator().manual_seed(1)
    edges = torch.randn(g.edge_mask().shape, generator=gen) * g.edge_mask()
    s = AttributionScores(torch.randn(2, 2, generator=gen), torch.randn(2, generator=gen), torch.tensor(0.5), g, edges)
    return save_scores(tmp_path / "scores.safetensors", s, {"model": model})


def test_export_writes_mibs_names_and_refuses_near_misses(tmp_path, capsys):
    src = _scores(tmp_path, "builtin:tiny-gpt2")
    for spelling in ("arithmetic_addition", "arithmetic-addition"):
        assert main(["export", str(src), str(tmp_path / spelling), "--format", "mib", "--model", "llama3",
                     "--task", spelling, "--d-model", "8"]) == 0
        assert (tmp_path / spelling / "arithmetic-addition_llama3" / "importances.json").is_file()
        assert check_mib(tmp_path / spelling) == []
    assert main(["export", str(src), str(tmp_path / "q"), "--format", "mib", "--model", "qwen2.5", "--d-model", "8"]) == 0
    assert check_mib(tmp_path / "q") == [] and (tmp_path / "q" / "ioi_qwen2.5").is_dir()
    capsys.readouterr()
    assert main(["export", str(src), str(tmp_path / "bad"), "--format", "mib", "--model", "qwen2_5"]) == 2
    err = capsys.readouterr().err
    assert "qwen2.5" in err and not (tmp_path / "bad").exists()
    # interpbench: written (hannamw's scripts run it), and the check says the leaderboard does not score it
    assert main(["export", str(src), str(tmp_path / "ib"), "--format", "mib", "--model", "interpbench",
                 "--d-model", "8"]) == 0
    assert "not scored by the leaderboard" in capsys.readouterr().out
    assert main(["export", "--check-mib", str(tmp_path / "ib")]) == 1


def test_mib_export_has_no_node_scores_and_records_the_model(tmp_path):
    from circuitkit.core.io import sha256_file
    from circuitkit.models.loading import resolve_model_path

    directory = Path(resolve_model_path("builtin:tiny-gpt2"))  # an absolute local path, as model.name may be
    src = _scores(tmp_path, str(directory))
    assert main(["export", str(src), str(tmp_path / "sub"), "--format", "mib", "--model", "gpt2",
                 "--d-model", "8"]) == 0
    obj = json.loads((tmp_path / "sub" / "ioi_gpt2" / "importances.json").read_text())
    assert not any("score" in n for n in obj["nodes"].values())
    assert "omitted" in obj["cfg"]["node_scores"]
    name = obj["cfg"]["model_name"]
    assert name and not Path(name).is_absolute() and str(directory) not in json.dumps(obj["cfg"])
    (weights,) = sorted(directory.glob("*.safetensors"))
    assert obj["cfg"]["weights_sha256"] == sha256_file(weights)
    assert obj["cfg"]["mib_task"] == "ioi" and obj["cfg"]["mib_model"] == "gpt2"
    # the EAP-IG export records the same, and keeps its node scores
    assert main(["export", str(src), str(tmp_path / "g.json"), "--d-model", "8"]) == 0
    g = json.loads((tmp_path / "g.json").read_text())
    assert g["cfg"]["model_name"] == name and g["cfg"]["weights_sha256"] == sha256_file(weights)
    assert "score" in g["nodes"]["a0.h0"]


def test_export_help_lists_the_mib_options(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["export", "--help"])
    assert stop.value.code == 0
    out = capsys.readouterr().out
    assert all(flag in out for flag in ("--format {eap-ig-json,mib}", "--check-mib", "--mib-mode", "--model"))
    capsys.readouterr()
    main(["--help"])
    assert "--format mib" in capsys.readouterr().out
