"""Tasks: clean/corrupted pairs of equal length, single-token answers, seeded, loud errors.

Most tests run on the fixture tokenizer (`tiny_model("tiny-gpt2")`). Tokenizers that exercise
one branch (numbers split into digits, two-digit number tokens, no single-token names, no
single-token letters) are trained here in a fraction of a second with `tokenizers`.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from circuitkit.discovery.config import DataParams
from circuitkit.discovery.tasks import (
    BUILT_TASKS,
    SAMPLE_FILES,
    TaskData,
    TaskError,
    build_task,
    greater_than,
    ioi,
    jsonl,
    mmlu,
)

REPO = Path(__file__).resolve().parents[3]


# --------------------------------------------------------------------------- tokenizers

@pytest.fixture(scope="module")
def tok(tiny_model):
    """The fixture model's tokenizer (byte-level BPE with English words, names and numbers)."""
    return AutoTokenizer.from_pretrained(tiny_model("tiny-gpt2"))


def _train(corpus: list[str], pre: list, vocab_size: int = 2000) -> PreTrainedTokenizerFast:
    """A small byte-level BPE tokenizer trained on `corpus` with the pre-tokenizers `pre`."""
    t = Tokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.Sequence([*pre, pre_tokenizers.ByteLevel(add_prefix_space=False)])
    t.decoder = decoders.ByteLevel()
    t.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=t, bos_token="<|endoftext|>", eos_token="<|endoftext|>")


def _words() -> str:
    """Every word of the ioi / greater_than templates, places, objects and nouns."""
    words = {w for t in (*ioi.TEMPLATES, greater_than.TEMPLATE) for w in t.replace("{", " ").replace("}", " ").split()}
    return " ".join(sorted(words | set(ioi.PLACES) | set(ioi.THINGS) | set(greater_than.NOUNS)))


@pytest.fixture(scope="module")
def pairs_tok():
    """Numbers split into two-digit chunks: '1732' -> '17' '32' (the GPT-2 situation)."""
    corpus = [_words() + " " + " ".join(ioi.NAMES)] * 20 + [f"17{y:02d} {y:02d}" for y in range(100)] * 5
    return _train(corpus, [pre_tokenizers.Split(Regex(r"\d\d"), behavior="isolated")])


@pytest.fixture(scope="module")
def digits_tok():
    """Numbers split into single digits (the Llama 2 / Gemma situation); no names, small vocab."""
    return _train([_words()] * 20 + ["0 1 2 3 4 5 6 7 8 9"], [pre_tokenizers.Digits(individual_digits=True)], 300)


@pytest.fixture(scope="module")
def merged_years_tok():
    """Whole years are single tokens (' 1732'): neither greater-than representation works."""
    return _train([_words()] * 20 + [f"the year 17{y:02d}" for y in range(100)] * 5, [])


@pytest.fixture(scope="module")
def mc_tok():
    """Trained on rendered multiple-choice prompts: ' A'..' D' are single tokens."""
    data = SAMPLE_FILES["mmlu"].parent
    qs = mmlu.read_questions(data / "mmlu_sample.csv") + mmlu.read_questions(data / "mmlu_sample.jsonl")
    corpus = [mmlu.render(q, q.choices) + " " + mmlu.LETTERS[q.answer] for q in qs] * 5 + [MMLU_CSV] * 5
    return _train(corpus, [])


# --------------------------------------------------------------------------- common checks

def check_layout(d: TaskData, n: int) -> None:
    """Shapes, right padding, one shared mask, answer position = last real token, -1 padding."""
    assert len(d) == n
    assert d.clean_ids.shape == d.corrupted_ids.shape == d.attention_mask.shape
    assert d.clean_ids.dtype == d.corrupted_ids.dtype == torch.long
    assert d.answer_pos.shape == (n,)
    assert d.correct.shape[0] == d.incorrect.shape[0] == n
    lengths = d.attention_mask.sum(1)
    assert torch.equal(d.answer_pos, lengths - 1)
    for i in range(n):  # right-padded: ones then zeros
        assert d.attention_mask[i, : lengths[i]].all() and not d.attention_mask[i, lengths[i]:].any()
    for ans in (d.correct, d.incorrect):
        assert (ans[:, 0] >= 0).all()  # at least one answer per row
        assert ((ans >= 0) | (ans == -1)).all()


def real(ids: torch.Tensor, mask: torch.Tensor) -> list[int]:
    """The ids of one row where the mask is 1 (the prompt without padding)."""
    return ids[mask.bool()].tolist()


def diff_positions(d: TaskData, i: int) -> list[int]:
    """Positions where row i's clean and corrupted ids differ."""
    return torch.nonzero(d.clean_ids[i] != d.corrupted_ids[i]).flatten().tolist()


def answers(tokenizer, row: torch.Tensor) -> list[str]:
    """Decoded answer tokens of one row, padding (-1) dropped."""
    return [tokenizer.decode([t]) for t in row.tolist() if t >= 0]


def assert_single_tokens(tokenizer, row: torch.Tensor) -> None:
    """Each answer id decodes to a text that encodes back to exactly that one id."""
    for t in row.tolist():
        if t >= 0:
            assert tokenizer.encode(tokenizer.decode([t]), add_special_tokens=False) == [t]


def same(a: TaskData, b: TaskData) -> bool:
    """True when two TaskData hold identical tensors."""
    return all(torch.equal(x, y) for x, y in zip(
        (a.clean_ids, a.corrupted_ids, a.attention_mask, a.answer_pos, a.correct, a.incorrect),
        (b.clean_ids, b.corrupted_ids, b.attention_mask, b.answer_pos, b.correct, b.incorrect), strict=True))


def write(path: Path, text: str) -> Path:
    """Write `text` to `path` (utf-8) and return the path."""
    path.write_text(text, encoding="utf-8")
    return path


# --------------------------------------------------------------------------- registry

def test_all_tasks_registered_and_unknown_task_lists_them(tok):
    """All seven tasks are registered; an unknown one names the available tasks."""
    assert BUILT_TASKS == ("induction", "ioi", "greater_than", "mmlu", "jsonl", "sva", "capitals")
    with pytest.raises(TaskError, match="available: induction, ioi, greater_than, mmlu, jsonl, sva, capitals"):
        build_task("sst2", tok, None, DataParams(), 4, 0)


def test_sample_files_ship_with_the_package():
    """The shipped samples exist under tasks/data/, which pyproject packages."""
    for path in (*SAMPLE_FILES.values(), SAMPLE_FILES["mmlu"].with_suffix(".jsonl")):
        assert path.is_file() and path.parent.name == "data"
    assert '"discovery/tasks/data/*"' in (REPO / "pyproject.toml").read_text()


@pytest.mark.parametrize("task", ["mmlu", "jsonl"])
def test_file_tasks_fall_back_to_the_sample_with_a_warning(tok, mc_tok, task, caplog):
    """data_path=null reads the shipped sample and says so."""
    with caplog.at_level(logging.WARNING, logger="circuitkit.discovery.tasks"):
        d = build_task(task, mc_tok if task == "mmlu" else tok, None, DataParams(data_path=None), 4, 0)
    check_layout(d, 4)
    assert f"{SAMPLE_FILES[task].name}" in caplog.text and "data_path is null" in caplog.text


def test_missing_data_path_names_the_key(tok, tmp_path):
    """A data_path that does not exist is an error naming the config key."""
    with pytest.raises(TaskError, match="discovery.data_params.data_path=.*does not exist"):
        build_task("jsonl", tok, None, DataParams(data_path=str(tmp_path / "nope.jsonl")), 4, 0)


# --------------------------------------------------------------------------- ioi

def test_ioi_pairs_answers_and_abc_corruption(tok):
    """IO/S answers are single name tokens; corruption replaces only S2, with a third name."""
    d = build_task("ioi", tok, None, DataParams(), 24, 0)
    check_layout(d, 24)
    assert d.correct.shape[1] == d.incorrect.shape[1] == 1
    name_ids = {tid for _, tid in ioi.single_token_names(tok)}
    for i in range(24):
        io, s = int(d.correct[i, 0]), int(d.incorrect[i, 0])
        assert io != s and {io, s} <= name_ids
        assert tok.decode([io]).strip() in ioi.NAMES and tok.decode([io]).startswith(" ")
        assert_single_tokens(tok, d.correct[i])
        assert_single_tokens(tok, d.incorrect[i])
        clean = real(d.clean_ids[i], d.attention_mask[i])
        corrupted = real(d.corrupted_ids[i], d.attention_mask[i])
        assert clean.count(io) == 1 and clean.count(s) == 2  # IO once, S twice (S1, S2)
        (pos,) = diff_positions(d, i)  # exactly one token changes: S2 -> C
        assert d.clean_ids[i, pos] == s and pos == max(k for k, t in enumerate(clean) if t == s)
        c = int(d.corrupted_ids[i, pos])
        assert c in name_ids and c not in (io, s)
        assert corrupted.count(io) == corrupted.count(s) == corrupted.count(c) == 1  # A, B, C distinct
        assert tok.decode(clean).endswith(" to")


def test_ioi_is_seeded(tok):
    """Same seed, same data; another seed, other data."""
    a = build_task("ioi", tok, None, DataParams(), 12, 3)
    assert same(a, build_task("ioi", tok, None, DataParams(), 12, 3))
    assert not same(a, build_task("ioi", tok, None, DataParams(), 12, 4))


def test_ioi_without_three_single_token_names_says_so(digits_tok):
    """A tokenizer without single-token names gets a clear TaskError."""
    assert len(ioi.single_token_names(digits_tok)) < 3
    with pytest.raises(TaskError, match=r"at least 3 first names that are a single token.*found 0"):
        build_task("ioi", digits_tok, None, DataParams(), 4, 0)


# --------------------------------------------------------------------------- greater_than

def check_greater_than(tokenizer, d: TaskData, kind: str) -> None:
    """Corruption changes only the first year's ending (to 01); answers split around YY."""
    for i in range(len(d)):
        pos = diff_positions(d, i)
        assert pos, "corrupted must differ from clean"
        clean_text, corrupted_text = (tokenizer.decode(real(x[i], d.attention_mask[i]))
                                      for x in (d.clean_ids, d.corrupted_ids))
        yy = clean_text.split("from the year 17")[1][:2]
        assert corrupted_text == clean_text.replace(f"from the year 17{yy}", "from the year 1701")
        assert tokenizer.decode(d.clean_ids[i, pos[0]:pos[-1] + 1]).strip().endswith(yy[-1])
        assert clean_text.endswith(" to the year 17")
        later, earlier = answers(tokenizer, d.correct[i]), answers(tokenizer, d.incorrect[i])
        assert_single_tokens(tokenizer, d.correct[i])
        assert_single_tokens(tokenizer, d.incorrect[i])
        if kind == "two_digit":
            assert all(len(a) == 2 and int(a) > int(yy) for a in later)
            assert all(len(a) == 2 and int(a) <= int(yy) for a in earlier)
        else:
            assert all(len(a) == 1 and int(a) > int(yy[0]) for a in later)
            assert all(len(a) == 1 and int(a) < int(yy[0]) for a in earlier)
        assert later and earlier and not set(later) & set(earlier)


def test_greater_than_on_the_fixture(tok):
    """The fixture tokenizer gets a working scheme (then the data is right) or a clear TaskError."""
    try:
        scheme = greater_than.choose_scheme(tok)
    except TaskError as err:  # tiny.py's vocabulary has whole-year tokens (' 1732'): a clear error
        assert "only 0 of the 100 endings" in str(err) and "' 1732'" in str(err)
        with pytest.raises(TaskError, match="greater_than cannot read a year ending"):
            build_task("greater_than", tok, None, DataParams(), 4, 0)
        return
    d = build_task("greater_than", tok, None, DataParams(), 16, 0)
    check_layout(d, 16)
    check_greater_than(tok, d, scheme.kind)


def test_greater_than_two_digit_tokens(pairs_tok):
    """'17' + 'YY' tokenizers: one token changes, answers cover all 100 endings."""
    assert greater_than.choose_scheme(pairs_tok).kind == "two_digit"
    d = build_task("greater_than", pairs_tok, None, DataParams(), 16, 0)
    check_layout(d, 16)
    check_greater_than(pairs_tok, d, "two_digit")
    for i in range(16):
        assert len(diff_positions(d, i)) == 1  # '17' '32' -> '17' '01'
        assert len(answers(pairs_tok, d.correct[i])) + len(answers(pairs_tok, d.incorrect[i])) == 100


def test_greater_than_single_digit_tokenizer_uses_the_tens_digit(digits_tok):
    """Digit-by-digit tokenizers score the tens digit."""
    assert greater_than.choose_scheme(digits_tok).kind == "tens_digit"
    d = build_task("greater_than", digits_tok, None, DataParams(), 16, 0)
    check_layout(d, 16)
    check_greater_than(digits_tok, d, "tens_digit")


def test_greater_than_is_seeded(pairs_tok):
    """Same seed, same data; another seed, other data."""
    a = build_task("greater_than", pairs_tok, None, DataParams(), 8, 1)
    assert same(a, build_task("greater_than", pairs_tok, None, DataParams(), 8, 1))
    assert not same(a, build_task("greater_than", pairs_tok, None, DataParams(), 8, 2))


def test_greater_than_with_whole_year_tokens_is_an_error(merged_years_tok):
    """A tokenizer with whole-year tokens gets a TaskError showing the split."""
    with pytest.raises(TaskError, match=r"only 0 of the 100 endings.*' 1732'"):
        build_task("greater_than", merged_years_tok, None, DataParams(), 4, 0)


# --------------------------------------------------------------------------- mmlu

MMLU_CSV = ('What is 2 + 2?,3,4,5,6,B\n'
            '"Which is a color, not a shape?",Circle,Square,Red,Cube,C\n'
            'Which animal barks?,Dog,Cat,Fish,Bird,A\n')


def check_mmlu(tokenizer, d: TaskData) -> None:
    """Only the two swapped option lines change; correct/incorrect are the two letters."""
    for i in range(len(d)):
        right, new = answers(tokenizer, d.correct[i]), answers(tokenizer, d.incorrect[i])
        assert_single_tokens(tokenizer, d.correct[i])
        assert right[0] in (" A", " B", " C", " D") and new[0] in (" A", " B", " C", " D") and right != new
        clean, corrupted = (tokenizer.decode(real(x[i], d.attention_mask[i])).split("\n")
                            for x in (d.clean_ids, d.corrupted_ids))
        assert clean[-1] == corrupted[-1] == "Answer:"
        changed = [k for k, (a, b) in enumerate(zip(clean, corrupted, strict=True)) if a != b]
        lines = {line[:1]: k for k, line in enumerate(clean) if line[1:3] == ". "}
        assert changed == sorted([lines[right[0].strip()], lines[new[0].strip()]])
        a, b = changed
        assert clean[a][3:] == corrupted[b][3:] and clean[b][3:] == corrupted[a][3:]


@pytest.mark.parametrize("sample", ["mmlu_sample.csv", "mmlu_sample.jsonl"])
def test_mmlu_samples(mc_tok, sample):
    """Both shipped MMLU samples build; the correct letter is the file's answer."""
    path = SAMPLE_FILES["mmlu"].parent / sample
    d = build_task("mmlu", mc_tok, None, DataParams(data_path=str(path)), 20, 0)
    check_layout(d, 20)
    assert d.correct.shape[1] == d.incorrect.shape[1] == 1
    check_mmlu(mc_tok, d)
    truth = {}
    for q in mmlu.read_questions(path):
        truth[q.question] = mmlu.LETTERS[q.answer]
    for i in range(20):  # the correct letter is the file's answer
        text = mc_tok.decode(real(d.clean_ids[i], d.attention_mask[i]))
        question = text.split("\n\n")[1].split("\n")[0]
        assert answers(mc_tok, d.correct[i]) == [" " + truth[question]]


def test_mmlu_directory_subjects_and_seeding(mc_tok, tmp_path):
    """A directory mixes CSV and JSONL, subjects come from file names, seeded."""
    write(tmp_path / "basic_math_test.csv", MMLU_CSV)
    write(tmp_path / "pets_test.jsonl", json.dumps({"question": "Which pet purrs?", "choices": ["Dog", "Cat"],
                                                   "answer": 1}) + "\n")
    dp = DataParams(data_path=str(tmp_path))
    d = build_task("mmlu", mc_tok, None, dp, 4, 0)
    check_layout(d, 4)
    check_mmlu(mc_tok, d)
    texts = [mc_tok.decode(real(d.clean_ids[i], d.attention_mask[i])) for i in range(4)]
    assert sum("about basic math." in t for t in texts) == 3 and sum("about pets." in t for t in texts) == 1
    assert same(d, build_task("mmlu", mc_tok, None, dp, 4, 0))
    assert not same(d, build_task("mmlu", mc_tok, None, dp, 4, 1))


def test_mmlu_fewer_rows_than_requested_warns_and_uses_all(mc_tok, tmp_path, caplog):
    """Fewer rows than n: all rows are used and the warning names both numbers."""
    path = write(tmp_path / "q.csv", MMLU_CSV)
    with caplog.at_level(logging.WARNING):
        d = build_task("mmlu", mc_tok, None, DataParams(data_path=str(path)), 10, 0)
    assert len(d) == 3 and "has 3 rows but 10 examples were requested" in caplog.text


@pytest.mark.parametrize("name,text,line,what", [
    ("bad.csv", MMLU_CSV + "Too few columns,1,2,3\n", 4, "expected 6 columns"),
    ("bad.csv", MMLU_CSV + "What is 1 + 1?,1,2,3,4,E\n", 4, "'E' is not one of the letters A, B, C, D"),
    ("bad.csv", "question,A,B,C,D,answer\n" + MMLU_CSV, 1, "no header row"),
    ("bad.csv", MMLU_CSV + ",1,2,3,4,A\n", 4, "question .* is empty"),
    ("bad.jsonl", '{"question": "Q?", "choices": ["a", "b"], "answer": 0}\n{"question": "Q?", "choices": ["a"],'
                  ' "answer": 0}\n', 2, "'choices' must be a list of 2 to 26"),
    ("bad.jsonl", '{"question": "Q?", "choices": ["a", "b"], "answer": 5}\n', 1, "answer index 5 is out of range"),
    ("bad.jsonl", '\n{"question": "Q?", "choices": ["a", "b"] "answer": 0}\n', 2, "not valid JSON"),
    ("bad.txt", MMLU_CSV, None, "unknown file type '.txt'"),
])
def test_mmlu_malformed_rows_name_file_and_line(tok, tmp_path, name, text, line, what):
    """Each malformed row is a TaskError that starts with file:line."""
    path = write(tmp_path / name, text)
    where = f"{path}:{line}: " if line else f"{path}: "
    with pytest.raises(TaskError, match=what) as err:
        build_task("mmlu", tok, None, DataParams(data_path=str(path)), 2, 0)
    assert str(err.value).startswith(where)


def test_mmlu_identical_options_cannot_be_swapped(mc_tok, tmp_path):
    """A question whose options are all the same cannot be corrupted: TaskError."""
    path = write(tmp_path / "same.csv", "Pick one,yes,yes,yes,yes,A\n")
    with pytest.raises(TaskError, match=rf"^{path}:1: no swap of the right option"):
        build_task("mmlu", mc_tok, None, DataParams(data_path=str(path)), 1, 0)


def test_mmlu_on_the_fixture(tok):
    """The fixture tokenizer either builds the sample, or says which letter is not one token."""
    try:
        mmlu.letter_ids(tok, 4)
    except TaskError as err:  # tiny.py's vocabulary: ' B' and ' C' are two tokens each
        assert "each option letter to be one token" in str(err)
        with pytest.raises(TaskError, match="each option letter to be one token"):
            build_task("mmlu", tok, None, DataParams(data_path=str(SAMPLE_FILES["mmlu"])), 4, 0)
        return
    d = build_task("mmlu", tok, None, DataParams(data_path=str(SAMPLE_FILES["mmlu"])), 8, 0)
    check_layout(d, 8)
    check_mmlu(tok, d)


def test_mmlu_letter_that_is_not_one_token_is_an_error(digits_tok, tmp_path):
    """Option letters that are not one token are a TaskError."""
    path = write(tmp_path / "q.csv", MMLU_CSV)
    with pytest.raises(TaskError, match="each option letter to be one token"):
        build_task("mmlu", digits_tok, None, DataParams(data_path=str(path)), 2, 0)


# --------------------------------------------------------------------------- jsonl

def row(clean: str, corrupted: str, correct, incorrect) -> str:
    """One JSONL line of the jsonl task."""
    return json.dumps({"clean": clean, "corrupted": corrupted, "correct": correct, "incorrect": incorrect}) + "\n"


IOI_CLEAN = "When Mary and John went to the store, John gave a drink to"
IOI_CORRUPTED = "When Mary and John went to the store, Lisa gave a drink to"
GOOD = row(IOI_CLEAN, IOI_CORRUPTED, " Mary", " John")  # single tokens for the fixture and real tokenizers


def test_jsonl_sample(tok):
    """The shipped JSONL sample builds and its answers decode to the file's strings."""
    rows = [json.loads(line) for line in SAMPLE_FILES["jsonl"].read_text().splitlines() if line.strip()]
    # The tokenizer's own policy (GPT-2: no BOS), so each row decodes to the file's text.
    d = build_task("jsonl", tok, None, DataParams(data_path=str(SAMPLE_FILES["jsonl"]), prepend_bos=False),
                   len(rows), 0)
    check_layout(d, len(rows))
    by_clean = {r["clean"]: r for r in rows}
    for i in range(len(d)):
        clean = tok.decode(real(d.clean_ids[i], d.attention_mask[i]))
        r = by_clean[clean]
        assert tok.decode(real(d.corrupted_ids[i], d.attention_mask[i])) == r["corrupted"]
        for key, got in (("correct", d.correct[i]), ("incorrect", d.incorrect[i])):
            want = [r[key]] if isinstance(r[key], str) else r[key]
            assert answers(tok, got) == want
            assert_single_tokens(tok, got)


def test_jsonl_sampling_is_seeded_and_short_files_warn(tok, caplog):
    """Row sampling follows the seed; asking for more rows than exist warns."""
    dp = DataParams(data_path=str(SAMPLE_FILES["jsonl"]))
    a = build_task("jsonl", tok, None, dp, 6, 0)
    assert len(a) == 6 and same(a, build_task("jsonl", tok, None, dp, 6, 0))
    assert not same(a, build_task("jsonl", tok, None, dp, 6, 1))
    with caplog.at_level(logging.WARNING):
        b = build_task("jsonl", tok, None, dp, 100, 0)
    assert len(b) == 16 and "has 16 rows but 100 examples were requested; using all 16" in caplog.text.replace(
        " (discovery.data_params.num_examples + eval_examples)", "")


def test_jsonl_pair_of_different_length_names_the_line(tok, tmp_path):
    """A pair of different token lengths names its line."""
    path = write(tmp_path / "p.jsonl", GOOD + "\n" + row(IOI_CLEAN, IOI_CORRUPTED.replace("the store", "the big store"),
                                                         " Mary", " John"))
    with pytest.raises(TaskError, match=rf"^{path}:3: clean prompt is \d+ tokens but corrupted is \d+"):
        build_task("jsonl", tok, None, DataParams(data_path=str(path)), 2, 0)


def test_jsonl_two_token_answer_names_the_line_and_split(tok, tmp_path):
    """A multi-token answer names its line, its split and the first token to use."""
    word = " Parisxq"  # not a word of any vocabulary: several tokens
    split = [tok.decode([t]) for t in tok.encode(word, add_special_tokens=False)]
    assert len(split) > 1
    path = write(tmp_path / "p.jsonl", row(IOI_CLEAN, IOI_CORRUPTED, [word], " John"))
    with pytest.raises(TaskError, match=rf"^{path}:1: correct answer ' Parisxq' is {len(split)} tokens") as err:
        build_task("jsonl", tok, None, DataParams(data_path=str(path)), 1, 0)
    assert repr(split[0]) in str(err.value) and "first token of the continuation" in str(err.value)


def test_jsonl_answer_that_merges_with_the_prompt_is_an_error(merged_years_tok, tmp_path):
    # ' 17' + '32' tokenizes as ' 1732': the answer is not a separate next token.
    """An answer that changes the prompt's last token is rejected."""
    path = write(tmp_path / "p.jsonl", row("The war lasted from the year 17", "The siege lasted from the year 17", "32",
                                           " the"))
    with pytest.raises(TaskError, match=r":1: correct answer '32' merges with the end of the prompt.*' 1732'"):
        build_task("jsonl", merged_years_tok, None, DataParams(data_path=str(path)), 1, 0)


@pytest.mark.parametrize("text,what", [
    ('{"clean": "a", "corrupted": "b", "correct": " x"}\n', "missing key.*incorrect"),
    ("not json\n", "not valid JSON"),
    ('["clean"]\n', "expected a JSON object"),
    (row(IOI_CLEAN, IOI_CLEAN, " Mary", " John"), "same text"),
    (row(IOI_CLEAN, IOI_CORRUPTED, [], " John"), "'correct' must be a non-empty string"),
    (row(IOI_CLEAN, IOI_CORRUPTED, [" Mary", " John"], " John"), "both correct and incorrect"),
])
def test_jsonl_malformed_rows_name_the_line(tok, tmp_path, text, what):
    """Each malformed row is a TaskError that starts with file:line."""
    path = write(tmp_path / "p.jsonl", GOOD + text)
    with pytest.raises(TaskError, match=rf"^{path}:2: .*{what}"):
        build_task("jsonl", tok, None, DataParams(data_path=str(path)), 2, 0)


def test_jsonl_errors_do_not_depend_on_the_sample(tok, tmp_path):
    """Every row is checked, whichever rows the seed samples."""
    path = write(tmp_path / "p.jsonl", GOOD * 5 + row(IOI_CLEAN, IOI_CORRUPTED, " Parisxq", " John"))
    for seed in range(3):  # n=1 never samples line 6 for some seeds, yet it is checked
        with pytest.raises(TaskError, match=rf"^{path}:6: "):
            build_task("jsonl", tok, None, DataParams(data_path=str(path)), 1, seed)


def test_helpers_pad_and_prefix(tok):
    """Pad id is an int; prompts are the special prefix plus the plain encoding."""
    assert isinstance(jsonl.pad_token_id(tok), int)
    assert jsonl.encode_prompt(tok, "The sky is")[-len(tok.encode("The sky is", add_special_tokens=False)):] == \
        tok.encode("The sky is", add_special_tokens=False)


def test_synthetic_task_warns_that_data_path_is_unused(tok, caplog):
    """ioi / greater_than generate their data: a data_path is reported as unused, not silently dropped."""
    with caplog.at_level(logging.WARNING, logger="circuitkit.discovery.tasks"):
        build_task("ioi", tok, None, DataParams(data_path="mine.jsonl"), 2, 0)
    assert "data_path='mine.jsonl' is not used" in caplog.text
