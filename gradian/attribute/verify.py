"""`gradian attribute --verify`: does training without the accused rows undo the regression?

The fine-tune is redone twice from the base model with `gradian.attribute.retrain` (the same seed and
settings both times, rows tokenized under the index's token policy):

    without the accused rows   the k rows the first engine accused are left out
    control                    k other rows drawn at random are left out (numpy's PCG64 seeded with
                               --seed; the rows are recorded)

and each retrained model scores the eval set as the tuned and base models did. The share of the
regression a retrain recovers is

    recovered = (acc(retrained) - acc(tuned)) / (acc(base) - acc(tuned))

and likewise with each model's mean answer log-probability in place of the accuracy: 1 is the base
model's level, 0 the tuned model's (< 0 worse than tuned, > 1 better than base). Rows that caused the
regression recover much of it and the control little. A control that recovers as much says the
retrain does not reproduce the regression (other settings than the original fine-tune's, or a
regression that any k fewer rows undo): the accused rows' recovery then proves nothing. Beside the
shares, each retrain counts the flipped items it gets right again and those where it still makes
the tuned model's mistake (its greedy continuation agrees with the tuned model's up to the tuned
model's first wrong token): a fine-tune also forgets what it does not rehearse, and an item the
retrained model gets wrong in another way is that forgetting, not the accused rows' lesson. The
accusation `holds` when the accused rows recover at least `HOLDS_SHARE` of the accuracy drop and
at least `HOLDS_MARGIN` more than the control.

Settings (`plan_verify`, checked before any model loads): a LoRA adapter's r, alpha, target modules
and the rest of its adapter_config.json (dropout, fan_in_fan_out, rsLoRA, DoRA) unless --lora-r,
--lora-alpha, --target-modules say otherwise; the learning rate and --epochs or --steps from the
command line, as adapter_config.json does not hold them (--batch-size 8, --train-seed 0 unless
given). A full fine-tune (the index records no adapter) retrains every weight of its base model.

Rows: by default the index's training data, read as the index read it, the accused rows left out by
row id. --train-data FILE (the data the fine-tune saw, when the index's is elsewhere or a part of
it): the same bytes as the index's data are read as the index read them; other data is read with
the index's token settings and loses every record equal to an accused row's record (its prompt and
completion, or messages), the control as many random others.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console

from circuitkit.core.device import release_memory
from circuitkit.core.errors import UserError
from circuitkit.core.progress import Progress
from circuitkit.models.config import ModelConfig
from circuitkit.models.loading import load_model
from circuitkit.models.lora import lora_config, read_adapter
from gradian.attribute import retrain
from gradian.attribute.evaluate import EvalItem, ItemScores, greedy_continuations, score_items
from gradian.attribute.rows import read_records
from gradian.build.checks import check_input_file
from gradian.data.rows import load_rows, policy_of
from gradian.data.sources import DataError, Source, SourceSpec
from gradian.rank.results import training_source

HOLDS_SHARE = 0.5  # the accused rows recover at least half the accuracy drop ...
HOLDS_MARGIN = 0.25  # ... and at least this much more of it than the control
RUNS = (("accused", "without the accused rows"), ("control", "without as many random rows"))


@dataclass
class VerifyPlan:
    """What `--verify` will train, from what, on which data (resolved before a model loads)."""

    settings: retrain.TrainSettings
    model_cfg: ModelConfig  # the model the fine-tune starts from
    train_data: str
    source: Source
    same_as_index: bool  # the index's own rows: dropped by row id (else by record)
    control_seed: int
    keep_dir: Path | None  # where the retrained models are kept (None: a temporary directory)


@dataclass
class VerifyOptions:
    """`--verify`'s command-line settings (None: not given; see `plan_verify` for the defaults)."""

    lr: float | None = None
    epochs: int | None = None
    steps: int | None = None
    batch_size: int | None = None
    train_seed: int = 0
    lora_r: int | None = None
    lora_alpha: float | None = None
    target_modules: list[str] | None = None
    train_data: str | None = None
    keep_dir: str | None = None


def plan_verify(manifest: dict[str, Any], base_cfg: ModelConfig, options: VerifyOptions, control_seed: int,
                adapter_dir: str | None = None) -> VerifyPlan:
    """The retraining `--verify` asks for, every setting checked: UserError naming the flag (exit
    code 2) for a missing or impossible setting, missing peft, or data that cannot be read.
    `adapter_dir`: where the index's adapter is now (--adapter DIR; default: the path it records)."""
    o = options
    lr, epochs, steps, batch_size, lora_r, lora_alpha, target_modules = (
        o.lr, o.epochs, o.steps, o.batch_size, o.lora_r, o.lora_alpha, o.target_modules)
    adapter = manifest.get("adapter")
    lora_flags = [f for f, v in (("--lora-r", lora_r), ("--lora-alpha", lora_alpha),
                                 ("--target-modules", target_modules)) if v is not None]
    if adapter is None and lora_flags:
        raise UserError(f"--verify: {', '.join(lora_flags)} shape a LoRA adapter, but the index's model is a full"
                        " fine-tune (its manifest records no adapter); leave them out.", exit_code=2)
    missing = ([] if lr is not None else ["--lr"]) + ([] if epochs is not None or steps is not None
                                                        else ["--epochs or --steps"])
    if missing:
        what = ("a full fine-tune, and the index records none of its trainer settings" if adapter is None else
                "the LoRA adapter, and its adapter_config.json holds no learning rate or length of training")
        raise UserError(f"--verify retrains {what}: give {' and '.join(missing)} as the original fine-tune used"
                        f" them (also --batch-size, default {retrain.DEFAULT_BATCH_SIZE}, and --train-seed,"
                        " default 0).", exit_code=2)
    if epochs is not None and steps is not None:
        raise UserError(f"--verify: --epochs {epochs} and --steps {steps}; give one of them.", exit_code=2)
    for flag, value, low in (("--lr", lr, 0), ("--epochs", epochs, 1), ("--steps", steps, 1),
                             ("--batch-size", batch_size, 1), ("--lora-r", lora_r, 1), ("--lora-alpha", lora_alpha, 0)):
        if value is not None and (value < low or (low == 0 and value <= 0)):
            raise UserError(f"{flag} {value}: it must be {'> 0' if low == 0 else f'>= {low}'}.", exit_code=2)
    if target_modules is not None and not target_modules:
        raise UserError("--target-modules names no module; give the names of the linears to adapt, comma-separated,"
                        " as adapter_config.json's target_modules lists them (or leave it out).", exit_code=2)
    config = None
    if adapter is not None:
        where = ("--adapter", adapter_dir) if adapter_dir else ("the index's adapter", str(adapter.get("path")))
        config = dict(read_adapter(where[1], where[0]).config)
        config.update({k: v for k, v in (("r", lora_r), ("lora_alpha", lora_alpha),
                                          ("target_modules", target_modules)) if v is not None})
        lora_config(config, "--verify")  # peft installed, and the settings make a LoRA config
        model_cfg = ModelConfig(name=manifest["model"], revision=manifest.get("revision"),
                                gguf_file=manifest.get("gguf_file"), precision=manifest.get("precision", "bfloat16"))
    else:
        model_cfg = base_cfg
    try:
        settings = retrain.TrainSettings(lr=lr, batch_size=batch_size or retrain.DEFAULT_BATCH_SIZE, seed=o.train_seed,
                                         steps=steps, epochs=epochs, lora=config)
    except ValueError as err:
        raise UserError(f"--verify: {err}", exit_code=2) from None
    return VerifyPlan(settings, model_cfg, *_train_source(manifest, o.train_data), control_seed,
                      Path(o.keep_dir) if o.keep_dir else None)


def _train_source(manifest: dict[str, Any], train_data: str | None) -> tuple[str, Source, bool]:
    """(the data's name, its Source, whether it is the index's own data)."""
    indexed = training_source(manifest)
    if train_data is None:
        if indexed is None:
            raise UserError(f"--verify trains on the index's training data {manifest.get('data_file')}, which is"
                            " gone or changed since the index was built: give the data the fine-tune saw with"
                            " --train-data FILE.", exit_code=2)
        return indexed.name, indexed, True
    check_input_file(Path(train_data), "--train-data")
    source = Source(SourceSpec(path=train_data))
    if source.fingerprint() == manifest.get("data_sha256"):
        return train_data, source, True
    if indexed is None:
        raise UserError(f"--train-data {train_data} is not the index's training data (another sha256), and the"
                        f" index's data {manifest.get('data_file')} is gone or changed, so the accused rows' records"
                        " cannot be found in it: restore the index's data, or give it as --train-data.", exit_code=2)
    return train_data, source, False


def _record_key(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, ensure_ascii=False)


def _left_out(plan: VerifyPlan, manifest: dict[str, Any], rows: list, accused: dict[int, int | None],
              n_index_rows: int) -> tuple[set[int], list[int]]:
    """(the training rows to leave out for the accusation, the accused rows' lines not found)."""
    if plan.same_as_index:
        if len(rows) != n_index_rows:
            raise UserError(f"--verify: the training data now yields {len(rows)} rows, the index holds"
                            f" {n_index_rows}: the accused row ids do not name the same rows; rebuild the index.",
                            exit_code=1)
        return set(accused), []
    indexed = training_source(manifest)
    theirs = read_records(indexed, [ln for ln in accused.values() if ln is not None]) if indexed else {}
    wanted = {_record_key(obj): line for line, obj in theirs.items()}
    ours = read_records(plan.source, [r.line for r in rows])
    drop = {i for i, r in enumerate(rows) if _record_key(ours.get(r.line)) in wanted}
    found = {_record_key(ours.get(rows[i].line)) for i in drop}
    return drop, sorted(line for key, line in wanted.items() if key not in found)


def _share(model: float, tuned: float, base: float) -> float | None:
    return (model - tuned) / (base - tuned) if base != tuned else None



def _scored(plan: VerifyPlan, directory: Path, items: list[EvalItem],
            flipped: list[int]) -> tuple[ItemScores, list[list[int]]]:
    """The retrained model's scores of every item, and its greedy continuations of the flipped ones."""
    cfg = (dataclasses.replace(plan.model_cfg, adapter=str(directory)) if plan.settings.lora is not None
           else ModelConfig(name=str(directory), precision=plan.model_cfg.precision))
    loaded = load_model(cfg)
    try:
        return score_items(loaded, items), greedy_continuations(loaded, [items[i] for i in flipped])
    finally:
        del loaded
        release_memory()


def says_as_tuned(answer: list[int], tuned: list[int], retrained: list[int]) -> bool:
    """Whether the retrained model still makes the tuned model's mistake: its continuation agrees with
    the tuned model's up to and including the tuned model's first token that departs from the answer."""
    wrong = next((t for t, (a, b) in enumerate(zip(answer, tuned, strict=False)) if a != b), len(tuned) - 1)
    return retrained[:wrong + 1] == tuned[:wrong + 1]


def run_verify(plan: VerifyPlan, manifest: dict[str, Any], tokenizer, accused: dict[int, int | None],
               items: list[EvalItem], base: ItemScores, tuned: ItemScores, flipped: list[int],
               tuned_says: list[list[int]], say) -> dict[str, Any]:
    """Retrain without the accused rows (`accused`: row id -> source line) and without as many random
    rows, score both on the eval items, and return the result's `verify` entry (module docstring).
    `flipped`: the flipped items' numbers; `tuned_says`: what the tuned model says for each of them."""
    try:
        rows, _ = load_rows(plan.source, tokenizer, int(manifest.get("max_seq_length", 512)),
                            manifest.get("on_truncation", "warn"), manifest.get("truncation_side", "right"),
                            policy=policy_of(manifest))
    except DataError as err:
        raise UserError(f"--verify: the training data cannot be read ({err}).", exit_code=1) from None
    drop, unmatched = _left_out(plan, manifest, rows, accused, int(manifest["n_rows"]))
    others = sorted(set(range(len(rows))) - drop)
    rng = np.random.default_rng(plan.control_seed)
    control = sorted(int(i) for i in rng.choice(others, size=min(len(drop), len(others)), replace=False))
    reference = {name: {"accuracy": s.accuracy, "logprob_mean": float(s.logprob.mean())}
                 for name, s in (("base", base), ("tuned", tuned))}
    entry: dict[str, Any] = {
        "settings": {**plan.settings.record(), "trained_from": plan.model_cfg.name, "train_data": plan.train_data,
                     "train_data_sha256": plan.source.fingerprint(), "same_as_index": plan.same_as_index,
                     "token_policy": manifest.get("token_policy"), "max_seq_length": manifest.get("max_seq_length")},
        "rows": len(rows), "left_out": len(drop), "control_seed": plan.control_seed, "unmatched_lines": unmatched,
        "reference": reference, "runs": [], "holds": None, "summary": ""}
    if not drop or len(drop) == len(rows):
        entry["summary"] = ("none of the accused rows is in the training data" if not drop else
                            "every training row is accused, so no row is left to train on") + ": nothing was retrained."
        return entry
    work = plan.keep_dir or Path(tempfile.mkdtemp(prefix="gradian-verify-"))
    try:
        for (name, label), left in zip(RUNS, (sorted(drop), control), strict=True):
            gone = set(left)
            kept = [r for i, r in enumerate(rows) if i not in gone]
            steps = plan.settings.n_steps(len(kept))
            say(f"--verify: retraining {label} ({len(left)} left out, {len(kept)} rows, {steps} steps) …",
                markup=False, highlight=False)
            # the progress goes where `say` prints (a bound Console.print), else to stderr
            with Progress(getattr(say, "__self__", None) or Console(stderr=True), f"retraining {label}", steps,
                          "steps", announce=True) as bar:
                trained = retrain.train(plan.model_cfg, kept, plan.settings, bar=bar)
            out = work / name
            shutil.rmtree(out, ignore_errors=True)
            trained.save(out)
            losses, wall_s = trained.losses, trained.wall_s
            del trained
            release_memory()
            scores, says = _scored(plan, out, items, flipped)
            same_mistake = sum(says_as_tuned(items[i].answer_ids, t, r)
                               for i, t, r in zip(flipped, tuned_says, says, strict=True))
            entry["runs"].append({
                "name": name, "label": label, "rows_left_out": left, "rows_trained": len(kept), "steps": steps,
                "final_loss": losses[-1] if losses else None, "train_wall_s": wall_s,
                "accuracy": scores.accuracy, "logprob_mean": float(scores.logprob.mean()),
                "recovered_accuracy": _share(scores.accuracy, tuned.accuracy, base.accuracy),
                "recovered_logprob": _share(float(scores.logprob.mean()), reference["tuned"]["logprob_mean"],
                                            reference["base"]["logprob_mean"]),
                "flipped_right_again": int(scores.exact[flipped].sum()) if flipped else 0, "flipped": len(flipped),
                "flipped_same_mistake": same_mistake,
                "model_dir": str(out) if plan.keep_dir else None})
    finally:
        if plan.keep_dir is None:
            shutil.rmtree(work, ignore_errors=True)
    entry["holds"], entry["summary"] = _verdict(entry["runs"])
    return entry


def _verdict(runs: list[dict[str, Any]]) -> tuple[bool, str]:
    ours, control = runs

    def pct(v: float | None) -> str:
        return "n/a" if v is None else f"{100 * v:.0f} %"

    ours_share, control_share = ours["recovered_accuracy"], control["recovered_accuracy"]
    holds = (ours_share is not None and control_share is not None and ours_share >= HOLDS_SHARE
             and ours_share - control_share >= HOLDS_MARGIN)
    text = (f"retrained without the {len(ours['rows_left_out'])} accused rows the model recovers"
            f" {pct(ours['recovered_accuracy'])} of the accuracy drop ({pct(ours['recovered_logprob'])} of the"
            f" log-prob drop) and {ours['flipped_same_mistake']} of the {ours['flipped']} flipped items still make"
            f" the tuned model's mistake; without as many random rows {pct(control['recovered_accuracy'])}"
            f" ({pct(control['recovered_logprob'])}), {control['flipped_same_mistake']} of {control['flipped']}: ")
    if holds:
        return True, text + "the accusation holds."
    if control_share is not None and control_share >= HOLDS_SHARE:
        return False, text + ("the control recovers as much: the retrain does not reproduce the regression (check"
                              " the trainer settings), so this proves nothing.")
    return False, text + "the accused rows do not explain the regression."
