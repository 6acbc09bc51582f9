"""A shard's rows leave the device in their stored form, and a writer thread owns the disk.

The index loop computes rows batch by batch on the device; none of its steps waits for the device
or for the disk:

    device   rows (B, width) float32 -> stored form, norms and finite flags, by the index's row format
             (`gradian.index.formats`, `RowFormat.pack`)                    (`ShardRows.add`)
    copy     stored, norms, flags -> a pinned host buffer, `non_blocking`, in batch order
    thread   waits for the copies (a CUDA event), checks the flags, writes the shard in row order,
             hashing while it writes, renames it into place, lists it      (`ShardPipeline`)

Two buffers alternate: the loop fills one shard while the thread writes the other, so the wall
time of an index is the loop's alone while the disk keeps up. A writer error (a non-finite row, a
full disk) reaches the loop at its next shard or at the end, as the exception itself; the shard it
was writing is not listed in the manifest (the file is renamed into place only once complete), so
a resume writes it again.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from circuitkit.core.device import DTYPES
from circuitkit.core.io import RowGather
from gradian.index.formats.base import RowFormat, StorageOverflowError
from gradian.index.writer import IndexWriter


def _host_buffer(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host tensor that a `non_blocking` copy from `device` can land in: pinned for CUDA."""
    out = torch.empty(shape, dtype=dtype)
    return out.pin_memory() if device.type == "cuda" else out


class ShardRows:
    """One shard's rows in their stored form, in host memory, filled from the device in batch order.

    `add(plan, rows, fisher_rows)` stores a batch: plan (B,) host list of the rows' positions in the
    shard, rows (B, computed width) float32 on the device. `positions` remembers where each row went,
    so the writer stores them in row order (`order`). `fisher_width`: the sampled-label rows' width
    (grads.fisher=sampled), kept beside the rows in the storage dtype."""

    def __init__(self, capacity: int, form: RowFormat, device: torch.device, fisher_width: int | None = None) -> None:
        self.form, self.device = form, device
        self.rows = _host_buffer((capacity, form.width), form.dtype, device)
        self.norms = _host_buffer((capacity,), torch.float32, device)
        # per row: stored values finite, and computed (float32) values finite
        self.finite = _host_buffer((capacity, 2), torch.bool, device)
        self.fisher = None if fisher_width is None else _host_buffer(
            (capacity, fisher_width), DTYPES[form.storage_dtype], device)
        self.fisher_finite = None if fisher_width is None else _host_buffer((capacity,), torch.bool, device)
        self.positions = np.zeros(capacity, dtype=np.int64)
        self.filled = 0
        self.copied: torch.cuda.Event | None = None

    def reset(self) -> None:
        self.filled = 0
        self.copied = None

    def add(self, plan: Sequence[int], rows: torch.Tensor, fisher_rows: torch.Tensor | None = None) -> None:
        """Store one batch (class docstring): converted, checked and normed on the device, copied without
        a wait."""
        n = len(plan)
        at = slice(self.filled, self.filled + n)
        stored, norms, flags = self.form.pack(rows.detach())
        self.rows[at].copy_(stored, non_blocking=True)
        self.norms[at].copy_(norms, non_blocking=True)
        self.finite[at].copy_(flags, non_blocking=True)
        if self.fisher is not None:
            fisher_stored = fisher_rows.detach().to(self.fisher.dtype)
            self.fisher[at].copy_(fisher_stored, non_blocking=True)
            self.fisher_finite[at].copy_(torch.isfinite(fisher_stored).all(dim=1), non_blocking=True)
        self.positions[at] = plan
        self.filled += n

    def close(self) -> None:
        """Mark the end of the shard's copies (the writer waits for them, not the loop)."""
        if self.device.type == "cuda":
            self.copied = torch.cuda.Event()
            self.copied.record()

    def wait(self) -> None:
        if self.copied is not None:
            self.copied.synchronize()

    def order(self) -> torch.Tensor:
        """(n,) long: the buffer position of each row of the shard, in row order."""
        positions = self.positions[:self.filled]
        if sorted(positions.tolist()) != list(range(self.filled)):
            raise RuntimeError(f"a shard's batches covered positions {sorted(positions.tolist())[:5]}..., not each of"
                               f" 0..{self.filled - 1} once.")
        return torch.from_numpy(np.argsort(positions, kind="stable"))


@dataclass
class ShardJob:
    """What the writer thread needs of one shard (`ShardPipeline.submit`)."""

    k: int
    first_row: int
    buffer: ShardRows
    sources: torch.Tensor
    extra_tensors: dict[str, torch.Tensor]  # on the host (K-FAC factor sums, copied after the rows)
    second_moment_blocks: int | None = None


def _non_finite(job: ShardJob) -> None:
    """StorageOverflowError naming the rows the writer must refuse (the messages of `IndexWriter.write_shard`)."""
    buffer, n = job.buffer, job.buffer.filled
    flags = buffer.finite[:n]
    bad = ~flags[:, 0]
    if bad.any():
        which = (torch.from_numpy(buffer.positions[:n])[bad] + job.first_row).sort().values.tolist()
        raise buffer.form.non_finite_error(which, job.k, bool(flags[bad, 1].all()))
    if buffer.fisher_finite is not None and not buffer.fisher_finite[:n].all():
        which = (torch.from_numpy(buffer.positions[:n])[~buffer.fisher_finite[:n]] + job.first_row).sort().values
        raise StorageOverflowError(f"the sampled-label rows (grads.fisher=sampled) of rows {which.tolist()[:10]} are"
                                   f" not finite in {buffer.form.storage_dtype}; nothing of this shard was written."
                                   " Set grads.storage_dtype=bfloat16 (same size, float32's range) or float32.")


def write_job(writer: IndexWriter, job: ShardJob) -> None:
    """Write one shard from its buffer (runs on the writer thread)."""
    buffer = job.buffer
    buffer.wait()
    _non_finite(job)
    order = buffer.order()
    n = buffer.filled
    norms = buffer.norms[:n][order]
    stored = RowGather(buffer.rows, order)
    extra = dict(job.extra_tensors)
    if buffer.fisher is not None:
        from gradian.curvature.factors import FISHER_ROWS

        extra[FISHER_ROWS] = buffer.fisher[:n][order]
    second_moment = None
    if job.second_moment_blocks is not None:
        from gradian.curvature.moments import shard_second_moment

        second_moment = shard_second_moment(buffer.rows[:n][order].float(), job.second_moment_blocks)
    writer.write_stored(job.k, stored, norms, job.sources, second_moment, extra)


class ShardPipeline:
    """Two `ShardRows` buffers and one writer thread (module docstring).

    `next_buffer()` gives a buffer the thread is done with (waiting for its last write, and raising
    that write's error); `submit(job)` hands a filled one to the thread; `finish()` waits for every
    write and raises the first error. Use as a context manager: leaving it waits for the thread."""

    def __init__(self, writer: IndexWriter, capacity: int, form: RowFormat, device: torch.device,
                 fisher_width: int | None = None) -> None:
        self.writer = writer
        self.buffers = [ShardRows(capacity, form, device, fisher_width) for _ in range(2)]
        self.futures: list[Future | None] = [None, None]
        self.turn = 0
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gradian-shard-writer")

    def next_buffer(self) -> ShardRows:
        self.turn = 1 - self.turn
        pending = self.futures[self.turn]
        if pending is not None:
            pending.result()  # raises the writer's error here, in the loop
        self.futures[self.turn] = None
        buffer = self.buffers[self.turn]
        buffer.reset()
        return buffer

    def submit(self, job: ShardJob) -> None:
        job.buffer.close()
        other = self.futures[1 - self.turn]
        if other is not None and other.done():
            other.result()  # an earlier shard failed: stop now, not a shard later
        self.futures[self.turn] = self.pool.submit(write_job, self.writer, job)

    def finish(self) -> None:
        for i, pending in enumerate(self.futures):
            if pending is not None:
                self.futures[i] = None
                pending.result()

    def __enter__(self) -> ShardPipeline:
        return self

    def __exit__(self, *exc) -> None:
        self.pool.shutdown(wait=True)
