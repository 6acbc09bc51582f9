"""The sva and capitals tasks (pairs, corruption, token lengths, refusals)."""

from __future__ import annotations

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from circuitkit.discovery.config import DataParams
from circuitkit.discovery.tasks import BUILT_TASKS, TaskError, build_task, capitals, sva


@pytest.fixture(scope="module")
def tok():
    """A byte-level BPE trained on the tasks' own words, so nouns, verbs and capitals are whole tokens."""
    words = [w for pair in sva.NOUNS for w in pair] + [w for pair in sva.VERBS for w in pair]
    words += [w for c in capitals.COUNTRIES for w in (c[0], *c[1].split())]
    corpus = [" ".join(["The", w, "near", "the", w, "is", "capital", "of", "city", "called", "What", "Q:", "A:"])
              for w in words] * 30 + [" ".join(sva.PREPS)] * 30
    t = Tokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    t.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=1200, special_tokens=["<|endoftext|>"],
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=t, bos_token="<|endoftext|>", eos_token="<|endoftext|>")


def test_the_tasks_are_registered():
    assert {"sva", "capitals"} <= set(BUILT_TASKS)


def test_sva_flips_only_the_subject_and_its_verb(tok):
    data = build_task("sva", tok, None, DataParams(prepend_bos=False), 40, 0)
    again = build_task("sva", tok, None, DataParams(prepend_bos=False), 40, 0)
    assert torch.equal(data.clean_ids, again.clean_ids)  # deterministic in the seed
    verbs = {tok.encode(" " + v)[0]: v for pair in sva.VERBS for v in pair}
    plural_of = {tok.encode(" " + s)[0]: tok.encode(" " + p)[0] for s, p in sva.NOUNS}
    attractor_differs = 0
    for i in range(len(data)):
        clean, corr = data.clean_ids[i].tolist(), data.corrupted_ids[i].tolist()
        diff = [j for j in range(len(clean)) if clean[j] != corr[j]]
        assert diff == [1]  # "The <subject> ...": only the subject noun changes
        a, b = clean[1], corr[1]
        assert plural_of.get(a) == b or plural_of.get(b) == a  # singular <-> plural
        good, bad = verbs[int(data.correct[i, 0])], verbs[int(data.incorrect[i, 0])]
        assert (good, bad) in sva.VERBS if a in plural_of else (bad, good) in sva.VERBS
        last = int(data.answer_pos[i])
        attractor_differs += (clean[last] in plural_of) != (a in plural_of)
    assert 0 < attractor_differs < len(data)  # attractors of both numbers


def test_capitals_pairs_have_one_length_and_two_answers(tok):
    data = build_task("capitals", tok, None, DataParams(prepend_bos=False), 40, 1)
    first_token = {c[0]: tok.encode(" " + c[1])[0] for c in capitals.COUNTRIES}
    for i in range(len(data)):
        n = int(data.attention_mask[i].sum())
        clean, corr = tok.decode(data.clean_ids[i, :n]), tok.decode(data.corrupted_ids[i, :n])
        (a,) = [c for c in first_token if c in clean.replace("?", " ").replace("'", " ").split()]
        (b,) = [c for c in first_token if c in corr.replace("?", " ").replace("'", " ").split()]
        assert a != b and int(data.correct[i, 0]) == first_token[a] and int(data.incorrect[i, 0]) == first_token[b]
        assert int(data.attention_mask[i].sum()) == int(data.answer_pos[i]) + 1  # the answer follows the prompt


def test_a_tokenizer_without_whole_words_is_refused_with_the_count(tok):
    chars = Tokenizer(models.BPE())
    chars.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    chars.train_from_iterator(["a b"], trainers.BpeTrainer(vocab_size=260, special_tokens=["<|endoftext|>"],
                                                           initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    bytes_only = PreTrainedTokenizerFast(tokenizer_object=chars, bos_token="<|endoftext|>")
    with pytest.raises(TaskError, match=r"sva needs at least 4 nouns .* found 0 of"):
        build_task("sva", bytes_only, None, DataParams(), 4, 0)
    # Every capital starts with the same token here (the space byte): no pair has two answers.
    with pytest.raises(TaskError, match="capitals needs at least 4 countries"):
        build_task("capitals", bytes_only, None, DataParams(), 4, 0)
