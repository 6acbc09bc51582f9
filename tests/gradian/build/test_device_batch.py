"""Batches sized to the device (`gradian.build.device_batch`): the largest token budget whose estimated
peak fits the free memory, never below the configured one, the CPU as configured."""

from __future__ import annotations

import torch

from gradian.build.device_batch import FREE_SHARE, TOKEN_STEP, device_batch


def _linear(per_token: int, per_row: int):
    return lambda rows, length: rows * length * per_token + rows * per_row


def test_the_cpu_and_off_keep_the_configured_batch() -> None:
    for device, setting in ((torch.device("cpu"), "auto"), (torch.device("cuda"), "off")):
        got = device_batch(setting, device, 8, 4096, 60, 460, _linear(1, 1), free_bytes=10**15)
        assert (got.batch_size, got.batch_tokens, got.source) == (8, 4096, "configured")


def test_an_accelerator_gets_the_largest_budget_that_fits_at_both_lengths() -> None:
    estimate = _linear(per_token=1000, per_row=50_000)  # short rows cost more per token (per-row buffers)
    free = 10**9
    got = device_batch("auto", torch.device("cuda"), 8, 4096, 60, 460, estimate, free_bytes=free)
    assert got.source == "device" and got.batch_tokens > 4096
    assert got.batch_tokens % TOKEN_STEP == 0
    for length in (60, 460):  # what the plan can form fits; one more step does not at some length
        assert estimate(got.batch_tokens // length, length) <= FREE_SHARE * free
    over = got.batch_tokens + TOKEN_STEP
    assert any(estimate(over // length, length) > FREE_SHARE * free for length in (60, 460))
    assert got.batch_size == got.batch_tokens // 60  # the budget, not the row cap, closes a batch
    assert "grads.device_batch=auto" in got.note


def test_a_device_too_small_for_more_keeps_the_configured_batch() -> None:
    got = device_batch("auto", torch.device("cuda"), 8, 4096, 60, 460, _linear(1000, 0), free_bytes=10**6)
    assert (got.batch_size, got.batch_tokens, got.source) == (8, 4096, "configured")
    assert "no larger batch fits" in got.note


def test_attribution_runs_the_largest_batch_that_fits_on_an_accelerator_only() -> None:
    from circuitkit.discovery.data_lengths import (
        DEVICE_FREE_SHARE,
        attribution_at,
        device_attribution_batch,
        pairs_lengths,
    )
    from circuitkit_app.config import compose

    _, cfg = compose(["model=tiny_gpt2", "discovery.batch_size=2", "discovery.data_params.num_examples=64"])
    lengths = pairs_lengths([24] * 64, 24)
    assert device_attribution_batch(cfg, lengths, torch.device("cpu"))[0] == 2
    one = attribution_at(cfg, lengths, 1)
    weights = one.terms["weights"]
    free = int((attribution_at(cfg, lengths, 16).total_bytes - weights) / DEVICE_FREE_SHARE) + 1
    batch, note = device_attribution_batch(cfg, lengths, torch.device("cuda"), free_bytes=free)
    assert batch >= 16 and "discovery.device_batch=auto" in note
    assert attribution_at(cfg, lengths, batch).total_bytes - weights <= DEVICE_FREE_SHARE * free
    off = compose(["model=tiny_gpt2", "discovery.batch_size=2", "discovery.device_batch=off"])[1]
    assert device_attribution_batch(off, lengths, torch.device("cuda"), free_bytes=free)[0] == 2
