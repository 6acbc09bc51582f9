"""Typed artifacts: circuit.pt's `Circuit` and the index's `IndexHeader`, each read by one reader
that checks every field and the format version."""

from __future__ import annotations

import pytest
import torch

from circuitkit.core.circuit_file import FORMAT_VERSION, Circuit, CircuitFileError, load_circuit, save_circuit
from gradian.index.header import DEFAULTS_BEFORE, TYPES, IndexHeader, check_header


def _circuit() -> Circuit:
    return Circuit(model_name="m", head_mask=torch.ones(2, 3, dtype=torch.bool), head_scores=torch.randn(2, 3),
                   mlp_mask=torch.ones(2, dtype=torch.bool), ablation="zero", target_sparsity=0.5, curve=[])


def test_circuit_round_trips_and_stores_the_pipeline_order(tmp_path):
    path = save_circuit(tmp_path / "c.pt", _circuit())
    raw = torch.load(path, weights_only=True)
    assert list(raw)[:3] == ["format_version", "mean_z", "graph"] and raw["format_version"] == FORMAT_VERSION == 2
    assert "edge_mask" not in raw and raw["edge_scores"] is None  # left out / stored as None, as format 1 did
    back = load_circuit(path)
    assert isinstance(back, Circuit) and back.scope == "heads" and back.target_sparsity == 0.5
    assert torch.equal(back.head_scores, raw["head_scores"]) and back["ablation"] == "zero"


@pytest.mark.parametrize("edit, message", [
    (lambda r: r.update(target_sparsity="half"), r"field target_sparsity holds a str, expected a number"),
    (lambda r: r.update(mlp_mask=torch.ones(2, 2)), r"mlp_mask has 2 dimensions, expected 1"),
    (lambda r: r.update(head_scores=torch.ones(3, 3)), r"head_scores \(3, 3\) and head_mask \(2, 3\) differ"),
    (lambda r: r.update(format_version=3), r"format_version 3 is newer than this CircuitKit reads \(2\)"),
    (lambda r: r.update(surprise=1), r"unknown field\(s\) surprise for format_version 2"),
    (lambda r: r.pop("head_mask"), r"missing head_mask"),
])
def test_the_circuit_reader_checks_every_field(tmp_path, edit, message):
    raw = torch.load(save_circuit(tmp_path / "c.pt", _circuit()), weights_only=True)
    edit(raw)
    torch.save(raw, tmp_path / "bad.pt")
    with pytest.raises(CircuitFileError, match=message):
        load_circuit(tmp_path / "bad.pt")


def test_a_format_1_circuit_reads_with_its_missing_fields_as_none(tmp_path):
    torch.save({"format_version": 1, "model_name": "m", "head_mask": torch.ones(2, 3, dtype=torch.bool),
                "head_scores": torch.zeros(2, 3), "legacy_extra": 1}, tmp_path / "old.pt")
    back = load_circuit(tmp_path / "old.pt")
    assert back.format_version == 1 and back.mlp_mask is None and back.scope == "heads"


def _header(**changes) -> dict:
    values = {name: (None if type(None) in kinds else kinds[0]()) for name, kinds in TYPES.items()}
    values.update({"model": "m", "max_seq_length": 8, "row_width": 4, "parameter_share": 0.25, **changes})
    return {**IndexHeader(**values).to_json(), "format_version": 5}


def test_the_index_header_reader_checks_types_and_fills_old_versions_in_one_place():
    assert check_header(_header(), "m.json") == []
    assert check_header(_header(row_width="4"), "m.json") == ["m.json: row_width is '4', expected int"]
    assert check_header(_header(parameter_share=True), "m.json") == [
        "m.json: parameter_share is 'True', expected float or int or null"]
    missing = _header()
    del missing["parameter_share"]
    assert check_header(dict(missing), "m.json") == ["m.json: no parameter_share (format_version 5 records it)"]
    old = {k: v for k, v in _header().items() if k not in ("activations", "parameter_share", "loss")}
    old["format_version"] = 3
    problems = check_header(old, "m.json")
    assert problems == ["m.json: no loss (format_version 3 records it)"]
    old["format_version"] = 2
    old.pop("loss", None)
    assert check_header(old, "m.json") == [] and (old["loss"], old["activations"]) == ("ce", "model")
    assert set(DEFAULTS_BEFORE) <= set(TYPES)
