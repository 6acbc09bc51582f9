"""Task data: clean / corrupted prompt pairs with the answer tokens a metric reads.

A task yields `TaskData`: right-padded token ids of equal length per pair (clean and corrupted
share one attention mask), the position whose next-token logits are scored, and the correct
and incorrect answer tokens (several per example allowed, padded with -1).

Batches (`TaskData.batches`, `TaskData.length_batches`) also carry what the host knows of them
when it collates them: `AnswerColumns`, the answer positions as the forward pass unembeds them,
and whether any pair is padded (`TaskData.forward_mask`). Finding either from device tensors
(`torch.unique`, Hugging Face reading the mask) would make the host wait for the device in
every pass.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from circuitkit.core.batching import plan_batches
from circuitkit.core.device import send
from circuitkit.core.io import atomic_save_safetensors

_POSITIONAL = ("clean_ids", "corrupted_ids", "attention_mask")  # the fields with a position axis
_TENSORS = (*_POSITIONAL, "answer_pos", "correct", "incorrect")  # what is saved, sliced and moved per row


class TaskError(ValueError):
    """Task data that cannot be used (the message names the row and what to fix)."""


def _to_device(t: torch.Tensor, device: torch.device | str, non_blocking: bool) -> torch.Tensor:
    """`t.to(device)`; with `non_blocking`, a host tensor goes through pinned memory to an
    accelerator, so the copy is queued and the host does not wait for it."""
    return send(t, device) if non_blocking and t.device.type == "cpu" else t.to(device)


@dataclass(frozen=True)
class AnswerColumns:
    """The answer positions of a batch, as a forward pass unembeds them
    (`circuitkit.discovery.attribution.metrics.answer_forward`).

    keep: (k,) long, the distinct answer positions in increasing order (the `logits_to_keep` of
    the model call); row: (B,) long, each example's index into keep. Made from host integers
    (`of`), so no pass needs `torch.unique` on the device.
    """

    keep: torch.Tensor
    row: torch.Tensor

    @classmethod
    def of(cls, positions: Sequence[int]) -> AnswerColumns:
        """From the batch's answer positions, in batch order, as host integers."""
        keep, row = np.unique(np.asarray(positions, dtype=np.int64), return_inverse=True)
        return cls(torch.from_numpy(keep), torch.from_numpy(row.reshape(-1)))

    @classmethod
    def on_device(cls, answer_pos: torch.Tensor) -> AnswerColumns:
        """From a tensor of positions (B,) wherever it is: one `torch.unique`, which on an
        accelerator waits for the device. For callers without collated columns."""
        keep, row = torch.unique(answer_pos, return_inverse=True)
        return cls(keep, row)

    def to(self, device: torch.device | str, non_blocking: bool = False) -> AnswerColumns:
        return AnswerColumns(_to_device(self.keep, device, non_blocking), _to_device(self.row, device, non_blocking))


@dataclass
class TaskData:
    clean_ids: torch.Tensor  # (N, T) long, right-padded
    corrupted_ids: torch.Tensor  # (N, T) long, same length as clean per row
    attention_mask: torch.Tensor  # (N, T) long, 1 = real token
    answer_pos: torch.Tensor  # (N,) long, position whose next-token logits are scored
    correct: torch.Tensor  # (N, Kc) long, -1 = padding
    incorrect: torch.Tensor  # (N, Ki) long, -1 = padding
    # Set when a batch is collated (batches, length_batches), None after other slicing: its
    # answer_pos as the model call reads them (else `answers` finds them on the device), and
    # whether a pair is shorter than the batch (else `forward_mask` is the attention mask).
    answer_columns: AnswerColumns | None = field(default=None, repr=False, compare=False)
    padded: bool | None = field(default=None, repr=False, compare=False)

    def __len__(self) -> int:
        return self.clean_ids.shape[0]

    def __getitem__(self, idx) -> TaskData:
        return TaskData(**{name: getattr(self, name)[idx] for name in _TENSORS})

    def to(self, device: torch.device | str, non_blocking: bool = False) -> TaskData:
        """The batch on `device`; `non_blocking` queues the copies (pinned memory to an accelerator)
        instead of waiting for each."""
        columns = self.answer_columns.to(device, non_blocking) if self.answer_columns is not None else None
        return TaskData(**{name: _to_device(getattr(self, name), device, non_blocking) for name in _TENSORS},
                        answer_columns=columns, padded=self.padded)

    @property
    def answers(self) -> AnswerColumns:
        """The answer columns of this batch: the collated ones, else found from `answer_pos` on
        its device (`AnswerColumns.on_device`, a wait for the device)."""
        return self.answer_columns if self.answer_columns is not None else AnswerColumns.on_device(self.answer_pos)

    @property
    def forward_mask(self) -> torch.Tensor | None:
        """The attention mask to call the model with: None for a batch collated without padding
        (the model's causal mask alone is then exact, and Hugging Face's mask code need not read
        the mask from the device to find that out), else attention_mask (B, T)."""
        return None if self.padded is False else self.attention_mask

    def _collated(self, idx, positions: Sequence[int], lengths: Sequence[int], width: int) -> TaskData:
        """Rows `idx` (a slice, or a list of indices) cut to `width` positions, with what the
        host knows of them from every row's answer `positions` and `lengths`."""
        rows = range(len(self))[idx] if isinstance(idx, slice) else idx
        batch = self[idx if isinstance(idx, slice) else torch.tensor(idx)]
        if width < batch.clean_ids.shape[1]:
            for name in _POSITIONAL:
                setattr(batch, name, getattr(batch, name)[:, :width])
        batch.answer_columns = AnswerColumns.of([positions[i] for i in rows])
        batch.padded = any(lengths[i] < width for i in rows)
        return batch

    def batches(self, batch_size: int):
        """Consecutive slices of `batch_size` examples (the last may be shorter), with what the
        host knows of them (`answers`, `forward_mask`)."""
        # read once for all batches, from host data
        positions, lengths, width = self.answer_pos.tolist(), self.lengths(), self.clean_ids.shape[1]
        for start in range(0, len(self), batch_size):
            yield self._collated(slice(start, start + batch_size), positions, lengths, width)

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
        positions = self.answer_pos.tolist()  # once for all batches, from host data
        return [self._collated(idx, positions, lengths, max(lengths[i] for i in idx))
                for idx in plan_batches(lengths, batch_size, None, group_by_length)]

    def save(self, path: Path, metadata: dict[str, str] | None = None) -> Path:
        return atomic_save_safetensors(path, {name: getattr(self, name) for name in _TENSORS}, metadata)

    @classmethod
    def load(cls, path: Path) -> TaskData:
        from safetensors.torch import load_file

        tensors = load_file(str(path))
        return cls(**{name: tensors[name] for name in _TENSORS})


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
