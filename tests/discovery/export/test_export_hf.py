"""`circuitkit export --format hf`: a pruned checkpoint that plain transformers loads.

Oracle per family: the exported model, loaded with AutoModelForCausalLM (no CircuitKit code,
trust_remote_code off), gives the logits of the base model run with the Evaluator's ablation
hooks (`ablate_heads`, the removed heads' z replaced by their mean vector or by 0) to 1e-5 in
float32; on a pipeline run its task metric is the circuit metric the pruning stage reported for
that ablation (circuit.pt weight_ablations).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from circuitkit.core.circuit_file import Circuit, load_circuit, save_circuit
from circuitkit.core.errors import UserError
from circuitkit.discovery.export.hf import PROVENANCE_FILE, ExportError, export_hf
from circuitkit.discovery.pruning.heads import ablate_heads
from circuitkit.models.config import ModelConfig
from circuitkit.models.loading import load_model

FAMILY_FIXTURES = ("tiny-gpt2", "tiny-neox", "tiny-neox-seq", "tiny-llama", "tiny-gemma3", "tiny-gemma3-cg",
                   "tiny-qwen3", "tiny-qwen3-moe")
CPU = torch.device("cpu")


def _load(name: str):
    return load_model(ModelConfig(name=f"builtin:{name}", precision="float32"), device=CPU)


def _circuit(loaded, path, means: bool = True) -> Circuit:
    """Layer 0 keeps only head 1; layer 1 keeps heads 0 and 1: with 4 heads in 2 KV groups, KV
    group 1 (heads 2, 3) is removed in both layers, so it can be cut."""
    a = loaded.adapter
    mask = torch.ones(a.n_layers, a.n_heads, dtype=torch.bool)
    mask[0, [0, 2, 3]] = False
    mask[1, [2, 3]] = False
    torch.manual_seed(0)
    c = Circuit(model_name=loaded.name, head_mask=mask, head_scores=torch.randn(a.n_layers, a.n_heads),
                graph={"n_layers": a.n_layers, "n_heads": a.n_heads, "n_kv_heads": a.n_kv_heads,
                       "parallel_residual": a.parallel_residual},
                head_means=torch.randn(a.n_layers, a.n_heads * a.head_dim) if means else None,
                ablation="corrupted", config={"model": {"name": loaded.name, "precision": "float32"}})
    save_circuit(path, c)
    return c


def _ids(vocab: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randint(3, vocab, (2, 12), generator=g)


def _exported_logits(out_dir, ids):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out_dir, trust_remote_code=False, dtype=torch.float32)
    with torch.no_grad():
        return model(input_ids=ids).logits, model


@pytest.mark.parametrize("name", FAMILY_FIXTURES)
@pytest.mark.parametrize("ablation", ["mean", "zero"])
def test_exported_logits_match_the_ablated_forward(name, ablation, tmp_path):
    loaded = _load(name)
    circuit = _circuit(loaded, tmp_path / "circuit.pt")
    ids = _ids(loaded.adapter.vocab_size)
    a = loaded.adapter
    values = ([m[None, None] for m in circuit.head_means] if ablation == "mean" else [None] * a.n_layers)
    with torch.no_grad(), ablate_heads(a, ~circuit.head_mask, values):
        expected = loaded.model(input_ids=ids).logits
    prov = export_hf(tmp_path / "circuit.pt", tmp_path / "out", ablation)  # loads its own copy
    got, model = _exported_logits(tmp_path / "out", ids)
    assert (got - expected).abs().max().item() < 1e-5
    assert prov["n_heads_removed"] == 5 and json.loads((tmp_path / "out" / PROVENANCE_FILE).read_text())["ablation"] == ablation
    cut = prov["physically_removed"]
    if a.kv_groups_removable is None:  # separate Q/K/V, head_dim in the config: group 1 is cut everywhere
        assert cut["kv_groups_per_layer"] == 1 and cut["why_not"] is None
        if ablation == "zero":
            assert prov["params_after"] < prov["params_before"]
        text = getattr(model.config, "text_config", None) or model.config
        assert (text.num_attention_heads, text.num_key_value_heads) == (2, 1)
        assert len(prov["zeroed_only_heads"]) == 1  # layer 0 head 0: its group keeps head 1
    else:
        assert cut["kv_groups_per_layer"] == 0 and "zeroed" in cut["why_not"]
        assert prov["params_after"] == prov["params_before"]  # GPT-NeoX's biases exist already


def test_a_cut_checkpoint_is_smaller_and_reloads(tmp_path):
    loaded = _load("tiny-llama")
    _circuit(loaded, tmp_path / "circuit.pt")
    base = _load("tiny-llama").model
    prov = export_hf(tmp_path / "circuit.pt", tmp_path / "out", "zero")
    _, model = _exported_logits(tmp_path / "out", _ids(loaded.adapter.vocab_size))
    # per layer: 2 of 4 query heads and 1 of 2 KV heads, head_dim 16, d_model 64 -> q, o: 2*16*64; k, v: 16*64
    saved = 2 * (2 * 2 * 16 * 64 + 2 * 16 * 64)
    assert prov["params_before"] == sum(p.numel() for p in base.parameters())
    assert prov["params_after"] == prov["params_before"] - saved == sum(p.numel() for p in model.parameters())
    assert prov["param_bytes_after"] == prov["param_bytes_before"] - 4 * saved
    src = sum(p.stat().st_size for p in Path(loaded.path).glob("*.safetensors"))
    assert prov["safetensors_bytes"] < src


def test_gpt2_is_zeroed_not_cut_and_says_why(tmp_path):
    """transformers 5 dropped config.pruned_heads, and GPT-2's head_dim is n_embd / n_head: no
    layer can hold fewer heads, so removed heads are zeroed and the provenance says so."""
    loaded = _load("tiny-gpt2")
    _circuit(loaded, tmp_path / "circuit.pt")
    prov = export_hf(tmp_path / "circuit.pt", tmp_path / "out", "mean")
    assert prov["params_after"] == prov["params_before"] and prov["physically_removed"]["cut"] == []
    assert "pruned_heads" in prov["physically_removed"]["why_not"]
    assert len(prov["zeroed_only_heads"]) == 5 and prov["zeroed_params"] == 5 * 16 * 64
    assert len(prov["base_model"]["weights_sha256"]) == 64 != prov["exported_weights_sha256"]


def test_mean_export_adds_a_zero_qkv_bias_where_the_config_adds_one(tmp_path):
    loaded = _load("tiny-llama")
    _circuit(loaded, tmp_path / "circuit.pt")
    prov = export_hf(tmp_path / "circuit.pt", tmp_path / "out", "mean")
    assert prov["config_changes"]["attention_bias"] is True
    assert json.loads((tmp_path / "out" / "config.json").read_text())["attention_bias"] is True


def _cli(argv):
    from circuitkit_app.cli import main

    return main(argv)


def test_bad_inputs_get_one_line(tmp_path, capsys):
    loaded = _load("tiny-gpt2")
    c = _circuit(loaded, tmp_path / "circuit.pt")
    assert _cli(["export", str(tmp_path / "circuit.pt"), "--format", "hf", str(tmp_path / "o"),
                 "--ablation", "counterfactual"]) == 2
    assert "is not one weights can hold" in capsys.readouterr().err
    # a circuit for another model: GPT-2's 4 KV heads against tiny-llama's 2
    assert _cli(["export", str(tmp_path / "circuit.pt"), "--format", "hf", str(tmp_path / "o"),
                 "--model", "builtin:tiny-llama"]) == 2
    err = capsys.readouterr().err
    assert "4 KV heads" in err and "Traceback" not in err
    for mask, text in ((torch.zeros_like(c.head_mask), "keeps no head"), (torch.ones_like(c.head_mask),
                                                                         "removes no head")):
        save_circuit(tmp_path / "c2.pt", Circuit(**{**{k: getattr(c, k) for k in ("model_name", "head_scores",
                                                                                  "graph", "config")},
                                                 "head_mask": mask}))
        assert _cli(["export", str(tmp_path / "c2.pt"), "--format", "hf", str(tmp_path / "o")]) == 1
        assert text in capsys.readouterr().err
    no_means = _circuit(loaded, tmp_path / "c3.pt", means=False)
    assert no_means.head_means is None
    with pytest.raises(ExportError, match="holds no per-head means"):
        export_hf(tmp_path / "c3.pt", tmp_path / "o", "mean")


def test_qwen2_mean_is_refused_zero_exports(tmp_path):
    loaded = _load("tiny-qwen2")
    c = _circuit(loaded, tmp_path / "circuit.pt")
    with pytest.raises(UserError, match="cannot be folded into Qwen2"):
        export_hf(tmp_path / "circuit.pt", tmp_path / "out", "mean")
    export_hf(tmp_path / "circuit.pt", tmp_path / "out", "zero")
    ids = _ids(loaded.adapter.vocab_size)
    with torch.no_grad(), ablate_heads(loaded.adapter, ~c.head_mask, [None, None]):
        expected = loaded.model(input_ids=ids).logits
    got, _ = _exported_logits(tmp_path / "out", ids)
    assert (got - expected).abs().max().item() < 1e-5


def _held_out_metric(model, base, held, metric: str) -> float:
    from circuitkit.discovery.attribution.metrics import answer_forward, compute_metric

    total = 0.0
    for batch in held.batches(4):
        clean = answer_forward(base, batch.clean_ids, batch.attention_mask, batch.answer_pos).float()
        logits = answer_forward(model, batch.clean_ids, batch.attention_mask, batch.answer_pos)
        total += compute_metric(metric, logits, batch, clean).sum().item()
    return total / len(held)


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gemma3"])
def test_exported_metric_is_the_reported_weight_ablation_faithfulness(name, tmp_path):
    """The pruning stage's figure for the export's ablation (`weight_ablation_faithfulness`, on
    `head_means` of the attribution examples) is what the exported checkpoint scores."""
    from transformers import AutoModelForCausalLM

    from circuitkit.discovery.config import DataParams
    from circuitkit.discovery.pruning.heads import faithfulness, head_means, weight_ablation_faithfulness
    from circuitkit.discovery.tasks import build_task

    loaded = _load(name)
    data = build_task("ioi", loaded.tokenizer, loaded.path, DataParams(), 16, 0)
    attr, held = data[:8], data[8:]
    c = _circuit(loaded, tmp_path / "circuit.pt")
    c.head_means = head_means(loaded.adapter, attr, 4)
    c.weight_ablations = weight_ablation_faithfulness(loaded.adapter, held, "logit_diff", c.head_mask, c.head_means, 4,
                                                      ("corrupted", 0.5))
    save_circuit(tmp_path / "circuit.pt", c)
    prov = export_hf(tmp_path / "circuit.pt", tmp_path / "out", "mean")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32)
    w = c.weight_ablations["mean"]
    m = _held_out_metric(model, loaded.model, held, "logit_diff")
    assert m == pytest.approx(w["circuit"], abs=1e-4) and w["circuit"] != pytest.approx(w["full"], abs=1e-3)
    assert faithfulness(m, w["full"], w["empty"]) == pytest.approx(prov["faithfulness"]["faithfulness"], abs=1e-4)
    assert prov["faithfulness"]["reference_faithfulness"] == 0.5


@pytest.mark.slow
@pytest.mark.parametrize("fixture", ["tiny-gpt2", "tiny-llama"])
def test_pipeline_export_metric_is_the_reported_faithfulness(fixture, tmp_path):
    """stages ... pruning, export: the exported model's held-out metric is the circuit metric the
    pruning stage reported under the export's ablation, and so is its faithfulness."""
    from transformers import AutoModelForCausalLM

    from circuitkit.discovery.pruning.heads import faithfulness
    from circuitkit.discovery.stages import _read_task_data
    from circuitkit_app.config import compose
    from circuitkit_app.stage_list import run_pipeline

    _, cfg = compose([f"model.name=builtin:{fixture}", "model.precision=float32",
                      "stages=[data,attribution,pruning,export]", "discovery.task=ioi", "discovery.ig_steps=1",
                      "discovery.data_params.num_examples=8", "discovery.data_params.eval_examples=8",
                      "discovery.batch_size=4", "pruning.target_sparsity=0.5", "pruning.graph=false",
                      "pruning.bootstrap_resamples=0", "export.format=hf", "report.enabled=false"])
    manifest = run_pipeline(cfg, tmp_path)
    assert manifest["stages"]["export"]["status"] == "ok"
    w = load_circuit(tmp_path / "circuit.pt").weight_ablations
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "pruned_model", dtype=torch.float32)
    base = _load(fixture).model
    data, n_attr = _read_task_data(tmp_path / "data.safetensors")
    held = data[n_attr:]
    m = _held_out_metric(model, base, held, cfg.discovery.metric)
    assert m == pytest.approx(w["mean"]["circuit"], abs=1e-4)
    assert faithfulness(m, w["mean"]["full"], w["mean"]["empty"]) == pytest.approx(w["mean"]["faithfulness"], abs=1e-4)
    prov = json.loads((tmp_path / "pruned_model" / PROVENANCE_FILE).read_text())
    assert prov["faithfulness"]["faithfulness"] == w["mean"]["faithfulness"]
    assert prov["faithfulness"]["reference_ablation"] == "corrupted"


def test_export_is_off_by_default(tmp_path):
    from circuitkit_app.config import compose

    _, cfg = compose([])
    assert cfg.export.format is None and "export" in cfg.stages
