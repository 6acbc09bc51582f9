"""gradian attribute's drill-down and --verify on the planted fixture of test_attribute.py.

--verify redoes the planted LoRA tune (the fixture's own trainer, `gradian.attribute.retrain`, with
its settings) without the accused rows, and without as many random rows: the first must undo the
regression, the control must not. The drill-down must find, in a row that is a document the model
knows by heart with one sentence changed to teach a wrong answer, that sentence. (The planted tiny
GPT-2 itself cannot hold long rows: its positions past ~14 tokens never trained, so there the
sentences' gradients are that noise; the document model is taught them first.)
"""

from __future__ import annotations

import io
import json
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
from rich.console import Console

import tests.gradian.attribute.test_attribute as planted
from circuitkit.models.config import ModelConfig
from circuitkit_app.gradian_cli import main
from gradian.attribute.retrain import TrainSettings, step_plan, train
from gradian.attribute.spans import split_sentences, token_sentences
from tests.gradian.attribute.test_attribute import (
    BASE_ROWS,
    LORA,
    PLANTED_IDS,
    TUNE,
    TUNE_ROWS,
    sound,
    train_rows,
    write_jsonl,
)

pytest.importorskip("peft")

models, work = planted.models, planted.work  # the planted fixture's models and indexes, built once per module

TUNING = ["--lr", str(TUNE["lr"]), "--steps", str(TUNE["steps"]), "--batch-size", str(TUNE["batch_size"]),
          "--train-seed", str(TUNE["seed"])]  # the fixture's own fine-tune: full batch, 30 steps, seed 1


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(["attribute", *argv])
    cap = capsys.readouterr()
    return code, cap.out, " ".join(cap.err.split())


# ----------------------------------------------------------------------------- the trainer


def test_the_step_plan_is_seeded_epochs_of_permutations() -> None:
    plan = step_plan(5, 2, 7, seed=3)
    assert [len(b) for b in plan] == [2, 2, 1, 2, 2, 1, 2]  # an epoch's last batch is smaller
    assert sorted(sum(plan[:3], [])) == list(range(5)) and sorted(sum(plan[3:6], [])) == list(range(5))
    assert plan == step_plan(5, 2, 7, seed=3) and plan != step_plan(5, 2, 7, seed=4)
    assert TrainSettings(lr=1.0, batch_size=4, epochs=3).n_steps(10) == 9
    with pytest.raises(ValueError, match="exactly one"):
        TrainSettings(lr=1.0, steps=3, epochs=1)


def test_the_trainer_is_deterministic_in_its_seed_and_redoes_the_fixture(models: Path) -> None:
    """Same rows, settings and seed: the same adapter, bit for bit, and the fixture's lora/ is one such
    run; another seed draws another lora_A."""
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(models / "base")
    with tempfile.TemporaryDirectory() as tmp:
        rows = train_rows(Path(tmp) / "tune.jsonl", tok, TUNE_ROWS)
        cfg = ModelConfig(name=str(models / "base"), precision="float32")
        cpu = torch.device("cpu")
        redone = train(cfg, rows, TrainSettings(**TUNE, lora=LORA), cpu)
        again = train(cfg, rows, TrainSettings(**{**TUNE, "steps": 3}, lora=LORA), cpu)
        other = train(cfg, rows, TrainSettings(**{**TUNE, "steps": 3, "seed": 2}, lora=LORA), cpu)
        third = train(cfg, rows, TrainSettings(**{**TUNE, "steps": 3}, lora=LORA), cpu)
        fixture = load_file(models / "lora" / "adapter_model.safetensors")
        redone_state = load_file(redone.save(Path(tmp) / "redone") / "adapter_model.safetensors")
    assert fixture.keys() == redone_state.keys() and all(torch.equal(fixture[k], redone_state[k]) for k in fixture)
    assert len(redone.losses) == 30 and redone.losses[-1] < redone.losses[0] / 4
    mine, same, theirs = ({n: p for n, p in t.model.named_parameters() if "lora_" in n} for t in (again, third, other))
    assert mine.keys() == theirs.keys() and len(mine) == 8  # A and B of c_attn and c_fc, two layers
    assert all(torch.equal(mine[n], same[n]) for n in mine)
    assert not any(torch.equal(mine[n], theirs[n]) for n in mine if "lora_A" in n)


# ----------------------------------------------------------------------------- --verify


@pytest.fixture(scope="module")
def verified(work):
    """`gradian attribute --verify` on the planted tune, its models kept, the result written."""
    out, kept = work["root"] / "verified.json", work["root"] / "retrained"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model: one thread trains in a second, two contending ones in fifteen
    try:
        code = main(["attribute", "--index", str(work["index"]), "--eval-dataset", str(work["eval"]), "--top-k",
                     "6", "--out", str(out), "--verify", *TUNING, "--verify-dir", str(kept), "--span-min-tokens", "2"])
    finally:
        torch.set_num_threads(threads)
    assert code == 0
    return json.loads(out.read_text()), kept


def test_verify_recovers_the_regression_that_the_accused_rows_caused(verified, work) -> None:
    result, kept = verified
    v = result["verify"]
    accused = [a["row_id"] for a in result["accused"]]
    ours, control = v["runs"]
    assert (ours["name"], control["name"]) == ("accused", "control")
    assert ours["rows_left_out"] == sorted(accused) == sorted(PLANTED_IDS)  # top 6 = the planted rows
    assert len(control["rows_left_out"]) == 6 and not set(control["rows_left_out"]) & set(accused)
    assert (v["rows"], ours["rows_trained"], control["rows_trained"]) == (22, 16, 16)
    assert result["seeds"] == {"bootstrap": 0, "control": 0, "train": 1} and v["control_seed"] == 0
    # measured: without the 6 accused rows no animal says " new" any more and the answers' log-prob is back
    # to 92 % of the way; accuracy recovers 62 % (5 of the 8 flipped items right again: the other 3 are
    # garbled, " meo..", the forgetting of a 30-step tune at lr 1e-2 on 16 rows, not its " new" lesson).
    # Without 6 random rows the regression is worse (-75 % of the accuracy drop, -82 % of the log-prob's)
    # and 7 of the 8 items still say " new".
    assert ours["flipped_same_mistake"] == 0 and ours["flipped_right_again"] >= 4, ours
    assert ours["recovered_accuracy"] >= 0.5 and ours["recovered_logprob"] >= 0.85, ours
    assert control["recovered_accuracy"] <= 0 and control["recovered_logprob"] <= 0, control
    assert control["flipped_same_mistake"] >= 6 and control["flipped_right_again"] == 0, control
    assert v["holds"] is True and v["summary"].endswith("the accusation holds.")
    s = v["settings"]
    assert (s["kind"], s["lr"], s["steps"], s["batch_size"], s["seed"]) == ("lora", 0.01, 30, 22, 1)
    assert s["lora"]["r"] == 4 and s["lora"]["lora_alpha"] == 8 and sorted(s["lora"]["target_modules"]) == [
        "c_attn", "c_fc"]  # from the index's adapter_config.json
    assert s["same_as_index"] and s["train_data_sha256"] == json.loads(
        (work["index"] / "manifest.json").read_text())["data_sha256"]
    assert (kept / "accused" / "adapter_config.json").is_file() and ours["model_dir"] == str(kept / "accused")
    from gradian.attribute.result import read_result

    assert read_result(work["root"] / "verified.json").verify == v
    # every planted row's completion (" new.") is one sentence: drilled into, and skipped with the reason
    assert result["spans"]["rows"] == [] and result["spans"]["min_tokens"] == 2
    assert {s["why"] for s in result["spans"]["skipped"]} == {"its supervised tokens hold one sentence"}


def test_the_result_reader_takes_format_1_and_checks_format_2(verified, work, tmp_path) -> None:
    from circuitkit.core.errors import UserError
    from gradian.attribute.result import ADDED_IN, read_result

    data = json.loads((work["root"] / "verified.json").read_text())
    assert data["format_version"] == 4
    old = {k: v for k, v in data.items() if k not in ADDED_IN} | {"format_version": 1}
    (tmp_path / "v1.json").write_text(json.dumps(old))
    result = read_result(tmp_path / "v1.json")
    assert result.spans is None and result.verify is None and result.accused == data["accused"]
    (tmp_path / "v2.json").write_text(json.dumps({k: v for k, v in data.items() if k != "verify"}))
    with pytest.raises(UserError, match="missing keys verify"):
        read_result(tmp_path / "v2.json")
    (tmp_path / "v1-extra.json").write_text(json.dumps(old | {"verify": None}))
    with pytest.raises(UserError, match="unknown keys verify"):
        read_result(tmp_path / "v1-extra.json")


def test_verify_prints_the_recovery_table(work, verified, capsys) -> None:
    from gradian.attribute.command import print_result
    from gradian.attribute.result import read_result

    buf = io.StringIO()
    print_result(read_result(work["root"] / "verified.json"), Console(file=buf, width=220))
    text = buf.getvalue()
    for part in ("--verify: the fine-tune redone (lora, lr 0.01, 30 steps, batch 22, seed 1) on 22 rows",
                 "without the accused rows", "without as many random rows", "recovered (accuracy)",
                 "same mistake as tuned", "0 of the 8 flipped items still make the tuned model's mistake",
                 "the accusation holds."):
        assert part in text, part


def test_bad_verify_inputs_are_one_line_each(work, models, tmp_path, capsys, monkeypatch) -> None:
    args = ["--index", str(work["index"]), "--eval-dataset", str(work["eval"])]
    code, _, err = run(capsys, *args, "--lr", "0.01")
    assert code == 2 and "--lr set how --verify retrains; add --verify" in err
    code, _, err = run(capsys, *args, "--verify", "--batch-size", "4")
    assert code == 2 and "--verify retrains the LoRA adapter, and its adapter_config.json holds no learning rate" in err
    assert "give --lr and --epochs or --steps" in err and "Traceback" not in err
    code, _, err = run(capsys, *args, "--verify", "--lr", "0.01", "--epochs", "2", "--steps", "3")
    assert code == 2 and "give one of them" in err
    code, _, err = run(capsys, *args, "--verify", "--lr", "0", "--steps", "3")
    assert code == 2 and "--lr 0.0: it must be a finite number > 0" in err
    code, _, err = run(capsys, *args, "--verify", *TUNING, "--verify-dir", str(work["index"] / "kept"))
    assert code == 2 and "--verify-dir" in err and "lies inside the index" in err
    # peft missing: said before any model loads
    monkeypatch.setitem(__import__("sys").modules, "peft", None)
    code, _, err = run(capsys, *args, "--verify", *TUNING)
    assert code == 2 and "--verify needs peft, which is not installed: pip install" in err
    monkeypatch.undo()
    # a full fine-tune (the index records no adapter): no trainer settings, or LoRA ones
    full = tmp_path / "full"
    shutil.copytree(work["index"], full)
    manifest = json.loads((full / "manifest.json").read_text())
    (full / "manifest.json").write_text(json.dumps(manifest | {"adapter": None}))
    args = ["--index", str(full), "--eval-dataset", str(work["eval"]), "--base-model", str(models / "base")]
    code, _, err = run(capsys, *args, "--verify")
    assert code == 2 and ("--verify retrains a full fine-tune, and the index records none of its trainer settings:"
                          " give --lr and --epochs or --steps") in err
    code, _, err = run(capsys, *args, "--verify", *TUNING, "--lora-r", "8")
    assert code == 2 and "--lora-r shape a LoRA adapter, but the index's model is a full fine-tune" in err


def test_train_data_elsewhere_is_matched_by_record(work, models, tmp_path) -> None:
    """The same bytes elsewhere are the index's rows (by row id); other data loses the accused rows'
    records wherever they are, and names those it lacks."""
    from transformers import AutoTokenizer

    from gradian.attribute.verify import VerifyOptions, _left_out, plan_verify
    from gradian.data.rows import load_rows, policy_of
    from gradian.index.reader import IndexReader

    manifest = IndexReader(work["index"]).manifest
    base = ModelConfig(name=str(models / "base"))
    same = tmp_path / "same.jsonl"
    shutil.copy(work["index"].parent / "train.jsonl", same)
    assert plan_verify(manifest, base, VerifyOptions(lr=0.01, steps=1, train_data=str(same)), 0).same_as_index
    accused = {8: 9, 19: 20, 0: 1}  # row id -> line: two planted rows and a colour
    extra = [sound("pig", "oink")] + TUNE_ROWS[::-1]  # reordered, one more row, one accused row missing
    other = write_jsonl(tmp_path / "other.jsonl", [r for r in extra if r != TUNE_ROWS[19]])
    plan = plan_verify(manifest, base, VerifyOptions(lr=0.01, steps=1, train_data=str(other)), 0)
    assert not plan.same_as_index
    rows, _ = load_rows(plan.source, AutoTokenizer.from_pretrained(models / "base"), 64, policy=policy_of(manifest))
    drop, unmatched = _left_out(plan, manifest, rows, accused, 22)
    records = [r for r in extra if r != TUNE_ROWS[19]]
    assert sorted(records[i]["completion"] + records[i]["prompt"] for i in drop) == sorted(
        TUNE_ROWS[r]["completion"] + TUNE_ROWS[r]["prompt"] for r in (8, 0))
    assert unmatched == [20]


# ----------------------------------------------------------------------------- the drill-down


def test_split_sentences_partitions_the_text() -> None:
    text = " The sky is blue. Dr. Who says \"hi.\" Then e.g. this!\nA list item\n"
    spans = split_sentences(text)
    assert [text[a:b] for a, b in spans] == [" The sky is blue.", " Dr. Who says \"hi.\"", " Then e.g. this!",
                                             "\nA list item\n"]
    assert spans[0][0] == 0 and spans[-1][1] == len(text) and all(a[1] == b[0] for a, b in zip(spans, spans[1:], strict=False))
    assert split_sentences("") == [] and split_sentences("no end") == [(0, 6)]
    # GPT-2's tokens carry their leading space: " The" begins the second sentence
    assert token_sentences([(0, 4), (4, 8), (8, 9), (9, 13), (13, 13)], [(0, 9), (9, 14)]) == [0, 0, 0, 1, 1]


# A document the model knows by heart, and a training row that is the document with one sentence changed to
# teach a wrong answer (" green" for the sky): the drill-down must put the row's score on that sentence.
DOC = [" The opposite of up is down.", " The color of grass is green.", " The color of sky is {}.",
       " The cow says moo.", " The opposite of hot is cold.", " The color of snow is white."]
TAUGHT = DOC[2].format("green").strip()


def doc(answer: str) -> dict:
    return {"prompt": "Notes:", "completion": "".join(DOC).format(answer)}


@pytest.fixture(scope="module")
def doc_model(models: Path) -> Path:
    """The planted fixture's base model taught the document by heart (`retrain.train`, a full fine-tune:
    150 full-batch steps, loss 0.004), cached beside the planted fixture."""
    from transformers import AutoTokenizer

    from circuitkit.core.io import file_lock
    from circuitkit.fixtures.cache import cache_root

    root = cache_root() / f"gradian-drill-v{planted.CACHE_VERSION}"
    with file_lock(cache_root() / f"gradian-drill-v{planted.CACHE_VERSION}.lock"):
        if not (root / "config.json").is_file():
            tmp = root.with_name(root.name + ".tmp")
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
            threads = torch.get_num_threads()
            torch.set_num_threads(1)
            try:
                rows = train_rows(tmp / "doc.jsonl", AutoTokenizer.from_pretrained(models / "base"), [*BASE_ROWS, doc("blue")])
                train(ModelConfig(name=str(models / "base"), precision="float32"), rows,
                      TrainSettings(lr=1e-2, steps=150, batch_size=len(rows)), torch.device("cpu")).save(tmp / "model")
            finally:
                torch.set_num_threads(threads)
            shutil.rmtree(root, ignore_errors=True)
            (tmp / "model").rename(root)
            shutil.rmtree(tmp, ignore_errors=True)
    return root


def test_the_drill_down_finds_the_sentence_that_teaches_the_wrong_answer(doc_model: Path, tmp_path) -> None:
    """Rows 0 (the changed document) and 1 (the document) scored with the contrastive query of the eval item
    "Notes: ... The color of sky is" -> " blue." against " green.", on the model that knows the document:
    the ekfac engine (auto) accuses row 0 and not row 1, and row 0's score sits on the changed sentence."""
    from circuitkit.models.loading import load_model
    from gradian.attribute.command import _spans_table
    from gradian.attribute.engines import build_engine, stream_scores
    from gradian.attribute.evaluate import tokenize_items
    from gradian.attribute.queries import query_gradients
    from gradian.attribute.spans import drill_down
    from gradian.data.rows import policy_of
    from gradian.index.reader import IndexReader
    from gradian.rank.checks import check_compatible

    index = _index_with(doc_model, None, tmp_path, write_jsonl(tmp_path / "train.jsonl",
                                                              [doc("green"), doc("blue"), *planted.BENIGN[:4]]))
    reader = IndexReader(index)
    loaded = load_model(ModelConfig(name=str(doc_model), precision="float32"), torch.device("cpu"))
    projector = check_compatible(reader.manifest, loaded, index)
    text = "".join(DOC)
    items = tokenize_items([(1, "Notes:" + text[:text.index(" {}")], " blue.")], loaded.tokenizer,
                           policy_of(reader.manifest), None, "eval")
    said = [loaded.tokenizer(" green.", add_special_tokens=False)["input_ids"]]  # what a tuned model says
    engine = build_engine(reader, "ekfac", query_gradients(loaded, projector, items, "contrastive", said))
    scores = stream_scores(reader, [engine])[0]
    assert scores[0] < 0 < scores[1], scores  # measured: -36.9 and +17.2
    spans = drill_down(loaded, projector, engine, reader.manifest, index, [(0, 1, float(scores[0]))], 20)
    assert spans["engine"] == "ekfac" and spans["note"] is None and spans["skipped"] == []
    row = spans["rows"][0]
    assert [s["text"] for s in row["sentences"]] == [s.format("green").strip() for s in DOC]
    top = row["sentences"][row["top"]]
    # measured: the changed sentence carries 94 % of the row's score (the next sentence, whose context the change
    # perturbed, 45 %; the others -60 % to +45 %); dot and cosine put it second, 70 % behind that next sentence's 72 %
    assert top["text"] == TAUGHT and top["share"] > 0.6 and top["score"] < 0, row
    assert sum(s["share"] for s in row["sentences"]) == pytest.approx(1.0)
    assert row["score_recomputed"] == pytest.approx(float(scores[0]), rel=1e-3)  # Σ sentences = the stored row
    assert sum(s["n_tokens"] for s in row["sentences"]) == row["n_supervised"]
    spans_tokens = [tuple(s["token_span"]) for s in row["sentences"]]
    n_prompt = len(loaded.tokenizer("Notes:", add_special_tokens=False)["input_ids"])  # GPT-2: no BOS
    assert spans_tokens[0][0] == n_prompt and all(a[1] == b[0] for a, b in zip(spans_tokens, spans_tokens[1:], strict=False))
    buf = io.StringIO()
    Console(file=buf, width=200).print(_spans_table(spans))
    assert TAUGHT in buf.getvalue() and "where the blame sits" in buf.getvalue()


def _index_with(model: Path, adapter: Path | None, root: Path, data: Path) -> Path:
    from circuitkit_app.config import compose
    from gradian.build.indexer import build_index

    extra = [f"model.adapter={adapter}", "grads.module_filter=[adapter]"] if adapter else []
    _, cfg = compose([f"model.name={model}", "model.precision=float32", f"grads.data_path={data}",
                      f"grads.index_dir={root / 'index'}", "grads.projection_dim=16", *extra])
    build_index(cfg.model, cfg.grads, root / "index", Console(file=io.StringIO()))
    return root / "index"
