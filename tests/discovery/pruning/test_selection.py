"""Per-example scores, stability, bootstrapped selection, the greedy oracle, MIB's CPR/CMD,
and the edge-circuit evaluator against its straightforward form."""

from __future__ import annotations

import functools

import pytest
import torch

from circuitkit.discovery.attribution import attribute, exact_patching, graph_of
from circuitkit.discovery.config import DataParams
from circuitkit.discovery.pruning.edges import EdgeEvaluator, mean_writes
from circuitkit.discovery.pruning.heads import CURVE_PERCENTS, curve_areas, curve_count, keep_top
from circuitkit.discovery.pruning.selection import (
    bootstrap_select,
    bootstrap_weights,
    greedy_heads,
    greedy_mask,
)
from circuitkit.discovery.pruning.stability import jaccard, stability
from circuitkit.discovery.tasks import build_task
from circuitkit.models.config import ModelConfig
from circuitkit.models.loading import load_model
from tests.helpers.reference_edges import reference_metric


@functools.cache
def loaded(name: str):
    return load_model(ModelConfig(name=f"builtin:{name}", precision="float32"))


@functools.cache
def pairs(name: str, n: int = 6):
    lm = loaded(name)
    return build_task("induction", lm.tokenizer, lm.path, DataParams(seq_len=16, induction_format="single"), n, 0)


def curve(fs):
    return [{"percent_kept": p, "faithfulness": f} for p, f in zip(CURVE_PERCENTS, fs, strict=True)]


def test_cpr_cmd_match_a_case_computed_by_hand():
    xs = [p / 100 for p in CURVE_PERCENTS]  # 0.001 .. 1
    # f = share kept: CPR = Σ (x2² - x1²) / 2 = (1 - 0.001²) / 2; CMD = (1 - 0.001) - CPR
    cpr, cmd = curve_areas(curve(xs))
    assert cpr == pytest.approx(0.4999995, abs=1e-9) and cmd == pytest.approx(0.4990005, abs=1e-9)
    assert curve_areas(curve([1.0] * 10)) == pytest.approx((0.999, 0.0))
    # f = 2 everywhere: CPR counts the overshoot, CMD its distance from 1
    assert curve_areas(curve([2.0] * 10)) == pytest.approx((1.998, 0.999))
    # one point off: only its two trapezoids move (x = 0.1 between 0.05 and 0.2)
    fs = [1.0] * 10
    fs[6] = 0.0
    assert curve_areas(curve(fs)) == pytest.approx((0.999 - (0.2 - 0.05) / 2, (0.2 - 0.05) / 2))


def test_curve_counts_floor_like_mib():
    assert [curve_count(p, 70651) for p in CURVE_PERCENTS] == [70, 141, 353, 706, 1413, 3532, 7065, 14130,
                                                               35325, 70651]
    assert [curve_count(p, 270) for p in CURVE_PERCENTS] == [0, 0, 1, 2, 5, 13, 27, 54, 135, 270]


def test_per_example_scores_average_to_the_scores_and_match_single_examples():
    lm, data = loaded("tiny-llama"), pairs("tiny-llama")
    s = attribute(lm.adapter, data, "eap-ig", "edge", ig_steps=2, batch_size=3, progress=False, per_example=True,
                  group_by_length=False)
    assert s.per_example["head"].shape == (6, *s.head.shape)
    assert s.per_example["edges"].shape == (6, *s.edges.shape)
    assert torch.allclose(s.per_example["head"].mean(0), s.head, atol=1e-6)
    assert torch.allclose(s.per_example["edges"].mean(0), s.edges, atol=1e-6)
    one = attribute(lm.adapter, data[4:5], "eap-ig", "edge", ig_steps=2, batch_size=1, progress=False)
    assert torch.allclose(s.per_example["head"][4], one.head, atol=1e-5)
    assert torch.allclose(s.per_example["edges"][4], one.edges, atol=1e-5)


def test_jaccard_and_stability():
    a = torch.tensor([True, True, False, False])
    assert jaccard(a, torch.tensor([True, False, True, False])) == pytest.approx(1 / 3)
    same = torch.tensor([[3.0, 2.0, 1.0, 0.0]]).repeat(8, 1)
    st = stability(same, 2, "abs", 50)
    assert st["jaccard_mean"] == 1.0 and st["jaccard_p5"] == 1.0 and st["n_resamples"] == 50
    gen = torch.Generator().manual_seed(0)
    noisy = torch.randn(8, 40, generator=gen)
    st = stability(noisy, 5, "abs", 100)
    assert 0.0 < st["jaccard_p5"] <= st["jaccard_mean"] < 0.9
    w = bootstrap_weights(8, 100, 0)
    assert w.shape == (100, 8) and torch.all(w.sum(1) == 8)


def test_bootstrap_selection_keeps_the_entries_most_often_in_a_resamples_top_n():
    gen = torch.Generator().manual_seed(0)
    # heavy-tailed per-example scores: a few entries live on single examples
    per_ex = torch.randn(12, 30, generator=gen) * 0.3 + torch.linspace(0, 1.5, 30)
    per_ex[torch.randint(0, 12, (6,), generator=gen), torch.arange(6)] += 15.0
    n = 6
    chosen = bootstrap_select(per_ex, n, "abs", 200, 7)
    # the definition, counted directly: per resample, the mean over its drawn examples and its top n
    w = bootstrap_weights(12, 200, 7)
    counts = torch.zeros(30)
    for r in range(200):
        idx = torch.repeat_interleave(torch.arange(12), w[r].long())
        counts += keep_top(per_ex[idx].mean(0), n, "abs").float()
    top_counts = counts.sort(descending=True).values
    assert int(chosen.sum()) == n and counts[chosen].min() >= top_counts[n - 1]
    top = keep_top(per_ex.mean(0), n, "abs")
    assert int(chosen[6:].sum()) > int(top[6:].sum())  # here it trades a one-example entry for a consistent one
    # identical examples: every resample agrees, so the selection is top-k
    same = per_ex[:1].repeat(12, 1)
    assert torch.equal(bootstrap_select(same, n, "abs", 50, 0), keep_top(same.mean(0), n, "abs"))


def test_greedy_adds_the_head_that_raises_the_metric_most():
    weights = torch.tensor([[0.1, 3.0], [2.0, -1.0]])

    def evaluate(kept):  # additive, plus a bonus when both (0, 0) and (1, 1) are kept
        return float((weights * kept).sum()) + (10.0 if kept[0, 0] and kept[1, 1] else 0.0)
    rows = greedy_heads(evaluate, (2, 2), 2)
    assert [r["head"] for r in rows] == [[0, 1], [1, 0]] and rows[-1]["metric"] == pytest.approx(5.0)
    rows = greedy_heads(evaluate, (2, 2), 4)
    assert rows[-1]["metric"] == pytest.approx(14.1)
    assert greedy_mask(rows, (2, 2), 1).tolist() == [[False, True], [False, False]]


@pytest.mark.parametrize("name", ["tiny-gpt2", "tiny-neox", "tiny-llama", "tiny-gemma3"])
def test_edge_evaluator_matches_the_direct_sum_over_removed_edges(name):
    """The running-sum evaluator equals shifting each input by Σ_{u→v removed} (live_u - ablated_u),
    written out directly (tests/reference_edges.py: the first implementation, full removed mask)."""
    lm, data = loaded(name), pairs(name)
    valid = graph_of(lm.adapter).edge_mask()
    gen = torch.Generator().manual_seed(1)
    means = mean_writes(lm.adapter, data, 3)
    for ablation in ("corrupted", "mean"):
        ev = EdgeEvaluator(lm.adapter, data, "logit_diff", ablation, means if ablation == "mean" else None, 3)
        assert ev.forward(valid) == pytest.approx(ev(None), abs=1e-5)
        if ablation == "corrupted":
            assert ev.forward(torch.zeros_like(valid)) == pytest.approx(ev(torch.zeros_like(valid)), abs=1e-5)
        values = []
        for p in (0.02, 0.3, 0.8):
            kept = (torch.rand(valid.shape, generator=gen) < p) & valid
            values.append(ev.forward(kept))
            assert values[-1] == pytest.approx(reference_metric(ev, kept), abs=1e-4)
        assert len(set(round(v, 4) for v in values)) >= 2  # the masks matter


def test_pipeline_writes_stability_and_selection(tmp_path):
    from circuitkit.discovery.circuit import load_circuit, show_circuit
    from circuitkit_app.config import compose
    from circuitkit_app.stage_list import run_pipeline

    _, cfg = compose(["model=induction", "stages=[data,attribution,pruning]", "pruning.selection=bootstrap",
                      "pruning.bootstrap_resamples=20", "pruning.graph=false", "pruning.ablation=corrupted",
                      "discovery.data_params.num_examples=8", "discovery.data_params.eval_examples=4",
                      "discovery.data_params.seq_len=32", "discovery.batch_size=8"])
    manifest = run_pipeline(cfg, tmp_path)
    summary = manifest["stages"]["pruning"]["summary"]
    c = load_circuit(tmp_path / "circuit.pt")
    assert c["selection"] == "bootstrap" and c["stability"]["n_resamples"] == 20
    assert 0.0 <= c["stability"]["jaccard_p5"] <= c["stability"]["jaccard_mean"] <= 1.0
    assert summary["stability_jaccard_mean"] == c["stability"]["jaccard_mean"]
    assert "not MIB's setting" in c["curve_definition"]
    from rich.console import Console
    console = Console(record=True, width=200)
    show_circuit(tmp_path / "circuit.pt", console)
    assert "stability (Jaccard)" in console.export_text()


def test_mib_export_and_check(tmp_path):
    import json

    from circuitkit.discovery.attribution import save_scores
    from circuitkit.discovery.export.mib import MIB_SHARES, check_mib, share_name
    from circuitkit_app.cli import main

    lm, data = loaded("tiny-llama"), pairs("tiny-llama")
    s = attribute(lm.adapter, data, "eap-ig", "edge", ig_steps=2, batch_size=3, progress=False)
    src = save_scores(tmp_path / "scores.safetensors", s, {"model": "builtin:tiny-llama"})
    assert main(["export", str(src), str(tmp_path / "sub"), "--format", "mib", "--model", "gpt2",
                 "--d-model", str(lm.adapter.d_model)]) == 0
    assert check_mib(tmp_path / "sub") == []
    obj = json.loads((tmp_path / "sub" / "ioi_gpt2" / "importances.json").read_text())
    assert all(e["in_graph"] for e in obj["edges"].values())
    # per-share circuits: the count kept at each share is MIB's int(share * n)
    assert main(["export", str(src), str(tmp_path / "circ"), "--format", "mib", "--model", "llama3",
                 "--mib-mode", "circuits", "--d-model", str(lm.adapter.d_model)]) == 0
    n = len(obj["edges"])
    for share in MIB_SHARES[:-1]:
        c = json.loads((tmp_path / "circ" / "ioi_llama3" / f"{share_name(share)}.json").read_text())
        assert len(c["edges"]) == n
    assert check_mib(tmp_path / "circ") == []
    # the validator names what is wrong
    bad = tmp_path / "circ" / "ioi_llama3" / "0.001.json"
    c = json.loads(bad.read_text())
    for e in list(c["edges"].values())[:50]:
        e["in_graph"] = True
    bad.write_text(json.dumps(c))
    (tmp_path / "circ" / "ioi_llama3" / "0.5.json").unlink()
    (tmp_path / "circ" / "foo_gpt2").mkdir()
    problems = check_mib(tmp_path / "circ")
    assert any("foo_gpt2" in p and "task" in p for p in problems)
    assert any("missing 0.5.json" in p for p in problems)
    assert main(["export", "--check-mib", str(tmp_path / "circ")]) == 1


@pytest.mark.parametrize("rule", ["right", "midpoint", "trapezoid", "gauss_legendre"])
def test_eap_ig_activations_matches_its_definition(rule):
    """s(u) = Δ_u · Σ_k w_k ∂m/∂a_u with only u's group interpolated, computed here by named hooks."""
    from circuitkit.discovery.attribution.eap_activations import attribute_activations, passes_per_batch
    from circuitkit.discovery.attribution.metrics import compute_metric
    from circuitkit.discovery.attribution.quadrature import integration_rule
    from tests.helpers.named_hooks import hooks, run_with_cache

    lm, data = loaded("tiny-llama"), pairs("tiny-llama", 4)
    a = lm.adapter
    s = attribute_activations(a, data, "node", ig_steps=2, batch_size=4, progress=False, ig_rule=rule,
                              group_by_length=False, per_example=True)
    q = integration_rule("eap-ig", 2, rule)
    layer = 1
    z, mlp = f"blocks.{layer}.attn.hook_z", f"blocks.{layer}.hook_mlp_out"
    with torch.no_grad():
        clean_logits, c = run_with_cache(a, data.clean_ids, [z, mlp], attention_mask=data.attention_mask)
        _, x = run_with_cache(a, data.corrupted_ids, [z, mlp], attention_mask=data.attention_mask)
    expect = {}
    for name in (z, mlp):
        total = 0
        for alpha, w in zip(q.alphas, q.weights, strict=True):
            leaf = (x[name] + alpha * (c[name] - x[name])).detach().requires_grad_(True)
            with hooks(a, {name: lambda v, n, leaf=leaf: leaf}):
                logits = a.model(input_ids=data.clean_ids, attention_mask=data.attention_mask).logits
            m = compute_metric("logit_diff", logits, data, clean_logits[torch.arange(4), data.answer_pos])
            (g,) = torch.autograd.grad(m.sum(), leaf)
            total = total + w * g
        expect[name] = (c[name] - x[name]) * total
    heads = expect[z].sum(dim=(1)).flatten(0, 0).sum(0).sum(-1) / 4  # (H,) mean over examples
    assert torch.allclose(s.head[layer], heads, atol=1e-5, rtol=1e-4)
    assert s.mlp[layer] == pytest.approx(float(expect[mlp].sum() / 4), abs=1e-5, rel=1e-4)
    assert torch.allclose(s.per_example["head"].mean(0), s.head, atol=1e-6)
    assert s.info["passes"] == passes_per_batch(a.n_layers, 2, rule) == q.passes * (2 * a.n_layers + 1)


def test_eap_ig_activations_edges_sum_to_the_node_scores():
    """At edge level the scores out of a head sum to its node score (its write reaches the logits only
    through the inputs that read it), and they differ from EAP-IG-inputs'."""
    from circuitkit.discovery.attribution.eap_activations import attribute_activations

    lm, data = loaded("tiny-llama"), pairs("tiny-llama", 4)
    a, g = lm.adapter, graph_of(lm.adapter)
    s = attribute_activations(a, data, "edge", ig_steps=2, batch_size=2, progress=False, ig_rule="midpoint")
    rows = [g.head_index(layer, h) for layer in range(a.n_layers) for h in range(a.n_heads)]
    assert torch.allclose(s.edges[rows].sum(1), s.head.flatten(), atol=1e-4, rtol=1e-3)
    mlp_rows = [g.mlp_index(layer) for layer in range(a.n_layers)]
    assert torch.allclose(s.edges[mlp_rows].sum(1), s.mlp, atol=1e-4, rtol=1e-3)
    inputs = attribute(a, data, "eap-ig", "edge", ig_steps=2, batch_size=2, progress=False, ig_rule="midpoint")
    assert not torch.allclose(inputs.edges, s.edges, atol=1e-4)


def test_exact_patching_per_example_rows_average_to_the_scores_and_match_single_examples():
    lm, data = loaded("tiny-llama"), pairs("tiny-llama")
    x = exact_patching(lm.adapter, data, "node", batch_size=4, progress=False, per_example=True)
    rows = x.per_example["head"]
    assert rows.shape == (len(data), *x.head.shape)
    torch.testing.assert_close(rows.mean(0), x.head, atol=1e-5, rtol=1e-5)
    one = exact_patching(lm.adapter, data[2:3], "node", batch_size=1, progress=False)
    torch.testing.assert_close(rows[2], one.head, atol=1e-4, rtol=1e-4)
    assert rows.abs().max() > 1e-3  # the patches move the metric
