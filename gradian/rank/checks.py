"""Is a query compatible with an index: the same weights, tokenizer, adapter, modules, projection, token
policy and circuit; anything else is refused, naming what differs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from circuitkit.core.circuit_file import circuit_sha256
from circuitkit.core.recorded import IndexIntegrityError
from circuitkit.models.loading import weights_hash
from circuitkit.models.lora import AdapterError, read_adapter
from gradian.build.checks import tokenizer_hash
from gradian.capture.sites import site_shapes, sites_from_names
from gradian.curvature.allocation import check_allocation
from gradian.data.rows import policy_of
from gradian.index.manifest import IndexMismatchError
from gradian.projection.projector import Projector, projection_fingerprint


def check_compatible(manifest: dict[str, Any], loaded, index_dir: str | Path | None = None) -> Projector:
    """Refuse a model that is not the one the index was built with; returns the index's Projector.

    Compares the weights sha256, the tokenizer hash, and the projection (kind, dim, seed,
    modules with their shapes) recomputed on `loaded.model` for the modules the manifest lists,
    and the sha256 of the matrices that projection generates with the manifest's
    `projection_sha256` (so an edited seed or kind cannot pass). `index_dir`: where a whitened
    projection's stored matrices and a spectrum allocation's ``allocation.json`` are read
    (`gradian.curvature.whitening`, `gradian.curvature.allocation`; required for the whitened kind).
    Raises IndexMismatchError naming every differing key; IndexIntegrityError (exit code 1) when a
    stored file is missing, linked outside the index or not the one the manifest records.
    """
    problems: list[str] = []
    ours = weights_hash(loaded.model)
    if ours != manifest.get("weights_sha256"):
        problems.append(f"weights_sha256: index has {str(manifest.get('weights_sha256'))[:12]}…, the loaded model"
                        f" {manifest.get('model')!r} ({manifest.get('precision')}) has {ours[:12]}…")
    ours = tokenizer_hash(loaded.tokenizer)
    if ours != manifest.get("tokenizer_sha256"):
        problems.append(f"tokenizer_sha256: index has {str(manifest.get('tokenizer_sha256'))[:12]}…, the loaded"
                        f" tokenizer has {ours[:12]}…")
    proj = manifest.get("projection")
    if not isinstance(proj, dict) or "modules" not in proj:
        raise IndexMismatchError(f"the index manifest has no projection description (got {proj!r}); it cannot"
                                 " be ranked against.")
    if index_dir is not None:
        check_allocation(index_dir, proj)  # allocation.json, through its sha256 (IndexIntegrityError)
    names = list(proj["modules"])
    projector = None
    try:  # names are modules, or "module:head{h}" sites of a circuit-restricted index
        sites = sites_from_names(loaded.model, loaded.adapter, names)
    except ValueError as err:
        problems.append(f"projection.modules: {err}")
    else:
        try:
            projector = Projector.from_description(site_shapes(sites), proj, index_dir)
        except IndexIntegrityError:  # the stored projection file is bad content, not a mismatch (exit code 1)
            raise
        except ValueError as err:
            problems.append(f"projection: {err}")
        else:
            mine = projector.describe()
            recorded = manifest.get("projection_sha256")
            if recorded is None:
                raise IndexMismatchError(
                    f"the index manifest has no projection_sha256 (format_version {manifest.get('format_version')},"
                    " from an older Gradian), so the projection its rows were made with cannot be checked;"
                    " rebuild it into a new grads.index_dir.")
            generated = projection_fingerprint(projector)
            if generated != recorded:
                problems.append(f"projection_sha256: the rows were projected with matrices of sha256 {str(recorded)[:12]}…,"
                                f" but the manifest's projection (kind {proj.get('kind')}, dim"
                                f" {proj.get('projection_dim')}, seed {proj.get('seed')}) generates {generated[:12]}…"
                                " (the manifest's projection settings were edited)")
            for key in ("kind", "projection_dim", "seed", "modules", "allocation"):
                if mine.get(key) != proj.get(key):
                    if key == "modules":
                        diff = [n for n in names if mine["modules"].get(n) != proj["modules"].get(n)]
                        problems.append(f"projection.modules: {', '.join(diff[:5])} differ (index has"
                                        f" {proj['modules'][diff[0]]}, the loaded model gives"
                                        f" {mine['modules'].get(diff[0])})")
                    else:
                        problems.append(f"projection.{key}: index has {proj.get(key)!r}, recomputed"
                                        f" {mine.get(key)!r}")
    if problems:
        model_differs = any(p.startswith(("weights_sha256", "tokenizer_sha256", "projection.modules"))
                            for p in problems)
        fix = ("Rank with the model the index was built with." if model_differs else
               "Restore the manifest's projection settings, or rebuild the index.")
        raise IndexMismatchError("the index was made with another model or projection than the one loaded: "
                                 + "; ".join(problems) + ". " + fix)
    return projector


# What decides an adapter's weights: a difference in any of them makes its gradients another model's.
ADAPTER_KEYS = ("weights_sha256", "r", "lora_alpha", "target_modules", "base_model_name_or_path")


def _adapter_line(record: dict[str, Any]) -> str:
    return (f"LoRA adapter {record.get('name')!r} ({record.get('path')}, weights sha256"
            f" {str(record.get('weights_sha256'))[:12]}…, r {record.get('r')})")


def compare_adapter(recorded: dict[str, Any] | None, ours: dict[str, Any] | None, what: str) -> None:
    """Refuse queries with another adapter than the index's (another file, none, or one where the
    index has none): IndexMismatchError naming both sides and each differing field. `ours`: the
    adapter record of the queries' model (`AdapterSpec.record`), None for none; `what` names it."""
    if recorded is None and ours is None:
        return
    if recorded is None:
        raise IndexMismatchError(f"{what} is {_adapter_line(ours)}, but the index was built on the model without an"
                                 " adapter: rank without one (--adapter none), or build an index with model.adapter set.")
    if ours is None:
        raise IndexMismatchError(f"the index was built with {_adapter_line(recorded)} and {what} has no adapter: rank"
                                 " with that adapter (--adapter DIR, or leave --adapter out to use the index's).")
    diffs = []
    for key in ADAPTER_KEYS:
        if recorded.get(key) != ours.get(key):
            theirs, mine = recorded.get(key), ours.get(key)
            if key == "weights_sha256":
                theirs, mine = f"{str(theirs)[:12]}…", f"{str(mine)[:12]}…"
            diffs.append(f"{key}: index has {theirs}, {what} has {mine}")
    if diffs:
        changed = " (the adapter's weights changed since the index was built)" if (
            recorded.get("path") == ours.get("path") and len(diffs) == 1 and diffs[0].startswith("weights_sha256")) else ""
        raise IndexMismatchError(f"the index was built with {_adapter_line(recorded)}, {what} is {ours.get('path')}"
                                 f"{changed}: {'; '.join(diffs)}. Rank with the adapter the index was built with, or"
                                 " rebuild the index with this one.")


def asked_adapter(manifest: dict[str, Any], adapter: str | None = "index") -> str | None:
    """The adapter directory the queries' model is loaded with, checked against the index's before
    anything loads: "index" = the one the manifest records (refused if it is gone or its weights
    changed), None = none, else that directory. IndexMismatchError naming the difference."""
    recorded = manifest.get("adapter")
    if adapter is None:
        compare_adapter(recorded, None, "--adapter none")
        return None
    where = "the index's adapter" if adapter == "index" else "--adapter"
    if adapter == "index":
        if recorded is None:
            return None
        adapter = str(recorded.get("path"))
    try:
        spec = read_adapter(adapter, where)
    except AdapterError as err:
        if where == "--adapter":
            raise
        raise IndexMismatchError(f"the index was built with {_adapter_line(recorded)}, which cannot be read now ({err})"
                                 " Give its directory with --adapter DIR.") from None
    compare_adapter(recorded, spec.record(), where)
    return str(spec.directory)


def check_token_policy(manifest: dict[str, Any], append_eos: bool | None = None,
                       prepend_bos: bool | None | str = "index") -> None:
    """Refuse queries asked to be tokenized under another policy than the index's rows.

    `append_eos` None and `prepend_bos` "index" mean "as the index": the queries then follow the
    manifest's ``token_policy``. IndexMismatchError names both sides otherwise.
    """
    ours = policy_of(manifest)
    problems = []
    if append_eos is not None and append_eos != ours.append_eos:
        problems.append(f"append_eos: index has {str(ours.append_eos).lower()}, asked {str(append_eos).lower()}")
    if prepend_bos != "index" and prepend_bos != ours.prepend_bos:
        problems.append(f"prepend_bos: index has {ours.prepend_bos}, asked {prepend_bos}")
    if problems:
        raise IndexMismatchError("the queries would be tokenized under another token policy than the index's rows ("
                                 + "; ".join(problems) + "): their gradients would not be comparable. Leave the"
                                 " option out (queries follow the index's policy), or rebuild the index with"
                                 " grads.append_eos / grads.prepend_bos set as asked.")


def check_circuit(manifest: dict[str, Any], circuit: str | Path | None) -> None:
    """Refuse queries restricted to another circuit than the index's (or to one, against an
    unrestricted index); IndexMismatchError says which circuit each side has."""
    if circuit is None:
        return

    if not Path(circuit).is_file():
        raise FileNotFoundError(f"circuit {str(circuit)!r} does not exist.")
    ours, theirs = circuit_sha256(circuit), (manifest.get("circuit") or {}).get("sha256")
    if theirs is None:
        raise IndexMismatchError(f"the queries are restricted to circuit {circuit} (sha256 {ours[:12]}…) but the"
                                 " index is unrestricted (built with grads.circuit=null): rank without --circuit,"
                                 " or build the index with grads.circuit set to this file.")
    if ours != theirs:
        raise IndexMismatchError(f"the queries are restricted to circuit {circuit} (sha256 {ours[:12]}…) but the"
                                 f" index was built for another circuit (sha256 {theirs[:12]}…, heads"
                                 f" {manifest['circuit'].get('heads')}): rank with that circuit, or rebuild the index.")


# ----------------------------------------------------------------------------- queries


