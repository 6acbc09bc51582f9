"""The index header, typed: what decides an index's stored values, one writer, one checking reader.

`IndexHeader` holds the fields `gradian.build.indexer` records at the top of manifest.json (in this
order); `IndexWriter` adds n_rows, rows_per_shard and format_version, then the shard list.
`header_json` is the one writer of those fields; `check_header` the one reader (called by
`gradian.index.manifest.read_manifest` for every index the indexer wrote, i.e. whose manifest records a
tokenizer): it checks the type of every field and fills, in one place, what an older format
version did not record (`DEFAULTS_BEFORE`), so no reader needs a default of its own. A bare
shard store (`IndexWriter` with a header of its own, as the benchmarks use) is checked for its
storage keys only.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

_NONE = type(None)


@dataclass(frozen=True)
class IndexHeader:
    """Everything that decides an index's stored values (see `gradian.build.indexer`)."""

    model: str
    revision: str | None
    precision: str
    weights_sha256: str
    tokenizer_sha256: str
    projection: dict[str, Any]
    storage_dtype: str
    loss_reduction: str
    loss: str
    preconditioner: str
    data_file: str
    data_source: dict[str, Any]
    data_sha256: str
    max_seq_length: int
    truncation_side: str
    on_truncation: str
    data_report: dict[str, Any]
    token_policy: dict[str, Any]
    row_width: int
    circuit: dict[str, Any] | None
    projection_sha256: str
    activations: str
    parameter_share: float  # share of the model's parameters (elements) the index covers
    gguf_file: str | None = None  # model.gguf_file, when the model is a GGUF inside model.name
    fisher: str = "empirical"  # grads.fisher: the labels of the K-FAC / EK-FAC curvature's output gradients
    # model.adapter's record (circuitkit.models.lora.AdapterSpec.record: directory name and path, weights
    # file and its sha256, peft_type, r, lora_alpha, target_modules, base_model_name_or_path), or None
    adapter: dict[str, Any] | None = None
    base_name: str | None = None  # model.base_name: the model a full fine-tune in `model` was tuned from
    # grads.row_format: dense blocks, rank-row_rank factors (gradian.index.formats.factored) or sign bits (gradian.index.formats.signs)
    row_format: str = "dense"
    row_rank: int | None = None  # grads.row_rank with factored rows, else None
    # What made the index (circuitkit.core.provenance.software: the distribution's version, the git commit
    # of a checkout); filled by `header_json`. Not part of what an index is compared on (a resume with a
    # newer version appends to it), and absent from indexes written before it was recorded.
    software: dict[str, Any] | None = None

    def to_json(self) -> dict[str, Any]:
        """The header's JSON fields, in the order manifest.json stores them."""
        return asdict(self)


# JSON types of each field (int where JSON has an integer; a float field also takes an int).
TYPES: dict[str, tuple[type, ...]] = {
    "model": (str,), "revision": (str, _NONE), "precision": (str,), "weights_sha256": (str,),
    "tokenizer_sha256": (str,), "projection": (dict,), "storage_dtype": (str,), "loss_reduction": (str,),
    "loss": (str,), "preconditioner": (str,), "data_file": (str,), "data_source": (dict, _NONE),
    "data_sha256": (str, _NONE), "max_seq_length": (int,), "truncation_side": (str,), "on_truncation": (str,),
    "data_report": (dict, _NONE), "token_policy": (dict, _NONE), "row_width": (int,), "circuit": (dict, _NONE),
    "projection_sha256": (str, _NONE), "activations": (str,), "parameter_share": (float, int, _NONE),
    "gguf_file": (str, _NONE), "fisher": (str,), "adapter": (dict, _NONE), "base_name": (str, _NONE),
    "row_format": (str,), "row_rank": (int, _NONE), "software": (dict, _NONE)}
assert list(TYPES) == [f.name for f in fields(IndexHeader)]

# What a manifest of an older format version lacks, and what that version meant. Format
# versions: 2 projection_sha256; 3 token_policy, loss, preconditioner; 4 activations;
# 5 parameter_share, gguf_file; 6 fisher; 7 adapter, base_name; 8 row_format, row_rank. (Before 2, the
# header was as it is in version 2 without its hash.)
DEFAULTS_BEFORE: dict[str, tuple[int, Any]] = {
    "projection_sha256": (2, None), "token_policy": (3, None), "loss": (3, "ce"), "preconditioner": (3, "none"),
    "activations": (4, "model"), "parameter_share": (5, None), "gguf_file": (5, None),
    "fisher": (6, "empirical"), "adapter": (7, None), "base_name": (7, None),
    "row_format": (8, "dense"), "row_rank": (8, None),
}


# Header fields an index records without being compared on: a resume or another worker with other
# values (a newer CircuitKit) is the same index.
NOT_COMPARED = ("software",)


def header_json(header: IndexHeader) -> dict[str, Any]:
    """The one writer of the header fields (`IndexWriter` stores them as given); `software` is this
    process's when not given."""
    out = header.to_json()
    if out["software"] is None:
        from circuitkit.core.provenance import software

        out["software"] = software()
    return out


def check_header(manifest: dict[str, Any], where: str) -> list[str]:
    """Problems with the header fields of a manifest (the type of every field), after filling
    `DEFAULTS_BEFORE` into `manifest` for the fields its format version did not record; a field
    its version records and the manifest lacks is a problem."""
    version = manifest.get("format_version", 1)
    problems = []
    for name, kinds in TYPES.items():
        if name not in manifest and name in NOT_COMPARED:  # recorded since it was added, in no format version
            manifest[name] = None
            continue
        if name not in manifest:
            since, default = DEFAULTS_BEFORE.get(name, (0, None))
            if version < since:
                manifest[name] = default
            else:
                problems.append(f"{where}: no {name} (format_version {version} records it)")
            continue
        value = manifest[name]
        if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
            expected = " or ".join("null" if k is _NONE else k.__name__ for k in kinds)
            problems.append(f"{where}: {name} is {str(value)[:60]!r}, expected {expected}")
    return problems


def _widths_line(proj: dict[str, Any]) -> str:
    """How the row's width is split among the modules: uniform, or each module's allocated width."""
    alloc = proj.get("allocation")
    if proj.get("kind") == "raw":
        return "raw (each module's d_out x d_in)"
    if not isinstance(alloc, dict):
        return "uniform (projection_dim per module)"
    entries = proj.get("modules") or {}
    widths = [f"{n} {e.get('width')}" for n, e in entries.items() if isinstance(e, dict)]
    return (f"{alloc.get('kind')} allocation, total {alloc.get('total')} of {alloc.get('budget')}: {', '.join(widths[:8])}"
            f"{' …' if len(widths) > 8 else ''}")


def describe_index(summary: dict[str, Any]) -> list[tuple[str, str]]:
    """How an index was made, as (key, value) lines: what `gradian inspect` prints and the report shows.

    `summary`: `gradian.index.reader.IndexReader.summary()` (the manifest plus what is on disk).
    """
    from gradian.curvature.factors import has_kfac
    from gradian.data.rows import policy_line
    from gradian.index.formats import FORMATS

    proj, report = summary.get("projection", {}), summary.get("data_report") or {}
    if not isinstance(proj, dict):  # a bare kind, as in hand-made headers
        proj = {"kind": proj, "projection_dim": summary.get("projection_dim"), "seed": summary.get("projection_seed")}
    if not isinstance(report, dict):
        report = {}
    modules = list(proj.get("modules") or {})
    if summary["complete"]:
        state = "complete"
    elif summary["manifest_complete"]:
        state = f"NOT complete although the manifest says so: {'; '.join(summary['missing'])}"
    else:
        state = f"incomplete ({'; '.join(summary['missing'])}): resume with the same command"
    dropped = (report.get("dropped_truncated") or 0) + (report.get("dropped_unsupervised") or 0)
    row_width, row_format = FORMATS[summary.get("row_format", "dense")].describe(summary)
    rows = [
        ("model", f"{summary.get('model')} ({summary.get('precision')}), weights sha256 "
                  f"{str(summary.get('weights_sha256'))[:12]}…"),
        ("projection", f"{proj.get('kind')}, dim {proj.get('projection_dim')} per module, seed {proj.get('seed')}"
                       f", matrices sha256 {str(summary.get('projection_sha256'))[:12]}…"),
        ("modules", f"{len(modules)}: {', '.join(modules[:4])}{' …' if len(modules) > 4 else ''}"),
        ("widths", _widths_line(proj)),
        ("row width", row_width),
        ("row format", row_format),
        ("circuit", "none (unrestricted)" if not summary.get("circuit") else
         f"sha256 {summary['circuit']['sha256'][:12]}…: heads {summary['circuit']['heads']},"
         f" MLPs {summary['circuit']['mlps']}"),
        ("loss", f"{summary.get('loss', 'ce')}, {summary.get('loss_reduction')} over supervised tokens;"
                 f" preconditioner {summary.get('preconditioner', 'none')}"
                 + (f", {summary.get('fisher', 'empirical')} Fisher" if has_kfac(summary.get("preconditioner")) else "")),
        ("data", f"{summary.get('data_file')} (sha256 {str(summary.get('data_sha256'))[:12]}…)"),
        ("rows", f"{report.get('rows_read')} read, {report.get('kept')} kept, {report.get('truncated')} truncated,"
                 f" {dropped} dropped"),
        ("tokens", policy_line(report)),
        ("stored", f"{summary['rows_stored']} of {summary.get('n_rows')} rows in {summary['n_shard_files']} shards"
                   f" ({state})"),
        ("size on disk", f"{summary['bytes'] / 2**20:.2f} MiB ({summary['bytes']} bytes)"),
    ]
    adapter = summary.get("adapter")
    if isinstance(adapter, dict):
        rows.insert(1, ("adapter", f"LoRA {adapter.get('name')} (r {adapter.get('r')}, alpha {adapter.get('lora_alpha')},"
                                   f" targets {adapter.get('target_modules')}), weights sha256"
                                   f" {str(adapter.get('weights_sha256'))[:12]}…, made for"
                                   f" {adapter.get('base_model_name_or_path')}"))
    if summary.get("base_name"):
        rows.insert(1, ("base model", f"{summary['base_name']} (model is its full fine-tune)"))
    share = summary.get("parameter_share")
    if isinstance(share, (int, float)):
        rows.insert(3, ("parameter share", f"{100 * share:.2f}% of the model's parameters"))
    return rows

