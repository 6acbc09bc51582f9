"""Several corruptions in one discovery (discovery.data_params.corruptions).

On the trained induction model (previous-token head L0H2 -> induction head L1H1) with corrupted
ablation. Besides the task's swap and fresh corruptions, a "value" corruption made here replaces
the answer's first occurrence by another symbol: the previous-token head's output is then the
clean one at every position the induction head reads, so that corruption removes L0H2's signal
(its ablated value is its live value) and a one-head circuit {L1H1} holds under it alone.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from circuitkit.discovery.attribution import attribute, load_scores, save_scores
from circuitkit.discovery.attribution.corruptions import combine, combine_shares
from circuitkit.discovery.attribution.eap import attribute_corruptions
from circuitkit.discovery.config import DataParams, PruningConfig
from circuitkit.discovery.pruning.heads import prune
from circuitkit.discovery.pruning.optimize import learn_head_mask
from circuitkit.discovery.tasks import build_task
from circuitkit.discovery.tasks.base import TaskData
from circuitkit.discovery.tasks.corruption_sets import check_corruptions, effective
from circuitkit.models.adapters import get_adapter
from circuitkit_app.config import compose
from tests.helpers.refusals import SMALL, error_lines, invoke

PREV_TOKEN, INDUCTION = (0, 2), (1, 1)
N_ATTR, N_EVAL = 8, 8


@pytest.fixture(scope="module")
def fixture(induction_model_dir):
    tok = AutoTokenizer.from_pretrained(induction_model_dir)
    model = AutoModelForCausalLM.from_pretrained(induction_model_dir).eval()
    for p in model.parameters():
        p.requires_grad_(False)
    dp = DataParams(seq_len=48)
    pairs = {c: build_task("induction", tok, str(induction_model_dir), dataclasses.replace(dp, induction_corruption=c),
                           N_ATTR + N_EVAL, 0) for c in ("swap", "fresh")}
    pairs["value"] = _value_corruption(pairs["swap"])
    return get_adapter(model), pairs


def _value_corruption(data: TaskData) -> TaskData:
    """The answer's first occurrence replaced by a symbol absent from the row, which becomes the
    incorrect answer (what the induction head copies in the corrupted prompt)."""
    corrupted, incorrect = data.clean_ids.clone(), data.incorrect.clone()
    for i in range(len(data)):
        row = data.clean_ids[i]
        answer = int(data.correct[i, 0])
        first = int((row == answer).nonzero()[0])
        symbols = sorted(set(data.clean_ids.flatten().tolist()) - set(row.tolist()))
        corrupted[i, first] = symbols[0]
        incorrect[i] = -1
        incorrect[i, 0] = symbols[0]
    return dataclasses.replace(data, corrupted_ids=corrupted, incorrect=incorrect)


def _kept(mask: torch.Tensor) -> set[tuple[int, int]]:
    return {tuple(lh) for lh in mask.nonzero().tolist()}


def test_one_clean_pass_gives_each_corruptions_own_scores_exactly(fixture):
    adapter, pairs = fixture
    datas = [pairs[c][:N_ATTR] for c in ("swap", "fresh")]
    joint = attribute_corruptions(adapter, datas, "eap-ig", ig_steps=3, batch_size=4, progress=False,
                                  per_example=True)
    for data, found in zip(datas, joint, strict=True):
        alone = attribute(adapter, data, "eap-ig", ig_steps=3, batch_size=4, progress=False, per_example=True)
        assert torch.equal(found.head, alone.head) and torch.equal(found.mlp, alone.mlp)
        assert found.metric_corrupted == alone.metric_corrupted
        assert torch.equal(found.per_example["head"], alone.per_example["head"])
    assert joint[0].metric_corrupted < -5 < 0 < joint[1].metric_corrupted  # the corruptions move m differently


def test_the_combined_scores_are_gap_normalised_shares_and_the_file_keeps_each(fixture, tmp_path):
    adapter, pairs = fixture
    found = attribute_corruptions(adapter, [pairs[c][:N_ATTR] for c in ("swap", "value")], "eap-ig", ig_steps=3,
                                  batch_size=8, progress=False)
    by = dict(zip(("swap", "value"), found, strict=True))
    gaps = {c: s.metric_clean - s.metric_corrupted for c, s in by.items()}
    # the value corruption leaves the previous-token head nearly nothing, swap needs it
    assert by["value"].head[PREV_TOKEN] / gaps["value"] < 0.1 < by["swap"].head[PREV_TOKEN] / gaps["swap"]
    mean = combine(by, "mean")
    shares = torch.stack([by[c].head / gaps[c] for c in by])
    scale = sum(gaps.values()) / 2
    assert torch.allclose(mean.head, shares.mean(0) * scale, rtol=1e-5)
    low, high = combine(by, "min"), combine(by, "max")
    assert torch.allclose(low.head[PREV_TOKEN], shares[1][PREV_TOKEN] * scale, rtol=1e-5)  # value's, the smaller
    assert torch.allclose(high.head[PREV_TOKEN], shares[0][PREV_TOKEN] * scale, rtol=1e-5)
    assert torch.equal(combine_shares(torch.tensor([[1.0, -3.0], [-2.0, 0.5]]), "min"), torch.tensor([1.0, 0.5]))
    path = save_scores(tmp_path / "scores.safetensors", mean)
    with safe_open(str(path), framework="pt") as fh:
        assert {"corruption.swap.head_scores", "corruption.value.head_scores"} <= set(fh.keys())
    back = load_scores(path)
    assert list(back.by_corruption) == ["swap", "value"] and torch.equal(back.head, mean.head)
    assert torch.equal(back.by_corruption["value"].head, by["value"].head)
    assert back.by_corruption["value"].metric_corrupted == by["value"].metric_corrupted


def test_a_joint_discovery_keeps_both_known_heads_and_a_single_corruption_circuit_fails_its_check(fixture):
    adapter, pairs = fixture
    names = ("value", "swap")
    found = attribute_corruptions(adapter, [pairs[c][:N_ATTR] for c in names], "eap-ig", ig_steps=3, batch_size=8,
                                  progress=False)
    by = dict(zip(names, found, strict=True))
    value = pairs["value"]
    held_out = {c: pairs[c][N_ATTR:] for c in names}
    one_head = PruningConfig(target_sparsity=7 / 8, bootstrap_resamples=0)
    # found with the value corruption alone: the induction head, faithful under that corruption ...
    alone = prune(adapter, by["value"], value[:N_ATTR], value[N_ATTR:], one_head, "logit_diff", 8)
    assert _kept(alone.selection.mask) == {INDUCTION} and alone.metrics["faithfulness"] > 0.8
    # ... but the joint check (worst over both corruptions) fails it: swap needs the previous-token head
    checked = prune(adapter, by["value"], value[:N_ATTR], value[N_ATTR:], one_head, "logit_diff", 8,
                    corruptions=held_out)
    joint = checked.extra["corruptions"]
    assert joint["names"] == list(names) and joint["rule"] == "worst"
    assert joint["by_corruption"]["value"]["faithfulness"] > 0.8 > 0.2 > joint["by_corruption"]["swap"]["faithfulness"]
    assert checked.metrics["faithfulness"] == joint["faithfulness"] < 0.2
    assert all(row["faithfulness"] == min(row["faithfulness_value"], row["faithfulness_swap"]) for row in checked.curve)
    # the joint discovery, at two heads, keeps both known heads and holds under each corruption
    for rule in ("mean", "max"):
        combined = combine(by, rule)
        both = prune(adapter, combined, value[:N_ATTR], value[N_ATTR:], PruningConfig(target_sparsity=0.75,
                     bootstrap_resamples=0), "logit_diff", 8, corruptions=held_out)
        assert _kept(both.selection.mask) == {PREV_TOKEN, INDUCTION}, rule
        assert min(b["faithfulness"] for b in both.extra["corruptions"]["by_corruption"].values()) > 0.9
        assert both.metrics["faithfulness"] > 0.9


@pytest.mark.parametrize("rule", ["worst", "mean"])
def test_a_mask_learned_under_every_corruption_keeps_the_head_only_one_of_them_needs(fixture, rule):
    adapter, pairs = fixture
    names = ("value", "swap")
    value_scores = attribute_corruptions(adapter, [pairs[c][:N_ATTR] for c in names], "eap-ig", ig_steps=3,
                                         batch_size=8, progress=False)[0]
    attr = {c: pairs[c][:N_ATTR] for c in names}
    # learned under the value corruption alone, the mask drops the previous-token head (its signal is gone) ...
    alone = torch.sigmoid(learn_head_mask(adapter, attr["value"], value_scores.head, steps=40, batch_size=8))
    assert _kept(alone > 0.5) == {INDUCTION} and alone[PREV_TOKEN] < 0.1
    # ... learned under both (each step's loss folded over the corruptions), it keeps it: swap needs it
    both = torch.sigmoid(learn_head_mask(adapter, attr["value"], value_scores.head, steps=40, batch_size=8,
                                         others=[attr["swap"]], rule=rule))
    assert _kept(both > 0.5) == {PREV_TOKEN, INDUCTION} and both[PREV_TOKEN] > 0.6, both
    # pruning.selection=mask in a joint discovery learns it so; the curve and the figure are the folded ones
    held_out = {c: pairs[c][N_ATTR:] for c in names}
    p = PruningConfig(selection="mask", mask_steps=40, target_sparsity=0.75, rank_by="signed", bootstrap_resamples=0)
    found = prune(adapter, value_scores, attr["value"], held_out["value"], p, "logit_diff", 8, corruptions=held_out,
                  corruption_faithfulness=rule, corruption_attr=attr)
    joint = found.extra["corruptions"]
    assert joint["mask_learned_under"] == list(names) and _kept(found.selection.mask) == {PREV_TOKEN, INDUCTION}
    assert min(b["faithfulness"] for b in joint["by_corruption"].values()) > 0.9
    fold_rule = min if rule == "worst" else (lambda *f: sum(f) / len(f))
    assert found.metrics["faithfulness"] == joint["faithfulness"]
    assert all(row["faithfulness"] == pytest.approx(fold_rule(row["faithfulness_value"], row["faithfulness_swap"]))
               for row in found.curve)


def test_one_listed_corruption_is_the_single_key():
    dp = DataParams(corruptions=["fresh"])
    assert effective("induction", dp) == DataParams(induction_corruption="fresh")
    assert effective("ioi", DataParams(corruptions=["abc"])).ioi_corruption == "abc"


@pytest.mark.parametrize(("task", "overrides", "named"), [
    ("greater_than", {"corruptions": ["s2", "abc"]}, "has one corruption"),
    ("ioi", {"corruptions": ["s2", "swap"]}, "swap is not a corruption of the ioi task"),
    ("ioi", {"corruptions": ["s2", "s2"]}, "twice"),
    ("ioi", {"corruptions": ["s2", "abc"], "ioi_corruption": "abc"}, "discovery.data_params.ioi_corruption='abc'"),
    ("induction", {"corruptions": ["swap", "fresh"], "induction_format": "single"}, "induction_format=repeat"),
    ("ioi", {"corruptions": []}, "names no corruption"),
])
def test_contradictory_corruption_settings_are_named(task, overrides, named):
    assert named in check_corruptions(task, DataParams(**overrides))
    assert check_corruptions("ioi", DataParams(corruptions=["abc", "s2"])) is None  # the default does not contradict
    assert "num_shards" in check_corruptions("ioi", DataParams(corruptions=["s2", "abc"]), num_shards=2)
    assert "pruning.scope" in check_corruptions("ioi", DataParams(corruptions=["s2", "abc"]), scope="edges")


def test_a_contradictory_run_exits_2_with_one_line(tmp_path, capsys):
    code, _, err = invoke("run", [*SMALL, "stages=[data]", "discovery.task=ioi",
                                  "discovery.data_params.corruptions=[s2,abc]",
                                  "discovery.data_params.ioi_corruption=abc", f"hydra.run.dir={tmp_path / 'run'}"],
                          capsys)
    lines = error_lines(err)
    assert code == 2 and len(lines) == 1 and "discovery.data_params.corruptions" in lines[0], err[-2000:]
    assert "discovery.data_params.ioi_corruption" in lines[0]


def test_the_pipeline_runs_both_corruptions_and_records_them(tmp_path, induction_model_dir):
    from circuitkit.core.circuit_file import load_circuit
    from circuitkit_app.stage_list import run_pipeline

    _, cfg = compose(["model=induction", "stages=[data,attribution,pruning]", "model.precision=float32",
                      "discovery.ig_steps=3", "discovery.batch_size=8", f"discovery.data_params.num_examples={N_ATTR}",
                      f"discovery.data_params.eval_examples={N_EVAL}", "discovery.data_params.seq_len=48",
                      "discovery.data_params.corruptions=[swap,fresh]", "pruning.target_sparsity=0.75",
                      "pruning.graph=false", "pruning.random_baselines=5", "pruning.bootstrap_resamples=10"])
    manifest = run_pipeline(cfg, tmp_path)
    assert (tmp_path / "data.fresh.safetensors").is_file()
    circuit = load_circuit(tmp_path / "circuit.pt")
    assert _kept(circuit["head_mask"]) == {PREV_TOKEN, INDUCTION}
    joint = circuit["corruptions"]
    assert joint["names"] == ["swap", "fresh"] and min(b["faithfulness"] for b in joint["by_corruption"].values()) > 0.9
    rows = {r["pillar"]: r for r in circuit["verdict"]["rows"]}
    assert "swap (discovery)" in rows["robustness"]["detail"] and "fresh (discovery)" in rows["robustness"]["detail"]
    summary = manifest["stages"]["pruning"]["summary"]
    assert summary["corruptions"] == ["swap", "fresh"] and set(summary["faithfulness_by_corruption"]) == {"swap", "fresh"}
    assert manifest["stages"]["attribution"]["summary"]["corruptions"] == ["swap", "fresh"]
    assert list(load_scores(tmp_path / "scores.safetensors").by_corruption) == ["swap", "fresh"]
    from circuitkit_app.report import write_run_report

    page = write_run_report(tmp_path).read_text()
    assert "corruptions (worst faithfulness)" in page and "swap 1.000" in page and "fresh (discovery)" in page


def test_generated_jsonl_corruptions_keep_the_rows_valid_under_every_one(tiny_model, tmp_path):
    import json

    from circuitkit.discovery.tasks.corruption_sets import build_corruption_set

    tok = AutoTokenizer.from_pretrained(tiny_model("tiny-gpt2"))
    names = [("Mary", " John"), ("Lisa", " Tom"), ("Anna", " Paul"), ("Kate", " Mark"), ("Emma", " David"),
             ("Sarah", " James")]
    path = tmp_path / "friends.jsonl"
    path.write_text("".join(json.dumps({"clean": f"The best friend of {c} is", "correct": a, "entity": c,
                                        "incorrect": " Bob"}) + "\n"
                            for c, a in names))
    dp = DataParams(data_path=str(path), prepend_bos=False)
    dropped = {1}  # a model check that finds token_replace leaves row 2's answer unchanged
    report: dict = {}

    def check(pairs: TaskData) -> torch.Tensor:
        ok = torch.ones(len(pairs), dtype=torch.bool)
        if check.calls == 1:
            ok[list(dropped)] = False
        check.calls += 1
        return ok
    check.calls = 0
    by = build_corruption_set("jsonl", tok, None, dp, ["entity_swap", "token_replace"], 6, 0, pair_check=check,
                              report=report)
    assert list(by) == ["entity_swap", "token_replace"] and len(by["entity_swap"]) == 5
    assert report["valid_under_all"] == 5 and report["token_replace"]["valid_pairs"] == 5
    assert torch.equal(by["entity_swap"].clean_ids, by["token_replace"].clean_ids)
    assert not torch.equal(by["entity_swap"].corrupted_ids, by["token_replace"].corrupted_ids)
