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
    query           {query_loss, loss_reduction, index_loss, activations}
    engines         the engine names, the first one accuses; `damping` per engine
    seeds           {"bootstrap": seed}
    regression      `gradian.attribute.regression.Regression.as_dict`
    base_blame      `BaseBlame.as_dict`
    items           per eval item: item, line, prompt and answer previews, base and tuned scores
                    (logprob, margin, first, exact), flipped, tuned_says (flipped items)
    top_k, accused  [{rank, row_id, line, score, text_preview, cluster}] (most negative score first)
    agreement       [{engine, against, spearman, top_k_overlap, k, low_confidence}]
    clusters        `gradian.attribute.clusters.cluster_rows`, or null with `clusters_note`
    clusters_note   why there are no clusters or findings (null when there are)
    wall_s
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from circuitkit.core.errors import UserError
from circuitkit.core.io import atomic_write_json

FORMAT_VERSION = 1


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
    the first problem: not JSON, another format version, a missing or unknown key)."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise UserError(f"{path}: not a `gradian attribute --out` result ({err}).", exit_code=1) from None
    if not isinstance(data, dict) or data.get("format_version") != FORMAT_VERSION:
        version = data.get("format_version") if isinstance(data, dict) else None
        raise UserError(f"{path}: format_version {version!r}, expected {FORMAT_VERSION}: write it again with this"
                        " version's `gradian attribute --out`.", exit_code=1)
    names = [f.name for f in fields(AttributionResult)]
    missing = [n for n in names if n not in data]
    unknown = [k for k in data if k not in names]
    if missing or unknown:
        raise UserError(f"{path}: {'missing keys ' + ', '.join(missing) if missing else ''}"
                        f"{'; ' if missing and unknown else ''}{'unknown keys ' + ', '.join(unknown) if unknown else ''};"
                        " it is not what `gradian attribute --out` writes.", exit_code=1)
    return AttributionResult(**data)
