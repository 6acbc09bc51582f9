"""Training and query rows for the induction model, as Gradian JSONL (prompt + completion).

Two kinds of row, each `BOS + distinct symbols`, 48-64 tokens, the last `n_answer` tokens being
the completion:

* ``copy``:  a segment of the prompt appears again at the end, after a lag of 12..40 tokens; the
  prompt ends with the segment's first token and the completion is the rest of it. The model
  predicts it by induction: previous-token head L0H2, induction head L1H1 (fixture_info.json).
* ``fresh``: same layout, but the completion is symbols that never occurred in the row: nothing
  to copy, so the induction circuit has nothing to do; the model's guess comes from the direct
  path (embedding -> unembedding) and whatever the heads add.

Symbols are the fixture's merged BPE tokens with a leading space that encode to themselves, so
the text of a row tokenizes back to exactly its ids (checked for every row).

    python scripts/bench/induction_rows.py OUT.jsonl [--n 64] [--seed 0] [--kinds copy,fresh]
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

KINDS = ("copy", "fresh")


def word_symbols(tokenizer, symbol_range: tuple[int, int] = (300, 700)) -> list[int]:
    """Symbol ids whose text starts with a space and encodes back to the same single id."""
    out = []
    for i in range(*symbol_range):
        text = tokenizer.decode([i])
        if text.startswith(" ") and tokenizer.encode(text, add_special_tokens=False) == [i]:
            out.append(i)
    return out


def induction_rows(tokenizer, n: int, seed: int, kinds: tuple[str, ...] = KINDS, n_answer: int = 4) -> list[dict]:
    """`n` rows alternating over `kinds` (deterministic for a seed); each dict has prompt, completion, kind."""
    rng = random.Random(seed)
    symbols = word_symbols(tokenizer)
    bos = tokenizer.bos_token
    rows = []
    for k in range(n):
        kind = kinds[k % len(kinds)]
        length = rng.randint(48, 64)
        toks = rng.sample(symbols, length + n_answer)
        body, spare = toks[:length], toks[length:]
        seg_len = n_answer + 1
        lag = rng.randint(12, 40)
        src = length - lag
        segment = body[src:src + seg_len]
        prompt_ids = body + [segment[0]]
        answer = segment[1:] if kind == "copy" else spare
        prompt = bos + "".join(tokenizer.decode([i]) for i in prompt_ids)
        completion = "".join(tokenizer.decode([i]) for i in answer)
        expected = [tokenizer.bos_token_id, *prompt_ids]
        if tokenizer.encode(prompt, add_special_tokens=False) != expected or \
                tokenizer.encode(completion, add_special_tokens=False) != answer:
            raise RuntimeError(f"row {k} does not tokenize back to its ids; the symbol filter is wrong.")
        rows.append({"prompt": prompt, "completion": completion, "kind": kind})
    return rows


def main() -> None:
    from transformers import AutoTokenizer

    from circuitkit.fixtures.models import ensure_fixture

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--n", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kinds", default="copy,fresh")
    args = parser.parse_args()
    tok = AutoTokenizer.from_pretrained(ensure_fixture("induction"))
    rows = induction_rows(tok, args.n, args.seed, tuple(args.kinds.split(",")))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"wrote {len(rows)} rows to {args.out}")


if __name__ == "__main__":
    main()
