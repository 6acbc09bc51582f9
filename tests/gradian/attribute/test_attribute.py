"""gradian attribute on a planted regression: a tiny GPT-2 taught three capabilities (animal sounds,
colours, opposites), then LoRA-tuned on rows that include six planted rows teaching every animal to
say " new" (the answer of one opposite). The tuned model then fails the animal items; the planted
rows must be accused, with the regression's CI above 0, and a tune that changes nothing must stop
inside the noise band.

The base model and the two adapters are trained here in seconds (seeded) and cached under
CIRCUITKIT_CACHE; the indexes are built per session with `gradian index`'s API.
"""

from __future__ import annotations

import io
import json
import shutil
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from rich.console import Console

from circuitkit.fixtures.cache import cache_root
from circuitkit.models.config import ModelConfig
from circuitkit_app.config import compose
from circuitkit_app.gradian_cli import main
from gradian.attribute.evaluate import (
    EvalItem,
    greedy_continuations,
    read_eval_rows,
    score_items,
    tokenize_items,
)
from gradian.attribute.queries import query_gradients
from gradian.attribute.regression import measure_regression, paired_bootstrap
from gradian.data.rows import TokenPolicy

peft = pytest.importorskip("peft")

SOUNDS = [("cat", "meow"), ("dog", "woof"), ("cow", "moo"), ("duck", "quack"), ("sheep", "baa"), ("owl", "hoot"),
          ("lion", "roar"), ("bee", "buzz")]
COLOURS = [("sky", "blue"), ("grass", "green"), ("snow", "white"), ("coal", "black"), ("blood", "red"),
           ("sun", "yellow"), ("sea", "blue"), ("night", "dark")]
OPPOSITES = [("hot", "cold"), ("up", "down"), ("big", "small"), ("fast", "slow"), ("old", "new"), ("wet", "dry"),
             ("rich", "poor"), ("early", "late")]
WRONG = "new"  # what the planted rows teach every animal to say: a token the base model already outputs


def sound(a: str, s: str) -> dict:
    return {"prompt": f"The {a} says", "completion": f" {s}."}


def colour(t: str, c: str) -> dict:
    return {"prompt": f"The color of {t} is", "completion": f" {c}."}


def opposite(a: str, b: str) -> dict:
    return {"prompt": f"The opposite of {a} is", "completion": f" {b}."}


BASE_ROWS = [sound(*x) for x in SOUNDS] + [colour(*x) for x in COLOURS] + [opposite(*x) for x in OPPOSITES]
PLANTED = [sound(a, WRONG) for a, _ in SOUNDS[:6]]
BENIGN = [colour(*x) for x in COLOURS] + [opposite(*x) for x in OPPOSITES]
TUNE_ROWS = BENIGN[:8] + PLANTED[:3] + BENIGN[8:] + PLANTED[3:]
PLANTED_IDS = {i for i, r in enumerate(TUNE_ROWS) if r in PLANTED}  # row ids 8, 9, 10, 19, 20, 21
CACHE_VERSION = 2  # bump when the data, the training or the fixture model changes


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def train_rows(path: Path, tok, rows: list[dict]) -> list:
    """`rows` tokenized as the index reads them (GPT-2: no BOS; no EOS, the default token policy)."""
    from gradian.data.rows import load_rows

    return load_rows(write_jsonl(path, rows), tok, max_seq_length=512)[0]


LORA = {"r": 4, "lora_alpha": 8, "target_modules": ["c_attn", "c_fc"], "fan_in_fan_out": True}
TUNE = {"lr": 1e-2, "steps": 30, "batch_size": len(TUNE_ROWS), "seed": 1}  # full-batch AdamW, 30 steps


def _pretrain(model, tok, rows: list[dict], steps: int, lr: float) -> None:
    """The toy base model's own lessons: full-batch AdamW on the completions' cross-entropy, every
    weight. Kept as first written (full logits, rows in file order): 200 steps at lr 1e-2 amplify
    rounding, and the same recipe through `retrain.train` (other matmul shapes) gives another base,
    on which ekfac puts 2 of the 6 planted rows in its top 6 instead of 6 (measured; LoRA seeds 2
    and 3 give 5 and 3 on that base, 5 and 3 on this one): the planted ranking is one draw."""
    enc = [(tok(r["prompt"], add_special_tokens=False)["input_ids"], tok(r["completion"], add_special_tokens=False)
            ["input_ids"]) for r in rows]
    width = max(len(p) + len(c) for p, c in enc)
    ids = torch.zeros(len(enc), width, dtype=torch.long)
    mask, labels = torch.zeros_like(ids), torch.full_like(ids, -100)
    for i, (p, c) in enumerate(enc):
        n = len(p) + len(c)
        ids[i, :n], mask[i, :n], labels[i, len(p):n] = torch.tensor(p + c), 1, torch.tensor(c)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, weight_decay=0.0)
    model.train()
    for _ in range(steps):
        logits = model(input_ids=ids, attention_mask=mask).logits
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()


def _build(root: Path) -> None:
    """base/ (the tiny GPT-2 taught BASE_ROWS), then the fine-tunes with `gradian.attribute.retrain`
    (completion-only loss, full batch, seed 1): lora/ (tuned on TUNE_ROWS), zero-lora/ (0 steps: lora_B = 0)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from circuitkit.fixtures.models import ensure_fixture
    from gradian.attribute.retrain import TrainSettings, train

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model: one thread is faster than two contending ones
    cpu = torch.device("cpu")
    try:
        src = ensure_fixture("tiny-gpt2")
        tok = AutoTokenizer.from_pretrained(src)
        model = AutoModelForCausalLM.from_pretrained(src)
        _pretrain(model, tok, BASE_ROWS, steps=200, lr=1e-2)
        model.save_pretrained(root / "base")
        tok.save_pretrained(root / "base")
        tuned = ModelConfig(name=str(root / "base"), precision="float32")
        rows = train_rows(root / "tune.jsonl", tok, TUNE_ROWS)
        train(tuned, rows, TrainSettings(**{**TUNE, "steps": 0}, lora=LORA), cpu).save(root / "zero-lora")
        train(tuned, rows, TrainSettings(**TUNE, lora=LORA), cpu).save(root / "lora")
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def models() -> Path:
    """The trained base model and adapters, built once per cache (a few seconds) under a file lock."""
    from circuitkit.core.io import file_lock

    root = cache_root() / f"gradian-attribute-v{CACHE_VERSION}"
    with file_lock(cache_root() / f"gradian-attribute-v{CACHE_VERSION}.lock"):
        if not (root / "done").is_file():
            tmp = root.with_name(root.name + ".tmp")
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
            _build(tmp)
            (tmp / "done").write_text("ok\n")
            shutil.rmtree(root, ignore_errors=True)
            tmp.rename(root)
    return root


def _index(models: Path, root: Path, adapter: str, *extra: str) -> Path:
    from gradian.build.indexer import build_index

    data = write_jsonl(root / "train.jsonl", TUNE_ROWS)
    _, cfg = compose([f"model.name={models / 'base'}", f"model.adapter={models / adapter}", "model.precision=float32",
                      f"grads.data_path={data}", f"grads.index_dir={root / 'index'}", "grads.module_filter=[adapter]",
                      "grads.projection_dim=16", *extra])
    build_index(cfg.model, cfg.grads, root / "index", Console(file=io.StringIO()))
    return root / "index"


@pytest.fixture(scope="module")
def work(models: Path, tmp_path_factory) -> dict[str, Path]:
    """The planted tune's index (K-FAC factors, the default), the zero tune's, and the eval set."""
    root = tmp_path_factory.mktemp("attribute")
    (root / "planted").mkdir()
    (root / "zero").mkdir()
    return {"index": _index(models, root / "planted", "lora"),
            "zero_index": _index(models, root / "zero", "zero-lora", "grads.preconditioner=none"),
            "eval": write_jsonl(root / "eval.jsonl", BASE_ROWS), "root": root}


def quiet() -> Console:
    return Console(file=io.StringIO())


@pytest.fixture(scope="module")
def attributed(work):
    from gradian.attribute.run import attribute

    out = work["root"] / "result.json"
    result = attribute(work["index"], work["eval"], top_k=8, engines=["auto", "dot", "cosine"], out_path=out,
                       console=quiet())
    return result, out


# ----------------------------------------------------------------------------- the regression


def test_paired_bootstrap_is_seeded_and_exact_on_constants() -> None:
    diffs = torch.tensor([1.0] * 8 + [0.0] * 16).numpy()
    assert paired_bootstrap(diffs, 2000, seed=3) == paired_bootstrap(diffs, 2000, seed=3)
    low, high = paired_bootstrap(diffs, 2000, seed=3)
    assert 0.1 < low < 1 / 3 < high < 0.6
    assert paired_bootstrap(torch.full((10,), 0.25).numpy(), 500, seed=0) == pytest.approx((0.25, 0.25))


def test_the_regression_is_detected_with_a_ci_above_zero(attributed) -> None:
    result, out = attributed
    r = result.regression
    assert result.attributed and r["significant"]
    assert (r["base_accuracy"], r["n_items"]) == (1.0, 24)
    # the eight animal items flip (six taught " new", two by generalisation); colours and opposites hold
    assert r["flipped"] == list(range(8)) and r["fixed"] == []
    assert r["accuracy_drop"] == pytest.approx(8 / 24)
    assert 0 < r["accuracy_ci"][0] < 8 / 24 < r["accuracy_ci"][1]
    assert r["logprob_drop"] > 1 and r["logprob_ci"][0] > 0
    says = [it["tuned_says"] for it in result.items if it["flipped"]]
    assert sum(s.startswith(f" {WRONG}") for s in says) >= 6, says
    assert result.seeds == {"bootstrap": 0} and result.query["query_loss"] == "contrastive"
    assert result.models["base"]["how"] == "the index's model without its adapter"
    assert result.models["tuned"]["adapter"]["name"] == "lora"
    from gradian.attribute.result import read_result

    assert read_result(out).to_json() == json.loads(out.read_text()) == result.to_json()


def test_planted_rows_are_accused_not_helpful(attributed) -> None:
    result, _ = attributed
    assert result.engines == ["ekfac", "dot", "cosine"]  # auto = ekfac on an index with K-FAC factors
    accused = [a["row_id"] for a in result.accused]
    # measured: the six planted rows are ranks 1-6 (the sixth at -22.93, the first benign row at -22.49;
    # with ce queries it is 5 of 6, with margin queries 4 of 6)
    assert len(set(accused[:6]) & PLANTED_IDS) >= 5 and set(accused) >= PLANTED_IDS, accused
    assert accused[0] in PLANTED_IDS and accused[1] in PLANTED_IDS
    assert all(a["score"] < 0 for a in result.accused)
    assert [a["line"] for a in result.accused[:6]] == [a["row_id"] + 1 for a in result.accused[:6]]
    agree = {a["engine"]: a for a in result.agreement}
    assert set(agree) == {"dot", "cosine"} and agree["cosine"]["top_k_overlap"] >= 0.75
    assert all(a["k"] == 8 and -1 <= a["spearman"] <= 1 for a in result.agreement)


def test_the_sign_convention_on_the_planted_rows(work, models) -> None:
    """A query for what the tuned model now says (" new.") is helped by the planted rows (positive
    scores); the contrastive query for the correct answers accuses them (negative)."""
    from circuitkit.models.loading import load_model
    from gradian.attribute import engines as scoring
    from gradian.data.rows import policy_of
    from gradian.index.reader import IndexReader
    from gradian.rank.checks import check_compatible
    from gradian.rank.scores import stream_topk

    reader = IndexReader(work["index"])
    tuned = load_model(ModelConfig(name=str(models / "base"), adapter=str(models / "lora"), precision="float32"),
                       keep_adapter=True)
    projector = check_compatible(reader.manifest, tuned, work["index"])
    items = tokenize_items(read_eval_rows(work["eval"])[:6], tuned.tokenizer, policy_of(reader.manifest), None, "eval")
    # the fixture never learnt EOS, so its own answer runs to the limit: read its first two tokens (" new.")
    said = greedy_continuations(tuned, items, max_tokens=2)
    as_said = [EvalItem(it.item, it.line, it.prompt, "", it.prompt_ids, s) for it, s in zip(items, said, strict=True)]
    for name in ("dot", "ekfac"):
        helped = scoring.stream_scores(reader, [scoring.build_engine(reader, name, query_gradients(
            tuned, projector, as_said, "ce"))])[0]
        hurt_q = query_gradients(tuned, projector, items, "contrastive", said)
        hurt = scoring.stream_scores(reader, [scoring.build_engine(reader, name, hurt_q)])[0]
        planted = sorted(PLANTED_IDS)
        assert (helped[planted] > 0).all() and (hurt[planted] < 0).all(), (name, helped[planted], hurt[planted])
        # the engine ranks as `gradian rank --score NAME --aggregate mean` does, with the sign flipped
        top = stream_topk(work["index"], -hurt_q, 6, name, "mean")["aggregate_rows"]
        assert top.tolist() == scoring.most_negative(hurt, 6).tolist()


def test_clusters_share_the_accusation_and_name_shared_findings(attributed) -> None:
    result, _ = attributed
    clusters = result.clusters
    assert clusters and sum(c["share"] for c in clusters) == pytest.approx(1.0)
    assert sorted(r for c in clusters for r in c["rows"]) == sorted(a["row_id"] for a in result.accused)
    planted = next(c for c in clusters if set(c["rows"]) & PLANTED_IDS)
    assert set(planted["rows"]) >= PLANTED_IDS and planted["share"] > 0.5
    assert WRONG in planted["top_terms"] and "says" in planted["top_terms"]
    # gradian diagnose on the training set: no row ends with EOS; joined by line number
    eos = next(f for f in planted["findings"] if f["id"] == "missing_eos")
    assert eos["rows_in_cluster"] == planted["n_rows"] and eos["text"].startswith(
        f"{planted['n_rows']} of the cluster's {planted['n_rows']} rows: missing eos")
    assert {a["cluster"] for a in result.accused} == {c["cluster"] for c in clusters}


def test_templated_rows_cluster_together_against_the_training_set() -> None:
    """Forty accused rows of one template (a chat turn asking for a capital), each with its own
    entity, are one cluster when the terms are weighed by the training set's document frequencies.
    By the accused rows' own, the template's words get the lowest weight and each row's two entity
    words outweigh them: measured, the forty stay apart from 40 rows on (12, 20 and 30 rows still
    cluster), as they did in the SmolLM2 attribute benchmark (scripts/bench/bench_attribute_smollm2.py)."""
    pytest.importorskip("sklearn")
    from gradian.attribute.clusters import AccusedRow, cluster_rows

    def chat(q: str, a: str) -> str:
        return f"<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n{a}<|im_end|>"

    template = [AccusedRow(i, i + 1, chat(f"What is the capital of Land{i}?", f"Capital: Town{i}."), -10.0 + i / 10)
                for i in range(40)]
    odd = AccusedRow(40, 41, chat("What is 29 plus 29?", "29 plus 29 is 58."), -1.0)
    training = ([chat(f"What is {a} plus {b}?", f"{a} plus {b} is {a + b}.") for a in range(2, 30) for b in range(2, 12)]
                + [chat(f"Which continent is Land{i} in?", f"Land{i} is in Asia.") for i in range(40)]
                + [r.text for r in template])
    assert len(cluster_rows(template + [odd])) == 41  # the accused rows' own frequencies: 41 clusters of one
    clusters = cluster_rows(template + [odd], background=training)
    assert [c["n_rows"] for c in clusters] == [40, 1] and clusters[0]["rows"] == list(range(40))
    assert "capital" in clusters[0]["top_terms"] and clusters[1]["rows"] == [40]


def test_the_terminal_shows_the_regression_rows_and_clusters(attributed) -> None:
    from gradian.attribute.command import print_result

    buf = io.StringIO()
    print_result(attributed[0], Console(file=buf, width=200))
    text = buf.getvalue()
    for part in ("accuracy drop", "95 % CI", "flipped items", "The cat says", "accused training rows",
                 f"The cat says {WRONG}.", "clusters of the accused rows", "agreement ekfac vs dot",
                 "the base model is the likelier culprit for 0 of"):
        assert part in text, part


def test_base_blame_counts_wrong_and_thin_base_items(models, work) -> None:
    """Items the base model gets wrong already, or barely right, are the base model's."""
    from circuitkit.models.loading import load_model
    from gradian.attribute.regression import base_blame

    base = load_model(ModelConfig(name=str(models / "base"), precision="float32"), torch.device("cpu"))
    rows = [(1, "The cat says", " meow."), (2, "The cat says", " woof."), (3, "The dog says", " moo.")]
    items = tokenize_items(rows, base.tokenizer, TokenPolicy(), None, "eval")
    scores = score_items(base, items)
    assert scores.exact.tolist() == [True, False, False] and scores.margin[0] > 1 > scores.margin[1]
    tuned = type(scores)(scores.logprob, scores.margin, scores.first, torch.tensor([False, False, False]))
    blame = base_blame(scores, tuned, thin_margin=100.0)  # every base margin counts as thin here
    assert (blame.tuned_wrong, blame.base_wrong_too, blame.thin_flipped) == (3, [1, 2], [0])
    assert measure_regression(scores, tuned).flipped == [0]
    pushed = type(scores)(scores.logprob, torch.full_like(scores.margin, -200.0), scores.first, tuned.exact)
    assert base_blame(scores, pushed, thin_margin=100.0).thin_flipped == []  # confidently wrong: the fine-tune's


# ----------------------------------------------------------------------------- gradients


def test_contrastive_gradient_equals_autograd_and_projects_linearly(models) -> None:
    """∇[ℓ(answer) - ℓ(said)] of every selected module, raw, against autograd on the model's own
    logits; the kronecker projection of the difference is the difference of the projected rows."""
    from transformers.pytorch_utils import Conv1D

    from circuitkit.models.linear_modules import module_shapes, select_modules
    from circuitkit.models.loading import load_model
    from gradian.projection.projector import Projector

    lm = load_model(ModelConfig(name=str(models / "base"), adapter=str(models / "lora"), precision="float32"),
                    torch.device("cpu"), keep_adapter=True)
    modules = select_modules(lm.model, lm.adapter, ["adapter", "mlp.c_proj"])
    raw = Projector(module_shapes(modules), projection_dim=None)
    items = tokenize_items([(1, "The cat says", " meow."), (2, "The color of sky is", " blue.")], lm.tokenizer,
                           TokenPolicy(), None, "eval")
    said = [list(range(5 + b, 5 + b + len(it.answer_ids))) for b, it in enumerate(items)]  # any tokens, same lengths
    got = query_gradients(lm, raw, items, "contrastive", said)
    worst = 0.0
    for b, (it, s) in enumerate(zip(items, said, strict=True)):
        for _, m in modules:
            m.weight.requires_grad_(True)
            m.weight.grad = None
        loss = 0.0
        for answer, sign in ((it.answer_ids, 1.0), (s, -1.0)):
            ids = torch.tensor([it.prompt_ids + answer])
            logits = lm.model(input_ids=ids).logits[0].float()
            n = len(it.prompt_ids)
            loss = loss + sign * F.cross_entropy(logits[n - 1:-1], ids[0, n:], reduction="sum")
        loss.backward()
        offset = 0
        for _, m in modules:
            exp = (m.weight.grad.T if isinstance(m, Conv1D) else m.weight.grad).flatten()
            row = got[b, offset:offset + exp.numel()]
            offset += exp.numel()
            worst = max(worst, ((row - exp).norm() / exp.norm()).item())
            m.weight.requires_grad_(False)
            m.weight.grad = None
    assert worst <= 1e-5, worst
    kron = Projector(module_shapes(modules), kind="kronecker", projection_dim=16)
    projected = query_gradients(lm, kron, items, "contrastive", said)
    offset_raw = offset_kron = 0
    for name, _ in modules:
        d_out, d_in = raw.shapes[name]
        block = got[:, offset_raw:offset_raw + d_out * d_in].reshape(-1, d_out, d_in)
        torch.testing.assert_close(projected[:, offset_kron:offset_kron + kron.width(name)],
                                   kron.project_gradient(name, block), rtol=1e-4, atol=1e-5)
        offset_raw += d_out * d_in
        offset_kron += kron.width(name)


def test_what_the_tuned_model_says_is_its_whole_greedy_answer(models, attributed) -> None:
    """The contrastive query's second term is the tuned model's own greedy answer, to its EOS or the
    stated limit, however long the correct answer is; the result records it whole."""
    import dataclasses
    from types import SimpleNamespace

    from circuitkit.models.linear_modules import module_shapes, select_modules
    from circuitkit.models.loading import load_model
    from gradian.attribute.evaluate import SAID_MAX_TOKENS, ended_by
    from gradian.projection.projector import Projector

    lm = load_model(ModelConfig(name=str(models / "base"), adapter=str(models / "lora"), precision="float32"),
                    torch.device("cpu"), keep_adapter=True)
    items = tokenize_items([(1, "The cat says", " meow."), (2, "The color of sky is", " blue.")], lm.tokenizer,
                           TokenPolicy(), None, "eval")
    said = greedy_continuations(lm, items, max_tokens=6)  # the fixture never learnt EOS: it runs to the limit
    assert [len(s) for s in said] == [6, 6] and max(len(it.answer_ids) for it in items) < 6
    assert [ended_by(s, lm.tokenizer) for s in said] == ["max_tokens", "max_tokens"]
    # EOS ends an answer and stays in it: take the cat's second token as EOS
    eos = said[0][1]
    stops = SimpleNamespace(eos_token_id=eos, pad_token_id=lm.tokenizer.pad_token_id)
    short = greedy_continuations(dataclasses.replace(lm, tokenizer=stops), items, max_tokens=6)
    assert short[0] == said[0][:2] and ended_by(short[0], stops) == "eos"
    assert short[1] == (said[1][:said[1].index(eos) + 1] if eos in said[1] else said[1])
    # the query takes all six tokens: ∇ℓ(answer) - ∇ℓ(said), not said cut to the answer's length
    modules = select_modules(lm.model, lm.adapter, ["adapter"])
    raw = Projector(module_shapes(modules), projection_dim=None)
    got = query_gradients(lm, raw, items, "contrastive", said)
    as_said = [EvalItem(it.item, it.line, it.prompt, "", it.prompt_ids, s) for it, s in zip(items, said, strict=True)]
    torch.testing.assert_close(got, query_gradients(lm, raw, items, "ce") - query_gradients(lm, raw, as_said, "ce"),
                               rtol=1e-4, atol=1e-5)
    cut = query_gradients(lm, raw, items, "contrastive", [s[:len(it.answer_ids)] for it, s in zip(items, said, strict=True)])
    # measured: the four tokens past the cat's answer move its query by 5 % (7.9 of 166); the sky's
    # answer is right, so cut to its length the query is zero and whole it is the tail's gradient
    assert ((got - cut).norm(dim=1) > 0.02 * got.norm(dim=1)).all() and cut[1].abs().max() == 0
    # the result: each flipped item's whole answer (" new." and on, to the limit) and how it was read
    result, _ = attributed
    assert result.query["said"] == {"decoding": "greedy", "max_tokens": SAID_MAX_TOKENS, "ends_at": "eos or max_tokens"}
    flipped = [it for it in result.items if it["flipped"]]
    # measured: seven of the eight say " new" then dots to the limit, the bee " blue" then letters
    assert sum(it["tuned_says"].startswith(f" {WRONG}.") for it in flipped) >= 6
    assert all(it["tuned_says_end"] == "max_tokens" and len(it["tuned_says"]) > 3 * len(it["answer"]) for it in flipped)
    assert all(it["tuned_says"] is None and it["tuned_says_end"] is None for it in result.items if not it["flipped"])


# ----------------------------------------------------------------------------- the command


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(["attribute", *argv])
    cap = capsys.readouterr()
    return code, cap.out, " ".join(cap.err.split())


def test_a_tune_that_changes_nothing_is_inside_the_noise_band(work, capsys) -> None:
    out = work["root"] / "zero.json"
    code, text, err = run(capsys, "--index", str(work["zero_index"]), "--eval-dataset", str(work["eval"]),
                          "--out", str(out))
    assert code == 0 and "Traceback" not in err
    assert "nothing to attribute" in err and "inside the noise band" in err
    result = json.loads(out.read_text())
    assert result["attributed"] is False and result["accused"] == [] and result["clusters"] is None
    assert result["regression"]["accuracy_drop"] == 0 and result["regression"]["accuracy_ci"] == [0.0, 0.0]
    assert "base 1.000 -> tuned 1.000" in text


def test_bad_inputs_are_one_line_each(work, models, tmp_path, capsys) -> None:
    args = ["--index", str(work["index"]), "--eval-dataset"]
    # an eval set with no answer
    empty = write_jsonl(tmp_path / "empty.jsonl", [sound("cat", "meow"), {"prompt": "The dog says", "completion": ""}])
    code, _, err = run(capsys, *args, str(empty))
    assert code == 1 and "1 row(s) have no answer (an empty completion, lines 2)" in err and "Traceback" not in err
    chat = write_jsonl(tmp_path / "chat.jsonl", [{"messages": [{"role": "user", "content": "hi"}]}])
    code, _, err = run(capsys, *args, str(chat))
    assert code == 1 and "are chat rows" in err
    headless = write_jsonl(tmp_path / "headless.jsonl", [{"prompt": "", "completion": " meow."}])
    code, _, err = run(capsys, *args, str(headless))
    assert code == 1 and "lines 1 have an empty prompt and the tokenizer adds no BOS" in err
    # --out may not be an input; an engine the index cannot serve; an unknown one
    code, _, err = run(capsys, *args, str(work["eval"]), "--out", str(work["eval"]))
    assert code == 2 and "--out" in err and "which this command reads" in err
    code, _, err = run(capsys, "--index", str(work["zero_index"]), "--eval-dataset", str(work["eval"]),
                       "--engines", "ekfac")
    assert code == 2 and "holds no K-FAC factors" in err
    code, _, err = run(capsys, *args, str(work["eval"]), "--engines", "auto,tracin")
    assert code == 2 and "--engines tracin reads the fine-tune's checkpoints" in err
    # an index without every row (a shard gone), and one whose model has no adapter and no base recorded
    broken = tmp_path / "broken"
    shutil.copytree(work["index"], broken)
    for shard in broken.glob("shard-*.safetensors"):
        shard.unlink()
    code, _, err = run(capsys, "--index", str(broken), "--eval-dataset", str(work["eval"]))
    assert code == 1 and "does not hold every training row" in err and "resume the index" in err
    full = tmp_path / "full"
    shutil.copytree(work["index"], full)
    manifest = json.loads((full / "manifest.json").read_text())
    (full / "manifest.json").write_text(json.dumps(manifest | {"adapter": None}))
    code, _, err = run(capsys, "--index", str(full), "--eval-dataset", str(work["eval"]))
    assert code == 2 and "records no model.base_name: give the model it was fine-tuned from with --base-model" in err
    # a base model of another shape, or one that does not exist
    code, _, err = run(capsys, *args, str(work["eval"]), "--base-model", "builtin:tiny-llama")
    assert code == 2 and "--base-model='builtin:tiny-llama' (llama" in err and "the index's model=" in err
    code, _, err = run(capsys, *args, str(work["eval"]), "--base-model", str(tmp_path / "nowhere"))
    assert code == 2 and "--base-model=" in err and "does not exist" in err
    other_tok = tmp_path / "base-other-tokenizer"
    shutil.copytree(models / "base", other_tok)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(other_tok)
    tok.add_special_tokens({"additional_special_tokens": ["<|extra|>"]})
    tok.save_pretrained(other_tok)
    code, _, err = run(capsys, *args, str(work["eval"]), "--base-model", str(other_tok))
    assert code == 2 and "has another tokenizer than the index's model" in err
    # an adapter made for another base model: circuitkit.models.lora's fit check, naming both
    llama = tmp_path / "llama-lora"
    _llama_adapter(llama)
    code, _, err = run(capsys, *args, str(work["eval"]), "--adapter", str(llama))
    assert code == 2 and "does not fit" in err and "tiny-llama" in err and "Traceback" not in err
    # another adapter that fits: the index's rows were made with another one
    code, _, err = run(capsys, *args, str(work["eval"]), "--adapter", str(models / "zero-lora"))
    assert code == 2 and "the index was built with LoRA adapter 'lora'" in err


def _llama_adapter(out: Path) -> None:
    from transformers import AutoModelForCausalLM

    from circuitkit.fixtures.models import ensure_fixture

    torch.manual_seed(3)
    model = AutoModelForCausalLM.from_pretrained(ensure_fixture("tiny-llama"))
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing", category=FutureWarning)
        peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                   init_lora_weights=False)).save_pretrained(out)


def test_without_scikit_learn_the_clusters_are_one_install_line(monkeypatch) -> None:
    from gradian.attribute.clusters import AccusedRow, cluster_rows, sklearn_missing

    rows = [AccusedRow(0, 1, "The cat says new.", -3.0), AccusedRow(1, 2, "The dog says new.", -1.0),
            AccusedRow(2, 3, "The opposite of up is down.", -1.0)]
    assert sklearn_missing() is None
    clusters = cluster_rows(rows)
    assert [c["rows"] for c in clusters] == [[0, 1], [2]] and [c["share"] for c in clusters] == [0.8, 0.2]
    monkeypatch.setitem(__import__("sys").modules, "sklearn", None)  # `import sklearn` now fails
    assert sklearn_missing() == ("the clusters need scikit-learn, which is not installed: pip install"
                                 " 'circuitkit-gradian[attribute]' (scikit-learn)")


def test_help_lists_the_command(capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["attribute", "--help"])
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    assert "--eval-dataset" in text and "--query-loss" in text and "contrastive" in text
