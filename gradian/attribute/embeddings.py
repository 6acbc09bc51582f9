"""Sentence embeddings and HDBSCAN for the clusters, when they can be had; TF-IDF otherwise.

Sentence embeddings put "What is the capital of France?" next to "Name France's capital city." although
they share few words, so phrasings of one question fall together; TF-IDF sees only shared words.
The embeddings need the optional `sentence-transformers` package and its model on this machine
(`EMBEDDING_MODEL`, or the environment variable `GRADIAN_EMBEDDING_MODEL`; nothing is downloaded:
the model is read with `local_files_only`), and HDBSCAN (scikit-learn >= 1.3, or the `hdbscan`
package). Without any of them the clusters are TF-IDF's, and `Method.note` says why in one line:

    clusters by TF-IDF (sentence-transformers not installed)

HDBSCAN finds the number of clusters itself (at least `MIN_CLUSTER_SIZE` rows each; clusters whose
centroids lie within `MERGE_DISTANCE` are merged); a row it leaves as noise is a cluster of its own.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import numpy as np

EMBEDDING_MODEL = "sentence-transformers/all-MiniLM-L6-v2"
MIN_CLUSTER_SIZE = 2
# Clusters whose centroids are closer than this cosine distance are one: HDBSCAN alone splits a
# phrasing's rows into pairs by the small differences their entities make. (Merged here, not by
# HDBSCAN's cluster_selection_epsilon, which fails in scikit-learn 1.9 with numpy 2.4.)
MERGE_DISTANCE = 0.15
TFIDF = "tfidf"


@dataclass
class Method:
    """How the clusters are made: `name` ("tfidf" or "embeddings:<model>+hdbscan"), the loaded
    encoder (None for TF-IDF), and `note`, one line saying why TF-IDF was used (None otherwise)."""

    name: str
    encoder: Any = None
    note: str | None = None


def _hdbscan_missing() -> str | None:
    try:
        from sklearn.cluster import HDBSCAN  # noqa: F401  (scikit-learn >= 1.3)
        return None
    except ImportError:
        pass
    try:
        import hdbscan  # noqa: F401
        return None
    except ImportError:
        return "no HDBSCAN: scikit-learn >= 1.3 or the hdbscan package is needed"


def choose_method(model: str | None = None) -> Method:
    """Embeddings + HDBSCAN when sentence-transformers, its model (`model`, else
    $GRADIAN_EMBEDDING_MODEL, else `EMBEDDING_MODEL`) and HDBSCAN are all here; TF-IDF with a note otherwise."""
    name = model or os.environ.get("GRADIAN_EMBEDDING_MODEL") or EMBEDDING_MODEL
    try:
        from sentence_transformers import SentenceTransformer
    except ImportError:
        return Method(TFIDF, note="clusters by TF-IDF (sentence-transformers not installed)")
    missing = _hdbscan_missing()
    if missing:
        return Method(TFIDF, note=f"clusters by TF-IDF ({missing})")
    try:
        encoder = SentenceTransformer(name, local_files_only=True)
    except Exception as err:  # noqa: BLE001  (any failure to load means: no embeddings, say why)
        first = str(err).strip().splitlines()[0][:200] if str(err).strip() else type(err).__name__
        return Method(TFIDF, note=f"clusters by TF-IDF (sentence-transformers model {name} not available: {first})")
    return Method(f"embeddings:{name}+hdbscan", encoder=encoder)


def embed(method: Method, texts: list[str]) -> np.ndarray:
    """(n, dim) float64 unit vectors of `texts` by the method's encoder."""
    x = np.asarray(method.encoder.encode(texts, show_progress_bar=False), dtype=np.float64)
    return x / np.clip(np.linalg.norm(x, axis=1, keepdims=True), 1e-12, None)


def hdbscan_labels(x: np.ndarray) -> np.ndarray:
    """Cluster labels of unit vectors `x` (n, dim) by HDBSCAN; each noise row gets a label of its own."""
    n = len(x)
    if n < 2 * MIN_CLUSTER_SIZE:  # too few rows for density: all one cluster if alike, else apart
        alike = n < 2 or float((x @ x.T).min()) > 0.8
        return np.zeros(n, dtype=int) if alike else np.arange(n)
    try:
        from sklearn.cluster import HDBSCAN

        labels = HDBSCAN(min_cluster_size=MIN_CLUSTER_SIZE, copy=True).fit_predict(x)
    except ImportError:
        import hdbscan

        labels = hdbscan.HDBSCAN(min_cluster_size=MIN_CLUSTER_SIZE).fit_predict(x)
    labels = np.asarray(labels, dtype=int).copy()
    noise = np.flatnonzero(labels < 0)
    labels[noise] = labels.max(initial=-1) + 1 + np.arange(len(noise))
    return _merge_close(x, labels)


def _merge_close(x: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """`labels` with clusters whose centroids lie within `MERGE_DISTANCE` (cosine) joined (transitively)."""
    ids = np.unique(labels)
    centroids = np.stack([x[labels == k].mean(axis=0) for k in ids])
    centroids /= np.clip(np.linalg.norm(centroids, axis=1, keepdims=True), 1e-12, None)
    parent = list(range(len(ids)))

    def root(i: int) -> int:
        while parent[i] != i:
            i = parent[i]
        return i
    close = 1.0 - centroids @ centroids.T < MERGE_DISTANCE
    for i, j in zip(*np.nonzero(np.triu(close, k=1)), strict=True):
        parent[root(int(j))] = root(int(i))
    remap = {int(k): root(i) for i, k in enumerate(ids)}
    return np.array([remap[int(k)] for k in labels], dtype=int)
