"""Trust, round three (issue 47, the Gradian and schema half): each hostile input ends in one
error line, the project's exit code (2: a wrong command or config; 1: bad file content) and
nothing written.

* an index's stored projection files (``allocation.json`` of grads.width_allocation=spectrum,
  ``projection.safetensors`` of grads.projection=whitened) edited, not JSON, a byte flipped, or
  replaced by a link to a same-bytes copy outside the index: `gradian rank`, a resume and
  `gradian inspect --verify` refuse with exit 1, naming the file and what is wrong;
* every float key of the schema refuses NaN and ±infinity (found by walking the dataclasses);
* the data_params counts have upper bounds (ioi's held-out templates at 1000000 ran for ever).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import shutil
import subprocess
import sys
import types
import typing
from pathlib import Path

import pytest

from circuitkit.core.config import ConfigError
from circuitkit_app.config import AppConfig, compose, validate
from circuitkit_app.gradian_cli import main
from gradian.build.indexer import build_index
from gradian.curvature.allocation import ALLOCATION_FILE
from gradian.curvature.factors import CURVATURE_FILE
from gradian.index.manifest import IndexIntegrityError
from gradian.index.reader import IndexReader
from gradian.projection.projector import WHITENING_FILE
from tests.gradian.curvature.test_kfac import DIM, ROWS, _cfg  # noqa: F401  (the 20 rows and config of the K-FAC tests)

# One index holds both stored projection files: the whitened matrices and the spectrum widths.
ARGS = ("grads.projection=whitened", "grads.width_allocation=spectrum", "grads.rows_per_shard=7")


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("round3")
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


# ----------------------------------------------------------------------------- tampering


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


# ----------------------------------------------------------------------------- the schema's floats


def _float_keys(cls: type = AppConfig, prefix: str = "") -> list[tuple[str, dict]]:
    """(dotted key, metadata) of every float field of every config group, nested groups included."""
    out = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        optional = typing.get_origin(tp) in (typing.Union, types.UnionType) and len(args) == 1
        base = args[0] if optional else tp  # Optional[float] is a float key too
        if dataclasses.is_dataclass(base):
            out += _float_keys(base, f"{prefix}{f.name}.")
        elif base is float:
            out.append((f"{prefix}{f.name}", dict(f.metadata)))
    return out


FLOAT_KEYS = _float_keys()


def _nested(key: str, value) -> dict:
    out: dict = value
    for part in reversed(key.split(".")):
        out = {part: out}
    return out


def test_the_sweep_sees_the_float_keys():
    keys = [k for k, _ in FLOAT_KEYS]
    assert {"pruning.mask_lr", "pruning.mask_penalty", "pruning.target_sparsity", "preflight.headroom"} <= set(keys)
    assert len(keys) >= 6


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("key", [k for k, _ in FLOAT_KEYS])
def test_every_float_key_refuses_nan_and_infinity(key, value):
    meta = dict(FLOAT_KEYS)[key]
    if meta.get("finite") is False:  # a key whose doc allows them (none today)
        pytest.skip(f"{key} documents NaN / infinity")
    with pytest.raises(ConfigError, match=rf"Config key '{key}' = -?(nan|inf) is not a finite number") as err:
        validate(_nested(key, value))
    assert err.value.exit_code == 2
    # The same through the command line's overrides (Hydra reads nan, inf, -inf as floats).
    with pytest.raises(ConfigError, match=rf"'{key}'"):
        compose([f"{key}={value}"])


def test_finite_values_still_pass():
    cfg = validate({"pruning": {"mask_lr": 0.5, "mask_penalty": 2}, "preflight": {"headroom": 1}})
    assert cfg.pruning.mask_lr == 0.5 and cfg.pruning.mask_penalty == 2.0 and cfg.preflight.headroom == 1.0
    with pytest.raises(ConfigError, match="is not a finite number"):  # an integer past float's range
        validate({"pruning": {"mask_penalty": 10 ** 400}})


def test_a_mask_lr_of_inf_exits_2_before_anything_runs(tmp_path, capsys):
    proc = subprocess.run([sys.executable, "-m", "circuitkit.run", "pruning.selection=mask", "pruning.mask_lr=inf",
                           f"hydra.run.dir={tmp_path}/run"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "pruning.mask_lr" in proc.stderr and "not a finite number" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "run").exists()
    capsys.readouterr()
    assert main(["index", "pruning.mask_penalty=nan", f"grads.index_dir={tmp_path / 'idx'}"]) == 2
    assert "pruning.mask_penalty" in _one_error(capsys)
    assert not (tmp_path / "idx").exists()


# ----------------------------------------------------------------------------- the data counts


@pytest.mark.parametrize("key, too_many, most", [
    ("discovery.data_params.heldout_template_examples", 1_000_000, 100_000),
    ("discovery.data_params.eval_examples", 1_000_000, 100_000),
    ("discovery.data_params.num_examples", 10_000_000, 1_000_000),
])
def test_the_data_counts_are_bounded(key, too_many, most):
    with pytest.raises(ConfigError, match=rf"'{key}' = {too_many} is out of range; it must be .*<= {most}"):
        compose(["discovery.task=ioi", f"{key}={too_many}"])
    compose(["discovery.task=ioi", f"{key}={most}"])  # the bound itself is allowed


def test_the_ioi_run_that_never_ended_exits_2(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "circuitkit.run", "discovery.task=ioi",
                           "discovery.data_params.num_examples=4", "discovery.data_params.eval_examples=4",
                           "discovery.data_params.heldout_template_examples=1000000",
                           f"hydra.run.dir={tmp_path}/run"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "heldout_template_examples" in proc.stderr and "<= 100000" in proc.stderr, proc.stderr
    assert not (tmp_path / "run").exists()
