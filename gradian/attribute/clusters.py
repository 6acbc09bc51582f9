"""Clusters of the accused rows: what they have in common, in words, and in `gradian diagnose` findings.

The accused rows' texts (prompt and completion, chat markers stripped: `gradian.attribute.templates`)
become TF-IDF vectors (scikit-learn, word unigrams and bigrams, sublinear term frequency), grouped by
agglomerative clustering with average linkage on cosine distance, cut at `CLUSTER_DISTANCE` (rows
whose word profiles are less alike than that stay apart; the number of clusters follows from the
data). With sentence-transformers and its model on this machine the rows are grouped by their
sentence embeddings and HDBSCAN instead (`gradian.attribute.embeddings`); the terms are TF-IDF's
either way. The clusters group phrasings; `gradian.attribute.lessons` groups them by the answer
template their rows teach.

The inverse document frequencies come from the training set (`background`: a sample of its rows,
read in the same pass as the accused rows' texts, `gradian.attribute.rows.read_texts`), not from
the accused rows alone. What accused rows share is what a cluster should show; fitted on the
accused rows only, a word that all of them carry gets the lowest weight, and the words that
differ from row to row (the entity of a templated row) dominate every vector: 40 rows asking "What
is the capital of X?" each with its own country and city stayed 40 clusters of one (the SmolLM2
benchmark). Against the training set, the words rare there but common among the accused
("capital") weigh most. Per cluster:

* share: its rows' summed score over all accused rows' summed score. Accused scores are all
  negative (`gradian.attribute.engines`), so shares are positive and sum to 1: the part of the
  accusation the cluster carries;
* top terms: the terms of highest mean TF-IDF weight in its rows (never a chat marker's piece);
* rows: their ids, line numbers and scores;
* findings: the `gradian diagnose` findings on training rows that its rows share ("3 of the
  cluster's 4 rows: truncated_completion"), joined by line number.

scikit-learn is an optional extra (`pip install 'circuitkit-gradian[attribute]'`): without it the
result says so in one line and has no clusters.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from gradian.attribute.embeddings import Method, embed, hdbscan_labels
from gradian.attribute.templates import marker_terms, strip_markers

CLUSTER_DISTANCE = 0.8  # cosine distance (1 - cosine similarity) at which the tree is cut
TOP_TERMS = 5
SKLEARN_INSTALL = "pip install 'circuitkit-gradian[attribute]' (scikit-learn)"


@dataclass
class AccusedRow:
    """One accused training row: id in the index, source line (None: unknown), text, score (< 0), and
    its completion (what it teaches; None: not known)."""

    row_id: int
    line: int | None
    text: str | None
    score: float
    completion: str | None = None


def sklearn_missing() -> str | None:
    """One line saying how to install scikit-learn, or None when it is installed."""
    try:
        import sklearn  # noqa: F401
    except ImportError:
        return f"the clusters need scikit-learn, which is not installed: {SKLEARN_INSTALL}"
    return None


def tfidf(texts: list[str], background: list[str], stop_words: frozenset[str] = frozenset(),
          distance: float = CLUSTER_DISTANCE, token_pattern: str = r"(?u)\b\w+\b",
          ) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """(cluster label per text, TF-IDF matrix (n, terms), the terms); the IDF fitted on `background`
    and `texts` together (so every term of a text has one), `stop_words` never a term, the tree cut
    at cosine `distance`."""
    from sklearn.cluster import AgglomerativeClustering
    from sklearn.feature_extraction.text import TfidfVectorizer

    try:
        vectorizer = TfidfVectorizer(sublinear_tf=True, ngram_range=(1, 2), token_pattern=token_pattern,
                                     stop_words=sorted(stop_words) or None)
        x = vectorizer.fit(list(background) + texts).transform(texts).toarray()
        terms = list(vectorizer.get_feature_names_out())
    except ValueError:  # no word in any text: one cluster, no terms
        return np.zeros(len(texts), dtype=int), np.zeros((len(texts), 0)), []
    if len(texts) < 2:
        return np.zeros(len(texts), dtype=int), x, terms
    # A row without any term has no direction: cosine distance to it is undefined, so it is placed
    # at distance 1 from everything by giving it a term of its own.
    empty = ~x.any(axis=1)
    if empty.any():
        x_fit = np.hstack([x, np.diag(empty.astype(float))[:, empty]])
    else:
        x_fit = x
    model = AgglomerativeClustering(n_clusters=None, distance_threshold=distance, metric="cosine",
                                    linkage="average")
    return model.fit_predict(x_fit), x, terms


def _shared_findings(lines: list[int], findings: list[Any]) -> list[dict[str, Any]]:
    """The findings on training rows that some of `lines` carry: id, severity, how many, the fix."""
    out = []
    mine = set(lines)
    for f in findings:
        if getattr(f, "source", None) != "train":
            continue
        hit = sorted(mine & set(f.all_rows))
        if hit:
            out.append({"id": f.id, "severity": f.severity, "rows_in_cluster": len(hit), "lines": hit,
                        "text": f"{len(hit)} of the cluster's {len(lines)} rows: {f.id.replace('_', ' ')} ({f.fix})",
                        "fix": f.fix})
    return sorted(out, key=lambda d: -d["rows_in_cluster"])


def cluster_rows(rows: list[AccusedRow], findings: list[Any] | None = None,
                 background: list[str] | None = None, special_tokens: tuple[str, ...] | list[str] = (),
                 method: Method | None = None) -> list[dict[str, Any]]:
    """Clusters of the accused `rows` (texts None count as empty), largest share first. `background`:
    texts of training rows whose document frequencies weigh the terms (module docstring; None: the
    accused rows' own). `special_tokens`: the tokenizer's, stripped with the chat markers. `method`:
    `gradian.attribute.embeddings.choose_method`'s (None: TF-IDF).

    Each cluster: ``cluster`` (1-based, in order of share), ``share``, ``score`` (summed), ``n_rows``,
    ``top_terms``, ``rows`` (row ids), ``lines``, ``findings`` (`_shared_findings`). Raises
    ImportError when scikit-learn is missing (`sklearn_missing` says it in one line).
    """
    if not rows:
        return []
    texts = [strip_markers(r.text or "", special_tokens) for r in rows]
    back = [strip_markers(t, special_tokens) for t in background or []]
    labels, x, terms = tfidf(texts, back, marker_terms(special_tokens))
    if method is not None and method.encoder is not None and len(rows) > 1:
        labels = hdbscan_labels(embed(method, texts))
    scores = np.array([r.score for r in rows], dtype=np.float64)
    total = scores.sum()
    clusters = []
    for label in np.unique(labels):
        members = np.flatnonzero(labels == label)
        weight = x[members].mean(axis=0) if x.shape[1] else np.zeros(0)
        top = [terms[i] for i in np.argsort(-weight, kind="stable")[:TOP_TERMS] if weight[i] > 0]
        lines = [rows[i].line for i in members if rows[i].line is not None]
        clusters.append({"share": float(scores[members].sum() / total) if total != 0 else 0.0,
                         "score": float(scores[members].sum()), "n_rows": len(members), "top_terms": top,
                         "rows": [rows[i].row_id for i in members], "lines": lines,
                         "findings": _shared_findings(lines, findings or [])})
    clusters.sort(key=lambda c: (-c["share"], c["rows"][0]))
    for i, c in enumerate(clusters, start=1):
        c["cluster"] = i
    return [{"cluster": c.pop("cluster"), **c} for c in clusters]
