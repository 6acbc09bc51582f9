"""`gradian diagnose`: deterministic checks of a fine-tuning set, its trainer settings and logs.

No model weights and no accelerator: the rows are read with Gradian's reader, measured with the
tokenizer alone (`--model`), and compared with each other and with the eval set in vectorised
passes (seconds for 100,000 rows). Each check lives in one of

    checks_data    malformed, empty, truncated, no EOS, chat template, duplicates, eval overlap
    checks_config  learning rate vs LoRA, epochs, packing with completion-only masking, loss mask
    checks_log     overfitting, NaN / inf, loss spikes, gradient norm explosions

and returns `Finding`s (`gradian.diagnose.finding`); `diagnose_findings` runs them all and gives
the findings as JSON-ready dicts (for `--json` and the report).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from circuitkit.core.errors import UserError
from gradian.diagnose import checks_config, checks_data, checks_log
from gradian.diagnose.finding import Finding, exit_status, sort_findings
from gradian.diagnose.rows import ReadResult, measure, read_rows
from gradian.diagnose.similar import Vocabulary

__all__ = ["Diagnosis", "Finding", "diagnose", "diagnose_findings", "exit_status"]


@dataclass
class Diagnosis:
    """The findings (errors first) and what was read."""

    findings: list[Finding]
    rows: int
    eval_rows: int
    wall_s: float

    def as_dicts(self) -> list[dict[str, Any]]:
        return [f.as_dict() for f in self.findings]


def _read(path: str, flag: str) -> ReadResult:
    if not Path(path).exists():
        raise UserError(f"{flag} {path}: no such file or directory; give a JSONL (or Parquet / Arrow) file of"
                        " prompt/completion or messages rows.", exit_code=2)
    return read_rows(path)


def _quiet_about_long_rows(tokenizer: Any) -> None:
    """Rows longer than the tokenizer's model_max_length are what the length check measures and reports;
    transformers' own warning about them ("Token indices sequence length is longer ...") is not for the
    user. Its tokenizers warn once per key of `deprecation_warnings`: mark the key as warned."""
    warned = getattr(tokenizer, "deprecation_warnings", None)
    if isinstance(warned, dict):
        warned["sequence-length-is-longer-than-the-specified-maximum"] = True


def _tokenizer(model: str) -> Any:
    from circuitkit.models.config import ModelConfig
    from circuitkit.models.loading import load_tokenizer

    try:
        return load_tokenizer(ModelConfig(name=model))
    except UserError:
        raise
    except Exception as err:  # noqa: BLE001 - transformers raises many types for a bad name
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise UserError(f"--model {model}: cannot load its tokenizer ({first}); give a local model directory,"
                        " builtin:NAME, or a hub name in the cache.", exit_code=2) from None


def diagnose(dataset: str, eval_dataset: str | None = None, run: str | None = None, trainer_args: str | None = None,
             trainer_log: str | None = None, model: str | None = None, max_seq_length: int | None = None,
             tokenizer: Any | None = None, check_eos: bool = False) -> Diagnosis:
    """Run every check that the inputs allow (see `diagnose_findings`). `check_eos`: look for completions
    without EOS even when the trainer args say the trainer appends it (otherwise reported as skipped)."""
    start = time.perf_counter()
    train = _read(dataset, "--dataset")
    evals = _read(eval_dataset, "--eval-dataset") if eval_dataset else None
    settings = checks_config.read_settings(trainer_args, run)
    if trainer_log is not None:
        points, log_path = checks_log.read_log(trainer_log), trainer_log
    elif settings.state is not None:
        points, log_path = checks_log.points_of(settings.state.get("log_history"), settings.state_path), settings.state_path
    else:
        points, log_path = [], ""
    if not train.rows and not train.malformed:
        raise UserError(f"--dataset {dataset}: holds no rows (the file is empty, or blank lines only); give the"
                        " training rows (prompt/completion or messages, one JSON object per line).")
    if tokenizer is None and model is not None:
        tokenizer = _tokenizer(model)
    if tokenizer is not None:
        _quiet_about_long_rows(tokenizer)
    found: list[Finding] = checks_data.malformed(train) + checks_data.empty_completions(train)
    if evals is not None:
        found += checks_data.malformed(evals, source="eval")
    if tokenizer is not None:
        append_eos = settings.append_eos
        failed = measure(train.rows, tokenizer, bool(append_eos))
        if max_seq_length is not None:
            limit: tuple[int, str] | None = (max_seq_length, f"--max-seq-length {max_seq_length}")
        else:
            limit = settings.max_seq_length
        if limit is not None:
            found += checks_data.truncated(train, tokenizer, limit[0], limit[1], bool(append_eos))
        else:
            found.append(Finding(id="length_not_checked", severity="info", source="config", message="no length limit"
                                 " given: completions cut by the trainer's max length were not looked for",
                                 fix="pass --max-seq-length N, or trainer args with max_seq_length / max_length"))
        if append_eos and settings.eos_inferred and not check_eos:
            found.append(Finding(
                id="missing_eos_skipped", severity="info", source="config", file=settings.path,
                message="the missing-EOS check was skipped: the trainer args look like TRL's SFTConfig"
                        f" ({', '.join(settings.trl_keys)}), which appends EOS to prompt/completion rows; a"
                        " completion cut short in the data still gets one, and is not looked for",
                fix="run with --check-eos to look for completions that lack the EOS the other rows write"))
        else:
            found += checks_data.missing_eos(train, tokenizer, None if check_eos and settings.eos_inferred else append_eos)
        found += checks_data.template_mismatch(train, tokenizer, failed)
    else:
        found.append(Finding(id="tokens_not_checked", severity="info", source="config", message="no tokenizer: length,"
                             " EOS and chat-template checks were skipped",
                             fix="pass --model NAME_OR_DIR (only its tokenizer is loaded)"))
    vocab = Vocabulary()
    words = checks_data.words_of(train)
    found += checks_data.duplicates(train, vocab, words)
    if evals is not None:
        found += checks_data.eval_overlap(train, evals, vocab, words)
    found += checks_config.learning_rate(settings, checks_log.peak_learning_rate(points))
    found += checks_config.epochs(settings, len(train.rows))
    found += checks_config.masking(settings, train)
    if points:
        found += checks_log.not_finite(points, log_path) + checks_log.spikes(points, log_path)
        found += checks_log.overfitting(points, log_path)
    return Diagnosis(sort_findings(found), len(train.rows), len(evals.rows) if evals else 0,
                     time.perf_counter() - start)


def diagnose_findings(dataset: str, eval_dataset: str | None = None, run: str | None = None,
                      trainer_args: str | None = None, trainer_log: str | None = None, model: str | None = None,
                      max_seq_length: int | None = None, tokenizer: Any | None = None) -> list[dict[str, Any]]:
    """The findings of `gradian diagnose`, as JSON-ready dicts with the keys of `Finding.as_dict`
    (errors first). For the report and for scripts.

    `dataset` / `eval_dataset`: the training and eval rows (JSONL, Parquet, Arrow);
    `run`: the trainer's output directory (adapter_config.json, *args*.json, trainer_state.json);
    `trainer_args`: a JSON of the trainer's arguments; `trainer_log`: trainer_state.json or JSONL
    of log points; `model`: whose tokenizer measures the rows (or pass `tokenizer`);
    `max_seq_length`: the trainer's length limit (else read from the trainer args).
    Raises UserError (exit code 2) for a missing file or an unknown trainer log format.
    """
    return diagnose(dataset, eval_dataset, run, trainer_args, trainer_log, model, max_seq_length,
                    tokenizer).as_dicts()
