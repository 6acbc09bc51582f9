"""Local fixture models: they load offline, run, round-trip text, rebuild bit-identically, and
the trained induction model really has a previous-token head and an induction head."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from circuitkit.fixtures.induction import (
    INDUCTION_THRESHOLD,
    PREV_TOKEN_THRESHOLD,
    evaluate_induction,
    head_pattern_scores,
    induction_batch,
    train_induction,
)
from circuitkit.fixtures.models import FIXTURE_NAMES, build_fixture, ensure_fixture

RANDOM = [n for n in FIXTURE_NAMES if n != "induction"]


@pytest.mark.parametrize("name", RANDOM)
def test_tiny_model_loads_and_runs(tiny_model, name):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = tiny_model(name)
    info = json.loads((path / "fixture_info.json").read_text())
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)  # also Gemma3ForConditionalGeneration
    assert type(model).__name__ == info["model_class"]
    assert model.dtype == torch.float32
    assert sum(p.numel() for p in model.parameters()) == info["n_params"]
    enc = tok(["When Mary and John went to the store, John gave a drink to", "Hi"], return_tensors="pt",
              padding=True)
    with torch.no_grad():
        logits = model(**enc).logits
    assert logits.shape == (2, enc.input_ids.shape[1], len(tok)) == (2, enc.input_ids.shape[1], info["vocab_size"])
    assert torch.isfinite(logits).all() and logits.std() > 0.05


def test_gemma3_cg_loads_with_image_text_to_text(tiny_model):
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(tiny_model("tiny-gemma3-cg"))
    assert type(model).__name__ == "Gemma3ForConditionalGeneration"


def test_tokenizer_round_trips_and_has_single_token_names_and_years(tiny_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    for text in ["When Mary and John went to the store, John gave a drink to Mary.",
                 "The war lasted from the year 1732 to the year 1756.", "  spaces\tand\nnewlines ",
                 "unicode: héllo wörld ✓ 日本", "<|endoftext|>"]:
        assert tok.decode(tok(text).input_ids) == text
    for word in [" Mary", " John", " Alice", " 1700", " 1799", " 42"]:
        assert len(tok(word).input_ids) == 1, word
    assert tok.bos_token == tok.eos_token == "<|endoftext|>" and tok.pad_token == "<pad>"
    assert tok.pad_token_id != tok.eos_token_id
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi Mary"},
            {"role": "assistant", "content": "Hello John"}]
    out = tok.apply_chat_template(msgs, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    supervised = [t for t, m in zip(out["input_ids"], out["assistant_masks"], strict=True) if m]
    assert tok.decode(supervised) == "Hello John<|end|>"
    prompt = tok.apply_chat_template(msgs[:2], tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|assistant|>\n")


@pytest.mark.parametrize("name", ["tiny-gpt2", "tiny-gemma3-cg"])
def test_random_fixture_rebuild_is_bit_identical(tiny_model, tmp_path, name):
    build_fixture(name, tmp_path)
    cached = tiny_model(name)
    for file in ["model.safetensors", "tokenizer.json", "config.json"]:
        assert (tmp_path / file).read_bytes() == (cached / file).read_bytes(), file


def test_ensure_fixture_is_cached_and_leaves_no_temp_dirs(tmp_path):
    first = ensure_fixture("tiny-llama", out_dir=tmp_path)
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    assert ensure_fixture("tiny-llama", out_dir=tmp_path) == first
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")) == [first.name]
    with pytest.raises(KeyError, match="tiny-gpt2"):
        ensure_fixture("nope", out_dir=tmp_path)


def test_concurrent_builders_build_once(tmp_path, monkeypatch):
    import threading
    import time

    import circuitkit.fixtures.models as tiny

    calls = []
    real_build = tiny.build_fixture

    def slow_build(name: str, directory: Path) -> None:
        calls.append(name)
        time.sleep(0.3)  # keep the lock held while the other thread arrives
        real_build(name, directory)

    monkeypatch.setattr(tiny, "build_fixture", slow_build)
    results: list[Path] = []
    threads = [threading.Thread(target=lambda: results.append(ensure_fixture("tiny-qwen2", out_dir=tmp_path)))
               for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert calls == ["tiny-qwen2"] and len(set(results)) == 1 and len(results) == 2
    assert (results[0] / "fixture_info.json").is_file()


def test_induction_batch_answers_are_unambiguous():
    ids, mask = induction_batch(16, 128, torch.Generator().manual_seed(0), bos_id=0)
    assert ids.shape == mask.shape == (16, 128) and (ids[:, 0] == 0).all() and not mask[:, -1].any()
    lags = []
    for row, m in zip(ids.tolist(), mask.tolist(), strict=True):
        for i in (i for i, on in enumerate(m) if on):
            earlier = [j for j in range(i) if row[j] == row[i]]
            assert len(earlier) == 1 and row[earlier[0] + 1] == row[i + 1]
            lags.append(i - earlier[0])
    assert min(lags) >= 4 and max(lags) > 80 and mask.float().mean() > 0.15
    again, _ = induction_batch(16, 128, torch.Generator().manual_seed(0), bos_id=0)
    assert torch.equal(ids, again)


def test_induction_training_is_deterministic():
    def run() -> dict[str, torch.Tensor]:
        model, _ = train_induction(1024, 0, 1, seed=7, max_steps=12, batch_size=8, eval_every=10**6)
        return model.state_dict()

    a, b = run(), run()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def induction(induction_model_dir: Path):
    from transformers import AutoModelForCausalLM

    info = json.loads((induction_model_dir / "fixture_info.json").read_text())
    return AutoModelForCausalLM.from_pretrained(induction_model_dir), info


def test_induction_fixture_is_attention_only(induction):
    model, info = induction
    assert info["attention_only"] and info["n_layers"] == 2
    for block in model.transformer.h:
        assert all((p == 0).all() for p in block.mlp.parameters())


def test_induction_fixture_heads_hold_on_fresh_data(induction):
    model, info = induction
    (l_prev, h_prev), (l_ind, h_ind) = info["prev_token_head"], info["induction_head"]
    assert (l_prev, l_ind) == (0, 1)
    ids, mask = induction_batch(32, 128, torch.Generator().manual_seed(2024), bos_id=0)
    impl = model.config._attn_implementation
    scores = head_pattern_scores(model, ids, induction_mask=mask)
    assert model.config._attn_implementation == impl  # eager only for the scoring forward
    assert scores["prev_token"][l_prev, h_prev] > PREV_TOKEN_THRESHOLD
    assert scores["induction"][l_ind, h_ind] > INDUCTION_THRESHOLD
    # One head per role: every other head is far below (the training's sparsity prior).
    others = scores["induction"][1].clone()
    others[h_ind] = 0
    assert others.max() < 0.3 and scores["best_induction"][:2] == (l_ind, h_ind)


def test_induction_fixture_accuracy_is_high(induction):
    # Measured at build time: 0.976 on 64 held-out sequences (fixture_info.json "accuracy").
    model, info = induction
    result = evaluate_induction(model, n=32, seq_len=128, seed=99)
    assert result["accuracy"] > 0.9, result["accuracy"]
    assert info["accuracy"] > 0.9
