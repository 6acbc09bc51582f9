"""IOI corruption (`discovery.data_params.ioi_corruption`: s2 | abc) and held-out templates.

On the fixture tokenizer and the tiny GPT-2: pairs keep their length under both corruptions,
s2 changes only the second subject mention and abc the three name positions, the held-out
templates share no sentence with the attribution ones, and the pruning stage records the
corruption and the faithfulness on held-out templates (summary, manifest, circuit.pt).
"""

from __future__ import annotations

import re

import pytest
import torch
from transformers import AutoTokenizer

from circuitkit.core.config import ConfigError
from circuitkit.discovery.config import DataParams
from circuitkit.discovery.tasks import (
    TaskError,
    build_heldout_templates,
    build_task,
    heldout_template_count,
    ioi,
)
from circuitkit_app.config import compose


@pytest.fixture(scope="module")
def tok(tiny_model):
    return AutoTokenizer.from_pretrained(tiny_model("tiny-gpt2"))


def _real(data, i: int) -> list[int]:
    return data.clean_ids[i][data.attention_mask[i].bool()].tolist()


def _changed(data, i: int) -> list[int]:
    """Positions where row i's corrupted prompt differs from its clean prompt."""
    return (data.clean_ids[i] != data.corrupted_ids[i]).nonzero().flatten().tolist()


@pytest.mark.parametrize("templates", ["attribution", "heldout"])
def test_both_corruptions_keep_each_pair_length_and_the_clean_prompts(tok, templates):
    """Corrupted pairs line up token for token with their clean prompt; the clean prompts (and
    answers) do not depend on the corruption, so the two are measured on the same sentences."""
    def make(corruption):
        dp = DataParams(ioi_corruption=corruption)
        if templates == "heldout":
            return build_heldout_templates("ioi", tok, dp, 24, 5)
        return build_task("ioi", tok, None, dp, 24, 5)

    s2, abc = make("s2"), make("abc")
    for d in (s2, abc):
        assert d.clean_ids.shape == d.corrupted_ids.shape
        pad = ~d.attention_mask.bool()  # padding is shared by clean and corrupted
        assert torch.equal(d.clean_ids[pad], d.corrupted_ids[pad])
    assert torch.equal(s2.clean_ids, abc.clean_ids) and torch.equal(s2.attention_mask, abc.attention_mask)
    assert torch.equal(s2.correct, abc.correct) and torch.equal(s2.incorrect, abc.incorrect)


def test_s2_changes_only_the_second_subject_and_abc_all_three_names(tok):
    s2 = build_task("ioi", tok, None, DataParams(ioi_corruption="s2"), 24, 0)
    abc = build_task("ioi", tok, None, DataParams(ioi_corruption="abc"), 24, 0)
    name_ids = {tid for _, tid in ioi.single_token_names(tok)}
    for i in range(24):
        clean = _real(s2, i)
        io, s = int(s2.correct[i, 0]), int(s2.incorrect[i, 0])
        io_pos = [k for k, t in enumerate(clean) if t == io]
        s_pos = [k for k, t in enumerate(clean) if t == s]
        assert len(io_pos) == 1 and len(s_pos) == 2
        assert _changed(s2, i) == [s_pos[1]]  # S2 only
        assert _changed(abc, i) == sorted(io_pos + s_pos)  # IO, S1 and S2
        new = [int(abc.corrupted_ids[i, k]) for k in sorted(io_pos + s_pos)]
        assert len(set(new)) == 3 and set(new) <= name_ids and not set(new) & {io, s}
        # S2's replacement C is the same name under both corruptions.
        assert int(abc.corrupted_ids[i, s_pos[1]]) == int(s2.corrupted_ids[i, s_pos[1]])


def _frame(template: str) -> re.Pattern:
    """A template as a regex over filled-in sentences (each slot one word)."""
    return re.compile(re.sub(r"\\\{\w+\\\}", r"\\w+", re.escape(template)) + "$")


def test_heldout_templates_are_disjoint_from_the_attribution_templates(tok):
    """No held-out prompt could have come from an attribution template, and the reverse."""
    assert not set(ioi.HELDOUT_TEMPLATES) & set(ioi.TEMPLATES)
    attr = build_task("ioi", tok, None, DataParams(prepend_bos=False), 48, 0)
    held = build_heldout_templates("ioi", tok, DataParams(prepend_bos=False), 48, 0)
    attr_text = [tok.decode(_real(attr, i)) for i in range(len(attr))]
    held_text = [tok.decode(_real(held, i)) for i in range(len(held))]
    assert all(any(_frame(t).match(x) for t in ioi.TEMPLATES) for x in attr_text)  # the regexes do match
    assert all(any(_frame(t).match(x) for t in ioi.HELDOUT_TEMPLATES) for x in held_text)
    assert not any(_frame(t).match(x) for t in ioi.TEMPLATES for x in held_text)
    assert not any(_frame(t).match(x) for t in ioi.HELDOUT_TEMPLATES for x in attr_text)
    assert len({x.split(",")[0] for x in held_text}) > 3  # several held-out templates are drawn


def test_heldout_template_count_defaults_and_errors():
    assert heldout_template_count("ioi", DataParams(eval_examples=7)) == 7
    assert heldout_template_count("ioi", DataParams(heldout_template_examples=0)) == 0
    assert heldout_template_count("ioi", DataParams(heldout_template_examples=3)) == 3
    assert heldout_template_count("induction", DataParams()) == 0
    with pytest.raises(TaskError, match="heldout_template_examples=4, but the induction task has no held-out"):
        heldout_template_count("induction", DataParams(heldout_template_examples=4))
    with pytest.raises(ConfigError, match="ioi_corruption"):
        compose(["discovery.task=ioi", "discovery.data_params.ioi_corruption=abcd"])


def test_abc_needs_five_names(tok, monkeypatch):
    four = ioi.single_token_names(tok)[:4]
    monkeypatch.setattr(ioi, "single_token_names", lambda tokenizer: four)
    with pytest.raises(TaskError, match=r"at least 5 first names .* ioi_corruption=abc; found 4.*ioi_corruption=s2"):
        build_task("ioi", tok, None, DataParams(ioi_corruption="abc"), 4, 0)
    assert len(build_task("ioi", tok, None, DataParams(ioi_corruption="s2"), 4, 0)) == 4


@pytest.fixture(scope="module")
def abc_run(tmp_path_factory):
    from circuitkit_app.stage_list import run_pipeline

    run_dir = tmp_path_factory.mktemp("ioi_abc")
    _, cfg = compose(["stages=[data,attribution,pruning]", "model.precision=float32", "discovery.task=ioi",
                      "discovery.algorithm=eap", "discovery.data_params.num_examples=6",
                      "discovery.data_params.eval_examples=4", "discovery.data_params.heldout_template_examples=5",
                      "discovery.data_params.ioi_corruption=abc", "pruning.graph=false",
                      "pruning.bootstrap_resamples=0", "pruning.ablation=corrupted"])
    return run_dir, run_pipeline(cfg, run_dir)


def test_corruption_and_heldout_faithfulness_are_recorded(abc_run):
    from circuitkit.discovery.circuit import load_circuit
    from circuitkit.discovery.pruning.heads import Evaluator, faithfulness
    from circuitkit.discovery.tasks import TaskData
    from circuitkit.models.config import ModelConfig
    from circuitkit.models.loading import load_model

    run_dir, manifest = abc_run
    data_summary = manifest["stages"]["data"]["summary"]
    summary = manifest["stages"]["pruning"]["summary"]
    assert data_summary["corruption"] == "abc" and data_summary["heldout_template_examples"] == 5
    assert summary["corruption"] == "abc"
    c = load_circuit(run_dir / "circuit.pt")  # weights_only=True: plain types
    assert (c.task, c.corruption) == ("ioi", "abc")
    assert c.config["discovery"]["data_params"]["ioi_corruption"] == "abc"
    other = c.heldout_templates
    assert other["n_examples"] == 5 and summary["heldout_templates"] == other
    assert summary["faithfulness_heldout_templates"] == other["faithfulness"]
    # The figure is the circuit's faithfulness on the held-out-template pairs, with the same ablation.
    held = TaskData.load(run_dir / "data_heldout_templates.safetensors")
    assert len(held) == 5 and held.clean_ids.shape == held.corrupted_ids.shape
    adapter = load_model(ModelConfig(name="builtin:tiny-gpt2", precision="float32")).adapter
    evaluate = Evaluator(adapter, held, "logit_diff", "corrupted", None, 4)
    full, empty = evaluate(None), evaluate(torch.zeros_like(c.head_mask))
    circuit = evaluate(c.head_mask)
    assert other["full"] == pytest.approx(full, rel=1e-5) and other["empty"] == pytest.approx(empty, rel=1e-5)
    assert other["faithfulness"] == pytest.approx(faithfulness(circuit, full, empty), rel=1e-4, abs=1e-6)
    # The in-distribution figure is measured on other pairs (the data stage's held-out ones).
    assert c.metrics["full"] != pytest.approx(other["full"])


def test_heldout_templates_off(tmp_path):
    from circuitkit.discovery.circuit import load_circuit
    from circuitkit_app.stage_list import run_pipeline

    _, cfg = compose(["stages=[data,attribution,pruning]", "model.precision=float32", "discovery.task=ioi",
                      "discovery.algorithm=eap", "discovery.data_params.num_examples=4",
                      "discovery.data_params.eval_examples=2", "discovery.data_params.heldout_template_examples=0",
                      "pruning.graph=false", "pruning.bootstrap_resamples=0"])
    manifest = run_pipeline(cfg, tmp_path)
    summary = manifest["stages"]["pruning"]["summary"]
    assert "faithfulness_heldout_templates" not in summary and summary["corruption"] == "s2"
    assert not (tmp_path / "data_heldout_templates.safetensors").exists()
    c = load_circuit(tmp_path / "circuit.pt")
    assert c.heldout_templates is None and c.corruption == "s2"


def test_heldout_templates_for_a_task_without_them_is_a_config_error(tmp_path):
    from circuitkit.core.pipeline import PipelineError
    from circuitkit_app.stage_list import run_pipeline

    _, cfg = compose(["stages=[data]", "discovery.task=induction", "discovery.data_params.heldout_template_examples=3"])
    with pytest.raises((ConfigError, PipelineError), match="induction task has no held-out templates"):
        run_pipeline(cfg, tmp_path)
