"""The trainer's settings, read from a JSON of its arguments or a run directory, and the checks on
them: a learning rate of the wrong regime (LoRA vs full fine-tuning), many epochs over a small
set, packing next to completion-only masking, a loss mask that covers the prompt, and a response
template the rows do not contain.

Settings are read by name from any flat JSON of trainer arguments (`TrainingArguments.to_dict()`,
TRL's `SFTConfig`, axolotl- or LLaMA-Factory-style keys); a nested object (`peft_config`, `lora`,
`training_args`, `data_collator`) is read too. A run directory gives `adapter_config.json` (a PEFT
adapter: LoRA), a `*args*.json`, and `trainer_state.json` (the log; `gradian.diagnose.checks_log`).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from circuitkit.core.errors import UserError
from gradian.diagnose.finding import Finding
from gradian.diagnose.rows import ReadResult

LORA_LR_MIN = 5e-5  # below this, a LoRA adapter barely moves (full fine-tuning's range)
FULL_LR_MAX = 1e-4  # above this, full fine-tuning forgets or diverges (LoRA's range)
MANY_EPOCHS, SMALL_SET, TOO_MANY_EPOCHS = 5, 5000, 10  # epochs >= 5 over <= 5000 rows, or >= 10 at any size
ARGS_FILES = ("training_args.json", "trainer_args.json", "sft_config.json", "args.json")
_LENGTH_KEYS = ("max_seq_length", "max_length", "sequence_len", "cutoff_len", "max_seq_len")
_NESTED = ("peft_config", "lora", "lora_config", "training_args", "args", "data_collator", "collator")


@dataclass
class TrainerSettings:
    """What the checks read of the trainer's settings (None: not given)."""

    path: str = ""
    values: dict[str, Any] = field(default_factory=dict)  # flat: nested objects merged in
    lora: bool | None = None
    lora_evidence: str = ""
    state: dict[str, Any] | None = None  # trainer_state.json of a run directory
    state_path: str = ""

    def get(self, *keys: str) -> tuple[str, Any] | None:
        """(key, value) of the first of `keys` that is set (not None)."""
        for key in keys:
            if self.values.get(key) is not None:
                return key, self.values[key]
        return None

    @property
    def learning_rate(self) -> float | None:
        hit = self.get("learning_rate", "lr")
        return float(hit[1]) if hit else None

    @property
    def max_seq_length(self) -> tuple[int, str] | None:
        hit = self.get(*_LENGTH_KEYS)
        return (int(hit[1]), f"{hit[0]}={hit[1]}") if hit else None

    @property
    def collator(self) -> str:
        hit = self.get("data_collator", "collator", "data_collator_class", "class")
        value = hit[1] if hit else ""
        return value if isinstance(value, str) else ""

    @property
    def trl_keys(self) -> list[str]:
        """The keys of TRL's SFTConfig these settings have (TRL appends EOS to prompt/completion rows)."""
        return [k for k in ("completion_only_loss", "assistant_only_loss", "dataset_text_field") if k in self.values]

    @property
    def trl_like(self) -> bool:
        """TRL's SFTConfig (its keys): it appends EOS to prompt/completion rows."""
        return bool(self.trl_keys)

    @property
    def eos_inferred(self) -> bool:
        """Whether `append_eos` is inferred from the trainer (TRL's keys), not set by a key."""
        return self.get("add_eos_token", "append_eos") is None and self.trl_like

    @property
    def append_eos(self) -> bool | None:
        hit = self.get("add_eos_token", "append_eos")
        if hit is not None:
            return bool(hit[1])
        return True if self.trl_like else None


def _flat(obj: dict[str, Any]) -> dict[str, Any]:
    out = dict(obj)
    for key in _NESTED:
        nested = obj.get(key)
        if isinstance(nested, dict):
            out.update({k: v for k, v in nested.items() if k not in out or out[k] is None})
            if key in ("data_collator", "collator"):
                out[key] = nested.get("class") or nested.get("name") or nested.get("type")
    return out


def _read_json(path: Path, what: str) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise UserError(f"{what} {path}: not readable JSON ({type(err).__name__}: {err}); give the JSON the trainer"
                        " wrote (e.g. TrainingArguments.to_json_string()).", exit_code=2) from None


def _lora_of(values: dict[str, Any]) -> tuple[bool | None, str]:
    for key in ("peft_config", "lora_r", "lora_rank", "lora_alpha", "lora_target_modules"):
        if values.get(key) not in (None, False, {}, ""):
            return True, f"{key}={json.dumps(values[key])[:40]}"
    for key in ("adapter", "finetuning_type", "peft_type"):
        value = values.get(key)
        if isinstance(value, str):
            return value.lower() in ("lora", "qlora", "dora"), f"{key}={value}"
    if isinstance(values.get("use_peft"), bool):
        return values["use_peft"], f"use_peft={str(values['use_peft']).lower()}"
    return None, ""


def read_settings(trainer_args: str | None = None, run: str | None = None) -> TrainerSettings:
    """The trainer's settings from an args JSON and / or a run directory (either may be None).

    Raises UserError (exit code 2) for a path that is missing or not a JSON object.
    """
    settings = TrainerSettings()
    values: dict[str, Any] = {}
    if run is not None:
        run_dir = Path(run)
        if not run_dir.is_dir():
            raise UserError(f"--run {run}: not a directory; give the trainer's output_dir.", exit_code=2)
        adapter = run_dir / "adapter_config.json"
        if adapter.is_file():
            config = _read_json(adapter, "adapter config")
            settings.lora, settings.lora_evidence = True, f"{adapter.name}: {config.get('peft_type', 'LORA')} r={config.get('r')}"
        else:
            settings.lora, settings.lora_evidence = False, f"no adapter_config.json in {run}"
        for name in ARGS_FILES:
            if (run_dir / name).is_file():
                values.update(_flat(_read_json(run_dir / name, "trainer args")))
                settings.path = str(run_dir / name)
                break
        states = [run_dir / "trainer_state.json"] + sorted(run_dir.glob("checkpoint-*/trainer_state.json"),
                                                           key=lambda p: int(p.parent.name.split("-")[-1])
                                                           if p.parent.name.split("-")[-1].isdigit() else -1)[::-1]
        state = next((p for p in states if p.is_file()), None)
        if state is not None:
            settings.state, settings.state_path = _read_json(state, "trainer state"), str(state)
    if trainer_args is not None:
        path = Path(trainer_args)
        if not path.is_file():
            raise UserError(f"--trainer-args {trainer_args}: no such file.", exit_code=2)
        obj = _read_json(path, "trainer args")
        if not isinstance(obj, dict):
            raise UserError(f"--trainer-args {trainer_args}: expected a JSON object of trainer arguments, got a JSON"
                            f" {type(obj).__name__}.", exit_code=2)
        values.update(_flat(obj))
        settings.path = str(path)
    _check_numbers(values, settings.path)
    settings.values = values
    lora, evidence = _lora_of(values)
    if lora is not None:
        settings.lora, settings.lora_evidence = lora, evidence
    return settings


# The trainer arguments the checks compute with: each must be a finite number (a whole one where
# marked) no larger than this, or the file is refused naming the key (a 400-digit max_steps overflows
# a float; learning_rate "fast" is no rate).
_NUMBER_KEYS = {"learning_rate": False, "lr": False, "max_steps": True, "num_train_epochs": False,
                "num_epochs": False, "epochs": False, "per_device_train_batch_size": True, "micro_batch_size": True,
                "gradient_accumulation_steps": True, "world_size": True,
                **{key: True for key in _LENGTH_KEYS}}
_MAX_NUMBER = 1e15


def _check_numbers(values: dict[str, Any], path: str | None) -> None:
    """UserError (exit 1: the file's content) naming the file and the first numeric trainer argument
    that is text, not finite, fractional where a count is meant, or absurdly large."""
    for key, whole in _NUMBER_KEYS.items():
        value = values.get(key)
        if value is None:
            continue
        number = isinstance(value, int | float) and not isinstance(value, bool)
        ok = (number and abs(value) <= _MAX_NUMBER and (isinstance(value, int) or math.isfinite(value))
              and (not whole or float(value).is_integer()))
        if not ok:
            shown = repr(value) if len(repr(value)) <= 40 else f"{repr(value)[:20]}… ({len(repr(value))} characters)"
            kind = "a whole number" if whole else "a finite number"
            raise UserError(f"{path or 'the trainer args'}: {key} is {shown}; it must be {kind} (at most"
                            f" {_MAX_NUMBER:g}): fix the file, or leave the key out.", exit_code=1)


def epochs_of(settings: TrainerSettings, n_rows: int) -> tuple[float, str] | None:
    """(epochs the run makes over the data, how that was found): max_steps turned into epochs
    through the effective batch, else num_train_epochs, else trainer_state.json's."""
    v = settings.values
    steps = v.get("max_steps")
    if isinstance(steps, int | float) and steps > 0 and n_rows:
        batch = (int(v.get("per_device_train_batch_size") or v.get("micro_batch_size") or 8)
                 * int(v.get("gradient_accumulation_steps") or 1) * int(v.get("world_size") or 1))
        return steps * batch / n_rows, f"max_steps={steps} x batch {batch} / {n_rows} rows"
    hit = settings.get("num_train_epochs", "num_epochs", "epochs")
    if hit is not None:
        return float(hit[1]), f"{hit[0]}={hit[1]}"
    state = settings.state or {}
    if state.get("num_train_epochs") is not None:
        return float(state["num_train_epochs"]), f"trainer_state num_train_epochs={state['num_train_epochs']}"
    return None


def _config(id: str, severity: str, settings: TrainerSettings, message: str, evidence: str, fix: str,
            count: int = 0) -> Finding:
    return Finding(id=id, severity=severity, source="config", file=settings.path or settings.state_path,
                   message=message, count=count, evidence=evidence, fix=fix)


def learning_rate(settings: TrainerSettings, peak_lr_logged: float | None = None) -> list[Finding]:
    """A full fine-tuning learning rate with LoRA, or a LoRA one without an adapter."""
    lr, where = settings.learning_rate, "learning_rate"
    if lr is None and peak_lr_logged is not None:
        lr, where = peak_lr_logged, "peak learning_rate in the log"
    if lr is None or settings.lora is None:
        return []
    if settings.lora and lr < LORA_LR_MIN:
        return [_config("lr_too_low_for_lora", "warning", settings, f"{where} {lr:g} is a full fine-tuning rate, used"
                        f" with LoRA ({settings.lora_evidence}): the adapter barely moves",
                        f"{where}={lr:g} < {LORA_LR_MIN:g}", "use 1e-4 to 3e-4 for LoRA (scale with lora_alpha / r)")]
    if not settings.lora and lr > FULL_LR_MAX:
        return [_config("lr_too_high_for_full_ft", "warning", settings, f"{where} {lr:g} is a LoRA rate, used for full"
                        f" fine-tuning ({settings.lora_evidence or 'no adapter settings'}): it overwrites what the"
                        " model knew", f"{where}={lr:g} > {FULL_LR_MAX:g}",
                        "use 1e-5 to 5e-5 for full fine-tuning, or train a LoRA adapter")]
    return []


def epochs(settings: TrainerSettings, n_rows: int) -> list[Finding]:
    """Many passes over a small set: the model memorises the rows."""
    found = epochs_of(settings, n_rows)
    if found is None:
        return []
    n_epochs, how = found
    if not ((n_epochs >= MANY_EPOCHS and n_rows <= SMALL_SET) or n_epochs >= TOO_MANY_EPOCHS):
        return []
    return [_config("too_many_epochs", "warning", settings, f"{n_epochs:g} epochs over {n_rows} rows: each row is seen"
                    f" {n_epochs:g} times, enough to memorise it", how,
                    "train 1 to 3 epochs (more data rather than more passes), and keep the checkpoint with the lowest"
                    " eval loss", count=n_rows)]


def masking(settings: TrainerSettings, data: ReadResult) -> list[Finding]:
    """Packing next to completion-only masking; a loss over the prompt; a response template that
    the rows do not contain (the collator then masks the whole row)."""
    out = []
    v, collator = settings.values, settings.collator
    completion_only = (v.get("completion_only_loss") is True or v.get("train_on_inputs") is False
                       or "CompletionOnly" in collator or v.get("assistant_only_loss") is True)
    if v.get("packing") is True and completion_only:
        known_bad = "CompletionOnly" in collator
        what = collator if known_bad else next(f"{k}={str(v[k]).lower()}" for k in (
            "completion_only_loss", "train_on_inputs", "assistant_only_loss") if v.get(k) is not None)
        out.append(_config("packing_with_completion_only", "error" if known_bad else "warning", settings,
                           "packing joins rows into one sequence next to completion-only masking: the mask can cover"
                           " the wrong tokens at row boundaries", f"packing=true, {what}",
                           "set packing=false, or pack padding-free with per-row masks (position ids reset per row)"
                           " and check the labels of one packed batch"))
    chat = any(r.kind == "messages" for r in data.rows)
    on_prompt = next((f"{k}={str(v[k]).lower()}" for k, bad in (
        ("completion_only_loss", False), ("train_on_inputs", True), ("train_on_prompt", True))
        if v.get(k) is bad), None)
    if on_prompt is None and chat and v.get("assistant_only_loss") is False:
        on_prompt = "assistant_only_loss=false (chat rows)"
    if on_prompt is None and collator.endswith("DataCollatorForLanguageModeling"):
        on_prompt = f"data_collator={collator} (labels = every input token)"
    if on_prompt:
        out.append(_config("loss_on_prompt", "warning", settings, "the loss covers the prompt as well as the completion:"
                           " the model learns to write prompts, and the completion's share of the gradient shrinks",
                           on_prompt, "mask the prompt (completion_only_loss=true / train_on_inputs=false; for chat"
                           " rows assistant_only_loss=true)", count=len(data.rows)))
    template = v.get("response_template")
    if isinstance(template, str) and template and "CompletionOnly" in (collator or "DataCollatorForCompletionOnlyLM"):
        missing = [r.line for r in data.rows if template not in (r.prompt + r.completion)]
        if missing:
            out.append(Finding(id="response_template_missing", severity="error", source="train", file=data.path,
                               message=f"{len(missing)} row(s) do not contain the response template {template!r}: the"
                               " collator masks all of their tokens", count=len(missing), rows=missing,
                               evidence=f"line {missing[0]}", fix="end each prompt with the response template exactly"
                               " as the collator gets it (tokenized in context it can differ), or use prompt/completion"
                               " rows with completion_only_loss=true"))
    return out
