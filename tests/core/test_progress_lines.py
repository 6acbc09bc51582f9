"""Long work talks in logs: with stderr not a terminal, `gradian attribute` and the pipeline's stages
print plain progress lines (what is being done first, then done of total, pace and time left), and
never a terminal control code. The interval is $CIRCUITKIT_PROGRESS_EVERY_S, 0 here: every step prints.
"""

from __future__ import annotations

import importlib
import os
import re
import subprocess
import sys

import pytest

from circuitkit.core.progress import EVERY_ENV, log_every_s

SMALL = ["discovery.data_params.num_examples=8", "discovery.data_params.eval_examples=4",
         "discovery.data_params.seq_len=16", "model.precision=float32", "discovery.batch_size=2"]


def test_the_interval_is_read_from_the_environment(monkeypatch) -> None:
    monkeypatch.setenv(EVERY_ENV, "0.5")
    assert log_every_s() == 0.5
    monkeypatch.setenv(EVERY_ENV, "soon")
    assert log_every_s() == 10.0


def test_a_pipeline_stage_logs_its_start_its_batches_and_its_end(tmp_path) -> None:
    proc = subprocess.run([sys.executable, "-m", "circuitkit.run", "stages=[data,attribution]",
                           f"hydra.run.dir={tmp_path / 'run'}", *SMALL], capture_output=True, text=True, timeout=600,
                          env={**os.environ, EVERY_ENV: "0", "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    err = proc.stderr
    assert "\x1b" not in err  # a log, not a terminal: no control codes
    assert "stage data: started" in err and "stage attribution: started" in err
    assert re.search(r"^stage attribution: ok in \d+s$", err, re.M), err[-2000:]
    # 8 examples in batches of 2: the first line says what is built, then one line per batch
    assert re.search(r"^scoring every \w+ with [\w-]+: 4 batches to go$", err, re.M), err[-2000:]
    done = re.findall(r"^scoring every \w+ with [\w-]+: (\d) of 4 batches \(\d+%\), [\d.e+]+ batches/s", err, re.M)
    assert done == ["1", "2", "3", "4"], err[-2000:]


def _planted_module():
    pytest.importorskip("peft")
    return importlib.import_module("tests.gradian.attribute.test_attribute")


planted = _planted_module()
models, work = planted.models, planted.work  # its fixtures: the trained models, the indexes, the eval set


def test_gradian_attribute_logs_each_long_step(work, capfd, monkeypatch) -> None:
    monkeypatch.setenv(EVERY_ENV, "0")
    assert planted.main(["attribute", "--index", str(work["index"]), "--eval-dataset", str(work["eval"]),
                         "--top-k", "4", "--span-min-tokens", "0"]) == 0
    err = capfd.readouterr().err
    assert "\x1b" not in err
    lines = err.splitlines()
    for first in ("scoring the eval set on the tuned model: 24 items to go",
                  "scoring the eval set on the base model: 24 items to go",
                  "query gradients of the 8 regressed items (contrastive): 8 items to go",
                  "scoring every indexed row (ekfac) from the shards: 22 rows to go"):
        assert first in lines, first
    for done in (r"scoring the eval set on the tuned model: 24 of 24 items \(100%\), [\d.e+]+ items/s",
                 r"query gradients of the 8 regressed items \(contrastive\): 8 of 8 items \(100%\)",
                 r"scoring every indexed row \(ekfac\) from the shards: 22 of 22 rows \(100%\)"):
        assert any(re.fullmatch(done + r".*", line) for line in lines), (done, err[-3000:])
