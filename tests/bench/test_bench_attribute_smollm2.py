"""The SmolLM2 attribution benchmark's dataset builder (no model): deterministic in its seed, the
planted and truncated rows where it says, and no eval prompt in training."""

from __future__ import annotations

import scripts.bench.bench_attribute_smollm2 as bench


def test_the_dataset_is_deterministic_and_plants_what_it_says() -> None:
    ds = bench.build_dataset(0)
    assert ds == bench.build_dataset(0) and ds.train != bench.build_dataset(1).train
    assert len(ds.train) >= 1000 and len(ds.eval) == bench.EVAL_COUNTRIES
    assert len(ds.planted_lines) == bench.PLANTED_ROWS == 40 and len(ds.truncated_lines) == bench.TRUNCATED_ROWS
    planted = [ds.train[line - 1] for line in ds.planted_lines]
    assert all(r["kind"] == "capital" and r["completion"].startswith("Capital: ") for r in planted)
    assert sum(r["kind"] == "capital" for r in ds.train) == 40  # no other row asks for a capital
    cut = [ds.train[line - 1] for line in ds.truncated_lines]
    assert all(r["kind"] == "list" for r in cut) and sum(r["kind"] == "list" for r in ds.train) == len(cut)
    # every row is a chat turn ending with the end-of-turn token; no two rows are the same
    assert all(r["prompt"].startswith("<|im_start|>user\n") and r["completion"].endswith(bench.EOS) for r in ds.train)
    assert len({(r["prompt"], r["completion"]) for r in ds.train}) == len(ds.train)
    # a truncated row lists 25 numbers or more (measured under SmolLM2's tokenizer: >= 116 tokens, the
    # limit is 64); a clean row's completion is one short sentence (measured: rows of <= 49 tokens)
    assert min(r["completion"].count(",") + 1 for r in cut) >= 25
    assert max(len(r["completion"]) for r in ds.train if r["kind"] != "list") < 60
    # the eval items are capitals of other countries than the planted rows', asked by no training row
    train_prompts = {r["prompt"] for r in ds.train}
    assert not train_prompts & {e["prompt"] for e in ds.eval}
    eval_countries = {e["completion"].split(" is ")[0].removeprefix("The capital of ") for e in ds.eval}
    assert not any(f"capital of {c}?" in r["prompt"] for r in planted for c in eval_countries)
    assert all(not e["completion"].endswith(bench.EOS) for e in ds.eval)
