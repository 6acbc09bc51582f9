"""`model.adapter`: a PEFT LoRA adapter on top of the model, in circuit discovery and in Gradian.

The adapters are made here in a second (peft's get_peft_model on the tiny fixtures, random
non-zero lora_B, save_pretrained), so no hub and no training run is needed.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from circuitkit.models.config import ModelConfig
from circuitkit.models.linear_modules import linear_module_shapes, module_shapes, select_modules
from circuitkit.models.loading import check_model, load_base_model, load_model, model_source
from circuitkit.models.lora import AdapterError, lora_linear_shapes, read_adapter, require_peft
from circuitkit_app.config import compose
from gradian.capture.gradients import per_example_gradients
from gradian.projection.projector import Projector

peft = pytest.importorskip("peft")

CPU = torch.device("cpu")
ROWS = [{"prompt": f"The {s} ", "completion": f"{v} in the {p} {i}."}
        for i, (s, v, p) in enumerate((s, v, p) for v in ("runs", "sleeps") for p in ("garden", "forest")
                                      for s in ("cat", "dog", "bird", "fish", "horse"))]  # 20 distinct rows


def make_adapter(fixture: str, out: Path, targets: list[str], seed: int, model=None) -> Path:
    """A LoRA adapter (r 4, alpha 8) with random non-zero A and B, saved as save_pretrained does."""
    from transformers import AutoModelForCausalLM

    from circuitkit.fixtures.models import ensure_fixture

    torch.manual_seed(seed)
    model = model if model is not None else AutoModelForCausalLM.from_pretrained(ensure_fixture(fixture))
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False,
                             fan_in_fan_out=fixture == "tiny-gpt2")
    with warnings.catch_warnings():  # peft 0.21 asks transformers 5 a deprecated question
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing", category=FutureWarning)
        peft.get_peft_model(model, config).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def adapters(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    return {"a": make_adapter("tiny-gpt2", root / "lora-a", ["c_attn", "c_fc"], seed=1),
            "b": make_adapter("tiny-gpt2", root / "lora-b", ["c_attn", "c_fc"], seed=2)}


def _cfg(adapter: Path | None = None, **kw) -> ModelConfig:
    return ModelConfig(name="builtin:tiny-gpt2", precision="float32", adapter=None if adapter is None else str(adapter),
                       **kw)


# ----------------------------------------------------------------------------- loading


def test_the_merged_and_kept_views_compute_the_adapted_model(adapters) -> None:
    base, merged = load_model(_cfg(), CPU), load_model(_cfg(adapters["a"]), CPU)
    kept = load_model(_cfg(adapters["a"]), CPU, keep_adapter=True)
    ids = torch.randint(5, 250, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = [lm.model(input_ids=ids).logits for lm in (base, merged, kept)]
    assert (logits[0] - logits[1]).abs().max() > 0.05  # the adapter changes the model
    torch.testing.assert_close(logits[1], logits[2], rtol=0, atol=1e-5)  # merged = kept, to round-off
    assert merged.lora == kept.lora and kept.adapter_kept and not merged.adapter_kept and base.lora is None
    # the merged view is a plain model: no PEFT layer is left for the families to trip on
    assert not any("lora" in n for n, _ in merged.model.named_modules())
    assert merged.adapter.n_layers == kept.adapter.n_layers == 2
    assert not any(p.requires_grad for p in kept.model.parameters())


def test_the_manifest_record_names_the_adapter(adapters) -> None:
    record = read_adapter(str(adapters["a"])).record()
    weights = adapters["a"] / "adapter_model.safetensors"
    assert record["name"] == "lora-a" and record["path"] == str(adapters["a"].resolve())
    assert record["weights_sha256"] == hashlib.sha256(weights.read_bytes()).hexdigest()
    assert (record["r"], record["lora_alpha"], record["target_modules"]) == (4, 8, ["c_attn", "c_fc"])
    assert record["base_model_name_or_path"].endswith("tiny-gpt2-v1") and record["peft_type"] == "LORA"
    source = model_source(_cfg(adapters["a"], base_name="builtin:tiny-gpt2"))
    assert source["adapter"] == record and source["base_name"] == "builtin:tiny-gpt2"


# ----------------------------------------------------------------------------- refusals


def test_a_missing_directory_and_missing_peft_are_one_line(tmp_path, monkeypatch) -> None:
    with pytest.raises(AdapterError, match=r"model.adapter='/nowhere/lora' does not exist") as err:
        check_model(_cfg(Path("/nowhere/lora")))
    assert err.value.exit_code == 2 and "\n" not in str(err.value)
    (tmp_path / "full").mkdir()
    with pytest.raises(AdapterError, match="not a PEFT adapter directory: it has no adapter_config.json"):
        load_model(_cfg(tmp_path / "full"), CPU)
    monkeypatch.setitem(__import__("sys").modules, "peft", None)  # `import peft` now fails
    with pytest.raises(AdapterError, match=re.escape("pip install 'circuitkit-gradian[peft]'")):
        require_peft()


def test_an_adapter_for_another_base_model_is_refused_naming_both(tmp_path, capsys) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    llama = make_adapter("tiny-llama", tmp_path / "llama-lora", ["q_proj", "v_proj"], seed=3)
    with pytest.raises(AdapterError) as err:
        load_model(_cfg(llama), CPU)
    text = str(err.value)
    assert "made for '" in text and "tiny-llama" in text and "model.name='builtin:tiny-gpt2'" in text
    assert "a module the model does not have" in text and "\n" not in text
    narrow = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=1024))
    narrow.config.name_or_path = "gpt2-narrow"
    small = make_adapter("tiny-gpt2", tmp_path / "narrow-lora", ["c_attn"], seed=4, model=narrow)
    with pytest.raises(AdapterError, match=r"transformer.h.0.attn.c_attn is 192 x 64 \(out x in\) in the model, but"
                                           r" the adapter's lora_B·lora_A is 96 x 32"):
        load_model(_cfg(small), CPU)
    # the command line: exit code 2 and one line, no traceback
    from circuitkit_app.gradian_cli import main

    code = main(["index", "model.name=builtin:tiny-gpt2", f"model.adapter={llama}", "model.precision=float32",
                 f"grads.index_dir={tmp_path / 'idx'}"])
    err_text = capsys.readouterr().err
    assert code == 2 and "does not fit model.name='builtin:tiny-gpt2'" in " ".join(err_text.split())
    assert "Traceback" not in err_text


# ----------------------------------------------------------------------------- Gradian


def test_the_module_filter_reaches_the_lora_linears(adapters) -> None:
    kept = load_model(_cfg(adapters["a"]), CPU, keep_adapter=True)
    names = lambda patterns: [n for n, _ in select_modules(kept.model, kept.adapter, patterns)]  # noqa: E731
    lora = names(["adapter"])
    assert lora == [f"transformer.h.{i}.{m}.{k}" for i in (0, 1) for m in ("attn.c_attn", "mlp.c_fc")
                    for k in ("lora_A", "lora_B")]
    assert names(["lora_B"]) == [n for n in lora if n.endswith("lora_B")]
    assert names(["attn.c_attn"]) == ["transformer.h.0.attn.c_attn", "transformer.h.1.attn.c_attn"]  # base only
    every = names(None)
    assert set(lora) < set(every) and "transformer.h.0.mlp.c_proj" in every
    shapes = module_shapes(select_modules(kept.model, kept.adapter, ["adapter", "mlp.c_fc"]))
    assert shapes["transformer.h.0.mlp.c_fc.lora_A"] == (4, 64) and shapes["transformer.h.0.mlp.c_fc.lora_B"] == (256, 4)
    assert shapes["transformer.h.0.mlp.c_fc"] == (256, 64)
    # the memory estimate names the same modules from the shape and the adapter file alone
    offline = linear_module_shapes(kept.adapter.shape(), ["adapter", "mlp.c_fc"], lora_linear_shapes(read_adapter(str(adapters["a"]))))
    assert offline == shapes
    plain = load_model(_cfg(), CPU)
    with pytest.raises(ValueError, match="names 'adapter', the linears of a LoRA adapter, but the model has no adapter"):
        select_modules(plain.model, plain.adapter, ["adapter"])
    from circuitkit.core.config import ConfigError

    with pytest.raises(ConfigError, match="names 'adapter' .* but model.adapter is null"):
        compose(["grads.module_filter=[adapter]"])


def test_lora_per_example_gradients_equal_autograd(adapters) -> None:
    lm = load_model(_cfg(adapters["a"]), CPU, keep_adapter=True)
    modules = select_modules(lm.model, lm.adapter, ["adapter", "mlp.c_proj"])
    projector = Projector(module_shapes(modules), projection_dim=None)
    g = torch.Generator().manual_seed(5)
    seqs = [torch.randint(5, 250, (n,), generator=g) for n in (9, 14, 17)]
    sup_from = [4, 7, 8]
    t = max(len(s) for s in seqs)
    batch = {"input_ids": torch.zeros(3, t, dtype=torch.long), "attention_mask": torch.zeros(3, t, dtype=torch.long),
             "supervised": torch.zeros(3, t, dtype=torch.bool)}
    for i, (s, k) in enumerate(zip(seqs, sup_from, strict=True)):
        batch["input_ids"][i, :len(s)], batch["attention_mask"][i, :len(s)], batch["supervised"][i, k:len(s)] = s, 1, True
    got = per_example_gradients(lm.model, lm.adapter, modules, projector, batch, loss_reduction="sum", loss="ce")
    from transformers.pytorch_utils import Conv1D

    worst = 0.0
    for b, (seq, k) in enumerate(zip(seqs, sup_from, strict=True)):
        for _, m in modules:
            m.weight.requires_grad_(True)
            m.weight.grad = None
        logits = lm.model(input_ids=seq[None]).logits[0].float()
        F.cross_entropy(logits[k - 1:-1], seq[k:], reduction="sum").backward()
        for name, m in modules:
            exp = (m.weight.grad.T if isinstance(m, Conv1D) else m.weight.grad).flatten()
            assert exp.norm() > 0, name
            worst = max(worst, ((got[name][b] - exp).norm() / exp.norm()).item())
        for _, m in modules:
            m.weight.requires_grad_(False)
            m.weight.grad = None
    assert worst <= 1e-5, worst
    assert [n for n, _ in modules][:2] == ["transformer.h.0.attn.c_attn.lora_A", "transformer.h.0.attn.c_attn.lora_B"]


@pytest.fixture(scope="module")
def adapted_run(adapters, tmp_path_factory):
    """One pipeline run with the adapter: preflight, data, attribution (merged view) and grads (kept view), and
    the same discovery without it."""
    from circuitkit_app.stage_list import run_pipeline

    root = tmp_path_factory.mktemp("adapted")
    data = root / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    small = ["model.precision=float32", "report.enabled=false", "discovery.data_params.num_examples=8",
             "discovery.data_params.eval_examples=4", "discovery.data_params.seq_len=16", "discovery.ig_steps=2"]
    grads = ["grads.module_filter=[adapter]", "grads.projection_dim=16", "grads.preconditioner=none",
             "grads.rows_per_shard=8", "grads.storage_dtype=float32", f"grads.data_path={data}",
             f"grads.index_dir={root / 'index'}"]
    run_pipeline(compose(["stages=[preflight,data,attribution,grads]", f"model.adapter={adapters['a']}", *small, *grads])[1],
                 root / "run")
    run_pipeline(compose(["stages=[data,attribution]", *small])[1], root / "base")
    return root


def test_discovery_runs_on_the_adapted_weights(adapted_run, adapters) -> None:
    from circuitkit.discovery.attribution import load_scores

    adapted = load_scores(adapted_run / "run" / "scores.safetensors").head
    base = load_scores(adapted_run / "base" / "scores.safetensors").head
    assert adapted.shape == base.shape == (2, 4)
    assert (adapted - base).abs().max() > 1e-3 * base.abs().max()  # the adapted weights decide the scores
    manifest = json.loads((adapted_run / "run" / "manifest.json").read_text())
    assert manifest["model_source"]["adapter"] == read_adapter(str(adapters["a"])).record()


def test_gradian_index_and_rank_with_the_adapter(adapted_run, adapters) -> None:
    from gradian.index.manifest import FORMAT_VERSION
    from gradian.index.reader import IndexReader
    from gradian.rank.ranking import rank

    index_dir = adapted_run / "index"
    manifest = IndexReader(index_dir).manifest
    assert manifest["adapter"] == read_adapter(str(adapters["a"])).record()
    assert all(n.endswith(("lora_A", "lora_B")) for n in manifest["projection"]["modules"])
    assert len(manifest["projection"]["modules"]) == 8 and manifest["format_version"] == FORMAT_VERSION
    queries = adapted_run / "queries.jsonl"
    queries.write_text(json.dumps(ROWS[3]) + "\n" + json.dumps(ROWS[12]) + "\n")
    results = rank(index_dir, queries, top_k=3, score="cosine")  # the index's adapter, from its manifest
    firsts = {r["query"]: r for r in results if r["rank"] == 1}
    assert firsts[0]["row_id"] == 3 and firsts[1]["row_id"] == 12
    assert firsts[0]["score"] == pytest.approx(1.0, abs=1e-4)


def test_rank_with_another_adapter_none_or_a_changed_file_is_refused(adapted_run, adapters, tmp_path, capsys) -> None:
    from circuitkit_app.gradian_cli import main
    from gradian.index.manifest import IndexMismatchError
    from gradian.index.reader import IndexReader
    from gradian.rank.checks import asked_adapter
    from gradian.rank.ranking import rank

    index_dir = adapted_run / "index"
    queries = tmp_path / "q.jsonl"
    queries.write_text(json.dumps(ROWS[0]) + "\n")

    def refused(*extra: str) -> str:
        code = main(["rank", "--index", str(index_dir), "--queries", str(queries), *extra])
        text = " ".join(capsys.readouterr().err.split())
        assert code == 2 and "Traceback" not in text, text
        return text

    other = refused("--adapter", str(adapters["b"]))
    assert "built with LoRA adapter 'lora-a'" in other and "weights_sha256: index has" in other
    assert str(adapters["b"].resolve()) in other
    assert "has no adapter" in refused("--adapter", "none")
    with pytest.raises(IndexMismatchError, match="has no adapter"):
        rank(index_dir, queries, model_cfg=_cfg())
    # an index built on a copy, whose weights file then changes
    moved = tmp_path / "lora-copy"
    shutil.copytree(adapters["a"], moved)
    manifest = json.loads((index_dir / "manifest.json").read_text())
    manifest["adapter"]["path"] = str(moved)
    copy_index = tmp_path / "index"
    shutil.copytree(index_dir, copy_index)
    (copy_index / "manifest.json").write_text(json.dumps(manifest))
    weights = moved / "adapter_model.safetensors"
    shutil.copyfile(adapters["b"] / "adapter_model.safetensors", weights)
    with pytest.raises(IndexMismatchError, match=r"the adapter's weights changed since the index was built"):
        rank(copy_index, queries)
    shutil.rmtree(moved)
    with pytest.raises(IndexMismatchError, match="cannot be read now .*Give its directory with --adapter DIR"):
        rank(copy_index, queries)
    # and an index without an adapter refuses one
    plain = IndexReader(index_dir).manifest | {"adapter": None}
    with pytest.raises(IndexMismatchError, match="the index was built on the model without an adapter"):
        asked_adapter(plain, str(adapters["a"]))


# ----------------------------------------------------------------------------- two checkpoints


def test_base_name_is_recorded_and_loads_the_base_model(tmp_path) -> None:
    from circuitkit.models.loading import ModelReferenceError, base_model_config, weights_hash

    cfg = ModelConfig(name="builtin:tiny-gpt2", base_name="builtin:tiny-gpt2", precision="float32")
    check_model(cfg)
    base_cfg = base_model_config(cfg)
    assert (base_cfg.name, base_cfg.base_name, base_cfg.adapter, base_cfg.precision) == (
        "builtin:tiny-gpt2", None, None, "float32")
    assert weights_hash(load_base_model(cfg, CPU).model) == weights_hash(load_model(_cfg(), CPU).model)
    with pytest.raises(ModelReferenceError, match=r"model.base_name='builtin:tiny-llama' \(llama, .*is not the"
                                                  r" architecture of model.name='builtin:tiny-gpt2' \(gpt2"):
        check_model(ModelConfig(name="builtin:tiny-gpt2", base_name="builtin:tiny-llama"))
    with pytest.raises(ModelReferenceError, match="model.base_name="):
        check_model(ModelConfig(name="builtin:tiny-gpt2", base_name=str(tmp_path / "missing")))


def test_only_the_lora_module_imports_peft() -> None:
    repo = Path(__file__).resolve().parents[2]
    importers = sorted(str(p.relative_to(repo)) for folder in ("circuitkit", "circuitkit_app", "gradian")
                       for p in (repo / folder).rglob("*.py")
                       if re.search(r"^\s*(import peft|from peft)", p.read_text(), re.M))
    assert importers == [] or importers == ["circuitkit/models/lora.py"]
    assert "import peft" in (repo / "circuitkit" / "models" / "lora.py").read_text()
