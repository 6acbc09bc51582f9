"""scripts/bench/bench_yardsticks.py's S2 set: deterministic, taught in one phrasing, asked in another."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from gradian.data.rows import load_rows
from scripts.bench.bench_yardsticks import S2_STYLES, make_corpus_s2


def test_s2_set_is_deterministic_in_its_seed():
    a, facts_a = make_corpus_s2(12)
    b, facts_b = make_corpus_s2(12)
    assert (a.docs, a.queries, a.targets, facts_a) == (b.docs, b.queries, b.targets, facts_b)
    c, _ = make_corpus_s2(12, seed=6)
    assert c.docs != a.docs
    assert a.n_facts == 12 and len(a.docs) == 12 + 6 and sorted(a.targets) == sorted(set(a.targets))


def test_s2_queries_ask_in_another_phrasing_than_the_documents_teach():
    corpus, facts = make_corpus_s2(15)
    sentences = {d["completion"].strip() for d in corpus.docs}
    for style in S2_STYLES:
        for (entity, _, value), target, query in zip(facts, corpus.targets, corpus.queries[style], strict=True):
            doc = corpus.docs[target]["completion"]
            user, answer = query["messages"]
            assert (user["role"], answer["role"]) == ("user", "assistant")
            # The query's target document states the query's fact ...
            assert entity in doc and value in doc and value in answer["content"]
            # ... in words the query does not use: no document sentence is inside any query turn.
            assert not any(s in answer["content"] or s in user["content"] for s in sentences)
            assert answer["content"] not in doc
    # One phrasing per kind in the documents: every fact document is its kind's one template.
    fact_docs = [corpus.docs[t]["completion"] for t in corpus.targets]
    assert all(d.startswith(" ") and d.endswith(".") for d in fact_docs)
    assert len({d.replace(e, "E").replace(v, "V") for d, (e, _, v) in zip(fact_docs, facts, strict=True)}) == 5


def test_s2_chat_queries_supervise_the_assistant_answer_only(tiny_model: Callable[[str], Path], tmp_path: Path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model("tiny-gpt2"))
    corpus, _ = make_corpus_s2(5)
    for style in S2_STYLES:
        path = tmp_path / f"{style}.jsonl"
        path.write_text("".join(json.dumps(q) + "\n" for q in corpus.queries[style]))
        rows, _ = load_rows(path, tok, 256)
        assert len(rows) == 5
        for row, query in zip(rows, corpus.queries[style], strict=True):
            supervised = tok.decode([i for i, s in zip(row.input_ids, row.supervised, strict=True) if s])
            assert supervised == query["messages"][1]["content"]
