"""The memory estimates under several corruptions in one discovery: attribution holds a batch's
clean run across the corruptions, pruning records and evaluates each corruption's held-out pairs
(and, for selection=mask, its mask pairs). On tiny random models, with two corruptions of the same
clean pairs, each estimate grows and stays within the tolerance its single-corruption check uses."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from circuitkit.core.device import measure_peak, module_bytes
from circuitkit.discovery.attribution.eap import attribute_corruptions
from circuitkit.discovery.attribution.memory import attribution_estimate, estimate_attribution
from circuitkit.discovery.config import PruningConfig
from circuitkit.discovery.pruning.heads import prune
from circuitkit.discovery.pruning.memory import estimate_pruning, pruning_estimate
from circuitkit.discovery.tasks.base import TaskData, random_pairs
from circuitkit.models.adapters import get_adapter
from circuitkit.preflight.memory import shape_from_config
from circuitkit_app.config import compose
from tests.discovery.pruning.test_pruning_memory import V, _model, _scores
from tests.preflight.test_memory import _load_script


def _second_corruption(data: TaskData, seed: int = 7) -> TaskData:
    """The same clean pairs with other corrupted tokens (another position) and other incorrect answers."""
    g = torch.Generator().manual_seed(seed)
    corrupted = data.clean_ids.clone()
    corrupted[:, data.clean_ids.shape[1] // 2] = torch.randint(0, V, (len(data),), generator=g)
    incorrect = data.incorrect.clone()
    incorrect[:, 0] = torch.randint(0, V, (len(data),), generator=g)
    return dataclasses.replace(data, corrupted_ids=corrupted, incorrect=incorrect)


def _attribution_peak(model, datas: list[TaskData], level: str) -> int:
    adapter = get_adapter(model)
    with measure_peak(torch.device("cpu"), resident_bytes=lambda: module_bytes(model)) as peak:
        attribute_corruptions(adapter, datas, "eap-ig", level, ig_steps=3, batch_size=len(datas[0]), progress=False)
    return peak.peak_bytes


@pytest.mark.parametrize("level", ["node", "edge"])
def test_attribution_counts_the_clean_run_held_across_corruptions(level):
    model = _model("llama")
    data = random_pairs(4, 32, V)
    shape = shape_from_config(model.config)
    one, two = (estimate_attribution(shape, 4, 4, 32, "eap-ig", level, 3, n_corruptions=c) for c in (1, 2))
    measured_one = _attribution_peak(model, [data], level)
    measured_two = _attribution_peak(model, [data, _second_corruption(data)], level)
    tolerance = _load_script().TOLERANCE  # the single-corruption sweep's
    assert abs(one.total_bytes / measured_one - 1) <= tolerance, (one.total_bytes, measured_one)
    assert abs(two.total_bytes / measured_two - 1) <= tolerance, (two.total_bytes, measured_two)
    # the term is what a second corruption adds: about one recorded run (embed, z and MLP writes, logits)
    added = two.total_bytes - one.total_bytes
    assert added == two.terms["clean run held across corruptions"] + two.terms["other corruptions' score sums"]
    assert 0.5 <= added / (measured_two - measured_one) <= 1.5, (added, measured_two - measured_one)
    # an algorithm that runs each corruption on its own peaks as one corruption does
    exact = [estimate_attribution(shape, 4, 4, 32, "exact", level, None, n_corruptions=c).total_bytes for c in (1, 2)]
    assert exact[0] == exact[1]


def _pruning_peak(model, selection: str, n_eval: int, corruptions: bool) -> int:
    adapter = get_adapter(model)
    n_attr = 8
    data = random_pairs(n_attr + n_eval, 32, V)
    other = _second_corruption(data)
    p = PruningConfig(selection=selection, mask_steps=2, bootstrap_resamples=0)
    several = {"a": data[n_attr:], "b": other[n_attr:]} if corruptions else None
    attr = {"a": data[:n_attr], "b": other[:n_attr]} if corruptions else None
    with measure_peak(torch.device("cpu"), resident_bytes=lambda: module_bytes(model)) as peak:
        prune(adapter, _scores(adapter), data[:n_attr], data[n_attr:], p, "logit_diff", 4, corruptions=several,
              corruption_attr=attr)
    return peak.peak_bytes


@pytest.mark.parametrize("family", ["gpt2", "llama"])
@pytest.mark.parametrize("selection", ["top_k", "mask"])
def test_pruning_counts_each_corruptions_records(family, selection):
    model = _model(family)
    shape = shape_from_config(model.config)
    one, two = (estimate_pruning(shape, 4, 4, 32, 8, "heads", "corrupted", selection, 8, 2, n_corruptions=c)
                for c in (1, 2))
    assert two.total_bytes > one.total_bytes
    measured = _pruning_peak(model, selection, 8, corruptions=True)
    assert 0.90 <= two.total_bytes / measured <= 1.15, (family, selection, two.total_bytes / measured, two.phase)


def test_the_configs_estimates_read_the_listed_corruptions():
    base = ["model=induction", "discovery.data_params.seq_len=48", "pruning.selection=mask"]
    _, single = compose(base)
    _, joint = compose([*base, "discovery.data_params.corruptions=[swap,fresh]"])
    assert attribution_estimate(joint).total_bytes > attribution_estimate(single).total_bytes
    assert "clean run held across corruptions" in attribution_estimate(joint).terms
    assert pruning_estimate(joint, free_bytes=2**34).total_bytes > pruning_estimate(single, free_bytes=2**34).total_bytes
