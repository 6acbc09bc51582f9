"""Sharded attribution: jobs split the examples, write float32 sums, and one merge divides.

With `discovery.num_shards = N`, job `shard_index = i` scores the contiguous range of the
attribution examples [⌊n·i/N⌋, ⌊n·(i+1)/N⌋) and writes the float32 *sums* over its range
(scores and metrics) and its example count, never a mean, and (with `discovery.per_example`)
every example's scores `per_example_head` (n_i, L, H) and at edge level `per_example_edges`. The
merge adds the N sums in shard order and divides by the total count, so it equals one job over
all examples up to the order of float32 additions; it concatenates the per-example rows in
shard order, which is example order, so stability and `pruning.selection=bootstrap` work on
the merged scores as on one job's. Shards written before per-example rows were kept merge as
before, without them (`missing_per_example` says so).

Shards meet in a shared directory (`discovery.shard_dir`, default `<run dir>/../attribution_shards`,
the sweep dir of a Hydra multirun): `shard-IIIII-of-NNNNN.safetensors` per job; the job that
finds every shard present (under a file lock) writes the merged `scores.safetensors` and
`merge.json` there. Shards merge only when they were made with the same config (every key but
the shard keys and where the model is placed), the same model files and the same task data;
otherwise the merge is refused naming the key.

Every shard file is verified before it is merged: the job that writes it records its sha256
in its run's manifest.json (`stages.attribution.shard_sha256`, written before the file is
published), and the merge refuses a file whose bytes no longer have that checksum, as
`gradian rank` refuses a changed index shard. The shard file names its run dir in its
metadata; `circuitkit merge RUN_DIRS` checks against the run dirs it is given.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from circuitkit.core.config import flatten
from circuitkit.core.errors import UserError
from circuitkit.core.io import atomic_save_safetensors, atomic_write_json, file_lock, sha256_file
from circuitkit.discovery.attribution.eap import AttributionScores
from circuitkit.discovery.attribution.graph import Graph

log = logging.getLogger(__name__)

PARTIAL_FILE = "attribution_shard.safetensors"  # a shard's sums, in its own run dir
PER_EXAMPLE_PREFIX = "per_example_"  # the same tensor names as scores.safetensors
MERGE_RECORD = "merge.json"
LOCK_FILE = ".merge.lock"
# Keys that may differ between shards of one merge: which shard, where they meet, where the
# model sits (placement changes float round-off, not the maths).
_SHARD_KEYS = {"discovery.num_shards", "discovery.shard_index", "discovery.shard_dir"}
_PLACEMENT_KEYS = {"model.device_map", "model.max_memory", "model.offload_folder"}


class ShardMergeError(UserError):
    """Shards that cannot be merged: different configs, models or data, or some missing."""


def shard_range(n_examples: int, num_shards: int, shard_index: int) -> tuple[int, int]:
    """[start, stop) of shard `shard_index`: contiguous, sizes differ by at most one."""
    return n_examples * shard_index // num_shards, n_examples * (shard_index + 1) // num_shards


def shard_file_name(shard_index: int, num_shards: int) -> str:
    return f"shard-{shard_index:05d}-of-{num_shards:05d}.safetensors"


def default_shard_dir(run_dir: Path) -> Path:
    """Next to the run dir: a multirun's jobs are `<sweep dir>/<job number>`, so they share it."""
    return Path(run_dir).resolve().parent / "attribution_shards"


def shard_identity(config: dict[str, Any]) -> dict[str, Any]:
    """The flattened config keys that decide a shard's sums (what must agree to merge)."""
    keep = {k: config[k] for k in ("model", "discovery", "seed") if k in config}
    return {k: v for k, v in flatten(keep).items() if k not in _SHARD_KEYS | _PLACEMENT_KEYS}


@dataclass
class Partial:
    """One shard's sums as read back from its file."""

    path: Path
    sums: AttributionScores  # sums over the shard's examples; n_examples = its count
    shard_index: int
    num_shards: int
    example_range: tuple[int, int]
    identity: dict[str, Any]
    model_sha256: str
    data_sha256: str
    # False for a shard written before shards kept per-example rows (no 'per_example' metadata)
    per_example_known: bool = True


def save_partial(path: Path, sums: AttributionScores, shard_index: int, num_shards: int,
                 example_range: tuple[int, int], identity: dict[str, Any], model_sha256: str,
                 data_sha256: str, run_dir: Path | None = None) -> Path:
    """A shard file: float32 sums `head_sums` (L, H), `mlp_sums` (L,), `embed_sum` (1,),
    `edge_sums` (n_up, n_down) when computed, `metric_sums` (2,) clean/corrupted, the
    per-example rows `per_example_<key>` (n, ...) when kept; the count and what it was made
    from in the metadata."""
    g = sums.graph
    tensors = {"head_sums": sums.head.float(), "mlp_sums": sums.mlp.float(),
               "embed_sum": sums.embed.float().reshape(1),
               "metric_sums": torch.tensor([sums.metric_clean, sums.metric_corrupted], dtype=torch.float64)}
    if sums.edges is not None:
        tensors["edge_sums"] = sums.edges.float()
    for key, rows in (sums.per_example or {}).items():  # in example order (run_attribution)
        tensors[f"{PER_EXAMPLE_PREFIX}{key}"] = rows.float().contiguous()
    meta = {"format": "circuitkit-attribution-shard-1", "n_examples": str(sums.n_examples),
            "shard_index": str(shard_index), "num_shards": str(num_shards),
            "example_range": json.dumps(list(example_range)), "identity": json.dumps(identity, sort_keys=True),
            "model_sha256": model_sha256, "data_sha256": data_sha256, "info": json.dumps(sums.info),
            "per_example": json.dumps(sorted(sums.per_example or {})),
            "graph": json.dumps({"n_layers": g.n_layers, "n_heads": g.n_heads, "n_kv_heads": g.n_kv_heads,
                                 "parallel_residual": g.parallel_residual})}
    if run_dir is not None:
        meta["run_dir"] = str(Path(run_dir).resolve())
    return atomic_save_safetensors(path, tensors, meta)


SHARD_SHA_KEY = "shard_sha256"  # in the attribution stage's manifest entry of the shard's run


def verify_shard_checksum(path: Path, run_dir: Path | None, shard_index: int) -> None:
    """ShardMergeError unless `path` has the sha256 its run recorded in `run_dir`/manifest.json."""
    from circuitkit.core.pipeline import MANIFEST, load_manifest

    if run_dir is None:
        raise ShardMergeError(f"{path} names no run dir, so its checksum cannot be verified (written by an older"
                              f" CircuitKit); rerun shard {shard_index}.")
    manifest_path = Path(run_dir) / MANIFEST
    entry = load_manifest(Path(run_dir)).get("stages", {}).get("attribution", {})
    recorded = entry.get(SHARD_SHA_KEY)
    if recorded is None:
        raise ShardMergeError(f"{manifest_path} records no checksum for shard {shard_index} ({path}): the"
                              f" manifest is missing or was written by an older CircuitKit; rerun shard {shard_index}.")
    actual = sha256_file(path)
    if actual != recorded:
        raise ShardMergeError(f"{path} does not have the sha256 its run recorded in {manifest_path}"
                              f" ({actual[:12]}... vs {recorded[:12]}...): the file changed after shard {shard_index}"
                              f" wrote it; rerun shard {shard_index}.")


def load_partial(path: Path, run_dir: Path | None = None, verify: bool = True) -> Partial:
    """Read a shard file; ShardMergeError naming the file if it is not one, its tensors do not fit
    its graph, or (with `verify`) its bytes differ from the checksum recorded in its run's
    manifest (`run_dir`, default the run dir named in the file)."""
    from safetensors import safe_open

    from circuitkit.discovery.attribution.checks import ArtifactMismatch, check_scores_consistent

    try:
        with safe_open(str(path), framework="pt") as fh:
            meta = fh.metadata() or {}
            t = {k: fh.get_tensor(k) for k in fh.keys()}
    except Exception as err:  # noqa: BLE001 - any unreadable file gets the same one-line answer
        raise ShardMergeError(f"{path} cannot be read as an attribution shard ({err}); rerun that shard.") from None
    if meta.get("format") != "circuitkit-attribution-shard-1":
        raise ShardMergeError(f"{path} is not an attribution shard (no circuitkit shard metadata).")
    needed_meta = ("n_examples", "shard_index", "num_shards", "example_range", "identity", "model_sha256",
                   "data_sha256", "info", "graph")
    missing = [f"metadata '{k}'" for k in needed_meta if k not in meta]
    missing += [f"tensor '{k}'" for k in ("head_sums", "mlp_sums", "embed_sum", "metric_sums") if k not in t]
    if missing:
        raise ShardMergeError(f"{path} is not a complete attribution shard: missing {', '.join(missing)}; rerun"
                              " that shard.")
    try:
        per_example = {k[len(PER_EXAMPLE_PREFIX):]: v for k, v in t.items() if k.startswith(PER_EXAMPLE_PREFIX)}
        sums = AttributionScores(t["head_sums"], t["mlp_sums"], t["embed_sum"].reshape(-1)[0],
                                 Graph(**json.loads(meta["graph"])), t.get("edge_sums"), float(t["metric_sums"][0]),
                                 float(t["metric_sums"][1]), int(meta["n_examples"]), json.loads(meta["info"]),
                                 per_example=per_example or None)
        start, stop = json.loads(meta["example_range"])
        partial = Partial(Path(path), sums, int(meta["shard_index"]), int(meta["num_shards"]), (int(start), int(stop)),
                          json.loads(meta["identity"]), meta["model_sha256"], meta["data_sha256"],
                          per_example_known="per_example" in meta)
    except (TypeError, ValueError, IndexError, RuntimeError) as err:
        raise ShardMergeError(f"{path} has unreadable shard metadata ({str(err)[:120]}); rerun that shard.") from None
    try:
        check_scores_consistent(sums, path)
        _check_per_example(sums, path)
    except ArtifactMismatch as err:
        raise ShardMergeError(str(err)) from None
    if verify:
        where = run_dir if run_dir is not None else (Path(meta["run_dir"]) if meta.get("run_dir") else None)
        verify_shard_checksum(Path(path), where, partial.shard_index)
    return partial


def _check_per_example(sums: AttributionScores, path: Path) -> None:
    """Per-example rows of a shard: one per example, each of its graph's shape, finite."""
    from circuitkit.discovery.attribution.checks import ArtifactMismatch, check_finite, expected_score_shapes

    want = expected_score_shapes(sums.graph)
    for key, rows in (sums.per_example or {}).items():
        shape = (sums.n_examples, *want[key]) if key in ("head", "edges") else None
        if shape is None or tuple(rows.shape) != shape:
            raise ArtifactMismatch(f"{path}: tensor '{PER_EXAMPLE_PREFIX}{key}' has shape {list(rows.shape)}, but"
                                   f" {sums.n_examples} examples of its graph need {list(shape or [])}; the file"
                                   " was changed or made by hand: rerun that shard.")
        check_finite(rows, f"{path}: per-example {key} scores", "rerun that shard.")


def missing_per_example(partials: list[Partial]) -> str | None:
    """Why the merge of `partials` holds no per-example scores although its config keeps them
    (`discovery.per_example`): shards written before shards kept them. None when none is missing."""
    if not partials or not partials[0].identity.get("discovery.per_example", True):
        return None
    without = sorted(p.shard_index for p in partials if not p.per_example_known)
    if not without:
        return None
    return (f"shard(s) {without} hold no per-example scores (written by an older CircuitKit), so the merged"
            " scores have none: the stability report and pruning.selection=bootstrap need shards written by"
            f" this version; rerun shard(s) {without} to get them.")


def check_compatible(partials: list[Partial]) -> None:
    """Refuse shards that do not belong to one job: the first differing key is named."""
    first = partials[0]
    for other in partials[1:]:
        a, b = first.identity, other.identity
        for key in sorted(set(a) | set(b)):
            if a.get(key) != b.get(key):
                raise ShardMergeError(
                    f"cannot merge {first.path} and {other.path}: config key '{key}' differs"
                    f" ({a.get(key)!r} vs {b.get(key)!r}); rerun the shards with one config.")
        if other.model_sha256 != first.model_sha256:
            raise ShardMergeError(f"cannot merge {first.path} and {other.path}: they were computed with different"
                                  " model files (model.name points to changed weights); rerun the shards.")
        if other.data_sha256 != first.data_sha256:
            raise ShardMergeError(f"cannot merge {first.path} and {other.path}: their task data (data.safetensors)"
                                  " differ; rerun the shards with the same data.")
        if other.sums.graph != first.sums.graph:
            raise ShardMergeError(f"cannot merge {first.path} and {other.path}: their graphs differ"
                                  f" ({first.sums.graph} vs {other.sums.graph}); rerun the shards with one model.")
        if other.num_shards != first.num_shards:
            raise ShardMergeError(f"cannot merge {first.path} and {other.path}: config key 'discovery.num_shards'"
                                  f" differs ({first.num_shards} vs {other.num_shards}).")
    kinds = {tuple(sorted(p.sums.per_example)) for p in partials if p.sums.per_example}
    if len(kinds) > 1:
        raise ShardMergeError(f"cannot merge: the shards hold different per-example scores ({sorted(kinds)});"
                              " rerun the shards with one config.")
    indices = sorted(p.shard_index for p in partials)
    expected = list(range(first.num_shards))
    if indices != expected:
        missing = sorted(set(expected) - set(indices))
        twice = sorted({i for i in indices if indices.count(i) > 1})
        what = f"shard(s) {missing} missing" if missing else f"shard(s) {twice} given twice"
        raise ShardMergeError(f"cannot merge: {what} of discovery.num_shards={first.num_shards}; give every shard once.")


def merge_partials(partials: list[Partial]) -> AttributionScores:
    """Means over all examples: Σ_shards sums / Σ_shards counts, added in shard order (float32);
    the per-example rows concatenated in shard order = example order, when every shard has them
    (else none: `missing_per_example` says why)."""
    check_compatible(partials)
    ordered = sorted(partials, key=lambda p: p.shard_index)
    n = sum(p.sums.n_examples for p in ordered)
    total = ordered[0].sums
    head, mlp, embed = total.head.clone(), total.mlp.clone(), total.embed.clone()
    edges = None if total.edges is None else total.edges.clone()
    metric_clean, metric_corrupted = total.metric_clean, total.metric_corrupted
    for p in ordered[1:]:
        head += p.sums.head
        mlp += p.sums.mlp
        embed += p.sums.embed
        if edges is not None:
            edges += p.sums.edges
        metric_clean += p.sums.metric_clean
        metric_corrupted += p.sums.metric_corrupted
    per_example = None
    if all(p.sums.per_example for p in ordered):
        per_example = {key: torch.cat([p.sums.per_example[key] for p in ordered]) for key in total.per_example}
    return AttributionScores(head / n, mlp / n, embed / n, total.graph, None if edges is None else edges / n,
                             metric_clean / n, metric_corrupted / n, n, dict(total.info), per_example)


def shard_records(partials: list[Partial]) -> list[dict[str, Any]]:
    """What went into a merge, for merge.json and the manifest: one row per shard."""
    return [{"shard_index": p.shard_index, "example_range": list(p.example_range), "n_examples": p.sums.n_examples,
             "path": str(p.path), "sha256": sha256_file(p.path)} for p in sorted(partials, key=lambda p: p.shard_index)]


def per_example_record(partials: list[Partial], merged: AttributionScores) -> dict[str, Any]:
    """For merge.json: whether the merged scores hold per-example rows, and why not if they should."""
    note = missing_per_example(partials)
    return {"per_example": sorted(merged.per_example or {}), **({"per_example_missing": note} if note else {})}


def shard_lock(shard_dir: Path):
    """An exclusive lock on the shard dir, so that two shards finishing together merge once."""
    return file_lock(shard_dir / LOCK_FILE)


def publish_and_try_merge(partial_path: Path, shard_dir: Path, shard_index: int, num_shards: int,
                          run_dir: Path) -> tuple[AttributionScores | None, list[dict[str, Any]], list[int]]:
    """Copy this shard's file into `shard_dir`; merge when every shard is there.

    Returns (merged scores or None, the merged shards' records, the shard indices still
    missing). The merge is refused (ShardMergeError naming the key) when a present shard was
    made differently. `merge.json` records the shards, the run dir that merged them, and the
    per-example scores kept (`per_example`; `per_example_missing` says why none were).
    """
    import shutil

    with shard_lock(shard_dir):
        target = shard_dir / shard_file_name(shard_index, num_shards)
        tmp = target.with_name(f".{target.name}.tmp")
        shutil.copyfile(partial_path, tmp)
        tmp.replace(target)
        present = {i: shard_dir / shard_file_name(i, num_shards) for i in range(num_shards)}
        missing = [i for i, path in present.items() if not path.is_file()]
        if missing:
            return None, [], missing
        partials = [load_partial(path) for path in present.values()]
        merged = merge_partials(partials)
        records = shard_records(partials)
        record = per_example_record(partials, merged)
        if "per_example_missing" in record:
            log.warning(record["per_example_missing"])
        atomic_write_json(shard_dir / MERGE_RECORD, {"merged_by": str(Path(run_dir).resolve()),
                                                     "n_examples": merged.n_examples, "shards": records, **record})
        return merged, records, []


def _model_and_data_sha256(run_dir: Path, data_file: Path) -> tuple[str, str]:
    """The model's fingerprint as the pipeline recorded it for this stage (no second hash of
    the weights), and the task data's sha256."""
    from circuitkit.core.io import sha256_json
    from circuitkit.core.pipeline import load_manifest

    inputs = load_manifest(run_dir).get("stages", {}).get("attribution", {}).get("inputs") or {}
    model = {k: v.get("sha256", v.get("fingerprint", v.get("files"))) for k, v in inputs.items()
             if k == "model" or k.startswith("model/")}
    return sha256_json(model), sha256_file(data_file)


@dataclass
class ShardOutcome:
    """What a shard's attribution stage did: always its sums, the merge when it was last."""

    partial_path: Path
    example_range: tuple[int, int]
    shard_dir: Path
    merged: AttributionScores | None
    shards: list[dict[str, Any]]  # the merged shards' records (empty until merged)
    missing: list[int]


def run_attribution_shard(ctx, data, data_file: Path) -> ShardOutcome:
    """This job's share of `data` (TaskData of all attribution examples): sums written to
    `<run dir>/attribution_shard.safetensors`, published to the shard dir, merged if last."""
    from circuitkit.core.config import to_dict
    from circuitkit.discovery.attribution import run_attribution

    d = ctx.cfg.discovery
    start, stop = shard_range(len(data), d.num_shards, d.shard_index)
    if stop <= start:
        raise ShardMergeError(f"discovery.num_shards={d.num_shards} leaves shard {d.shard_index} no example of"
                              f" {len(data)}: use at most {len(data)} shards.")
    sums = run_attribution(ctx.model().adapter, data[start:stop], d, sums=True)
    model_sha, data_sha = _model_and_data_sha256(ctx.run_dir, data_file)
    path = save_partial(ctx.run_dir / PARTIAL_FILE, sums, d.shard_index, d.num_shards, (start, stop),
                        shard_identity(to_dict(ctx.cfg)), model_sha, data_sha, ctx.run_dir)
    ctx.record(**{SHARD_SHA_KEY: sha256_file(path)})  # before publishing: the merge verifies it
    shard_dir = Path(d.shard_dir).expanduser() if d.shard_dir else default_shard_dir(ctx.run_dir)
    merged, records, missing = publish_and_try_merge(path, shard_dir, d.shard_index, d.num_shards, ctx.run_dir)
    if merged is None:
        ctx.console.print(f"attribution shard {d.shard_index} of {d.num_shards} (examples {start}..{stop - 1})"
                          f" written to {shard_dir}; waiting for shard(s) {missing}: the last to finish merges"
                          " and prunes.", markup=False)
    else:
        ctx.console.print(f"attribution shard {d.shard_index} of {d.num_shards} was the last: merged"
                          f" {d.num_shards} shards ({merged.n_examples} examples) in {shard_dir}", markup=False)
    return ShardOutcome(path, (start, stop), shard_dir, merged, records, missing)
