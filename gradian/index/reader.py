"""Reading an index: its shards checked against the manifest (names, rows, dtypes, sha256) and the row
format, streamed one at a time; `verify` (`gradian inspect --verify`) checks every recorded file."""

from __future__ import annotations

import hashlib
import json
import math
import mmap
import os
import warnings
from collections.abc import Collection, Iterator
from pathlib import Path
from typing import Any

import torch

from circuitkit.core.device import DTYPES
from circuitkit.core.recorded import (
    MANIFEST,
    REBUILD,
    IndexIntegrityError,
    confined_path,
)
from gradian.index.formats import format_of
from gradian.index.formats.base import (
    RowFormat,
)
from gradian.index.manifest import OPTIONAL_TENSORS, IndexMismatchError, read_manifest, shard_name
from gradian.projection.projector import WHITENING_FILE, Projector, projection_fingerprint

_SAFETENSORS_DTYPES = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "I64": torch.int64,
                       "U8": torch.uint8}


def _tensors_from_buffer(buf) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file held in `buf` (bytes or a read-only mmap), as views of it.

    Format: 8-byte little-endian header length n, n bytes of JSON {name: {dtype, shape,
    data_offsets [begin, end)}}, then the data. Raises ValueError on anything malformed.
    """
    if len(buf) < 8:
        raise ValueError("shorter than a safetensors header")
    n = int.from_bytes(buf[:8], "little")
    if 8 + n > len(buf):
        raise ValueError(f"header of {n} bytes runs past the end of the file ({len(buf)} bytes)")
    header = json.loads(bytes(buf[8:8 + n]))
    out = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "non-writable buffer": the views are only read
        for key, info in header.items():
            if key == "__metadata__":
                continue
            dtype = _SAFETENSORS_DTYPES.get(info.get("dtype"))
            begin, end = info["data_offsets"]
            count = math.prod(info["shape"])
            if dtype is None or end - begin != count * dtype.itemsize or 8 + n + end > len(buf):
                raise ValueError(f"tensor {key!r} ({info.get('dtype')}, shape {info['shape']}) does not fit the file")
            flat = (torch.frombuffer(buf, dtype=dtype, count=count, offset=8 + n + begin) if count
                    else torch.empty(0, dtype=dtype))
            out[key] = flat.reshape(info["shape"])
    return out


class IndexReader:
    """Streams an index shard by shard (memory independent of the index size).

    The manifest is checked on opening (`read_manifest`); each shard is checked against its
    manifest entry as it is read.
    """

    def __init__(self, index_dir: Path) -> None:
        self.index_dir = Path(index_dir)
        self.manifest = read_manifest(self.index_dir)
        layout = self._layout_problems()
        if layout:  # overlapping or foreign ranges would rank some rows twice or not at all
            raise IndexIntegrityError(f"{self.index_dir / MANIFEST}: {'; '.join(layout)}; {REBUILD}.")
        # How the rows are stored (`gradian.index.formats`): their dtype, width, norms, scorer, refusals.
        self.row_format: RowFormat = format_of(self.manifest)

    @property
    def n_index_shards(self) -> int:
        return max(1, math.ceil(self.manifest["n_rows"] / self.manifest["rows_per_shard"]))

    def _expected_rows(self, k: int) -> list[int]:
        start = k * self.manifest["rows_per_shard"]
        return [start, min(self.manifest["n_rows"], start + self.manifest["rows_per_shard"])]

    def _layout_problems(self) -> list[str]:
        """Listed shards whose name or row range is not the one their position gives."""
        expected = {shard_name(k): k for k in range(self.n_index_shards)}
        problems = []
        for name, entry in sorted(self.manifest["shards"].items()):
            if name not in expected:
                problems.append(f"{name} is listed but an index of {self.manifest['n_rows']} rows in shards of"
                                f" {self.manifest['rows_per_shard']} has no such shard")
            elif entry["rows"] != self._expected_rows(expected[name]):
                problems.append(f"{name} is listed with rows {entry['rows']}, expected"
                                f" {self._expected_rows(expected[name])} (row ranges must be contiguous)")
        return problems

    def missing(self) -> list[str]:
        """Why the index is not complete (cheap: names, row ranges and file sizes, no hashing).

        Empty when every shard 0..n-1 is listed with its row range and its file is present with
        the recorded size, i.e. the rows stored are exactly 0..n_rows-1.
        """
        shards, problems = self.manifest["shards"], []
        expected = {shard_name(k): k for k in range(self.n_index_shards)}
        absent = [name for name in expected if name not in shards]
        if absent:
            problems.append(f"{len(absent)} of {len(expected)} shards not written yet"
                            f" ({', '.join(absent[:3])}{' …' if len(absent) > 3 else ''})")
        problems += self._layout_problems()
        for name, entry in sorted(shards.items()):
            path = self.index_dir / name
            if not path.is_file():
                problems.append(f"{name} is listed but its file is missing")
            elif path.stat().st_size != entry["bytes"]:
                problems.append(f"{name} has {path.stat().st_size} bytes, the manifest says {entry['bytes']}"
                                " (truncated or replaced)")
        return problems

    @property
    def complete(self) -> bool:
        """The manifest says complete and the files agree (`missing()` is empty)."""
        return self.manifest["complete"] and not self.missing()

    def _load(self, name: str, verify: bool) -> dict[str, torch.Tensor]:
        from safetensors import SafetensorError, safe_open

        entry = self.manifest["shards"][name]
        path = confined_path(self.index_dir, name)
        if not path.is_file():
            raise IndexIntegrityError(f"{path}: shard listed in the manifest is missing; {REBUILD}.")
        try:
            if verify:
                with open(path, "rb") as fh:
                    size = os.fstat(fh.fileno()).st_size
                    # The hash runs over the mapped file and the tensors are views of the same
                    # mapping: what is checked is what is parsed, read once, no copy.
                    buf = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) if size else b""
                digest = hashlib.sha256(buf).hexdigest()
                if digest != entry["sha256"]:
                    raise IndexIntegrityError(
                        f"{path}: sha256 {digest[:12]}… differs from the manifest's {str(entry['sha256'])[:12]}…:"
                        f" the shard changed after it was written (or the manifest was edited); {REBUILD}.")
                return _tensors_from_buffer(buf)
            with safe_open(str(path), framework="pt") as fh:
                return {key: fh.get_tensor(key) for key in fh.keys()}  # noqa: SIM118 - safe_open has no iter
        except IndexIntegrityError:
            raise
        except (SafetensorError, ValueError, KeyError, TypeError) as err:
            raise IndexIntegrityError(f"{path}: not a readable safetensors file ({err}); it is truncated or"
                                      f" damaged; {REBUILD}.") from None

    def _check_tensors(self, name: str, tensors: dict[str, torch.Tensor]) -> list[str]:
        """What in a loaded shard disagrees with its manifest entry."""
        entry, problems = self.manifest["shards"][name], []
        from gradian.curvature.factors import factor_shapes, has_kfac, is_factor_tensor, shard_factor_problems

        if {t for t in tensors if not is_factor_tensor(t)} - set(OPTIONAL_TENSORS) != {"grads", "norms", "rows"}:
            return [f"{name} holds tensors {sorted(tensors)}, expected grads, norms, rows (and sources,"
                    " second_moment)"]
        moment, blocks = tensors.get("second_moment"), self.second_moment_blocks
        if (moment is None) != (blocks is None):
            return [f"{name} {'lacks' if moment is None else 'holds'} second_moment, but the manifest's"
                    f" preconditioner is {self.manifest.get('preconditioner', 'none')!r}"]
        start, end = entry["rows"]
        kfac = has_kfac(self.manifest.get("preconditioner"))
        if kfac != any(is_factor_tensor(t) for t in tensors):
            return [f"{name} {'lacks' if kfac else 'holds'} K-FAC factors, but the manifest's preconditioner is"
                    f" {self.manifest.get('preconditioner', 'none')!r}"]
        if kfac:
            fisher = self.manifest.get("fisher", "empirical") == "sampled"
            problems += shard_factor_problems(name, tensors, factor_shapes(self.manifest), end - start,
                                              (self.manifest.get("row_width"), DTYPES[self.manifest["storage_dtype"]])
                                              if fisher else None)
        rows, grads, norms = tensors["rows"], tensors["grads"], tensors["norms"]
        if rows.dtype != torch.int64 or rows.shape != (end - start,) or not torch.equal(rows, torch.arange(start, end)):
            problems.append(f"{name} holds row ids {rows.tolist()[:3]}… ({rows.dtype}), the manifest says rows"
                            f" {start}..{end - 1}")
        problems += self.row_format.grads_problems(name, grads, end - start)
        sources = tensors.get("sources")
        if sources is not None and (sources.dtype != torch.int64 or sources.shape != (end - start,)):
            problems.append(f"{name} sources are {sources.dtype} {tuple(sources.shape)}, expected int64"
                            f" ({end - start},)")
        if moment is not None:
            k = grads.shape[1] // blocks if grads.ndim == 2 else 0
            if moment.dtype != torch.float32 or tuple(moment.shape) != (blocks, k, k):
                problems.append(f"{name} second_moment is {moment.dtype} {tuple(moment.shape)}, expected float32"
                                f" ({blocks}, {k}, {k})")
        if norms.dtype != torch.float32 or norms.shape != (end - start,):
            problems.append(f"{name} norms are {norms.dtype} {tuple(norms.shape)}, expected float32"
                            f" ({end - start},)")
        return problems

    @property
    def second_moment_blocks(self) -> int | None:
        """M, the number of per-module blocks whose second moments the shards hold (None: none)."""
        from gradian.curvature.factors import has_module

        if not has_module(self.manifest.get("preconditioner", "none")):
            return None
        modules = (self.manifest.get("projection") or {}).get("modules") or {}
        return len(modules) or None

    def read_tensors(self, name: str, keys: list[str], fix: str) -> dict[str, torch.Tensor]:
        """The named tensors of listed shard `name`, read without the rows (the sha256 of the
        same files is checked when `shards()` streams them); IndexIntegrityError naming `fix`
        (the setting that would have stored them) when one is absent."""
        from safetensors import SafetensorError, safe_open

        path = confined_path(self.index_dir, name)
        try:
            with safe_open(str(path), framework="pt") as fh:
                absent = [k for k in keys if k not in fh.keys()]  # noqa: SIM118 - safe_open has no iter
                if absent:
                    raise IndexIntegrityError(f"{path} holds no {absent[0]}; {REBUILD} with {fix}.")
                return {k: fh.get_tensor(k) for k in keys}
        except (SafetensorError, OSError) as err:
            raise IndexIntegrityError(f"{path}: not a readable safetensors file ({err}); {REBUILD}.") from None

    def second_moment_sums(self) -> list[torch.Tensor]:
        """Every listed shard's ``second_moment`` (M, k, k) float32, read without the rows (the
        sha256 of the same files is checked when `shards()` streams them)."""
        from safetensors import SafetensorError, safe_open

        out = []
        for name in sorted(self.manifest["shards"]):
            path = confined_path(self.index_dir, name)
            try:
                with safe_open(str(path), framework="pt") as fh:
                    if "second_moment" not in fh.keys():  # noqa: SIM118 - safe_open has no iter
                        raise IndexIntegrityError(f"{path} holds no second_moment; {REBUILD}"
                                                  " with grads.preconditioner=module.")
                    out.append(fh.get_tensor("second_moment"))
            except (SafetensorError, OSError) as err:
                raise IndexIntegrityError(f"{path}: not a readable safetensors file ({err}); {REBUILD}.") from None
        return out

    def shards(self, verify: bool = True, factored: bool = False, signs: bool = False,
               formats: Collection[str] = ()) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """(rows (n,), grads (n, width) float32, norms (n,)) per shard, in row order.

        verify: check each shard's sha256 against the manifest on the bytes read (one read per
        shard, no second pass). Either way the row ids, shapes and dtypes must match the
        manifest. Raises IndexIntegrityError naming the shard and what differs.
        formats: the row formats (`gradian.index.formats`) whose stored rows the caller reads, as
        `row_format.read_dtype` (packed sign rows: the stored uint8 bytes); dense rows are read by every
        caller, an index of another format is refused (IndexMismatchError, the format's
        `reader_refusal`) before any shard is read. factored, signs: add those formats.
        """
        fmt = self.row_format
        readable = {*formats, *(["factored"] if factored else []), *(["signs"] if signs else [])}
        if not fmt.float_rows and fmt.name not in readable:
            raise IndexMismatchError(fmt.reader_refusal(self.index_dir))
        for name in sorted(self.manifest["shards"]):
            tensors = self._load(name, verify)
            problems = self._check_tensors(name, tensors)
            if problems:
                raise IndexIntegrityError(f"{self.index_dir}: {'; '.join(problems)}; {REBUILD}.")
            # Copies, so no tensor handed out keeps the shard's file mapped.
            yield (tensors["rows"].clone(), tensors["grads"].to(fmt.read_dtype, copy=verify),
                   tensors["norms"].clone())
            del tensors

    def verify(self) -> list[str]:
        """Every problem of the index, one sentence each; empty when it is sound.

        Checks the shard list against the row count (contiguous, complete ranges), every
        shard's presence, size, sha256, tensors (names, shapes, dtypes, row ids, norms of the
        stored values), files in the directory the manifest does not list, the `complete`
        flag, the data report's row count and the projection fingerprint.
        """
        problems = self.missing()
        for name in sorted(self.manifest["shards"]):
            if not (self.index_dir / name).is_file():
                continue
            try:
                tensors = self._load(name, verify=True)
            except IndexIntegrityError as err:
                problems.append(str(err).split("; rebuild")[0])
                continue
            found = self._check_tensors(name, tensors)
            if not found:
                recomputed = self.row_format.norms(tensors["grads"])
                if not torch.allclose(recomputed, tensors["norms"], rtol=1e-5, atol=1e-6):
                    found.append(f"{name} norms are not the norms of its stored grads")
                if "second_moment" in tensors:
                    from gradian.curvature.moments import shard_second_moment

                    again = shard_second_moment(tensors["grads"].float(), self.second_moment_blocks)
                    if not torch.allclose(again, tensors["second_moment"], rtol=1e-5, atol=1e-6):
                        found.append(f"{name} second_moment is not the sum of its stored rows' outer products")
            problems += found
        from gradian.curvature.factors import CURVATURE_FILE, has_kfac
        from gradian.index.curvature import verify_curvature

        if has_kfac(self.manifest.get("preconditioner")) and not problems:
            problems += verify_curvature(self)
        listed = set(self.manifest["shards"]) | {MANIFEST} | ({CURVATURE_FILE} if "curvature" in self.manifest else set())
        if self.whitening is not None:  # the whitened projection's matrices (checked below)
            listed.add(WHITENING_FILE)
        allocation = (self.manifest.get("projection") or {}).get("allocation")
        if isinstance(allocation, dict) and allocation.get("file"):  # the width allocation (checked below)
            listed.add(str(allocation["file"]))
        unlisted = sorted(p.name for p in self.index_dir.iterdir() if not p.name.startswith(".") and p.name not in listed)
        if unlisted:
            problems.append(f"files the manifest does not list: {', '.join(unlisted[:5])}"
                            f"{' …' if len(unlisted) > 5 else ''}")
        honest = not self.missing()
        if self.manifest["complete"] and not honest:
            problems.append("the manifest says complete, but the shards above are missing or damaged")
        if not self.manifest["complete"] and honest:
            problems.append("the manifest says incomplete although every shard is present")
        report = self.manifest.get("data_report")
        if isinstance(report, dict) and report.get("kept") != self.manifest["n_rows"]:
            problems.append(f"data_report says {report.get('kept')} rows kept, the index has n_rows"
                            f" {self.manifest['n_rows']}")
        problems += self._projection_problems()
        return problems

    def _projection_problems(self) -> list[str]:
        proj = self.manifest.get("projection")
        if not isinstance(proj, dict) or not isinstance(proj.get("modules"), dict):
            return ["no projection description (projection.modules): queries cannot be projected like the rows"]
        if "projection_sha256" not in self.manifest:
            return [f"no projection_sha256 (format_version {self.manifest['format_version']}): the projection"
                    " the rows were made with cannot be checked"]
        from gradian.curvature.allocation import allocation_problems

        problems = allocation_problems(self.index_dir, proj)
        try:
            shapes = {n: tuple(e["shape"]) for n, e in proj["modules"].items()}
            projector = Projector.from_description(shapes, proj, self.index_dir)
        except IndexIntegrityError as err:  # the whitened projection's file, named as a shard would be
            return [*problems, str(err).split(f"; {REBUILD}")[0]]
        except (KeyError, TypeError, ValueError) as err:
            return [*problems, f"projection {proj.get('kind')!r} (dim {proj.get('projection_dim')}) is not valid: {err}"]
        width, how = self.row_format.projection_width(projector)
        if self.manifest.get("row_width") != width:
            problems.append(f"row_width {self.manifest.get('row_width')} is not the projection's width {width}{how}")
        fingerprint = projection_fingerprint(projector)
        if fingerprint != self.manifest["projection_sha256"]:
            problems.append(f"projection_sha256 {str(self.manifest['projection_sha256'])[:12]}… is not that of the"
                            f" matrices the manifest's projection (kind {proj.get('kind')}, dim"
                            f" {proj.get('projection_dim')}, seed {proj.get('seed')}) generates ({fingerprint[:12]}…):"
                            " the projection settings were edited")
        return problems

    def source_positions(self, row_ids: list[int]) -> dict[int, int]:
        """row id -> its position in the data (JSONL line or table row index), read from the
        `sources` tensor of the shards that hold those rows; rows of shards without it are left out."""
        from safetensors import safe_open

        per_shard = self.manifest.get("rows_per_shard") or 1
        by_shard: dict[int, list[int]] = {}
        for r in row_ids:
            by_shard.setdefault(r // per_shard, []).append(r)
        out: dict[int, int] = {}
        for k, wanted in by_shard.items():
            entry = self.manifest["shards"].get(shard_name(k))
            if entry is None:
                continue
            with safe_open(str(confined_path(self.index_dir, shard_name(k))), framework="pt") as fh:
                if "sources" not in fh.keys():
                    continue
                sources = fh.get_tensor("sources")
            first = entry["rows"][0]
            out.update({r: int(sources[r - first]) for r in wanted})
        return out

    def summary(self) -> dict[str, Any]:
        """Header, shard count, rows stored, bytes on disk, and why it is incomplete (if it is)."""
        shards = self.manifest["shards"]
        stored = sum(e["rows"][1] - e["rows"][0] for e in shards.values())
        header = {k: v for k, v in self.manifest.items() if k != "shards"}
        missing = self.missing()
        return {**header, "complete": self.manifest["complete"] and not missing, "missing": missing,
                "manifest_complete": self.manifest["complete"],
                "n_shard_files": len(shards), "shard_files": sorted(shards), "rows_stored": stored,
                "bytes": sum(e["bytes"] for e in shards.values()) + (self.index_dir / MANIFEST).stat().st_size
                + ((self.manifest.get("curvature") or {}).get("bytes") or 0)
                + (self.whitening or {}).get("bytes", 0)}

    @property
    def whitening(self) -> dict[str, Any] | None:
        """The whitened projection's record (file, sha256, bytes, damping), or None for other kinds."""
        proj = self.manifest.get("projection")
        record = proj.get("whitening") if isinstance(proj, dict) else None
        return record if isinstance(record, dict) else None
