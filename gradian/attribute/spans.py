"""Where in a long accused row the blame sits: one gradient per sentence of its completion.

A row's loss is a sum over its supervised tokens, so its gradient is the sum of the gradients of any
partition of them. With the completion cut into sentences whose supervised positions are S_1..S_m,

    g_row = Σ_j g_j,    g_j = ∇θ Σ_{t ∈ S_j} w_t ℓ_t        (w_t = 1, or 1 / |S| under the index's
                                                          loss_reduction: mean, |S| the row's count)

and each g_j is a per-example gradient of the row's tokens with the loss masked to S_j
(`gradian.capture.gradients`: the row repeated once per sentence, each copy an "example" with its own mask),
projected as the index's rows are. Each sentence is scored with the accusing engine's aggregate
query q̃, as its row was:

    s_j = q̃ᵀ g_j                 (cosine: divided by |g_row|, the row's norm, so that Σ_j s_j = s_row)

and its share of the row's score is s_j / Σ_i s_i. The top sentence is the one of most negative
score, the one that pushed hardest off the answers; a share above 1 means other sentences of the
row pull the other way.

Sentences (`split_sentences`): one ends after `.`, `!`, `?` or `…` (with any closing quotes or
brackets right after it) when whitespace follows, and at a line break; not after a one-letter
initial or a common abbreviation (`ABBREVIATIONS`). The cuts partition the completion: the
whitespace after a cut begins the next sentence, and a piece that is only whitespace joins its
neighbour. Each token of the completion (tokenized as the index did, with the fast tokenizer's
character offsets) belongs to the sentence its first character is in; EOS, when the token policy
appends it, to the last one.

Rows drilled: accused prompt/completion rows with at least `--span-min-tokens` supervised tokens
and two sentences or more (chat rows are not drilled yet). Cost: one forward and backward of the
row per sentence (and one for the whole row), `SPAN_BATCH` copies at a time.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch

from circuitkit.core.errors import UserError
from gradian.attribute.engines import Engine
from gradian.attribute.rows import read_records
from gradian.capture.gradients import per_example_gradients
from gradian.capture.sites import sites_from_names
from gradian.data.rows import Row
from gradian.projection.projector import Projector
from gradian.rank.results import training_source
from gradian.rank.tokens import indexed_rows

DEFAULT_MIN_TOKENS = 64
SPAN_BATCH = 8  # copies of a row per forward
ABBREVIATIONS = frozenset({"e.g", "i.e", "etc", "vs", "cf", "mr", "mrs", "ms", "dr", "prof", "st", "fig", "no"})
_CUT = re.compile(r"[.!?…]+[\"'”’)\]}»]*(?=\s)|\n")
_WORD_BEFORE = re.compile(r"(\w+(?:\.\w+)*)$")


def split_sentences(text: str) -> list[tuple[int, int]]:
    """(start, end) character spans that partition `text` into sentences (module docstring)."""
    cuts = {0, len(text)}
    for m in _CUT.finditer(text):
        if m.group() == "\n":
            cuts.add(m.start())
            continue
        word = _WORD_BEFORE.search(text, 0, m.start())
        if m.group() == "." and word and (word.group(1).lower() in ABBREVIATIONS
                                          or (len(word.group(1)) == 1 and word.group(1).isupper())):
            continue
        cuts.add(m.end())
    bounds = sorted(cuts)
    spans = [(a, b) for a, b in zip(bounds, bounds[1:], strict=False) if b > a]
    merged: list[tuple[int, int]] = []
    for a, b in spans:  # a piece of whitespace joins the sentence before it (the first: the one after)
        if merged and (not text[a:b].strip() or not text[merged[-1][0]:merged[-1][1]].strip()):
            merged[-1] = (merged[-1][0], b)
        else:
            merged.append((a, b))
    return merged


def token_sentences(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> list[int]:
    """The sentence of each token, by the span its first character is in (a token with no characters,
    a special token: the previous token's sentence)."""
    out, j = [], 0
    for start, end in offsets:
        if end > start:
            while j + 1 < len(spans) and start >= spans[j][1]:
                j += 1
        out.append(j)
    return out


def _sentence_masks(row: Row, completion: str, tokenizer) -> tuple[list[tuple[int, int]], list[list[int]]] | str:
    """(the sentences' character spans, each one's supervised positions in the row), or why not."""
    try:
        enc = tokenizer(completion, add_special_tokens=False, return_offsets_mapping=True)
    except (NotImplementedError, ValueError, TypeError):
        return "the tokenizer gives no character offsets (not a fast tokenizer)"
    ids, offsets = list(enc["input_ids"]), [tuple(o) for o in enc["offset_mapping"]]
    positions = [t for t, s in enumerate(row.supervised) if s]
    said = [row.input_ids[t] for t in positions]
    extra = said[len(ids):]
    if said[:len(ids)] != ids[:len(said)] or (extra and extra != [tokenizer.eos_token_id]):
        return "its supervised tokens are not its completion's (a chat row, or the data changed)"
    spans = split_sentences(completion)
    owner = token_sentences(offsets, spans)
    owner += [owner[-1] if owner else 0] * (len(said) - len(ids))  # EOS: the last sentence
    masks: list[list[int]] = [[] for _ in spans]
    for t, j in zip(positions, owner, strict=False):
        masks[j].append(t)
    kept = [(span, mask) for span, mask in zip(spans, masks, strict=True) if mask]
    if len(kept) < 2:
        return "its supervised tokens hold one sentence"
    return [s for s, _ in kept], [m for _, m in kept]


def masked_gradients(loaded, modules, projector: Projector, row: Row, masks: list[list[int]], loss: str,
                     activations: str) -> torch.Tensor:
    """(len(masks), projector.total_width) float32: the projected gradient of `row`'s summed loss over
    each mask's positions only, `SPAN_BATCH` copies of the row per forward."""
    out = []
    n = len(row.input_ids)
    for start in range(0, len(masks), SPAN_BATCH):
        part = masks[start:start + SPAN_BATCH]
        ids = torch.tensor(row.input_ids, dtype=torch.long).expand(len(part), n).clone()  # (B, T)
        supervised = torch.zeros(len(part), n, dtype=torch.bool)
        for b, mask in enumerate(part):
            supervised[b, mask] = True
        batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "supervised": supervised}
        grads = per_example_gradients(loaded.model, loaded.adapter, modules, projector, batch, "sum", loss, activations)
        out.append(grads.row().float().cpu())
    return torch.cat(out)


def drill_down(loaded, projector: Projector, engine: Engine, manifest: dict[str, Any], index_dir: str | Path,
               accused: list[tuple[int, int | None, float]], min_tokens: int) -> dict[str, Any]:
    """The sentences of every long accused row (`accused`: (row id, line, score) triples), scored
    with `engine`'s query on the tuned model `loaded`: the result's `spans` entry."""
    entry: dict[str, Any] = {"min_tokens": min_tokens, "engine": engine.name, "rows": [], "skipped": [], "note": None}
    source = training_source(manifest)
    if source is None:
        entry["note"] = "the training data is gone or changed since indexing: no row was drilled into."
        return entry
    try:
        rows = indexed_rows(index_dir, [r for r, _, _ in accused], loaded.tokenizer)
    except UserError as err:
        entry["note"] = f"the accused rows cannot be re-tokenized ({err}): no row was drilled into."
        return entry
    long_rows = [(r, line, score) for r, line, score in accused if sum(rows[r].supervised) >= min_tokens]
    records = read_records(source, [rows[r].line for r, _, _ in long_rows])
    modules = sites_from_names(loaded.model, loaded.adapter, projector.names)
    scale_mean = manifest.get("loss_reduction", "sum") == "mean"
    for row_id, line, score in long_rows:
        row, record = rows[row_id], records.get(rows[row_id].line)
        if not isinstance(record, dict) or not isinstance(record.get("completion"), str):
            entry["skipped"].append({"row_id": row_id, "why": "a chat row (only prompt/completion rows are drilled)"})
            continue
        found = _sentence_masks(row, record["completion"], loaded.tokenizer)
        if isinstance(found, str):
            entry["skipped"].append({"row_id": row_id, "why": found})
            continue
        spans, masks = found
        everything = [t for t, s in enumerate(row.supervised) if s]
        g = masked_gradients(loaded, modules, projector, row, [everything, *masks], manifest.get("loss", "ce"),
                             manifest.get("activations", "model"))
        if scale_mean:
            g /= len(everything)
        s = g @ engine.query.cpu()  # (1 + sentences,)
        if engine.unit_rows:
            s /= g[0].norm().clamp_min(1e-12)
        sentence_scores = s[1:].double()
        total = float(sentence_scores.sum())
        sentences = [{"text": record["completion"][a:b].strip(), "chars": [a, b], "token_span": [m[0], m[-1] + 1],
                      "n_tokens": len(m), "score": float(v), "share": float(v) / total if total else None}
                     for (a, b), m, v in zip(spans, masks, sentence_scores, strict=True)]
        top = int(torch.argmin(sentence_scores))
        entry["rows"].append({"row_id": row_id, "line": line, "score": score, "score_recomputed": float(s[0]),
                              "n_supervised": len(everything), "top": top, "sentences": sentences})
    return entry
