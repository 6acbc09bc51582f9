"""`make demo`'s config (conf/demo.yaml): the induction model's circuit and the restricted grads stage."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from circuitkit_app.config import compose

REPO = Path(__file__).resolve().parents[2]


def test_demo_config_composes_on_top_of_the_default() -> None:
    _, demo = compose(config_name="demo")
    _, default = compose()
    assert demo.model.name == "builtin:induction" and default.model.name == "builtin:tiny-gpt2"
    assert demo.discovery.level == "edge" and demo.grads.circuit == "run" and default.grads.circuit is None
    assert (REPO / demo.grads.data_path).is_file()


def test_shipped_induction_rows_tokenize_to_their_symbols(induction_model_dir) -> None:
    """The demo's rows: copy rows end with a segment seen earlier, fresh rows with unseen symbols."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(induction_model_dir)
    rows = [json.loads(line) for line in (REPO / "gradian/data/samples/induction_train.jsonl").read_text().splitlines()]
    assert len(rows) == 48 and [r["kind"] for r in rows[:2]] == ["copy", "fresh"]
    for r in rows:
        prompt = tok.encode(r["prompt"], add_special_tokens=False)
        answer = tok.encode(r["completion"], add_special_tokens=False)
        assert prompt[0] == tok.bos_token_id and len(answer) == 4
        if r["kind"] == "copy":
            start = prompt.index(prompt[-1])  # the segment's first occurrence
            assert start < len(prompt) - 1 and prompt[start + 1:start + 5] == answer
        else:
            assert not set(answer) & set(prompt)


@pytest.mark.slow
def test_demo_finds_the_known_circuit_and_indexes_through_it(tmp_path, induction_model_dir) -> None:
    from circuitkit_app.stage_list import run_pipeline
    from gradian.index.reader import IndexReader

    info = json.loads((induction_model_dir / "fixture_info.json").read_text())
    _, cfg = compose([f"grads.data_path={REPO / 'gradian/data/samples/induction_train.jsonl'}"], config_name="demo")
    manifest = run_pipeline(cfg, tmp_path / "demo")
    kept = sorted(IndexReader(tmp_path / "demo" / "index").manifest["circuit"]["heads"])
    assert kept == sorted([info["prev_token_head"], info["induction_head"]])
    assert manifest["stages"]["pruning"]["summary"]["faithfulness"] > 0.9
    assert (tmp_path / "demo" / "circuit_graph.png").is_file()
