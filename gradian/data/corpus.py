"""A tokenized corpus on disk: rows encoded once, streamed in, read back a shard at a time.

Indexing needs every row's length and id before the first shard (shards are fixed row ranges,
so that workers and resumed runs agree), but it must not hold millions of token lists in
memory. `TokenizedCorpus.scan` therefore reads the source record by record, encodes each row
(`gradian.data.rows.iter_rows`) and appends its tokens and supervision mask to two flat files in a
private temporary directory; memory keeps two int64 per row (offset and source position:
16 MB for a million rows). `rows(start, end)` reads one shard's bytes back and rebuilds its
`Row`s.

    tokens.bin   int32, all kept rows' token ids back to back
    mask.bin     uint8, 1 where the token is supervised
"""

from __future__ import annotations

import shutil
import tempfile
from array import array
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from gradian.data.rows import DataReport, Row, TokenPolicy, finish_report, iter_rows, new_report
from gradian.data.sources import Source


class TokenizedCorpus:
    """Kept rows of a source, tokenized, on disk (see the module docstring). Use as a context
    manager, or call `close()`: the temporary files are removed then."""

    def __init__(self, workdir: Path, offsets: np.ndarray, positions: np.ndarray, report: DataReport) -> None:
        self.workdir = Path(workdir)
        self.offsets = offsets  # (n + 1,) int64: row i is tokens[offsets[i]:offsets[i + 1]]
        self.positions = positions  # (n,) int64: where row i is in the source (line or row index)
        self.report = report

    @classmethod
    def scan(cls, source: Source, tokenizer: Any, max_seq_length: int, on_truncation: str = "warn",
             truncation_side: str = "right", context_length: int | None = None,
             progress: Callable[[int], None] | None = None, tmp_root: str | Path | None = None,
             policy: TokenPolicy | None = None) -> TokenizedCorpus:
        """Encode every record of `source`; raises DataError as `gradian.data.rows.load_rows` does
        (rows are cut at the smaller of max_seq_length and the model's `context_length`).

        `policy`: BOS / EOS and chat supervision (`gradian.data.rows.TokenPolicy`).
        `progress(n)` is called with the number of records read so far, every 1024 records.
        """
        report = new_report(source, max_seq_length, on_truncation, truncation_side, context_length, policy)
        workdir = Path(tempfile.mkdtemp(prefix="gradian-corpus-", dir=tmp_root))
        offsets, positions = array("q", [0]), array("q")
        try:
            with open(workdir / "tokens.bin", "wb") as tok_fh, open(workdir / "mask.bin", "wb") as mask_fh:
                for row in iter_rows(source, tokenizer, report):
                    tok_fh.write(np.asarray(row.input_ids, dtype=np.int32).tobytes())
                    mask_fh.write(np.asarray(row.supervised, dtype=np.uint8).tobytes())
                    offsets.append(offsets[-1] + len(row.input_ids))
                    positions.append(row.line)
                    if progress is not None and report.rows_read % 1024 == 0:
                        progress(report.rows_read)
            finish_report(report)
        except BaseException:
            shutil.rmtree(workdir, ignore_errors=True)
            raise
        if progress is not None:
            progress(report.rows_read)
        return cls(workdir, np.frombuffer(offsets, dtype=np.int64), np.frombuffer(positions, dtype=np.int64), report)

    # -- reading ------------------------------------------------------------------------------
    @property
    def n_rows(self) -> int:
        return len(self.positions)

    @property
    def lengths(self) -> np.ndarray:
        """(n,) int64 token count of every row."""
        return np.diff(self.offsets)

    def rows(self, start: int, end: int) -> list[Row]:
        """Rows [start, end) with their token ids and supervision masks (previews left empty).

        The shard's bytes are read with one positioned read per file, not through a memory map,
        so pages of rows already indexed do not stay resident as the corpus is walked.
        """
        first, last = int(self.offsets[start]), int(self.offsets[end])
        tokens = np.fromfile(self.workdir / "tokens.bin", dtype=np.int32, count=last - first, offset=4 * first)
        mask = np.fromfile(self.workdir / "mask.bin", dtype=np.uint8, count=last - first, offset=first).astype(bool)
        out = []
        for i in range(start, end):
            a, b = int(self.offsets[i]) - first, int(self.offsets[i + 1]) - first
            out.append(Row(row_id=i, line=int(self.positions[i]), input_ids=tokens[a:b].tolist(),
                           supervised=mask[a:b].tolist(), preview=""))
        return out

    def close(self) -> None:
        """Remove the temporary files."""
        shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> TokenizedCorpus:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
