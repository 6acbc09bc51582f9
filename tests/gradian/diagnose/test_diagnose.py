"""gradian diagnose: a planted-defect set where every planted defect is found and no clean row is
flagged; each config and log check on a case that has it and one that does not; the CLI's exit
codes, JSON keys and one-line errors."""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from circuitkit.fixtures.models import ADJECTIVES, NOUNS, OBJECTS, PLACES
from circuitkit_app.gradian_cli import main
from gradian.data.rows import TokenPolicy, load_rows
from gradian.diagnose import diagnose, diagnose_findings
from gradian.diagnose.finding import SHOWN

EOS = "<|endoftext|>"
LIMIT = 64
# One token each for the fixture's tokenizer: clean rows stay far below LIMIT.
WORDS = PLACES + OBJECTS + NOUNS + ADJECTIVES


@pytest.fixture(scope="module")
def tok(tiny_model: Callable[[str], Path]) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model("tiny-gpt2"))


def write_jsonl(path: Path, items: list[Any]) -> Path:
    path.write_text("".join((it if isinstance(it, str) else json.dumps(it)) + "\n" for it in items))
    return path


def sentence(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def clean_rows(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt": f"Q: {sentence(rng, 8)}? A:", "completion": f" {sentence(rng, 6)}.{EOS}"} for _ in range(n)]


def by_id(findings: list[dict]) -> dict[str, dict]:
    out: dict[str, dict] = {}
    for f in findings:
        assert f["id"] not in out or f["id"] == "chat_template_mismatch", f"two findings named {f['id']}"
        out.setdefault(f["id"], f)
    return out


class Planted:
    """A training set of clean rows with each defect planted at known lines, and an eval set."""

    def __init__(self, tmp: Path) -> None:
        rng = random.Random(1)
        rows: list[Any] = clean_rows(60)
        self.defects: dict[str, list[int]] = {}

        def plant(kind: str, row: Any) -> None:
            rows.append(row)
            self.defects.setdefault(kind, []).append(len(rows))  # 1-based line of the row just added

        for _ in range(3):  # ~100 completion tokens: past LIMIT
            plant("truncated_completion", {"prompt": "Tell a long story:", "completion": f" {sentence(rng, 60)}.{EOS}"})
        plant("empty_completion", {"prompt": "Q: nothing here? A:", "completion": ""})
        plant("empty_completion", {"prompt": "Q: blank too? A:", "completion": "   "})
        plant("missing_eos", {"prompt": "Q: where does it stop? A:", "completion": " it never stops"})
        plant("missing_eos", {"prompt": "Q: and this one? A:", "completion": f" no end either {EOS} really"})
        plant("exact_duplicate", dict(rows[4]))
        plant("exact_duplicate", dict(rows[9]))
        plant("near_duplicate", {"prompt": rows[14]["prompt"].upper().replace("?", " ?!"),
                                 "completion": rows[14]["completion"]})
        long_prompt = sentence(rng, 40)
        rows.append({"prompt": f"Summarise: {long_prompt}", "completion": f" short.{EOS}"})
        self.long_line = len(rows)
        words = long_prompt.split()
        words[20] = "zeppelin"
        plant("near_duplicate", {"prompt": f"Summarise: {' '.join(words)}", "completion": f" short.{EOS}"})
        plant("chat_template_mismatch", {"prompt": "<|im_start|>user\nQ: hello there?<|im_end|>\n<|im_start|>"
                                         "assistant\n", "completion": f" hi.{EOS}"})
        plant("template_markers_in_messages", {"messages": [
            {"role": "user", "content": "<|im_start|>user say hi"}, {"role": "assistant", "content": "hi"}]})
        plant("malformed_row", {"prompt": "Q: a number? A:", "completion": 7})
        for _ in range(3):
            rows.append({"messages": [{"role": "user", "content": sentence(rng, 7)},
                                      {"role": "assistant", "content": sentence(rng, 5)}]})
        # The source of the eval set's leaked answer: a clean training row whose prompt holds it.
        rows.append({"prompt": "Context: the vault code is amber falcon seven nine. Q: what colour is the sky? A:",
                     "completion": f" blue.{EOS}"})
        self.train = write_jsonl(tmp / "train.jsonl", rows)
        self.clean_lines = set(range(1, len(rows) + 1)) - {n for lines in self.defects.values() for n in lines}
        evals = clean_rows(20, seed=7)
        evals.append({"prompt": rows[30]["prompt"], "completion": " something else."})
        self.contaminated = [len(evals)]
        evals.append({"prompt": "Q: what is the vault code? A:", "completion": " amber falcon seven nine"})
        self.leaked = [len(evals)]
        self.eval = write_jsonl(tmp / "eval.jsonl", evals)
        self.clean_eval = set(range(1, len(evals) + 1)) - set(self.contaminated) - set(self.leaked)


@pytest.fixture()
def planted(tmp_path: Path) -> Planted:
    return Planted(tmp_path)


def test_every_planted_defect_is_found_and_no_clean_row_is_flagged(planted: Planted, tok: Any) -> None:
    findings = diagnose_findings(str(planted.train), str(planted.eval), max_seq_length=LIMIT, tokenizer=tok)
    train = [f for f in findings if f["source"] == "train"]
    flagged: dict[str, list[int]] = {}
    for f in train:
        assert f["count"] == len(f["rows"]) <= SHOWN, f
        flagged.setdefault(f["id"], []).extend(f["rows"])
    assert {k: sorted(v) for k, v in flagged.items()} == planted.defects
    assert not planted.clean_lines & {n for lines in flagged.values() for n in lines}
    evals = by_id([f for f in findings if f["source"] == "eval"])
    assert evals["eval_contamination"]["rows"] == planted.contaminated
    assert evals["answer_leakage"]["rows"] == planted.leaked
    assert set(evals) == {"eval_contamination", "answer_leakage"}
    # Every finding: the fixed keys, evidence and a fix; errors before warnings.
    for f in findings:
        assert list(f) == ["id", "severity", "source", "file", "message", "count", "rows", "all_rows", "steps",
                           "evidence", "fix"]
        assert f["fix"] and f["message"]
    severities = [f["severity"] for f in findings]
    assert severities == sorted(severities, key=("error", "warning", "info").index)
    found = by_id(findings)
    cut = found["truncated_completion"]
    assert cut["severity"] == "error" and "✂" in cut["evidence"] and f"max-seq-length {LIMIT}" in cut["message"]
    assert "it never stops" in found["missing_eos"]["evidence"]
    assert "<|im_start|>" in found["chat_template_mismatch"]["evidence"]


def test_truncation_agrees_with_the_index_reader(planted: Planted, tok: Any, tmp_path: Path) -> None:
    # The oracle: gradian.data.rows's own loader, with the same limit and token policy, cuts the same rows.
    rows = [json.loads(line) for line in planted.train.read_text().splitlines()]
    readable = [r for r in rows if isinstance(r.get("completion", ""), str) and "messages" not in r]
    data = write_jsonl(tmp_path / "readable.jsonl", readable)
    for append_eos in (False, True):
        _, report = load_rows(data, tok, LIMIT, on_truncation="warn", policy=TokenPolicy(append_eos=append_eos))
        args = write_jsonl(tmp_path / "args.json", [{"max_length": LIMIT, "add_eos_token": append_eos}])
        found = by_id(diagnose_findings(str(data), trainer_args=str(args), tokenizer=tok))
        assert found["truncated_completion"]["rows"] == report.truncated_lines
        assert f"max_length={LIMIT}" in found["truncated_completion"]["message"]


def test_a_clean_set_has_no_finding_and_exits_0(tmp_path: Path, tok: Any, tiny_model: Callable[[str], Path],
                                                capsys: pytest.CaptureFixture) -> None:
    train = write_jsonl(tmp_path / "t.jsonl", clean_rows(200))
    evals = write_jsonl(tmp_path / "e.jsonl", clean_rows(30, seed=99))
    assert diagnose_findings(str(train), str(evals), max_seq_length=LIMIT, tokenizer=tok) == []
    code = main(["diagnose", "--dataset", str(train), "--eval-dataset", str(evals), "--model",
                 str(tiny_model("tiny-gpt2")), "--max-seq-length", str(LIMIT), "--json"])
    assert code == 0 and json.loads(capsys.readouterr().out) == []


def test_the_cli_exits_1_on_errors_and_prints_the_table(planted: Planted, tiny_model: Callable[[str], Path],
                                                        capsys: pytest.CaptureFixture,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "300")  # the table's cells unfolded
    code = main(["diagnose", "--dataset", str(planted.train), "--model", str(tiny_model("tiny-gpt2")),
                 "--max-seq-length", str(LIMIT)])
    out = capsys.readouterr()
    assert code == 1
    assert "truncated_completion" in out.out and "exact_duplicate" in out.out
    assert "error(s)" in out.err
    # Without a tokenizer the token checks are skipped, and said to be.
    assert main(["diagnose", "--dataset", str(planted.train), "--json"]) == 1
    ids = {f["id"] for f in json.loads(capsys.readouterr().out)}
    assert "tokens_not_checked" in ids and "truncated_completion" not in ids and "exact_duplicate" in ids


def test_chat_rows_need_the_tokenizers_template(tmp_path: Path, tiny_model: Callable[[str], Path]) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model("tiny-gpt2"))
    tok.chat_template = None
    data = write_jsonl(tmp_path / "chat.jsonl", [{"messages": [{"role": "user", "content": "hi"},
                                                               {"role": "assistant", "content": "hello"}]}] * 1)
    found = by_id(diagnose_findings(str(data), tokenizer=tok))
    assert found["chat_template_mismatch"]["rows"] == [1] and "chat template" in found["chat_template_mismatch"]["evidence"]


# ----------------------------------------------------------------------------- trainer settings


def config_ids(tmp_path: Path, args: dict, n_rows: int = 400, run: Path | None = None) -> dict[str, dict]:
    data = write_jsonl(tmp_path / "d.jsonl", clean_rows(n_rows))
    path = None
    if args is not None:
        path = tmp_path / "args.json"
        path.write_text(json.dumps(args))
    found = diagnose_findings(str(data), trainer_args=str(path) if path and run is None else None,
                              run=str(run) if run else None)
    return {f["id"]: f for f in found if f["source"] == "config" and f["severity"] != "info"}


def test_learning_rate_of_the_wrong_regime(tmp_path: Path) -> None:
    low = config_ids(tmp_path, {"learning_rate": 1e-5, "peft_config": {"r": 8, "lora_alpha": 16}})
    assert list(low) == ["lr_too_low_for_lora"] and "1e-05" in low["lr_too_low_for_lora"]["evidence"]
    assert config_ids(tmp_path, {"learning_rate": 2e-4, "peft_config": {"r": 8}}) == {}
    # A run directory without adapter_config.json is a full fine-tune.
    run = tmp_path / "run"
    run.mkdir()
    (run / "training_args.json").write_text(json.dumps({"learning_rate": 3e-4}))
    assert list(config_ids(tmp_path, None, run=run)) == ["lr_too_high_for_full_ft"]
    (run / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 16}))
    assert config_ids(tmp_path, None, run=run) == {}
    # No adapter information at all: the regime is unknown and nothing is claimed.
    assert config_ids(tmp_path, {"learning_rate": 3e-4}) == {}


def test_many_epochs_over_a_small_set(tmp_path: Path) -> None:
    found = config_ids(tmp_path, {"num_train_epochs": 12}, n_rows=400)
    assert list(found) == ["too_many_epochs"] and "12 epochs over 400 rows" in found["too_many_epochs"]["message"]
    assert config_ids(tmp_path, {"num_train_epochs": 3}, n_rows=400) == {}
    # max_steps turned into epochs: 600 steps x 8 rows / 400 rows = 12.
    steps = config_ids(tmp_path, {"max_steps": 600, "per_device_train_batch_size": 4, "gradient_accumulation_steps": 2})
    assert "12 epochs" in steps["too_many_epochs"]["message"]


def test_packing_next_to_completion_only_masking(tmp_path: Path) -> None:
    found = config_ids(tmp_path, {"packing": True, "completion_only_loss": True})
    assert found["packing_with_completion_only"]["severity"] == "warning"
    found = config_ids(tmp_path, {"packing": True, "data_collator": {"class": "DataCollatorForCompletionOnlyLM",
                                                                      "response_template": " A:"}})
    assert found["packing_with_completion_only"]["severity"] == "error"
    assert config_ids(tmp_path, {"packing": False, "completion_only_loss": True}) == {}


def test_a_loss_mask_over_the_prompt(tmp_path: Path) -> None:
    for args, shown in (({"completion_only_loss": False}, "completion_only_loss=false"),
                        ({"train_on_inputs": True}, "train_on_inputs=true"),
                        ({"data_collator": "DataCollatorForLanguageModeling"}, "DataCollatorForLanguageModeling")):
        found = config_ids(tmp_path, args)
        assert list(found) == ["loss_on_prompt"] and shown in found["loss_on_prompt"]["evidence"]
    assert config_ids(tmp_path, {"completion_only_loss": True}) == {}


def test_a_response_template_the_rows_lack(tmp_path: Path) -> None:
    rows = clean_rows(5) + [{"prompt": "Question without the marker", "completion": f" x.{EOS}"}]
    data = write_jsonl(tmp_path / "d.jsonl", rows)
    args = tmp_path / "a.json"
    args.write_text(json.dumps({"data_collator": "DataCollatorForCompletionOnlyLM", "response_template": " A:"}))
    found = by_id(diagnose_findings(str(data), trainer_args=str(args)))
    assert found["response_template_missing"]["rows"] == [6]


# ----------------------------------------------------------------------------- trainer logs


def log_ids(tmp_path: Path, log: Any, name: str = "trainer_state.json") -> dict[str, dict]:
    data = write_jsonl(tmp_path / "d.jsonl", clean_rows(50))
    path = tmp_path / name
    if name.endswith(".jsonl"):
        write_jsonl(path, log)
    else:
        path.write_text(json.dumps(log))
    return {f["id"]: f for f in diagnose_findings(str(data), trainer_log=str(path)) if f["source"] == "log"}


def falling(n: int, start: float = 2.0) -> list[float]:
    return [start * 0.97 ** i for i in range(n)]


def test_overfitting_names_the_best_step(tmp_path: Path) -> None:
    history = [{"step": 10 * (i + 1), "loss": v, "learning_rate": 2e-4, "grad_norm": 1.0}
               for i, v in enumerate(falling(40))]
    evals = [1.9, 1.6, 1.5, 1.55, 1.62, 1.7]
    history += [{"step": 60 * (i + 1), "eval_loss": v} for i, v in enumerate(evals)]
    found = log_ids(tmp_path, {"log_history": history, "global_step": 400})
    assert list(found) == ["overfitting"] and found["overfitting"]["steps"] == [180]
    assert "step 180" in found["overfitting"]["fix"]
    # Eval loss still falling: nothing.
    history = [h for h in history if "eval_loss" not in h] + [{"step": 60 * (i + 1), "eval_loss": 2 - 0.1 * i}
                                                              for i in range(6)]
    assert log_ids(tmp_path, {"log_history": history}) == {}


def test_nan_spikes_and_grad_norm_explosions(tmp_path: Path) -> None:
    log = [{"step": i + 1, "loss": v, "grad_norm": 1.0} for i, v in enumerate(falling(30))]
    log[20]["loss"] = 5.0  # ~1.1 before it
    log[25]["grad_norm"] = 80.0
    log.append({"step": 31, "loss": float("nan"), "grad_norm": float("inf")})
    found = log_ids(tmp_path, log, "log.jsonl")
    assert found["loss_spike"]["steps"] == [21] and found["grad_norm_explosion"]["steps"] == [26]
    assert found["loss_not_finite"]["severity"] == "error" and found["loss_not_finite"]["steps"] == [31]
    clean = [{"step": i + 1, "loss": v, "grad_norm": 1.0 + 0.1 * (i % 3)} for i, v in enumerate(falling(30))]
    assert log_ids(tmp_path, clean, "log.jsonl") == {}


@pytest.mark.parametrize("content", ['{"global_step": 3}', '[{"loss": 1.0}]', "not json at all\n", "[]"])
def test_an_unknown_trainer_log_is_one_line_and_exit_2(tmp_path: Path, content: str,
                                                       capsys: pytest.CaptureFixture) -> None:
    data = write_jsonl(tmp_path / "d.jsonl", clean_rows(5))
    log = tmp_path / "log.json"
    log.write_text(content)
    assert main(["diagnose", "--dataset", str(data), "--trainer-log", str(log)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "unknown trainer log format" in err and "trainer_state.json" in err


def test_bad_arguments_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["diagnose", "--dataset", str(tmp_path / "missing.jsonl")]) == 2
    assert "no such file" in capsys.readouterr().err
    data = write_jsonl(tmp_path / "d.jsonl", clean_rows(5))
    args = tmp_path / "a.json"
    args.write_text("[1, 2]")
    assert main(["diagnose", "--dataset", str(data), "--trainer-args", str(args)]) == 2
    assert "JSON object" in capsys.readouterr().err


def test_the_run_directory_gives_settings_and_log(tmp_path: Path) -> None:
    run = tmp_path / "out"
    (run / "checkpoint-200").mkdir(parents=True)
    (run / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 8}))
    (run / "training_args.json").write_text(json.dumps({"learning_rate": 1e-5, "num_train_epochs": 12}))
    log = [{"step": i + 1, "loss": v} for i, v in enumerate(falling(20))] + [{"step": 21, "loss": float("nan")}]
    (run / "checkpoint-200" / "trainer_state.json").write_text(json.dumps({"log_history": log}))
    data = write_jsonl(tmp_path / "d.jsonl", clean_rows(400))
    result = diagnose(str(data), run=str(run))
    assert {f.id for f in result.findings} == {"lr_too_low_for_lora", "too_many_epochs", "loss_not_finite",
                                               "tokens_not_checked"}


def test_an_eos_check_the_trainer_makes_unneeded_is_reported_skipped_and_can_be_forced(
        tmp_path: Path, tok: Any, tiny_model: Callable[[str], Path], capsys: pytest.CaptureFixture) -> None:
    """TRL's keys say the trainer appends EOS: the missing-EOS check is said to be skipped (not silently
    dropped), and --check-eos runs it, finding the rows cut short in the data."""
    eos = tok.eos_token
    rows = [{"prompt": f"Q{i}: ", "completion": f"answer {i}.{eos}"} for i in range(12)]
    rows += [{"prompt": f"Q{i}: ", "completion": "answer cut sho"} for i in range(12, 15)]  # cut short, no EOS
    train = write_jsonl(tmp_path / "t.jsonl", rows)
    args = tmp_path / "args.json"
    args.write_text(json.dumps({"completion_only_loss": True, "learning_rate": 2e-4, "num_train_epochs": 1}))
    model = str(tiny_model("tiny-gpt2"))
    main(["diagnose", "--dataset", str(train), "--model", model, "--trainer-args", str(args), "--json"])
    found = {f["id"]: f for f in json.loads(capsys.readouterr().out)}
    assert "missing_eos" not in found
    assert "completion_only_loss" in found["missing_eos_skipped"]["message"]
    assert "--check-eos" in found["missing_eos_skipped"]["fix"]
    main(["diagnose", "--dataset", str(train), "--model", model, "--trainer-args", str(args), "--check-eos", "--json"])
    found = {f["id"]: f for f in json.loads(capsys.readouterr().out)}
    assert found["missing_eos"]["all_rows"] == [13, 14, 15] and "missing_eos_skipped" not in found


def test_json_carries_every_row_of_a_finding(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    rows = [{"prompt": "same ", "completion": "row."}] * (SHOWN + 5)
    train = write_jsonl(tmp_path / "t.jsonl", rows)
    main(["diagnose", "--dataset", str(train), "--json"])
    dup = next(f for f in json.loads(capsys.readouterr().out) if f["id"] == "exact_duplicate")
    assert len(dup["rows"]) == SHOWN and dup["count"] == len(dup["all_rows"]) > SHOWN
