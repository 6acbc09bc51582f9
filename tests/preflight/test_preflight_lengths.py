"""The preflight on the data that will run: the circuit stages estimated at the tokenized prompts
(circuitkit.discovery.data_lengths), not at discovery.data_params.seq_len, and discover-smart's
batch size bounded by every stage."""

from __future__ import annotations

import dataclasses
import importlib.util
import io
import sys
from pathlib import Path

import torch
from rich.console import Console

from circuitkit.core.device import measure_peak, module_bytes
from circuitkit.core.pipeline import RunContext
from circuitkit.discovery.attribution import run_attribution
from circuitkit.discovery.attribution.memory import attribution_estimate
from circuitkit.discovery.data_lengths import (
    ATTRIBUTION_AT_DATA,
    PRUNING_AT_DATA,
    attribution_batches,
    pairs_lengths,
    task_lengths,
)
from circuitkit.discovery.pruning.heads import prune
from circuitkit.discovery.pruning.memory import pruning_estimate
from circuitkit.discovery.tasks import build_heldout_templates, build_task
from circuitkit.models.loading import load_model
from circuitkit.preflight.stage import PREFLIGHT_STAGE
from circuitkit_app.config import compose
from circuitkit_app.smart import bound_line, largest_batch
from circuitkit_app.stage_list import PIPELINE

REPO = Path(__file__).resolve().parents[2]


def _tolerance() -> float:
    """The tolerance the memory tests hold every estimate to (scripts/bench/check_memory_estimates.py)."""
    spec = importlib.util.spec_from_file_location("check_memory_estimates",
                                                  REPO / "scripts" / "bench" / "check_memory_estimates.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module.TOLERANCE


def _fixed_terms(estimate) -> int:
    """The terms that do not grow with the tokens of a batch (weights, answer logits, edge score matrix)."""
    return sum(estimate.terms.get(k, 0) for k in ("weights", "logits", "score matrix"))


def test_ioi_at_512_configured_tokens_is_estimated_at_its_prompts_and_still_bounds_the_peak():
    """seq_len=512 is ~20x the longest IOI prompt of the fixture's tokenizer: the estimate drops by
    exactly the ratio of tokens in its largest batch and stays above the measured peak (attribution
    and pruning, each measured as the pipeline does: live tensor bytes plus the resident weights)."""
    _, cfg = compose(["model.precision=float32", "discovery.task=ioi", "discovery.level=edge",
                      "discovery.data_params.seq_len=512", "discovery.data_params.num_examples=8",
                      "discovery.data_params.eval_examples=4", "discovery.batch_size=4", "discovery.ig_steps=2"])
    d = cfg.discovery
    lengths = task_lengths(cfg)
    # the pairs the data stage builds, from the tokenizer alone
    loaded = load_model(cfg.model)
    data = build_task("ioi", loaded.tokenizer, loaded.path, d.data_params, 12, cfg.seed)
    templates = build_heldout_templates("ioi", loaded.tokenizer, d.data_params, 4, cfg.seed)
    assert lengths.tokenized and lengths.attr == tuple(data.lengths()[:8]) and lengths.width == data.clean_ids.shape[1]
    assert (lengths.n_templates, lengths.templates_width) == (4, templates.clean_ids.shape[1])
    rows, tokens = max(attribution_batches(cfg, lengths), key=lambda shape: shape[0] * shape[1])
    assert tokens <= 30 and rows == 4  # IOI prompts of ~15-27 tokens, not 512

    at_data, configured = ATTRIBUTION_AT_DATA.estimate(cfg), attribution_estimate(cfg)
    assert at_data.lengths["source"] == "tokenized" and at_data.lengths["tokens"] == tokens
    assert "ioi prompts tokenized" in at_data.lengths["line"] and "seq_len=512" in at_data.lengths["line"]
    # every term that grows with the batch's tokens is linear in them: the drop is exactly 4·tokens / (4·512)
    drop = (at_data.total_bytes - _fixed_terms(at_data)) / (configured.total_bytes - _fixed_terms(configured))
    assert abs(drop - rows * tokens / (4 * 512)) < 1e-6, drop
    pruning_at_data = PRUNING_AT_DATA.estimate(cfg)
    assert pruning_at_data.total_bytes < 0.5 * pruning_estimate(cfg).total_bytes

    resident = lambda: module_bytes(loaded.model)  # noqa: E731 - what the pipeline adds on the CPU
    with measure_peak(torch.device("cpu"), resident) as attribution_peak:
        scores = run_attribution(loaded.adapter, data[:8], d, progress=False)
    with measure_peak(torch.device("cpu"), resident) as pruning_peak:
        prune(loaded.adapter, scores, data[:8], data[8:], cfg.pruning, d.metric, d.batch_size, heldout=templates)
    tolerance = _tolerance()
    for estimate, peak in ((at_data, attribution_peak), (pruning_at_data, pruning_peak)):
        assert estimate.total_bytes >= (1 - tolerance) * peak.peak_bytes, (estimate.total_bytes, peak.peak_bytes)
        assert estimate.total_bytes <= (1 + tolerance) * peak.peak_bytes, (estimate.total_bytes, peak.peak_bytes)
    # at the configured length the attribution estimate was many times the measured peak
    assert configured.total_bytes > 5 * attribution_peak.peak_bytes


def test_the_preflight_prints_and_records_the_length_it_used(tmp_path):
    _, cfg = compose(["stages=[preflight,data,attribution,pruning]", "discovery.task=ioi",
                      "discovery.data_params.seq_len=512"])
    console = Console(file=io.StringIO(), width=400)
    # the preflight stage as the pipeline runs it; its summary is the manifest's entry
    summary = PREFLIGHT_STAGE.run(RunContext(cfg, tmp_path, console, stages=tuple(PIPELINE.selected(cfg)))).summary
    lengths = task_lengths(cfg)
    assert summary["attribution_lengths"]["tokens"] <= lengths.width < 30
    assert summary["pruning_lengths"]["tokens"] == lengths.templates_width  # the held-out templates are longer
    out = console.file.getvalue()
    assert "attribution: estimated at 4 pairs x" in out and "the ioi prompts tokenized" in out
    assert f"pruning: estimated at 4 held-out pairs x {lengths.width} tokens per batch" in out


def test_without_the_tokenizer_the_configured_length_is_used_and_said():
    _, cfg = compose(["model=gemma4b", "discovery.task=ioi"])  # its tokenizer is not on this machine
    estimate = ATTRIBUTION_AT_DATA.estimate(cfg)
    assert estimate.lengths["source"] == "configured" and estimate.lengths["tokens"] == 128
    assert "seq_len=128 as configured: the tokenizer of google/gemma-3-4b-it is not on this machine" in \
        estimate.lengths["line"]
    assert estimate.total_bytes == attribution_estimate(cfg).total_bytes


def test_generated_corruptions_are_known_only_with_the_model_and_a_huge_task_is_not_built():
    _, cfg = compose(["discovery.task=jsonl", "discovery.data_params.corruption=name_swap"])
    lengths = task_lengths(cfg)
    assert not lengths.tokenized and "model's answer changes" in lengths.reason
    _, huge = compose(["discovery.task=ioi", "discovery.data_params.num_examples=60000"])
    lengths = task_lengths(huge)  # 60000 + 64 + 64 pairs: as long as the data stage would take
    assert not lengths.tokenized and "60128 pairs are more than the 50000" in lengths.reason
    assert attribution_batches(huge, lengths) == [(4, 128)]


def test_exact_runs_every_batch_at_the_full_width_the_others_cut_each_batch():
    lengths = pairs_lengths([10, 30, 12, 11], 30)
    _, eap_ig = compose(["discovery.batch_size=2"])
    assert attribution_batches(eap_ig, lengths) == [(2, 11), (2, 30)]  # sorted by length: (30, 12), (11, 10)
    _, exact = compose(["discovery.batch_size=2", "discovery.algorithm=exact"])
    assert attribution_batches(exact, lengths) == [(2, 30)]


def _with_batch(cfg, batch_size: int):
    return dataclasses.replace(cfg, discovery=dataclasses.replace(cfg.discovery, batch_size=batch_size))


def test_discover_smart_takes_the_smallest_batch_over_the_stages_and_names_the_bound():
    _, cfg = compose(["stages=[preflight,data,attribution,pruning]", "discovery.task=ioi", "discovery.level=edge",
                      "discovery.data_params.num_examples=64", "discovery.data_params.eval_examples=384",
                      "discovery.batch_size=16"])
    # the budget at which attribution alone takes 16 pairs a batch; pruning keeps 384 + 384 held-out
    # pairs' corrupted runs, so it allows fewer
    budget = ATTRIBUTION_AT_DATA.estimate(cfg).total_bytes
    best, per_stage = largest_batch(cfg, budget)
    assert per_stage["attribution"] >= 16 and per_stage["pruning"] == best == 2, per_stage
    assert PRUNING_AT_DATA.estimate(_with_batch(cfg, 2)).total_bytes <= budget
    assert PRUNING_AT_DATA.estimate(_with_batch(cfg, 3)).total_bytes > budget
    assert bound_line(best, per_stage, 64) == f"bound by pruning (attribution alone: {per_stage['attribution']})"
    assert bound_line(64, {"attribution": 64, "pruning": 64}, 64) == \
        "every stage fits the whole num_examples=64 in one batch"
