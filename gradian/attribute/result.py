"""The result of `gradian attribute`, typed: one writer (atomic JSON) and one checking reader.

The file is what the report (and scripts) read: everything a reader needs to trust the accusation
is in it, how it was made included (query loss, engines and damping, bootstrap seed and resamples,
the tuned and base models and the adapter).

Keys, in order:

    format_version  FORMAT_VERSION
    attributed      true when rows were ranked; false with `reason` when the regression is inside
                    the noise band (or the tuned model is better)
    reason          one sentence
    index, eval_dataset, eval_sha256
    models          {"tuned": {name, revision, precision, weights_sha256, adapter}, "base": {name,
                    revision, precision, how}}
    query           {query_loss, loss_reduction, index_loss, activations, said: how what the tuned
                    model says was read (greedy, to its EOS or max_tokens)}
    engines         the engine names, the first one accuses; `damping` per engine
    engine_notes    {engine: one sentence} where the index decides what an engine computed (datainf:
                    exact on raw gradients, or in the projected space)
    precision       {requested, used, note, index, queries, near_tie}: the dtype both models were
                    evaluated in (`--precision`: requested as given, used as resolved, note why), the
                    index's, the query gradients' (always the index's), and `near_tie`
                    (`gradian.attribute.precision.near_tie_check`: precision, eps, checked, items,
                    margins; null when no item flipped)
    seeds           {"bootstrap": seed}
    regression      `gradian.attribute.regression.Regression.as_dict`
    base_blame      `BaseBlame.as_dict`
    items           per eval item: item, line, prompt and answer previews, base and tuned scores
                    (logprob, margin, first, exact), flipped, tuned_says (flipped items: the tuned
                    model's whole greedy answer) and tuned_says_end ("eos" or "max_tokens"), near_tie
                    (flipped items: whether the flip depends on the precision; else null)
    top_k, accused  [{rank, row_id, line, score, text_preview, cluster}] (most negative score first)
    agreement       [{engine, against, spearman, top_k_overlap, k, low_confidence}]
    clusters        `gradian.attribute.clusters.cluster_rows`, or null with `clusters_note`
    clusters_note   why there are no clusters or findings (null when there are)
    clusters_method how the clusters were made: "tfidf" or "embeddings:<model>+hdbscan"
                    (`gradian.attribute.embeddings`), null when there are none
    lessons         the accused rows grouped by the answer template they teach
                    (`gradian.attribute.lessons.find_lessons`: lesson, template, templates, share, score,
                    n_rows, rows, lines, clusters, phrasings, said, same_lesson {n_rows, n_negative,
                    n_unindexed, rows [{row_id, line, score, text_preview}], said} or null), or null
    lesson_accused  the accusation that follows the main lessons, at the same top_k
                    (`gradian.attribute.lessons.following_lessons`: [{rank, row_id, line, score, by}],
                    by "engine" or "lesson"), or null without a main lesson
    spans           the sentences of the long accused rows (`gradian.attribute.spans.drill_down`:
                    min_tokens, engine, rows [{row_id, line, score, score_recomputed, n_supervised,
                    top, sentences [{text, chars, token_span, n_tokens, score, share}]}], skipped,
                    note), or null (--span-min-tokens 0, or nothing attributed)
    verify          `--verify`'s retrains (`gradian.attribute.verify.run_verify`: settings, rows,
                    left_out, control_seed, unmatched_lines, reference, runs [{name, label,
                    rows_left_out, rows_trained, steps, final_loss, train_wall_s, accuracy,
                    logprob_mean, recovered_accuracy, recovered_logprob, flipped_right_again,
                    flipped_same_mistake, flipped, model_dir}], holds, summary), or null without --verify
    checkpoints     the tracin engines' run (`gradian.attribute.checkpoints.TracinScores.record`: source,
                    lr_source, note, engine, checkpoints [{name, path, step, lr, weight, weights_sha256,
                    index_dir, index, index_wall_s, index_bytes, query_wall_s, inner, accused_score,
                    accused_share}], most_accusing, accused [{row_id, by_checkpoint}]), or null without
                    --checkpoints
    wall_s

Version 2 added `spans` and `verify`, version 3 `engine_notes`, `precision`, `checkpoints`,
`clusters_method` and `lessons`, version 4 `lesson_accused`; an older file reads with the keys added
since null.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from circuitkit.core.errors import UserError
from circuitkit.core.io import atomic_write_json

FORMAT_VERSION = 4
ADDED_IN = {"spans": 2, "verify": 2, "engine_notes": 3, "precision": 3, "checkpoints": 3,
            "clusters_method": 3, "lessons": 3, "lesson_accused": 4}  # key -> the format version that added it


@dataclass
class AttributionResult:
    """See the module docstring for each field."""

    attributed: bool
    reason: str
    index: str
    eval_dataset: str
    eval_sha256: str
    models: dict[str, Any]
    query: dict[str, Any]
    engines: list[str]
    damping: dict[str, float | None]
    seeds: dict[str, int]
    regression: dict[str, Any]
    base_blame: dict[str, Any]
    items: list[dict[str, Any]]
    top_k: int
    accused: list[dict[str, Any]] = field(default_factory=list)
    agreement: list[dict[str, Any]] = field(default_factory=list)
    clusters: list[dict[str, Any]] | None = None
    clusters_note: str | None = None
    clusters_method: str | None = None
    lessons: list[dict[str, Any]] | None = None
    lesson_accused: list[dict[str, Any]] | None = None
    spans: dict[str, Any] | None = None
    verify: dict[str, Any] | None = None
    engine_notes: dict[str, str] | None = None
    precision: dict[str, Any] | None = None
    checkpoints: dict[str, Any] | None = None
    wall_s: float = 0.0
    format_version: int = FORMAT_VERSION

    def to_json(self) -> dict[str, Any]:
        """The JSON object, keys in the documented order (format_version first)."""
        d = asdict(self)
        return {"format_version": d.pop("format_version"), **d}


def write_result(path: str | Path, result: AttributionResult) -> Path:
    """The one writer: `result` as indented JSON at `path`, atomically (a temp file renamed)."""
    return atomic_write_json(Path(path), result.to_json())


def read_result(path: str | Path) -> AttributionResult:
    """The one reader: the result at `path`, every key checked (UserError, exit code 1, naming
    the first problem: not JSON, an unknown format version, a missing or unknown key). A file of an
    older version reads with the keys added since (`ADDED_IN`) null, as the current version."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise UserError(f"{path}: not a `gradian attribute --out` result ({err}).", exit_code=1) from None
    version = data.get("format_version") if isinstance(data, dict) else None
    if not isinstance(version, int) or isinstance(version, bool) or not 1 <= version <= FORMAT_VERSION:
        raise UserError(f"{path}: format_version {version!r}, expected 1 to {FORMAT_VERSION}: write it again with"
                        " this version's `gradian attribute --out`.", exit_code=1)
    names = [f.name for f in fields(AttributionResult)]
    later = {n for n, added in ADDED_IN.items() if added > version}  # absent from an older file
    missing = [n for n in names if n not in data and n not in later]
    unknown = [k for k in data if k not in names or k in later]
    if missing or unknown:
        raise UserError(f"{path}: {'missing keys ' + ', '.join(missing) if missing else ''}"
                        f"{'; ' if missing and unknown else ''}{'unknown keys ' + ', '.join(unknown) if unknown else ''};"
                        " it is not what `gradian attribute --out` writes.", exit_code=1)
    return AttributionResult(**{**data, "format_version": FORMAT_VERSION})
