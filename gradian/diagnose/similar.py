"""Text similarity for the duplicate and contamination checks: deterministic and vectorised.

* `normal_words`: NFKC, case-folded, every run of non-word characters a space, split.
* `Shingles`: each text as the set of its word 3-grams (a text of fewer words: one shingle of
  all of them), over its first `MAX_WORDS` words. Words get ids in order of first appearance, a
  3-gram is a 64-bit mix of its ids, so nothing depends on Python's salted `hash`.
* `near_duplicates`: MinHash (`N_HASH` multiply-shift hashes ``(a·x + b) mod 2⁶⁴ >> 32`` of
  32-bit shingle keys) cut into
  `BANDS` bands; rows that share a band are candidates, and a candidate is kept when the exact
  Jaccard of the two shingle sets is at least `NEAR_JACCARD`.
* `containments`: for each query text, the documents that hold at least a share θ of its
  shingles. A document with share ≥ θ misses at most ⌊(1 − θ)·|q|⌋ of them, so it holds one of
  any ⌊(1 − θ)·|q|⌋ + 1 of them: the query's rarest shingles give the candidates (pigeonhole),
  each verified exactly.
"""

from __future__ import annotations

import re
import unicodedata
from dataclasses import dataclass
from itertools import chain

import numpy as np

MAX_WORDS = 256
N_HASH, BANDS = 32, 8  # 8 bands of 4: a pair at Jaccard 0.8 shares a band with probability 0.985
NEAR_JACCARD = 0.8
MIN_SHINGLES_NEAR = 4  # shorter texts are compared by their normalised words only
MAX_CANDIDATES = 4096  # per query, in `containments`
_NONWORD = re.compile(r"[\W_]+")
_MIX1, _MIX2 = np.uint64(0x9E3779B97F4A7C15), np.uint64(0xC2B2AE3D27D4EB4F)
_SENTINEL = np.uint64(0xFFFFFFFF)
_OWNER_BITS = 24  # texts up to 16.7 M sort as one packed key


def normal_words(text: str) -> list[str]:
    """The words of `text` after NFKC, case folding and punctuation removal."""
    return _NONWORD.sub(" ", unicodedata.normalize("NFKC", text).casefold()).split()


@dataclass
class Shingles:
    """Shingle sets of many texts, flat: text i's sorted unique shingles are
    ``values[starts[i]:starts[i + 1]]`` (uint64)."""

    values: np.ndarray  # (S,) uint64
    starts: np.ndarray  # (n + 1,) int64

    def size(self, i: int) -> int:
        return int(self.starts[i + 1] - self.starts[i])

    def of(self, i: int) -> np.ndarray:
        return self.values[self.starts[i]:self.starts[i + 1]]


class Vocabulary:
    """Word -> id in order of first appearance (shared by every text compared with each other)."""

    def __init__(self) -> None:
        self.ids: dict[str, int] = {}

    def shingles(self, word_lists: list[list[str]]) -> Shingles:
        """The shingle sets of texts given as word lists (`normal_words`)."""
        capped = [words[:MAX_WORDS] for words in word_lists]
        words = list(chain.from_iterable(capped))
        for word in dict.fromkeys(words):  # new words get ids in order of first appearance
            self.ids.setdefault(word, len(self.ids))
        flat = np.fromiter(map(self.ids.__getitem__, words), dtype=np.uint64, count=len(words))
        lengths = np.fromiter(map(len, capped), dtype=np.int64, count=len(capped))
        n = len(capped)
        row = np.repeat(np.arange(n, dtype=np.int64), lengths)
        ends = np.cumsum(lengths)
        begin = ends - lengths
        pos = np.arange(len(flat))
        end_of = ends[row]
        nxt1 = np.where(pos + 1 < end_of, np.roll(flat, -1), _SENTINEL)
        nxt2 = np.where(pos + 2 < end_of, np.roll(flat, -2), _SENTINEL)
        keep = (pos + 2 < end_of) | ((pos == begin[row]) & (lengths[row] < 3))
        with np.errstate(over="ignore"):
            mixed = ((flat[keep] * _MIX1 + nxt1[keep]) * _MIX2 + nxt2[keep]) * _MIX1
        owner = row[keep]
        if n < (1 << _OWNER_BITS):
            # One sort of (owner, shingle) packed into a uint64: shingles keep their top 40 bits.
            packed = np.sort((owner.astype(np.uint64) << np.uint64(64 - _OWNER_BITS)) | (mixed >> np.uint64(_OWNER_BITS)))
            owner = (packed >> np.uint64(64 - _OWNER_BITS)).astype(np.int64)
            mixed = packed & np.uint64((1 << (64 - _OWNER_BITS)) - 1)
        else:
            order = np.lexsort((mixed, owner))
            mixed, owner = mixed[order], owner[order]
        unique = np.ones(len(mixed), dtype=bool)
        unique[1:] = (mixed[1:] != mixed[:-1]) | (owner[1:] != owner[:-1])
        mixed, owner = mixed[unique], owner[unique]
        starts = np.searchsorted(owner, np.arange(n + 1), side="left").astype(np.int64)
        return Shingles(mixed, starts)


def jaccard(a: np.ndarray, b: np.ndarray) -> float:
    """|a ∩ b| / |a ∪ b| of two sorted unique arrays."""
    inter = len(np.intersect1d(a, b, assume_unique=True))
    union = len(a) + len(b) - inter
    return inter / union if union else 1.0


def _minhashes(sh: Shingles, rows: np.ndarray) -> np.ndarray:
    """(len(rows), N_HASH) MinHash signatures of the (non-empty) shingle sets `rows` (sorted)."""
    rng = np.random.default_rng(0)
    a = rng.integers(1, 1 << 63, N_HASH, dtype=np.uint64) | np.uint64(1)
    b = rng.integers(0, 1 << 63, N_HASH, dtype=np.uint64)
    sizes = np.diff(sh.starts)
    take = np.zeros(len(sizes), dtype=bool)
    take[rows] = True
    values = sh.values[np.repeat(take, sizes)]
    x = (values ^ (values >> np.uint64(32))) & np.uint64(0xFFFFFFFF)
    offsets = np.concatenate([[0], np.cumsum(sizes[rows])[:-1]]).astype(np.int64)
    sig = np.empty((len(rows), N_HASH), dtype=np.uint64)
    with np.errstate(over="ignore"):
        for k in range(N_HASH):
            sig[:, k] = np.minimum.reduceat((a[k] * x + b[k]) >> np.uint64(32), offsets)
    return sig


def near_duplicates(sh: Shingles, eligible: np.ndarray) -> dict[int, tuple[int, float]]:
    """{text i: (an earlier text j, Jaccard)} for texts whose shingle set is within
    `NEAR_JACCARD` of an earlier eligible one's. `eligible`: bool (n,), which texts take part."""
    rows = np.flatnonzero(eligible & (np.diff(sh.starts) >= MIN_SHINGLES_NEAR))
    if len(rows) < 2:
        return {}
    sig = _minhashes(sh, rows)
    per = N_HASH // BANDS
    candidates: dict[int, set[int]] = {}
    for band in range(BANDS):
        block = np.ascontiguousarray(sig[:, band * per:(band + 1) * per]).view(np.dtype((np.void, 8 * per))).ravel()
        _, first, inverse = np.unique(block, return_index=True, return_inverse=True)
        earliest = first[inverse]  # position (in rows) of the first row with this band
        for i in np.flatnonzero(earliest < np.arange(len(rows))):
            candidates.setdefault(int(rows[i]), set()).add(int(rows[earliest[i]]))
    found: dict[int, tuple[int, float]] = {}
    for i in sorted(candidates):
        for j in sorted(candidates[i]):
            score = jaccard(sh.of(i), sh.of(j))
            if score >= NEAR_JACCARD:
                found[i] = (j, score)
                break
    return found


def containments(queries: Shingles, docs: Shingles, threshold: float,
                 eligible: np.ndarray | None = None) -> dict[int, tuple[int, float]]:
    """{query i: (the first doc j holding a share >= `threshold` of i's shingles, that share)}.

    `eligible`: bool (n_queries,), the queries to look up (default all non-empty ones).
    """
    n_q = len(queries.starts) - 1
    eligible = np.ones(n_q, dtype=bool) if eligible is None else eligible
    wanted = np.unique(queries.values)
    # The inverted index holds only the docs' shingles some query has: (shingle, doc) sorted.
    doc_of = np.repeat(np.arange(len(docs.starts) - 1), np.diff(docs.starts))
    hit = np.isin(docs.values, wanted, assume_unique=False)
    keys, owners = docs.values[hit], doc_of[hit]
    order = np.lexsort((owners, keys))
    keys, owners = keys[order], owners[order]
    found: dict[int, tuple[int, float]] = {}
    for i in np.flatnonzero(eligible & (np.diff(queries.starts) > 0)):
        q = queries.of(i)
        lo, hi = np.searchsorted(keys, q, side="left"), np.searchsorted(keys, q, side="right")
        need = int(np.floor((1 - threshold) * len(q))) + 1
        rarest = np.argsort(hi - lo, kind="stable")[:need]
        cand = np.unique(np.concatenate([owners[lo[k]:hi[k]] for k in rarest]))[:MAX_CANDIDATES]
        for j in cand:
            share = len(np.intersect1d(q, docs.of(int(j)), assume_unique=True)) / len(q)
            if share >= threshold:
                found[int(i)] = (int(j), share)
                break
    return found
