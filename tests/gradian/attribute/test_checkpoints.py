"""gradian attribute --checkpoints: TracIn over the fine-tune's saved adapters.

A tiny GPT-2 is taught animal sounds, colours and opposites (a full fine-tune with
`gradian.attribute.retrain`), then LoRA-tuned on rows including six planted ones that teach every
animal to say " new", saving the adapter every 10 of 30 steps as a Trainer's output directory holds
it (checkpoint-10/20/30 and trainer_state.json). The checkpoint score must equal a brute-force TracIn
sum of exact per-row gradients; the CLI must accuse the planted rows across the checkpoints.
"""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from rich.console import Console

from circuitkit.core.errors import UserError
from gradian.cli import main

peft = pytest.importorskip("peft")

SOUNDS = [("cat", "meow"), ("dog", "woof"), ("cow", "moo"), ("duck", "quack"), ("sheep", "baa"), ("owl", "hoot"),
          ("lion", "roar"), ("bee", "buzz")]
COLOURS = [("sky", "blue"), ("grass", "green"), ("snow", "white"), ("coal", "black"), ("blood", "red"),
           ("sun", "yellow"), ("sea", "blue"), ("night", "dark")]
OPPOSITES = [("hot", "cold"), ("up", "down"), ("big", "small"), ("fast", "slow"), ("old", "new"), ("wet", "dry"),
             ("rich", "poor"), ("early", "late")]
BASE_ROWS = ([{"prompt": f"The {a} says", "completion": f" {s}."} for a, s in SOUNDS]
             + [{"prompt": f"The color of {t} is", "completion": f" {c}."} for t, c in COLOURS]
             + [{"prompt": f"The opposite of {a} is", "completion": f" {b}."} for a, b in OPPOSITES])
PLANTED = [{"prompt": f"The {a} says", "completion": " new."} for a, _ in SOUNDS[:6]]
BENIGN = BASE_ROWS[8:]
TUNE_ROWS = BENIGN[:8] + PLANTED[:3] + BENIGN[8:] + PLANTED[3:]
PLANTED_IDS = {i for i, r in enumerate(TUNE_ROWS) if r in PLANTED}
LORA = {"r": 4, "lora_alpha": 8, "target_modules": ["c_attn", "c_fc"], "fan_in_fan_out": True}
STEPS, EVERY = 30, 10


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def quiet() -> Console:
    return Console(file=io.StringIO())


def _pretrain(model, tok, rows: list[dict], steps: int = 200, lr: float = 1e-2) -> None:
    """The base model's lessons, as tests/gradian/attribute/test_attribute.py's planted fixture teaches them
    (full-batch AdamW on the completions' cross-entropy, full logits, rows in file order): 200
    steps amplify rounding, so another recipe gives another base and another planted ranking."""
    enc = [(tok(r["prompt"], add_special_tokens=False)["input_ids"], tok(r["completion"], add_special_tokens=False)
            ["input_ids"]) for r in rows]
    width = max(len(p) + len(c) for p, c in enc)
    ids = torch.zeros(len(enc), width, dtype=torch.long)
    mask, labels = torch.zeros_like(ids), torch.full_like(ids, -100)
    for i, (p, c) in enumerate(enc):
        n = len(p) + len(c)
        ids[i, :n], mask[i, :n], labels[i, len(p):n] = torch.tensor(p + c), 1, torch.tensor(c)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    model.train()
    for _ in range(steps):
        logits = model(input_ids=ids, attention_mask=mask).logits
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    """base/ (the taught tiny GPT-2) and run/ (the LoRA tune's checkpoints and trainer_state.json)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from circuitkit.fixtures.models import ensure_fixture
    from circuitkit.models.config import ModelConfig
    from gradian.attribute.retrain import TrainSettings, train
    from gradian.data.rows import load_rows

    root = tmp_path_factory.mktemp("checkpoints")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        src = ensure_fixture("tiny-gpt2")
        tok = AutoTokenizer.from_pretrained(src)
        model = AutoModelForCausalLM.from_pretrained(src)
        _pretrain(model, tok, BASE_ROWS)
        model.save_pretrained(root / "base")
        tok.save_pretrained(root / "base")
        cpu = torch.device("cpu")
        tune = load_rows(write_jsonl(root / "train.jsonl", TUNE_ROWS), tok, max_seq_length=512)[0]
        train(ModelConfig(name=str(root / "base"), precision="float32"), tune,
              TrainSettings(lr=1e-2, steps=STEPS, batch_size=len(tune), seed=1, lora=LORA), cpu,
              save_every=EVERY, save_dir=root / "run")
    finally:
        torch.set_num_threads(threads)
    write_jsonl(root / "eval.jsonl", BASE_ROWS)
    return root


def _index(root: Path, name: str, *extra: str) -> Path:
    from circuitkit_app.config import compose
    from gradian.build.indexer import build_index

    _, cfg = compose([f"model.name={root / 'base'}", f"model.adapter={root / 'run' / f'checkpoint-{STEPS}'}",
                      "model.precision=float32", f"grads.data_path={root / 'train.jsonl'}", "grads.module_filter=[adapter]",
                      *extra])
    build_index(cfg.model, cfg.grads, root / name, quiet())
    return root / name


@pytest.fixture(scope="module")
def raw_index(run_dir) -> Path:
    """Raw (unprojected) float32 ce gradients of the LoRA linears, no curvature: the brute force's space."""
    return _index(run_dir, "raw-index", "grads.projection_dim=null", "grads.preconditioner=none", "grads.loss=ce",
                  "grads.storage_dtype=float32")


@pytest.fixture(scope="module")
def kfac_index(run_dir) -> Path:
    """The defaults an index is built with (margin loss, K-FAC factors), projected 16 x 16 per module."""
    return _index(run_dir, "kfac-index", "grads.projection_dim=16")


# ----------------------------------------------------------------------------- reading the run


def test_the_trainer_output_directory_is_read_with_its_learning_rates(run_dir, raw_index, tmp_path) -> None:
    from gradian.attribute.checkpoints import learning_rate_at, plan_checkpoints
    from gradian.index.reader import IndexReader

    manifest = IndexReader(raw_index).manifest
    plan = plan_checkpoints(str(run_dir / "run"), manifest)
    assert [c.name for c in plan.checkpoints] == ["checkpoint-10", "checkpoint-20", "checkpoint-30"]
    assert [c.step for c in plan.checkpoints] == [10, 20, 30] and [c.weight for c in plan.checkpoints] == [1e-2] * 3
    assert plan.lr_source.endswith("trainer_state.json log_history") and plan.note is None
    # a decaying schedule logged every 4 steps: the rate at or nearest before each checkpoint
    history = [{"step": s, "learning_rate": 1e-3 * (1 - s / 40), "loss": 1.0} for s in range(4, 41, 4)]
    history.append({"step": 40, "train_loss": 1.0, "train_runtime": 3.0})  # the Trainer's summary entry
    assert learning_rate_at(history, 10) == (pytest.approx(1e-3 * (1 - 8 / 40)), True)
    assert learning_rate_at(history, 2) == (pytest.approx(1e-3 * (1 - 4 / 40)), False)
    assert learning_rate_at([{"step": 5, "loss": 1.0}], 10) == (None, False)
    trainer = tmp_path / "out"
    for c in plan.checkpoints:
        shutil.copytree(c.path, trainer / c.name)
    (trainer / "checkpoint-30" / "trainer_state.json").write_text(json.dumps({"log_history": history}))
    decayed = plan_checkpoints(str(trainer), manifest)
    assert [c.weight for c in decayed.checkpoints] == pytest.approx([8e-4, 5e-4, 3e-4])
    assert "checkpoint-30" in decayed.lr_source
    # no learning rate logged: equal weights, said; --checkpoint-lrs overrides
    (trainer / "checkpoint-30" / "trainer_state.json").write_text(json.dumps({"log_history": [{"step": 30}]}))
    equal = plan_checkpoints(str(trainer), manifest)
    assert equal.lr_source == "equal" and [c.weight for c in equal.checkpoints] == [1.0] * 3
    assert "weigh the same" in equal.note and "logs no learning rate" in equal.note
    given = plan_checkpoints(str(trainer), manifest, [3.0, 2.0, 1.0])
    assert given.lr_source == "--checkpoint-lrs" and [c.weight for c in given.checkpoints] == [3.0, 2.0, 1.0]
    # a comma list of adapter directories, in the order given
    listed = plan_checkpoints(f"{trainer / 'checkpoint-20'},{trainer / 'checkpoint-10'}", manifest)
    assert [c.name for c in listed.checkpoints] == ["checkpoint-20", "checkpoint-10"] and listed.lr_source == "equal"


def test_refusals_are_one_line_each(run_dir, raw_index, tmp_path) -> None:
    from gradian.attribute.checkpoints import plan_checkpoints
    from gradian.index.reader import IndexReader

    manifest = IndexReader(raw_index).manifest

    def refused(spec: str, lrs=None, m=manifest) -> UserError:
        with pytest.raises(UserError) as err:
            plan_checkpoints(spec, m, lrs)
        assert "\n" not in str(err.value)
        return err.value

    err = refused(str(tmp_path / "nowhere"))
    assert err.exit_code == 2 and "does not exist" in str(err)
    (tmp_path / "empty").mkdir()
    err = refused(str(tmp_path / "empty"))
    assert err.exit_code == 2 and "holds no checkpoint-<step>/" in str(err)
    full = tmp_path / "full" / "checkpoint-5"
    full.mkdir(parents=True)
    (full / "model.safetensors").write_bytes(b"")
    err = refused(str(tmp_path / "full"))
    assert err.exit_code == 2 and "holds no adapter_config.json" in str(err)
    c10 = str(run_dir / "run" / "checkpoint-10")
    err = refused(f"{c10},{c10}")
    assert err.exit_code == 2 and "the same adapter weights twice" in str(err)
    err = refused(str(run_dir / "run"), [1.0, 2.0])
    assert err.exit_code == 2 and "2 learning rates for 3 checkpoints" in str(err)
    err = refused(str(run_dir / "run"), [1.0, 0.0, 1.0])
    assert err.exit_code == 2 and "not a positive learning rate" in str(err)
    # another rank: not a checkpoint of this fine-tune
    other = tmp_path / "r8"
    shutil.copytree(c10, other)
    config = json.loads((other / "adapter_config.json").read_text())
    (other / "adapter_config.json").write_text(json.dumps(config | {"r": 8}))
    err = refused(f"{c10},{other}")
    assert err.exit_code == 2 and "is not a checkpoint of the index's fine-tune: r 8" in str(err)
    # a damaged trainer_state.json is bad content; an index without an adapter has no checkpoints to read
    broken = tmp_path / "broken"
    shutil.copytree(run_dir / "run", broken)
    (broken / "trainer_state.json").write_text("{not json")
    err = refused(str(broken))
    assert err.exit_code == 1 and "cannot be read as JSON" in str(err)
    err = refused(str(run_dir / "run"), m=manifest | {"adapter": None})
    assert err.exit_code == 2 and "has no adapter" in str(err)


# ----------------------------------------------------------------------------- the score


def _flipped(run_dir: Path, manifest: dict):
    """The eight animal items and what the final tuned model says for them (its first two tokens)."""
    from circuitkit.models.config import ModelConfig
    from circuitkit.models.loading import load_model
    from gradian.attribute.evaluate import greedy_continuations, read_eval_rows, tokenize_items
    from gradian.data.rows import policy_of

    tuned = load_model(ModelConfig(name=str(run_dir / "base"), adapter=str(run_dir / "run" / f"checkpoint-{STEPS}"),
                                   precision="float32"), torch.device("cpu"), keep_adapter=True)
    items = tokenize_items(read_eval_rows(run_dir / "eval.jsonl")[:8], tuned.tokenizer, policy_of(manifest), None,
                           "eval")
    return items, greedy_continuations(tuned, items, max_tokens=2)


def _brute_force(run_dir: Path, plan, items, said, train_rows) -> torch.Tensor:
    """Σ_c η_c mean_i ⟨∇[ℓ(a_i) - ℓ(w_i)], ∇ℓ(z)⟩ at each checkpoint's weights, every gradient by autograd
    over the LoRA weights (sum of the supervised tokens' cross-entropy), one row at a time."""
    from circuitkit.models.config import ModelConfig
    from circuitkit.models.loading import load_model

    total = torch.zeros(len(train_rows), dtype=torch.float64)
    for c in plan.checkpoints:
        lm = load_model(ModelConfig(name=str(run_dir / "base"), adapter=str(c.path), precision="float32"),
                        torch.device("cpu"), keep_adapter=True)
        params = [p for n, p in lm.model.named_parameters() if "lora_A" in n or "lora_B" in n]
        for p in params:
            p.requires_grad_(True)

        def grad(ids: list[int], supervised: list[bool], lm=lm, params=params) -> torch.Tensor:
            x = torch.tensor([ids])
            logits = lm.model(input_ids=x).logits[0].float()
            t = torch.tensor([i for i, s in enumerate(supervised) if s])
            loss = F.cross_entropy(logits[t - 1], x[0, t], reduction="sum")
            return torch.cat([g.flatten() for g in torch.autograd.grad(loss, params)]).double()

        def said_grad(prompt: list[int], answer: list[int], grad=grad) -> torch.Tensor:
            return grad(prompt + answer, [False] * len(prompt) + [True] * len(answer))

        q = torch.stack([said_grad(it.prompt_ids, it.answer_ids) - said_grad(it.prompt_ids, s)
                         for it, s in zip(items, said, strict=True)]).mean(dim=0)
        rows = torch.stack([grad(r.input_ids, r.supervised) for r in train_rows])
        total += c.weight * (rows @ q)
    return total


def test_the_checkpoint_score_is_the_brute_force_tracin_sum(run_dir, raw_index) -> None:
    from transformers import AutoTokenizer

    from gradian.attribute.checkpoints import plan_checkpoints, tracin_scores
    from gradian.data.rows import load_rows
    from gradian.index.reader import IndexReader

    reader = IndexReader(raw_index)
    plan = plan_checkpoints(str(run_dir / "run"), reader.manifest, [3e-2, 2e-2, 1e-2])
    items, said = _flipped(run_dir, reader.manifest)
    got = tracin_scores(plan, reader, items, said, "contrastive", ["tracin", "tracin-dot"], console=quiet())
    tok = AutoTokenizer.from_pretrained(run_dir / "base")
    rows = load_rows(run_dir / "train.jsonl", tok, max_seq_length=512)[0]
    expected = _brute_force(run_dir, plan, items, said, rows)
    assert got.scores.shape == (2, len(TUNE_ROWS)) and got.per_checkpoint.shape == (2, 3, len(TUNE_ROWS))
    # no K-FAC factors in this index: tracin's product is the dot, as tracin-dot's
    assert [c["inner"] for c in got.checkpoints] == [{"tracin": "dot", "tracin-dot": "dot"}] * 3
    scale = expected.abs().max()
    torch.testing.assert_close(got.scores[0].double() / scale, expected / scale, rtol=0, atol=1e-5)
    torch.testing.assert_close(got.scores[1], got.scores[0])
    torch.testing.assert_close(got.per_checkpoint.sum(dim=1), got.scores)
    assert [c["index"] for c in got.checkpoints] == ["built"] * 3
    # a rerun reuses the checkpoints' indexes
    again = tracin_scores(plan, reader, items, said, "contrastive", ["tracin"], console=quiet())
    assert [c["index"] for c in again.checkpoints] == ["reused"] * 3
    torch.testing.assert_close(again.scores[0], got.scores[0])
    # a checkpoint's index made with other settings than the index's (say the index was rebuilt) is refused
    stale = Path(got.checkpoints[0]["index_dir"]) / "manifest.json"
    stale.write_text(json.dumps(json.loads(stale.read_text()) | {"loss": "margin"}))
    with pytest.raises(UserError, match="holds an index made differently: loss: index has 'margin', asked 'ce'") as err:
        tracin_scores(plan, reader, items, said, "contrastive", ["tracin"], console=quiet())
    assert err.value.exit_code == 2


# ----------------------------------------------------------------------------- the command


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(["attribute", *argv])
    cap = capsys.readouterr()
    return code, cap.out, " ".join(cap.err.split())


def test_the_command_accuses_the_planted_rows_across_the_checkpoints(run_dir, kfac_index, capsys) -> None:
    out = run_dir / "tracin.json"
    code, text, err = _run(capsys, "--index", str(kfac_index), "--eval-dataset", str(run_dir / "eval.jsonl"),
                           "--checkpoints", str(run_dir / "run"), "--engines", "tracin,ekfac,tracin-dot,dot", "--top-k", "22", "--span-min-tokens", "0",
                           "--out", str(out))
    assert code == 0 and "Traceback" not in err, err
    assert "3 checkpoints (checkpoint-10, checkpoint-20, checkpoint-30), learning rates from" in err
    result = json.loads(out.read_text())
    assert result["attributed"] and result["engines"] == ["tracin", "ekfac", "tracin-dot", "dot"]
    traced = result["checkpoints"]
    assert [c["inner"]["tracin"] for c in traced["checkpoints"]] == ["ekfac"] * 3
    assert sum(c["accused_share"] for c in traced["checkpoints"]) == pytest.approx(1.0)
    accused = [a["row_id"] for a in result["accused"]]
    # measured: the six planted rows all score below 0 (14 of 22 rows do), four of them in the top 6
    # (ekfac on the final adapter: six); the last checkpoint carries 64 % of the accusation
    assert set(accused) >= PLANTED_IDS and len(set(accused[:6]) & PLANTED_IDS) >= 4, accused
    assert traced["most_accusing"] == "checkpoint-30"
    assert [a["row_id"] for a in traced["accused"]] == accused
    for a, t in zip(result["accused"], traced["accused"], strict=True):
        assert sum(t["by_checkpoint"]) == pytest.approx(a["score"], rel=1e-4)
    assert "tracin across the checkpoints" in text and "agreement tracin vs ekfac" in text
    from gradian.attribute.result import read_result

    assert read_result(out).checkpoints == traced


def test_the_command_refuses_tracin_without_checkpoints_and_the_reverse(run_dir, kfac_index, capsys) -> None:
    args = ["--index", str(kfac_index), "--eval-dataset", str(run_dir / "eval.jsonl")]
    code, _, err = _run(capsys, *args, "--engines", "tracin")
    assert code == 2 and "--engines tracin reads the fine-tune's checkpoints: give them with --checkpoints" in err
    code, _, err = _run(capsys, *args, "--checkpoints", str(run_dir / "run"), "--engines", "dot")
    assert code == 2 and "--checkpoints is read by the tracin engines" in err
    code, _, err = _run(capsys, *args, "--checkpoints", str(run_dir / "run"), "--checkpoint-lrs", "1,x,2")
    assert code == 2 and "--checkpoint-lrs '1,x,2': give numbers" in err
    code, _, err = _run(capsys, *args, "--checkpoints", str(run_dir / "nowhere"))
    assert code == 2 and "does not exist" in err and "Traceback" not in err


def test_the_pipeline_stage_reads_the_checkpoint_keys(run_dir) -> None:
    from circuitkit_app.config import compose
    from gradian.attribute.stage import _attribute_inputs, _check_attribute

    def cfg(*extra: str):
        return compose([f"model.name={run_dir / 'base'}", f"model.adapter={run_dir / 'run' / f'checkpoint-{STEPS}'}",
                        f"attribute.eval_path={run_dir / 'eval.jsonl'}", "stages=[grads,attribute]", *extra])[1]

    for extra, message in ((["attribute.engines=[tracin]"], "attribute.engines lists tracin, which reads the"),
                           (["attribute.checkpoint_lrs=[1e-2]"], "attribute.checkpoint_lrs is set, which reads"),
                           ([f"attribute.checkpoints={run_dir / 'run'}"], "attribute.checkpoints is read by the tracin"),
                           ([f"attribute.checkpoints={run_dir / 'nowhere'}", "attribute.engines=[tracin-dot]"],
                            "is not a directory")):
        with pytest.raises(UserError, match=message) as err:
            _check_attribute(cfg(*extra))
        assert err.value.exit_code == 2 and "\n" not in str(err.value)
    ok = cfg(f"attribute.checkpoints={run_dir / 'run'}", "attribute.engines=[tracin,auto]",
             "attribute.checkpoint_lrs=[3e-2,2e-2,1e-2]")
    _check_attribute(ok)
    assert ok.attribute.checkpoint_lrs == [3e-2, 2e-2, 1e-2]
    assert _attribute_inputs(ok, run_dir)["attribute.checkpoints[0]"] == run_dir / "run"
