"""Induction: `... A B ... A` -> predict B, with repeats at varying lags.

Two formats (`discovery.data_params.induction_format`):

* ``single``: one `A B` among random symbols, `A` last. Corruption (DESIGN.md,
  "Test fixtures"): "key" replaces the token A before the first occurrence of the copied token
  B, so the previous-token signal at B's position no longer matches the query (the K-composition
  path); the incorrect answer is a random other symbol. The test fixtures' format (DESIGN.md);
  a pretrained model barely does induction on it (SmolLM2-135M: the answer is its top-1 token on
  3 % of 24-token prompts; docs/benchmarks.md, "Induction on SmolLM2 at real scale").
* ``repeat`` (the default): a random span, some filler, then the span again cut short: the answer is the span's
  next token (Olsson et al.'s repeated random tokens). Corruption ("swap") exchanges the query
  token's first occurrence with the answer after it, so in the corrupted prompt the query token is
  followed by the answer's successor, which is the incorrect answer: both answers are in context
  in both prompts, the logit difference measures which in-context token is copied (not whether
  one is), and the contrast runs through both halves of the mechanism (the previous-token signal
  at the answer's position and the induction head's attention). The other corruption of this
  format (``fresh``, `discovery.data_params.induction_corruption`) replaces the whole first copy
  by fresh random tokens, so no induction is possible in the corrupted prompt; the previous-token
  signal goes with it, and a circuit found with it keeps the early previous-token heads that
  ``swap`` lets it leave out. The incorrect answer is the same token as under ``swap``.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from circuitkit.discovery.tasks.base import TaskData, TaskError, pad_answers


def symbol_ids(tokenizer, model_dir: str | None) -> torch.Tensor:
    """Token ids to draw symbols from: the fixture's training symbols when recorded, else
    every non-special token of the tokenizer."""
    if model_dir is not None:
        info_path = Path(model_dir) / "fixture_info.json"
        if info_path.is_file():
            info = json.loads(info_path.read_text())
            for key in ("symbol_ids", "symbols"):
                ids = info.get(key)
                if isinstance(ids, list) and ids and isinstance(ids[0], int):
                    return torch.tensor(ids, dtype=torch.long)
            lo_hi = info.get("symbol_range")
            if isinstance(lo_hi, list) and len(lo_hi) == 2:
                return torch.arange(lo_hi[0], lo_hi[1], dtype=torch.long)
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    return torch.tensor([i for i in range(len(tokenizer)) if i not in special], dtype=torch.long)


CORRUPTIONS = {"single": ("key",), "repeat": ("swap", "fresh")}  # per format (module docstring)


def build(tokenizer, model_dir: str | None, n: int, seq_len: int, seed: int, fmt: str = "repeat",
          corruption: str = "swap") -> TaskData:
    """`n` induction pairs of `seq_len` tokens in format `fmt` (single or repeat, module docstring);
    `corruption` (swap or fresh) is read by the repeat format only."""
    if fmt == "repeat":
        return build_repeat(tokenizer, model_dir, n, seq_len, seed, corruption)
    return build_single(tokenizer, model_dir, n, seq_len, seed)


def build_single(tokenizer, model_dir: str | None, n: int, seq_len: int, seed: int) -> TaskData:
    """`n` induction pairs of `seq_len` tokens: BOS, random symbols, `A B` early, `A` last.

    clean:      BOS s s A B s s ... s A        (predict B)
    corrupted:  BOS s s A' B s s ... s A       (A' != A: the key no longer points at B)
    """
    g = torch.Generator().manual_seed(seed)
    symbols = symbol_ids(tokenizer, model_dir)
    bos = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else int(symbols[0])
    clean = torch.empty((n, seq_len), dtype=torch.long)
    corrupted = torch.empty_like(clean)
    correct, incorrect = [], []
    for i in range(n):
        # Distinct symbols so A and B occur exactly where we put them.
        perm = symbols[torch.randperm(len(symbols), generator=g)]
        body = perm[: seq_len - 1].clone()
        a, b, a_alt, wrong = perm[seq_len - 1], perm[seq_len], perm[seq_len + 1], perm[seq_len + 2]
        # First occurrence at a random lag from the end (4 .. seq_len - 4 tokens back).
        first = int(torch.randint(1, seq_len - 5, (1,), generator=g))
        body[first], body[first + 1], body[-1] = a, b, a
        clean[i, 0], clean[i, 1:] = bos, body
        corrupted[i] = clean[i]
        corrupted[i, 1 + first] = a_alt
        correct.append([int(b)])
        incorrect.append([int(wrong)])
    mask = torch.ones_like(clean)
    answer_pos = torch.full((n,), seq_len - 1, dtype=torch.long)
    return TaskData(clean, corrupted, mask, answer_pos, pad_answers(correct), pad_answers(incorrect))


def build_repeat(tokenizer, model_dir: str | None, n: int, seq_len: int, seed: int,
                 corruption: str = "swap") -> TaskData:
    """`n` repeated-span pairs of `seq_len` tokens:

    clean:           BOS r1 .. r(m-1) rm r(m+1) r(m+2) .. rk f .. f r1 .. rm      (predict r(m+1))
    swap corrupted:  BOS r1 .. r(m-1) r(m+1) rm r(m+2) .. rk f .. f r1 .. rm      (predict r(m+2))
    fresh corrupted: BOS x1 .. xk f .. f r1 .. rm          (x: fresh symbols; nothing to copy)

    The clean prompts depend on the seed only, not on the corruption; the incorrect answer is
    r(m+2) under both.

    k = (seq_len + 2) // 2 symbols in the span, 0 .. k // 3 filler symbols (fewer for short prompts),
    m = the rest: 2 <= m <= k - 2, so both answers lie inside the first copy.
    """
    if corruption not in CORRUPTIONS["repeat"]:
        raise TaskError(f"discovery.data_params.induction_corruption={corruption!r} is not a corruption of the"
                        f" repeat format; allowed: {', '.join(CORRUPTIONS['repeat'])}.")
    g = torch.Generator().manual_seed(seed)
    symbols = symbol_ids(tokenizer, model_dir)
    bos = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else int(symbols[0])
    k = (seq_len + 2) // 2
    max_gap = max(0, min(k // 3, seq_len - 3 - k))
    if corruption == "fresh" and len(symbols) < 2 * k + max_gap:
        raise TaskError(f"induction_corruption=fresh at seq_len={seq_len} needs {2 * k + max_gap} distinct symbols"
                        f" (a span of {k}, as many fresh ones and up to {max_gap} filler); this model has"
                        f" {len(symbols)}: lower discovery.data_params.seq_len or use induction_corruption=swap.")
    clean = torch.empty((n, seq_len), dtype=torch.long)
    corrupted = torch.empty_like(clean)
    correct, incorrect = [], []
    for i in range(n):
        perm = symbols[torch.randperm(len(symbols), generator=g)]
        gap = int(torch.randint(0, max_gap + 1, (1,), generator=g))
        m = seq_len - 1 - k - gap
        span, filler = perm[:k], perm[k:k + gap]
        clean[i] = torch.cat([torch.tensor([bos]), span, filler, span[:m]])
        corrupted[i] = clean[i]
        if corruption == "fresh":
            # Drawn after the clean prompt's symbols, so the clean prompts do not depend on the corruption.
            corrupted[i, 1:1 + k] = perm[k + gap:2 * k + gap]
        else:
            corrupted[i, m], corrupted[i, 1 + m] = span[m], span[m - 1]
        correct.append([int(span[m])])
        incorrect.append([int(span[m + 1])])
    mask = torch.ones_like(clean)
    answer_pos = torch.full((n,), seq_len - 1, dtype=torch.long)
    return TaskData(clean, corrupted, mask, answer_pos, pad_answers(correct), pad_answers(incorrect))
