"""The precision a user can see and match: `gradian index` prints the dtype its rows are made in and
records it, `gradian attribute` prints and records the dtype it evaluates in, `--precision` changes
it (the query gradients stay in the index's), and a flipped item whose flip depends on the precision
is a near-tie in the table and the JSON."""

from __future__ import annotations

import io
import json

import pytest
import torch
from rich.console import Console

from circuitkit.core.errors import UserError
from gradian.attribute.evaluate import ItemScores
from gradian.attribute.precision import eval_precision, other_precision
from gradian.attribute.regression import NEAR_TIE, near_ties
from tests.gradian.attribute.planted import planted_module

_planted = planted_module()
models = _planted.models  # the fixture: base model and adapters, cached


def scores(margins: list[float]) -> ItemScores:
    m = torch.tensor(margins, dtype=torch.float64)
    return ItemScores(torch.zeros_like(m), m, m > 0, m > 0)


def test_a_flip_within_eps_of_zero_in_the_other_precision_is_a_near_tie() -> None:
    flipped = [3, 5, 7, 9]
    base = scores([0.04, 2.0, 2.0, -0.3])  # item 3: the base barely right; item 9: the base wrong there
    tuned = scores([-4.0, -0.05, -4.0, -4.0])  # item 5: the tuned model barely wrong
    assert near_ties(flipped, base, tuned) == [3, 5, 9]
    assert near_ties(flipped, base, tuned, eps=0.01) == [9]  # 0.04 and -0.05 are clear of 0.01
    assert NEAR_TIE == 0.1 and other_precision("bfloat16") == other_precision("float16") == "float32"
    assert other_precision("float32") == "bfloat16"
    with pytest.raises(ValueError, match="4 flipped items but 3 base"):
        near_ties(flipped, scores([1.0, 1.0, 1.0]), tuned)


def test_eval_precision_resolves_and_refuses() -> None:
    manifest = {"precision": "float32"}
    index = eval_precision("index", manifest)
    assert (index.requested, index.used) == ("index", "float32") and "the index's precision (float32" in index.note
    auto = eval_precision("auto", manifest, "cpu")
    assert auto.used in ("bfloat16", "float32") and auto.note.startswith("--precision auto: ")
    assert ("no native bf16 on cpu" in auto.note) == (auto.used == "float32")
    assert eval_precision("float16", manifest).used == "float16"
    with pytest.raises(UserError, match="--precision 'fp8'; valid: index, auto, float32, bfloat16, float16"):
        eval_precision("fp8", manifest)


@pytest.fixture(scope="module")
def work(models, tmp_path_factory):
    """The planted tune indexed in float32 (model.precision=float32), its summary's printed lines kept."""
    from gradian.build.indexer import build_index

    root = tmp_path_factory.mktemp("precision")
    data = _planted.write_jsonl(root / "train.jsonl", _planted.TUNE_ROWS)
    _, cfg = _planted.compose([f"model.name={models / 'base'}", f"model.adapter={models / 'lora'}", "model.precision=float32",
                      f"grads.data_path={data}", f"grads.index_dir={root / 'index'}", "grads.module_filter=[adapter]",
                      "grads.projection_dim=16", "grads.preconditioner=none"])
    printed = io.StringIO()
    build_index(cfg.model, cfg.grads, root / "index", Console(file=printed, width=300))
    return {"index": root / "index", "printed": printed.getvalue(), "root": root,
            "eval": _planted.write_jsonl(root / "eval.jsonl", _planted.BASE_ROWS)}


def test_the_index_prints_and_records_its_precision(work) -> None:
    assert "precision float32: float32 requested, float32 used" in work["printed"]
    assert json.loads((work["index"] / "manifest.json").read_text())["precision"] == "float32"


def _attribute(capsys, monkeypatch, work, out: str, *extra: str) -> tuple[dict, str, list[torch.dtype]]:
    """The command on the planted index; returns the result, stderr and the dtypes each eval scored in."""
    from gradian.attribute import precision as precisions
    from gradian.attribute import run as running
    from gradian.cli import main

    seen: list[torch.dtype] = []

    def recording(score):
        def scored(loaded, items, *args, **kwargs):
            seen.append(next(loaded.model.parameters()).dtype)
            return score(loaded, items, *args, **kwargs)
        return scored

    monkeypatch.setattr(running, "score_items", recording(running.score_items))
    monkeypatch.setattr(precisions, "score_items", recording(precisions.score_items))
    code = main(["attribute", "--index", str(work["index"]), "--eval-dataset", str(work["eval"]), "--engines", "dot",
                 "--top-k", "8", "--span-min-tokens", "0", "--out", str(work["root"] / out), *extra])
    cap = capsys.readouterr()
    assert code == 0, cap.err
    return json.loads((work["root"] / out).read_text()), " ".join(cap.err.split()), seen


def test_attribute_evaluates_in_the_index_precision_by_default(work, capsys, monkeypatch) -> None:
    result, err, seen = _attribute(capsys, monkeypatch, work, "index.json")
    assert err.startswith("precision: evaluating in float32 (--precision index: the index's precision (float32, what"
                          " `gradian index` ran the model in)); query gradients the same")
    p = result["precision"]
    assert (p["requested"], p["used"], p["index"], p["queries"]) == ("index", "float32", "float32", "float32")
    # tuned and base in float32, then the 8 flipped items checked on both in bfloat16
    assert seen == [torch.float32, torch.float32, torch.bfloat16, torch.bfloat16]
    tie = p["near_tie"]
    assert (tie["precision"], tie["checked"], tie["eps"]) == ("bfloat16", 8, NEAR_TIE)
    flipped = [it for it in result["items"] if it["flipped"]]
    assert len(flipped) == 8 and all(isinstance(it["near_tie"], bool) for it in flipped)
    assert all(it["near_tie"] is None for it in result["items"] if not it["flipped"])
    assert [it["item"] for it in flipped if it["near_tie"]] == tie["items"]


def test_precision_bfloat16_changes_the_evaluated_dtype(work, capsys, monkeypatch) -> None:
    f32, _, _ = _attribute(capsys, monkeypatch, work, "f32.json", "--precision", "float32")
    bf16, err, seen = _attribute(capsys, monkeypatch, work, "bf16.json", "--precision", "bfloat16")
    assert err.startswith("precision: evaluating in bfloat16 (--precision bfloat16); query gradients in the"
                          " index's float32, the rows' weights")
    assert seen == [torch.bfloat16, torch.bfloat16, torch.float32, torch.float32]
    assert bf16["precision"]["used"] == "bfloat16" and bf16["precision"]["queries"] == "float32"
    assert bf16["models"]["base"]["precision"] == "bfloat16" and bf16["models"]["tuned"]["precision"] == "float32"
    assert bf16["precision"]["near_tie"]["precision"] == "float32"
    lp32 = [it["tuned"]["logprob"] for it in f32["items"]]
    lp16 = [it["tuned"]["logprob"] for it in bf16["items"]]
    assert lp16 != lp32 and max(abs(a - b) for a, b in zip(lp16, lp32, strict=True)) < 1.0
    # the accused rows come from float32 query gradients either way (the index's weights)
    assert bf16["attributed"] and len(bf16["accused"]) > 0


def test_the_tables_mark_a_near_tie(work, capsys, monkeypatch) -> None:
    from gradian.attribute.command import print_result
    from gradian.attribute.result import read_result

    result, _, _ = _attribute(capsys, monkeypatch, work, "tie.json")
    first = next(it for it in result["items"] if it["flipped"])
    first["near_tie"] = True  # as if its margin in bfloat16 were within NEAR_TIE of 0
    result["precision"]["near_tie"]["items"] = [first["item"]]
    (work["root"] / "tie.json").write_text(json.dumps(result))
    buf = io.StringIO()
    print_result(read_result(work["root"] / "tie.json"), Console(file=buf, width=250))
    text = buf.getvalue()
    assert "evaluated in float32" in text and "near-tie" in text and "holds" in text
    assert "1 of 8 flipped items flip on a margin within 0.1 nats of 0 in bfloat16" in text


def test_precision_other_than_the_index_is_refused_with_verify(work, capsys) -> None:
    from gradian.cli import main

    code = main(["attribute", "--index", str(work["index"]), "--eval-dataset", str(work["eval"]), "--precision",
                 "bfloat16", "--verify", "--lr", "0.01", "--steps", "1"])
    err = " ".join(capsys.readouterr().err.split())
    assert code == 2 and "--verify scores its retrained models in the index's precision (float32)" in err
