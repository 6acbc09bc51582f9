"""Task data: clean / corrupted prompt pairs with the answer tokens a metric reads.

A task yields `TaskData`: right-padded token ids of equal length per pair (clean and corrupted
share one attention mask), the position whose next-token logits are scored, and the correct
and incorrect answer tokens (several per example allowed, padded with -1).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path

import torch

from circuitkit.core.batching import plan_batches
from circuitkit.core.io import atomic_save_safetensors

_POSITIONAL = ("clean_ids", "corrupted_ids", "attention_mask")  # the fields with a position axis


class TaskError(ValueError):
    """Task data that cannot be used (the message names the row and what to fix)."""


@dataclass
class TaskData:
    clean_ids: torch.Tensor  # (N, T) long, right-padded
    corrupted_ids: torch.Tensor  # (N, T) long, same length as clean per row
    attention_mask: torch.Tensor  # (N, T) long, 1 = real token
    answer_pos: torch.Tensor  # (N,) long, position whose next-token logits are scored
    correct: torch.Tensor  # (N, Kc) long, -1 = padding
    incorrect: torch.Tensor  # (N, Ki) long, -1 = padding

    def __len__(self) -> int:
        return self.clean_ids.shape[0]

    def __getitem__(self, idx) -> TaskData:
        return TaskData(**{f.name: getattr(self, f.name)[idx] for f in fields(self)})

    def to(self, device: torch.device) -> TaskData:
        return TaskData(**{f.name: getattr(self, f.name).to(device) for f in fields(self)})

    def batches(self, batch_size: int):
        """Consecutive slices of `batch_size` examples (the last may be shorter)."""
        for start in range(0, len(self), batch_size):
            yield self[start:start + batch_size]

    def lengths(self) -> list[int]:
        """Real tokens per pair (the attention mask's row sums)."""
        return self.attention_mask.sum(dim=1).tolist()

    def length_batches(self, batch_size: int, group_by_length: bool = True) -> list[TaskData]:
        """Batches of at most `batch_size` pairs, each trimmed to its own longest pair.

        With `group_by_length`, pairs of similar length share a batch (`circuitkit.core.batching`:
        sorted longest first, cut where padding would cost more than another batch); without it,
        consecutive slices in data order. The positions trimmed are padding after every pair's
        last token: no metric reads them (the answer position comes before them and attention is
        causal), so per-example scores are unchanged up to float round-off, and sums over examples
        do not depend on the batching.
        """
        lengths = self.lengths()
        out = []
        for idx in plan_batches(lengths, batch_size, None, group_by_length):
            width = max(lengths[i] for i in idx)
            batch = self[torch.tensor(idx)]
            out.append(TaskData(**{f.name: (getattr(batch, f.name)[:, :width] if f.name in _POSITIONAL
                                            else getattr(batch, f.name)) for f in fields(self)}))
        return out

    def save(self, path: Path, metadata: dict[str, str] | None = None) -> Path:
        return atomic_save_safetensors(path, {f.name: getattr(self, f.name) for f in fields(self)}, metadata)

    @classmethod
    def load(cls, path: Path) -> TaskData:
        from safetensors.torch import load_file

        tensors = load_file(str(path))
        return cls(**{f.name: tensors[f.name] for f in fields(cls)})


def pad_answers(rows: list[list[int]]) -> torch.Tensor:
    """List of token-id lists -> (N, K) long tensor padded with -1."""
    width = max(1, max(len(r) for r in rows))
    out = torch.full((len(rows), width), -1, dtype=torch.long)
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.tensor(r, dtype=torch.long)
    return out


def from_token_lists(clean: list[list[int]], corrupted: list[list[int]], correct: list[list[int]],
                     incorrect: list[list[int]], pad_id: int, row_names: list[str] | None = None,
                     max_tokens: int | None = None) -> TaskData:
    """Assemble TaskData from per-row token lists; the answer position is each row's last token.

    Raises TaskError naming the row when a clean/corrupted pair differs in length, or when a
    prompt is longer than `max_tokens` (the model's context).
    """
    for i, (c, x) in enumerate(zip(clean, corrupted, strict=True)):
        name = row_names[i] if row_names else f"row {i}"
        if max_tokens is not None and len(c) > max_tokens:
            raise TaskError(f"{name}: the prompt is {len(c)} tokens, longer than the model's context of"
                            f" {max_tokens} tokens; shorten it or remove the row.")
        if len(c) != len(x):
            raise TaskError(f"{name}: clean prompt has {len(c)} tokens but corrupted has {len(x)}; a pair must"
                            " tokenize to the same length (edit the corrupted text so the tokens line up).")
    n, width = len(clean), max(len(c) for c in clean)
    clean_ids = torch.full((n, width), pad_id, dtype=torch.long)
    corrupted_ids = torch.full((n, width), pad_id, dtype=torch.long)
    mask = torch.zeros((n, width), dtype=torch.long)
    for i, (c, x) in enumerate(zip(clean, corrupted, strict=True)):
        clean_ids[i, : len(c)] = torch.tensor(c)
        corrupted_ids[i, : len(x)] = torch.tensor(x)
        mask[i, : len(c)] = 1
    answer_pos = torch.tensor([len(c) - 1 for c in clean], dtype=torch.long)
    return TaskData(clean_ids, corrupted_ids, mask, answer_pos, pad_answers(correct), pad_answers(incorrect))


def random_pairs(batch: int, seq: int, vocab: int, seed: int = 1) -> TaskData:
    """Random token pairs for benchmarks and memory checks: one corrupted position, random answers."""
    g = torch.Generator().manual_seed(seed)
    clean = torch.randint(0, vocab, (batch, seq), generator=g)
    corrupted = clean.clone()
    corrupted[:, seq // 3] = torch.randint(0, vocab, (batch,), generator=g)
    correct = pad_answers([[int(t)] for t in torch.randint(0, vocab, (batch,), generator=g)])
    incorrect = pad_answers([[int(t)] for t in torch.randint(0, vocab, (batch,), generator=g)])
    return TaskData(clean, corrupted, torch.ones_like(clean), torch.full((batch,), seq - 1), correct, incorrect)
