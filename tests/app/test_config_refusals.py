"""Config values refused before anything runs: every float key of the schema refuses NaN and ±infinity
(found by walking the dataclasses), the data counts have upper bounds, every numeric flag of every command
refuses NaN, infinity and out-of-range values, and a data_params key the task does not read is an error.
"""

from __future__ import annotations

import dataclasses
import math
import subprocess
import sys
import types
import typing

import pytest

from circuitkit.core.config import ConfigError
from circuitkit_app.config import AppConfig, compose, validate
from circuitkit_app.gradian_cli import main
from tests.gradian.curvature.test_kfac import DIM, ROWS, _cfg  # noqa: F401  (the 20 rows and config of the K-FAC tests)
from tests.helpers.refusals import (
    SMALL,
    _log_to_this_tests_stderr,  # noqa: F401  (autouse: loggers on this test's stderr)
    _one_error,
    invoke,
)


def _capsys_error_line(capsys) -> str:
    """The one error line on stderr (no traceback)."""
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    lines = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1, err
    return lines[0]


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
    assert "pruning.mask_penalty" in _capsys_error_line(capsys)
    assert not (tmp_path / "idx").exists()


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


def _sweep_commands():
    """(entry, base argv, parser) of every command whose numeric options the sweep covers: the parsers
    are the commands' own, so a numeric option added later is swept (and must declare its range)."""
    from circuitkit.core.flags import subparser
    from circuitkit.discovery.export import hf, interop, mib
    from gradian.cli import _parser

    gradian = _parser()
    return [
        ("gradian", ["attribute", "--index", "IDX", "--eval-dataset", "EVAL.jsonl"], subparser(gradian, "attribute")),
        ("gradian", ["rank", "--index", "IDX", "--queries", "Q.jsonl"], subparser(gradian, "rank")),
        ("gradian", ["diagnose", "--dataset", "TRAIN.jsonl"], subparser(gradian, "diagnose")),
        ("gradian", ["inspect", "IDX"], subparser(gradian, "inspect")),
        ("circuitkit", ["export", "SRC.pt", "OUT.json"], interop.export_parser()),
        ("circuitkit", ["export", "SRC.pt", "OUT", "--format", "mib", "--model", "gpt2"], mib.export_parser()),
        ("circuitkit", ["export", "SRC.pt", "OUT", "--format", "hf"], hf.export_parser()),
    ]


def _bad_values(action) -> list[str]:
    b = action.bounds
    values = ["nan", "inf", "-inf", "1e400"] if action.type is float else []
    low = b.ge if b.ge is not None else b.gt
    if low is not None:
        values.append(str(int(low) - 1) if action.type is int else repr(float(low) - (1.0 if b.ge is not None else 0)))
    if b.le is not None:
        values.append("9" * 400 if action.type is int else repr(float(b.le) * 10))
    return values


def _sweep_cases():
    from circuitkit.core.flags import flag_name, numeric_actions

    cases = []
    for entry, base, parser in _sweep_commands():
        for action in numeric_actions(parser):
            assert hasattr(action, "bounds"), f"{entry} {base[0]} {flag_name(action)} declares no range"
            for value in _bad_values(action):
                cases.append(pytest.param(entry, [*base, f"{flag_name(action)}={value}"], flag_name(action),
                                          id=f"{entry}-{base[0]}{'-' + base[-1] if '--format' in base else ''}"
                                             f"-{flag_name(action)}={value[:12]}"))
    return cases


def test_the_sweep_covers_every_numeric_option():
    from circuitkit.core.flags import flag_name, numeric_actions

    flags = {(base[0], flag_name(a)) for _, base, parser in _sweep_commands() for a in numeric_actions(parser)}
    assert {("attribute", "--lr"), ("attribute", "--seed"), ("attribute", "--lora-alpha"), ("rank", "--damping"),
            ("rank", "--top-k"), ("diagnose", "--max-seq-length"), ("export", "--d-model")} <= flags
    assert len(_sweep_cases()) >= 2 * len(flags)


@pytest.mark.parametrize(("entry", "argv", "flag"), _sweep_cases())
def test_every_numeric_flag_refuses_nan_infinity_and_out_of_range(entry, argv, flag, tmp_path, monkeypatch,
                                                                  capsys, no_load):
    from circuitkit_app.cli import main as circuitkit_main
    from circuitkit_app.gradian_cli import main as gradian_main

    monkeypatch.chdir(tmp_path)
    capsys.readouterr()
    code = (gradian_main if entry == "gradian" else circuitkit_main)(argv)
    line = _one_error(capsys.readouterr().err)
    value = argv[-1].split("=", 1)[1].replace("1e400", "inf")  # parsed as float: it is infinity
    assert code == 2 and line.startswith(f"error: {flag} ") and "it must be" in line, (code, line)
    assert len(line) < 300 and (value in line or len(value) > 24)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(("overrides", "key"), [
    (["discovery.task=ioi", "discovery.data_params.corruption=name_swap"], "discovery.data_params.corruption"),
    (["discovery.task=induction", "discovery.data_params.ioi_corruption=abc"], "discovery.data_params.ioi_corruption"),
    (["discovery.task=ioi", "discovery.data_params.induction_format=single"], "discovery.data_params.induction_format"),
    (["discovery.task=induction", "discovery.data_params.induction_format=single",
      "discovery.data_params.induction_corruption=fresh"], "discovery.data_params.induction_corruption"),
    (["discovery.task=greater_than", "discovery.data_params.data_path=mine.jsonl"], "discovery.data_params.data_path"),
    (["discovery.task=jsonl", "discovery.data_params.min_valid_share=0.9"], "discovery.data_params.min_valid_share"),
])
def test_a_data_params_key_the_task_does_not_read_is_a_config_error(overrides, key, tmp_path, capsys):
    code, _, err = invoke("run", [*SMALL, "stages=[data]", *overrides, f"hydra.run.dir={tmp_path / 'run'}"], capsys)
    line = _one_error(err)
    assert code == 2 and line.startswith(f"error: {key}=") and "does not apply to discovery.task=" in line, line
    assert not (tmp_path / "run").exists()
