"""Induction: `... A B ... A` -> predict B, with repeats at varying lags.

Corruption (DESIGN.md, "Test fixtures"): "key" replaces the token A before the first
occurrence of the copied token B, so the previous-token signal at B's position no longer
matches the query (the K-composition path); the incorrect answer is a random other symbol.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from circuitkit.tasks.base import TaskData, pad_answers


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


def build(tokenizer, model_dir: str | None, n: int, seq_len: int, seed: int) -> TaskData:
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
