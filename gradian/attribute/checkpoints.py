"""Attribution across the fine-tune's checkpoints: TracIn-CP (Pruthi et al. 2020).

The final-adapter engines (`gradian.attribute.engines`) read the gradients of one point of the run,
its end. TracIn follows the run: with θ_c the adapter saved at checkpoint c and η_c the learning
rate in force there,

    tracin       s(z) = Σ_c η_c · mean_i q_i(θ_c)ᵀ (F_c + λI)⁻¹ g_z(θ_c)    (K-FAC / EK-FAC: ekfac where
                                                                          checkpoint c's index holds
                                                                          factors, else F_c + λI = I)
    tracin-dot   s(z) = Σ_c η_c · mean_i q_i(θ_c)ᵀ g_z(θ_c)                 (Pruthi et al.'s TracIn-CP)

q_i(θ_c) is the regressed item's query gradient (`gradian.attribute.queries`: the same query loss and
the same "what the tuned model says" as the other engines, taken at θ_c), g_z(θ_c) the stored
gradient of training row z in checkpoint c's index. A step on z at θ_c moves the query's function by
about -η_c s_c(z), so the sign convention is the other engines': the accused rows are the most
negative. The product is TracIn's for gradient descent; the fine-tune's optimizer (AdamW) rescales
each step, which the per-checkpoint K-FAC stands in for only roughly. Each checkpoint's term is
reported (`record`): which checkpoint carries most of the accusation says when in the run the damage
was done.

Where the checkpoints come from (`plan_checkpoints`, every refusal before a model loads):

* a Hugging Face Trainer output directory: its `checkpoint-<step>/` adapter directories (each an
  adapter_config.json + adapter_model.safetensors) in step order, and η_c the learning rate that
  `trainer_state.json`'s `log_history` logs at the checkpoint's step or the nearest before it (the
  directory's own trainer_state.json, else the latest checkpoint's). Without logged learning rates
  every checkpoint weighs the same, and the plan says so;
* a comma list of adapter directories, equal weights;
* `--checkpoint-lrs` (one per checkpoint) overrides either.

Each checkpoint's adapter must be the index's adapter at another point of the run: the same base
model, rank, alpha and target modules (another is one line, exit code 2).

Storage: one gradient index per checkpoint, `<index>/checkpoints/<name>-<weights sha256[:12]>/`,
built by `gradian.build.indexer.build_index` with the final index's own grads settings (data, modules,
projection, loss, preconditioner, dtypes) and `model.adapter` = the checkpoint. It is the one index
format, read by the one reader, with its own manifest, resume and K-FAC factors; a rerun reuses it
(the name carries the weights' hash, so a retrained checkpoint gets a new one; the index's resume
check refuses any other mismatch). The alternative, one index with a checkpoint axis, would save no
byte (each checkpoint's rows are other numbers) and would need a second format, resume logic and
curvature file. The cost is linear in the checkpoints: C checkpoints take C times the final index's
disk and indexing time (the indexing dominates; the query gradients are a few items per checkpoint).
Measured on the planted tiny-GPT-2 fixture (22 rows, LoRA r 4 on c_attn and c_fc: 8 LoRA linears,
projection_dim 16, float16 rows, K-FAC factors; one CPU thread): 17.7 kB and 0.1-0.45 s per checkpoint
index, as the final index (0.3-0.4 s); `gradian attribute` with 3 checkpoints took 5.5-7.4 s, with 6
8.7-12.2 s. For SmolLM2-360M with a rank-8 adapter on the 7 linears of each of its 32 blocks (448 LoRA
linears, 4.3 M adapter weights), float16 rows, the memory estimate's own sizes
(`gradian.build.memory.grads_index_bytes`, `preconditioner_index_bytes`) give per checkpoint and
10,000 training rows: 8.5 GiB + 58 MiB of K-FAC factors at the default projection_dim 1024
(917 kB a row), 0.53 GiB + 0.6 MiB at projection_dim 64, 0.13 GiB at 16; 5 checkpoints are five
times that (43 GiB, 2.7 GiB, 0.67 GiB). The checkpoints' indexes copy the final index's settings, so
an index meant for TracIn is best built narrow. The indexing time is C times the final index's, the
peak memory the final index's (one checkpoint model at a time, next to the tuned model the other
steps hold).
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from circuitkit.core.errors import UserError
from circuitkit.models.config import ModelConfig
from circuitkit.models.lora import read_adapter
from gradian.attribute.engines import TRACIN_ENGINES
from gradian.settings.grads import GradsConfig

TRAINER_STATE = "trainer_state.json"
CHECKPOINTS_DIR = "checkpoints"  # under the final index: one index per checkpoint
ADAPTER_SHAPE_KEYS = ("r", "lora_alpha", "target_modules", "base_model_name_or_path")
_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")


@dataclass(frozen=True)
class Checkpoint:
    """One saved adapter of the run: its name, directory, step (None when not a Trainer checkpoint),
    the learning rate logged for it (None when none was) and η_c, its weight in the sum."""

    name: str
    path: Path
    step: int | None
    lr: float | None
    weight: float
    weights_sha256: str


@dataclass(frozen=True)
class CheckpointPlan:
    """The checkpoints in order, where they were read from and where their weights come from."""

    checkpoints: list[Checkpoint]
    source: str
    lr_source: str  # "trainer_state.json log_history", "--checkpoint-lrs" or "equal"
    note: str | None = None  # what the user should know about the weights (equal weights, a guess)


def is_tracin(name: str) -> bool:
    """Whether the engine `name` is scored across the checkpoints (here) rather than on the final index."""
    return name in TRACIN_ENGINES


# ----------------------------------------------------------------------------- reading the run


def read_trainer_state(path: Path) -> list[dict[str, Any]]:
    """trainer_state.json's `log_history` (a list of dicts; [] when it has none): UserError (exit
    code 1) when the file is not JSON or not what the Trainer writes."""
    try:
        state = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise UserError(f"{path}: cannot be read as JSON ({str(err).splitlines()[0]}); it is not the"
                        f" {TRAINER_STATE} a Trainer writes: remove it, or give --checkpoint-lrs.", exit_code=1) from None
    history = state.get("log_history", []) if isinstance(state, dict) else None
    if not isinstance(history, list) or not all(isinstance(e, dict) for e in history):
        raise UserError(f"{path}: log_history is not a list of logged steps; it is not the {TRAINER_STATE} a"
                        " Trainer writes: remove it, or give --checkpoint-lrs.", exit_code=1)
    return history


def _logged_lrs(history: list[dict[str, Any]]) -> list[tuple[int, float]]:
    """(step, learning rate) of every log entry that has both, in step order."""
    out = []
    for e in history:
        step, lr = e.get("step"), e.get("learning_rate")
        if isinstance(step, int) and not isinstance(step, bool) and isinstance(lr, int | float) \
                and not isinstance(lr, bool) and math.isfinite(lr):
            out.append((step, float(lr)))
    return sorted(out)


def learning_rate_at(history: list[dict[str, Any]], step: int) -> tuple[float | None, bool]:
    """(the learning rate logged at `step` or the nearest step before it, True), or the first one
    logged after it when none was before ((lr, False)); (None, False) when no learning rate is logged."""
    logged = _logged_lrs(history)
    before = [lr for s, lr in logged if s <= step]
    if before:
        return before[-1], True
    return (logged[0][1], False) if logged else (None, False)


def _positive_lrs(lrs: Sequence[float], n: int) -> list[float]:
    if len(lrs) != n:
        raise UserError(f"--checkpoint-lrs gives {len(lrs)} learning rates for {n} checkpoints: give one per"
                        " checkpoint, in step order (comma-separated).", exit_code=2)
    bad = [x for x in lrs if not (math.isfinite(x) and x > 0)]
    if bad:
        raise UserError(f"--checkpoint-lrs: {bad[0]!r} is not a positive learning rate.", exit_code=2)
    return [float(x) for x in lrs]


def _check_adapter(spec, index_adapter: dict[str, Any], what: str) -> str:
    """The adapter's weights sha256, after refusing one that is not the index's adapter at another
    point of the run (another base model, rank, alpha or targets)."""
    ours = spec.record()
    diffs = [f"{k} {ours.get(k)!r} (the index's adapter has {index_adapter.get(k)!r})" for k in ADAPTER_SHAPE_KEYS
             if ours.get(k) != index_adapter.get(k)]
    if diffs:
        raise UserError(f"{what} ({spec.directory}) is not a checkpoint of the index's fine-tune: {'; '.join(diffs)}."
                        " Give the checkpoints of the run whose final adapter the index was built with.", exit_code=2)
    return ours["weights_sha256"]


def plan_checkpoints(spec: str, manifest: dict[str, Any], lrs: Sequence[float] | None = None) -> CheckpointPlan:
    """The checkpoints `--checkpoints` names (a Trainer output directory, or a comma list of adapter
    directories: module docstring), read and checked against the index (`manifest`) without loading a
    model; UserError (exit code 2: a wrong argument, 1: a damaged file) naming what to change."""
    index_adapter = manifest.get("adapter")
    if not isinstance(index_adapter, dict):
        raise UserError("--checkpoints reads the LoRA adapters a fine-tune saved, but the index's model has no"
                        " adapter (a full fine-tune or the base model): build the index with model.adapter set to"
                        " the final adapter.", exit_code=2)
    if manifest.get("circuit"):
        raise UserError("--checkpoints: the index is restricted to a circuit (grads.circuit), which the checkpoints'"
                        " indexes cannot be made with; use an unrestricted index.", exit_code=2)
    parts = [p.strip() for p in spec.split(",") if p.strip()]
    if not parts:
        raise UserError("--checkpoints is empty: give a Trainer output directory or a comma list of adapter"
                        " directories.", exit_code=2)
    history: list[dict[str, Any]] = []
    state_file = None
    if len(parts) == 1 and not (Path(parts[0]).expanduser() / "adapter_config.json").is_file():
        root = Path(parts[0]).expanduser()
        if not root.is_dir():
            raise UserError(f"--checkpoints {parts[0]!r} does not exist or is not a directory: give the fine-tune's"
                            " output directory (its checkpoint-*/) or a comma list of adapter directories.",
                            exit_code=2)
        found = sorted((int(m.group(1)), d) for d in root.iterdir()
                       if d.is_dir() and (m := _CHECKPOINT.match(d.name)))
        if not found:
            raise UserError(f"--checkpoints {parts[0]!r} holds no checkpoint-<step>/ directory and no adapter: save"
                            " checkpoints during the fine-tune (the Trainer's save_steps), or give adapter directories"
                            " as a comma list.", exit_code=2)
        dirs = [(d, step) for step, d in found]
        states = [root / TRAINER_STATE] + [d / TRAINER_STATE for d, _ in reversed(dirs)]
        state_file = next((s for s in states if s.is_file()), None)
        if state_file is not None:
            history = read_trainer_state(state_file)
        source = str(root)
    else:
        dirs = [(Path(p).expanduser(), None) for p in parts]
        source = ",".join(parts)
    checkpoints: list[tuple[str, Path, int | None, str]] = []
    for d, step in dirs:
        what = f"--checkpoints {d.name}"
        if not (d / "adapter_config.json").is_file() and d.is_dir():
            raise UserError(f"{what} ({d}) holds no adapter_config.json: --checkpoints reads the LoRA adapters a"
                            " fine-tune saved (a full fine-tune's checkpoints are not supported).", exit_code=2)
        adapter = read_adapter(str(d), what)
        checkpoints.append((d.name, adapter.directory, step, _check_adapter(adapter, index_adapter, what)))
    shas = [sha for *_, sha in checkpoints]
    if len(set(shas)) < len(shas):
        twice = next(c[1] for c in checkpoints if shas.count(c[3]) > 1)
        raise UserError(f"--checkpoints names the same adapter weights twice ({twice}): give each checkpoint once.",
                        exit_code=2)

    note = None
    if lrs is not None:
        weights, lr_source = _positive_lrs(lrs, len(checkpoints)), "--checkpoint-lrs"
        logged: list[float | None] = list(weights)
    elif history and _logged_lrs(history) and all(step is not None for _, _, step, _ in checkpoints):
        found_lrs = [learning_rate_at(history, step) for _, _, step, _ in checkpoints]
        logged = [lr for lr, _ in found_lrs]
        weights, lr_source = [float(lr) for lr in logged], f"{state_file} log_history"
        after = [c[0] for c, (_, before) in zip(checkpoints, found_lrs, strict=True) if not before]
        if after:
            note = (f"no learning rate is logged at or before {', '.join(after)}: the first one logged after it is"
                    " used.")
        if not any(w > 0 for w in weights):
            raise UserError(f"{state_file}: every learning rate logged at the checkpoints is 0; give"
                            " --checkpoint-lrs.", exit_code=2)
    else:
        logged, weights, lr_source = [None] * len(checkpoints), [1.0] * len(checkpoints), "equal"
        if state_file is not None:
            why = f"{state_file} logs no learning rate"
        elif dirs[0][1] is None:
            why = "adapter directories given as a list carry no learning rate"
        else:
            why = f"{source} has no {TRAINER_STATE}"
        note = (f"the checkpoints weigh the same (eta_c = 1): {why}; give --checkpoint-lrs for the learning rate"
                " of each.")
    return CheckpointPlan([Checkpoint(name, path, step, lr, w, sha) for (name, path, step, sha), lr, w
                           in zip(checkpoints, logged, weights, strict=True)], source, lr_source, note)


# ----------------------------------------------------------------------------- one index per checkpoint


def checkpoint_index_dir(index_dir: str | Path, checkpoint: Checkpoint) -> Path:
    """Where checkpoint `checkpoint`'s index goes: under the final index, named by the checkpoint and
    its weights' hash (a retrained checkpoint gets another directory)."""
    return Path(index_dir) / CHECKPOINTS_DIR / f"{checkpoint.name}-{checkpoint.weights_sha256[:12]}"


def checkpoint_grads(manifest: dict[str, Any], index_dir: Path) -> GradsConfig:
    """The grads settings that made the final index (its manifest), for a checkpoint's index in `index_dir`:
    the same data, modules (by their exact names), projection, loss, curvature and stored form."""
    proj = manifest["projection"]
    source = manifest.get("data_source") or {}
    columns = source.get("columns") or {}
    policy = manifest.get("token_policy") or {}
    allocation = proj.get("allocation")
    kind = proj.get("kind")
    defaults = GradsConfig()
    return dataclasses.replace(
        defaults, data_path=manifest["data_file"], data_format=source.get("format", "auto"),
        data_split=source.get("split", defaults.data_split), data_row_range=source.get("row_range"),
        prompt_column=columns.get("prompt", defaults.prompt_column),
        completion_column=columns.get("completion", defaults.completion_column),
        messages_column=columns.get("messages", defaults.messages_column),
        max_seq_length=manifest["max_seq_length"], on_truncation=manifest["on_truncation"],
        truncation_side=manifest["truncation_side"], loss_reduction=manifest["loss_reduction"],
        loss=manifest["loss"], append_eos=bool(policy.get("append_eos", defaults.append_eos)),
        prepend_bos=policy.get("prepend_bos", defaults.prepend_bos), module_filter=list(proj["modules"]),
        projection=defaults.projection if kind == "raw" else kind, projection_dim=proj.get("projection_dim"),
        projection_seed=proj.get("seed", defaults.projection_seed),
        width_allocation=allocation.get("kind", "uniform") if isinstance(allocation, dict) else "uniform",
        preconditioner=manifest["preconditioner"], fisher=manifest.get("fisher", "empirical"),
        storage_dtype=manifest["storage_dtype"], row_format=manifest.get("row_format", "dense"),
        row_rank=manifest.get("row_rank") or defaults.row_rank, activations=manifest.get("activations", "model"),
        rows_per_shard=manifest.get("rows_per_shard", defaults.rows_per_shard), index_dir=str(index_dir))


def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _check_same_rows(manifest: dict[str, Any], theirs: dict[str, Any], where: Path) -> None:
    """A checkpoint's index must store the final index's rows under the same ids."""
    for key in ("n_rows", "data_sha256", "token_policy", "loss", "loss_reduction"):
        if theirs.get(key) != manifest.get(key):
            raise UserError(f"{where} holds other rows than the index ({key}: {theirs.get(key)!r}, the index has"
                            f" {manifest.get(key)!r}): delete {where} to rebuild it.", exit_code=1)


def checkpoint_index(manifest: dict[str, Any], index_dir: str | Path, checkpoint: Checkpoint, loaded,
                     console=None) -> tuple[Any, str, float]:
    """(checkpoint's IndexReader, "built" or "reused", wall seconds of the build): its index, built into
    `checkpoint_index_dir` with the final index's settings when it is not complete there yet, then
    checked to store the same rows. `loaded`: the model with the checkpoint's adapter kept."""
    from rich.console import Console

    from circuitkit.core.recorded import MANIFEST
    from gradian.build.indexer import build_index, check_resume_settings
    from gradian.index.manifest import read_manifest
    from gradian.index.reader import IndexReader

    where = checkpoint_index_dir(index_dir, checkpoint)
    grads = checkpoint_grads(manifest, where)
    start = time.perf_counter()
    how = "reused"
    if (where / MANIFEST).is_file():  # one made with other settings (the final index rebuilt) is refused
        check_resume_settings(read_manifest(where), grads, where)
    if not ((where / MANIFEST).is_file() and IndexReader(where).complete):
        build_index(_model_config(manifest, checkpoint), grads, where, console or Console(stderr=True), loaded=loaded)
        how = "built"
    reader = IndexReader(where)
    _check_same_rows(manifest, reader.manifest, where)
    return reader, how, time.perf_counter() - start


def _model_config(manifest: dict[str, Any], checkpoint: Checkpoint) -> ModelConfig:
    return ModelConfig(name=manifest["model"], revision=manifest.get("revision"), gguf_file=manifest.get("gguf_file"),
                       precision=manifest.get("precision", "bfloat16"), adapter=str(checkpoint.path))


# ----------------------------------------------------------------------------- the score


def inner_engine(name: str, manifest: dict[str, Any]) -> str:
    """The final-index engine that gives `name`'s per-checkpoint product on a checkpoint's index."""
    from gradian.curvature.factors import has_kfac

    if name == "tracin-dot":
        return "dot"
    return "ekfac" if has_kfac(manifest.get("preconditioner", "none")) else "dot"


@dataclass
class TracinScores:
    """Every tracin engine's scores: `scores` (V, n_rows) = Σ_c `per_checkpoint`[:, c], the weighted
    terms η_c s_c (V, C, n_rows) float32, in `names` order; `checkpoints` what each checkpoint did."""

    names: list[str]
    scores: torch.Tensor
    per_checkpoint: torch.Tensor
    plan: CheckpointPlan
    checkpoints: list[dict[str, Any]] = field(default_factory=list)
    damping: dict[str, float | None] = field(default_factory=dict)

    def merge(self, names: list[str], others: list[str], other_scores: torch.Tensor | None) -> torch.Tensor:
        """(E, n_rows): the final-index engines' scores (`others`, rows of `other_scores`; None when
        there is none) and these, in the order of `names`."""
        rows = {n: self.scores[i] for i, n in enumerate(self.names)}
        if other_scores is not None:
            rows |= {n: other_scores[i] for i, n in enumerate(others)}
        return torch.stack([rows[n] for n in names])

    def record(self, accused: list[int]) -> dict[str, Any]:
        """The result's `checkpoints` entry: the plan, each checkpoint with its share of the accused
        rows' summed score (of the first tracin engine), and each accused row's terms."""
        terms = self.per_checkpoint[0][:, accused].double()  # (C, A)
        total = float(terms.sum())
        out = []
        for c, entry in enumerate(self.checkpoints):
            part = float(terms[c].sum())
            out.append({**entry, "accused_score": part, "accused_share": part / total if total else None})
        top = min(range(len(out)), key=lambda c: out[c]["accused_score"]) if out and accused else None
        return {"source": self.plan.source, "lr_source": self.plan.lr_source, "note": self.plan.note,
                "engine": self.names[0], "checkpoints": out,
                "most_accusing": out[top]["name"] if top is not None else None,
                "accused": [{"row_id": r, "by_checkpoint": [float(v) for v in terms[:, a]]}
                            for a, r in enumerate(accused)]}


def tracin_scores(plan: CheckpointPlan, reader, flipped: list, said_ids: list[list[int]], query_loss: str,
                  names: list[str], verify: bool = True, say: Callable[..., Any] | None = None,
                  chunk: int = 64, console=None) -> TracinScores:
    """Score every row of the final index (`reader`) with the tracin engines `names`: per checkpoint,
    its model and index (`checkpoint_index`), the flipped items' query gradients on it (`chunk` items
    at a time, what the tuned model says as `said_ids`), each engine's product on its index, weighted by
    η_c (module docstring)."""
    from circuitkit.models.loading import load_model
    from gradian.attribute import engines as scoring
    from gradian.attribute.queries import query_gradients
    from gradian.rank.checks import check_compatible

    manifest = reader.manifest
    n_rows = int(manifest["n_rows"])
    per = torch.zeros(len(names), len(plan.checkpoints), n_rows, dtype=torch.float32)
    traced = TracinScores(names, per.sum(dim=1), per, plan)
    for c, checkpoint in enumerate(plan.checkpoints):
        if say is not None:
            say(f"checkpoint {c + 1} of {len(plan.checkpoints)} ({checkpoint.name}, eta {checkpoint.weight:g}): its"
                " index and the query gradients on it …", markup=False, highlight=False)
        loaded = load_model(_model_config(manifest, checkpoint), keep_adapter=True)
        ckpt_reader, how, index_s = checkpoint_index(manifest, reader.index_dir, checkpoint, loaded, console)
        projector = check_compatible(ckpt_reader.manifest, loaded, ckpt_reader.index_dir)
        start = time.perf_counter()
        inner = [inner_engine(n, ckpt_reader.manifest) for n in names]
        engines = [scoring.build_engine(ckpt_reader, e) for e in inner]
        for at in range(0, len(flipped), chunk):
            queries = query_gradients(loaded, projector, flipped[at:at + chunk], query_loss, said_ids[at:at + chunk],
                                      manifest.get("loss_reduction", "sum"), manifest.get("activations", "model"))
            for engine in engines:
                engine.add(queries)
            del queries
        per[:, c] = checkpoint.weight * scoring.stream_scores(ckpt_reader, engines, verify)
        for n, e in zip(names, engines, strict=True):
            traced.damping.setdefault(n, e.damping)
        traced.checkpoints.append({
            "name": checkpoint.name, "path": str(checkpoint.path), "step": checkpoint.step, "lr": checkpoint.lr,
            "weight": checkpoint.weight, "weights_sha256": checkpoint.weights_sha256,
            "index_dir": str(ckpt_reader.index_dir), "index": how, "index_wall_s": index_s,
            "index_bytes": _dir_bytes(Path(ckpt_reader.index_dir)), "query_wall_s": time.perf_counter() - start,
            "inner": dict(zip(names, inner, strict=True))})
        del loaded, engines
    traced.scores = per.sum(dim=1)
    return traced
