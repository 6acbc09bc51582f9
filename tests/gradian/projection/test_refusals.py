"""An index's stored projection files (``allocation.json`` of grads.width_allocation=spectrum,
``projection.safetensors`` of grads.projection=whitened) edited, not JSON, a byte flipped, or replaced by a
link to a same-bytes copy outside the index: `gradian rank`, a resume and `gradian inspect --verify` refuse
with exit 1 and one error line naming the file and what is wrong, before the model loads.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest

from circuitkit.core.recorded import IndexIntegrityError
from circuitkit_app.gradian_cli import main
from gradian.build.indexer import build_index
from gradian.curvature.allocation import ALLOCATION_FILE
from gradian.curvature.factors import CURVATURE_FILE
from gradian.index.reader import IndexReader
from gradian.projection.projector import WHITENING_FILE
from tests.gradian.curvature.test_kfac import DIM, ROWS, _cfg  # noqa: F401  (the 20 rows and config of the K-FAC tests)

# One index holds both stored projection files: the whitened matrices and the spectrum widths.
ARGS = ("grads.projection=whitened", "grads.width_allocation=spectrum", "grads.rows_per_shard=7")


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("stored-projection")
    cfg = _cfg(root, *ARGS)
    build_index(cfg.model, cfg.grads, root / "index")
    assert IndexReader(root / "index").verify() == []
    return root


@pytest.fixture
def no_model(monkeypatch):
    """Every refusal here comes before the model loads."""
    import circuitkit.models.loading
    import gradian.build.indexer
    import gradian.rank.ranking

    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the stored files were checked")
    for module in (circuitkit.models.loading, gradian.rank.ranking, gradian.build.indexer):
        monkeypatch.setattr(module, "load_model", refuse)


def _edit_widths(idx: Path) -> None:
    path = idx / ALLOCATION_FILE
    stored = json.loads(path.read_text())
    first = next(iter(stored["widths"]))
    stored["widths"][first] *= 2
    path.write_text(json.dumps(stored))


def _not_json(idx: Path) -> None:
    (idx / ALLOCATION_FILE).write_text("widths: all of them\n")


def _flip_byte(idx: Path) -> None:
    path = idx / WHITENING_FILE
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data))


def _linker(name: str):
    def link(idx: Path) -> None:
        outside = idx.parent / f"outside-{name}"
        shutil.copy(idx / name, outside)  # the same bytes: only where they live is wrong
        (idx / name).unlink()
        os.symlink(outside, idx / name)
    return link


# (tampering, the file the line must name, what it must say)
TAMPERED = {
    "allocation widths edited": (_edit_widths, ALLOCATION_FILE, r"has sha256 .* changed after it was written"),
    "allocation not JSON": (_not_json, ALLOCATION_FILE, r"has sha256 .* changed after it was written"),
    "projection byte flipped": (_flip_byte, WHITENING_FILE, r"has sha256 .* changed after it was written"),
    "projection linked outside": (_linker(WHITENING_FILE), WHITENING_FILE, r"is a link to .*outside-"),
    "allocation linked outside": (_linker(ALLOCATION_FILE), ALLOCATION_FILE, r"is a link to .*outside-"),
}


def _copy(built: Path, tmp_path: Path, case: str) -> Path:
    idx = tmp_path / "idx"
    shutil.copytree(built / "index", idx)
    TAMPERED[case][0](idx)
    return idx


def _one_error(capsys) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    lines = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1, err
    return lines[0]


def _index_argv(root: Path, idx: Path) -> list[str]:
    return ["index", "model.precision=float32", f"grads.projection_dim={DIM}", "grads.storage_dtype=float32",
            f"grads.data_path={root / 'train.jsonl'}", *ARGS, f"grads.index_dir={idx}"]


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and not p.name.endswith(".lock")}


@pytest.mark.parametrize("case", list(TAMPERED))
def test_rank_refuses_a_tampered_projection_file_with_exit_1(case, built, tmp_path, capsys, no_model):
    idx = _copy(built, tmp_path, case)
    queries = tmp_path / "q.jsonl"
    queries.write_text("".join(json.dumps(r) + "\n" for r in ROWS[:2]))
    before = _tree(tmp_path)
    capsys.readouterr()
    code = main(["rank", "--index", str(idx), "--queries", str(queries), "--out", str(tmp_path / "ranked.jsonl")])
    line = _one_error(capsys)
    _, name, what = TAMPERED[case]
    assert code == 1, line
    assert name in line, line
    assert re.search(what, line), line
    assert _tree(tmp_path) == before  # nothing written, nothing changed


@pytest.mark.parametrize("case", list(TAMPERED))
def test_resume_refuses_a_tampered_projection_file_with_exit_1(case, built, tmp_path, capsys, no_model):
    idx = _copy(built, tmp_path, case)
    before = _tree(idx)
    capsys.readouterr()
    code = main(_index_argv(built, idx))
    line = _one_error(capsys)
    _, name, what = TAMPERED[case]
    assert code == 1, line
    assert name in line and re.search(what, line), line
    assert _tree(idx) == before


@pytest.mark.parametrize("case", list(TAMPERED))
def test_inspect_verify_names_the_tampered_file(case, built, tmp_path, capsys):
    idx = _copy(built, tmp_path, case)
    _, name, what = TAMPERED[case]
    problems = IndexReader(idx).verify()
    assert len(problems) == 1 and name in problems[0], problems
    assert re.search(what, problems[0]), problems
    capsys.readouterr()
    assert main(["inspect", str(idx), "--verify"]) == 1
    err = capsys.readouterr().err
    assert f"problem: {problems[0][:40]}" in " ".join(err.split()), err
    summary = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert len(summary) == 1 and f"1 problem(s) (in {name})" in summary[0], err


def test_the_api_raises_the_integrity_error(built, tmp_path):
    """gradian.rank.ranking.rank and build_index raise IndexIntegrityError (a UserError with exit code 1),
    not the mismatch error (exit 2) they raised for a changed projection file."""
    from gradian.rank.ranking import rank

    idx = _copy(built, tmp_path, "projection byte flipped")
    queries = tmp_path / "q.jsonl"
    queries.write_text(json.dumps(ROWS[0]) + "\n")
    with pytest.raises(IndexIntegrityError) as err:
        rank(idx, queries)
    assert err.value.exit_code == 1
    cfg = _cfg(built, *ARGS)
    with pytest.raises(IndexIntegrityError):
        build_index(cfg.model, cfg.grads, idx)


def test_a_curvature_file_linked_outside_is_refused(built, tmp_path, capsys, no_model):
    idx = tmp_path / "idx"
    shutil.copytree(built / "index", idx)
    _linker(CURVATURE_FILE)(idx)
    problems = IndexReader(idx).verify()
    assert any(CURVATURE_FILE in p and "is a link to" in p for p in problems), problems
    queries = tmp_path / "q.jsonl"
    queries.write_text(json.dumps(ROWS[0]) + "\n")
    # The stored files are checked first (before the model); then the curvature, as it is read.
    from gradian.index.curvature import current_record

    with pytest.raises(IndexIntegrityError, match=r"curvature\.safetensors' is a link to"):
        current_record(idx, IndexReader(idx).manifest)


def test_a_manifest_linked_outside_is_refused(built, tmp_path):
    idx = tmp_path / "idx"
    shutil.copytree(built / "index", idx)
    _linker("manifest.json")(idx)
    with pytest.raises(IndexIntegrityError, match=r"manifest.json' is a link to .*outside-manifest.json"):
        IndexReader(idx)
