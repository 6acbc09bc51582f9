"""Checks of the rows themselves: malformed, empty, cut by the length limit, no EOS, duplicated,
pre-rendered with another chat template, and, with an eval set, contaminated or leaking answers.

Each check takes the rows (`gradian.diagnose.rows`) and returns findings; the token checks need
the tokenizer (`--model`), the eval checks the eval rows. Thresholds are module constants, so a
finding can be traced to the rule that made it (docs/troubleshooting.md, "gradian diagnose").
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np

from gradian.diagnose.finding import Finding, clip, tail
from gradian.diagnose.rows import DiagRow, ReadResult, row_tokens
from gradian.diagnose.similar import Vocabulary, containments, near_duplicates, normal_words

CONTAINED = 0.9  # share of an eval text's word 3-grams found in one training row
MIN_PROMPT_WORDS = 5  # shorter eval prompts count only when a training prompt equals them
MIN_ANSWER_WORDS = 4  # shorter eval answers are not looked for in training prompts
# Markers that chat templates write around turns, by template family.
TEMPLATE_MARKERS: dict[str, tuple[str, ...]] = {
    "ChatML (Qwen, SmolLM, ...)": ("<|im_start|>", "<|im_end|>"),
    "Llama 3": ("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"),
    "Llama 2 / Mistral": ("[INST]", "[/INST]", "<<SYS>>"),
    "Gemma": ("<start_of_turn>", "<end_of_turn>"),
    "Phi-3 / Zephyr": ("<|system|>", "<|user|>", "<|assistant|>", "<|end|>"),
}
_MARKER = re.compile("|".join(re.escape(m) for ms in TEMPLATE_MARKERS.values() for m in ms))
_FAMILY = {m: family for family, ms in TEMPLATE_MARKERS.items() for m in ms}


def _finding(id: str, severity: str, data: ReadResult, lines: list[int], message: str, evidence: str,
             fix: str, source: str = "train") -> Finding:
    return Finding(id=id, severity=severity, source=source, file=data.path, message=message, count=len(lines),
                   rows=lines, evidence=evidence, fix=fix)


def row_text(row: DiagRow) -> str:
    """The row's text as one string (a chat row's turns as `role: content` lines)."""
    if row.kind == "messages":
        return "\n".join(f"{m['role']}: {m['content']}" for m in row.messages)
    return f"{row.prompt}\n{row.completion}"


def malformed(data: ReadResult, source: str = "train") -> list[Finding]:
    """Rows Gradian's row check refuses (wrong keys or types)."""
    if not data.malformed:
        return []
    lines = [line for line, _ in data.malformed]
    return [_finding("malformed_row", "error", data, lines, f"{len(lines)} row(s) are not rows Gradian or a trainer"
                     " can read", data.malformed[0][1], "fix or remove these rows (each must be"
                     ' {"prompt", "completion"} or {"messages": [...]})', source=source)]


def empty_completions(data: ReadResult) -> list[Finding]:
    """Rows with nothing to learn: a blank completion, or a chat row with no non-blank assistant turn."""
    lines = [r.line for r in data.rows if not r.completion.strip()]
    if not lines:
        return []
    first = next(r for r in data.rows if r.line == lines[0])
    return [_finding("empty_completion", "error", data, lines, f"{len(lines)} row(s) have an empty completion (no"
                     " token to learn: an all-masked batch gives a NaN loss in most trainers)",
                     f"line {first.line}: prompt {clip(first.prompt, 50)!r}, completion {first.completion!r}",
                     "drop these rows or write their completions")]


def truncated(data: ReadResult, tokenizer: Any, limit: int, limit_name: str, append_eos: bool) -> list[Finding]:
    """Rows whose supervised tokens reach past `limit` (the trainer cuts the end: the model learns
    completions that stop mid-way, and loses their EOS)."""
    cut = [r for r in data.rows if r.supervised_end is not None and r.supervised_end > limit]
    if not cut:
        return []
    first = cut[0]
    ids = row_tokens(first, tokenizer, append_eos)
    start = max(first.first_supervised, limit - 8)
    kept, lost = tokenizer.decode(ids[start:limit]), tokenizer.decode(ids[limit:limit + 8])
    supervised = first.supervised_end - first.first_supervised
    lost_n = first.supervised_end - max(limit, first.first_supervised)
    longest = max(r.n_tokens for r in data.rows if r.n_tokens is not None)
    lengths = sorted(r.n_tokens for r in data.rows if r.n_tokens is not None)
    p99 = lengths[min(len(lengths) - 1, int(0.99 * len(lengths)))]
    gone = sum(r.first_supervised >= limit for r in cut)
    return [_finding("truncated_completion", "error", data, [r.line for r in cut],
                     f"{len(cut)} row(s) lose completion tokens at {limit_name}"
                     + (f" ({gone} lose all of it: the prompt alone fills the limit)" if gone else ""),
                     f"line {first.line}: {first.n_tokens} tokens; {lost_n} of its {supervised} completion tokens are"
                     f" cut: …{kept!r} ✂ {lost!r}…",
                     f"raise the limit to {longest} (the longest row; {p99} covers 99 % of rows), or shorten or drop"
                     " these rows")]


def missing_eos(data: ReadResult, tokenizer: Any, append_eos: bool | None) -> list[Finding]:
    """Prompt/completion rows whose completion does not end with the tokenizer's EOS when nothing
    says the trainer appends it: the model never learns to stop. (Chat rows end with the
    template's end-of-turn marker.)"""
    eos = tokenizer.eos_token
    if append_eos or eos is None:
        return []
    rows = [r for r in data.rows if r.kind == "prompt" and r.completion.strip() and not r.completion.rstrip().endswith(eos)]
    if not rows:
        return []
    how = ("the trainer settings say it is not appended" if append_eos is False
           else "unless your trainer appends it")
    return [_finding("missing_eos", "error" if append_eos is False else "warning", data, [r.line for r in rows],
                     f"{len(rows)} completion(s) do not end with EOS {eos!r} ({how}): the model does not learn"
                     " to stop", f"line {rows[0].line}: completion ends {tail(rows[0].completion, 40)}",
                     f"end each completion with {eos!r} (id {tokenizer.eos_token_id}), or have the trainer append it"
                     " (check that a tokenized row ends with that id; grads.append_eos=true for gradian)")]


def template_mismatch(data: ReadResult, tokenizer: Any, failed: list[tuple[int, str]]) -> list[Finding]:
    """Chat rows the tokenizer cannot render, and text pre-rendered with a template family the
    tokenizer does not have (its markers are then plain text to the model)."""
    out = []
    if failed:
        out.append(_finding("chat_template_mismatch", "error", data, [line for line, _ in failed],
                            f"{len(failed)} chat row(s) cannot be rendered with this tokenizer's chat template",
                            failed[0][1], "use the tokenizer of the model you fine-tune (one with a chat template),"
                            " or write the rows as prompt/completion"))
    template = tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else str(tokenizer.chat_template or "")
    known = set(tokenizer.get_added_vocab()) | {m for m in _FAMILY if m in template}
    own = {_FAMILY[m] for m in known if m in _FAMILY}
    foreign, in_messages = [], []
    for r in data.rows:
        text = row_text(r)
        hits = _MARKER.findall(text) if ("<" in text or "[" in text) else []
        if not hits:
            continue
        if r.kind == "messages":
            in_messages.append((r.line, hits[0]))
        elif any(_FAMILY[h] not in own for h in hits):
            foreign.append((r.line, next(h for h in hits if _FAMILY[h] not in own)))
    if foreign:
        marker = foreign[0][1]
        mine = ", ".join(sorted(own)) or "none of the known families"
        out.append(_finding("chat_template_mismatch", "error", data, [line for line, _ in foreign],
                            f"{len(foreign)} row(s) are pre-rendered with {_FAMILY[marker]} markers, which this"
                            f" tokenizer does not have (its template: {mine})",
                            f"line {foreign[0][0]} contains {marker!r}",
                            "store the conversation as {\"messages\": [...]} and let the tokenizer's template render it,"
                            " or re-render the text with the fine-tuned model's own template"))
    if in_messages:
        out.append(_finding("template_markers_in_messages", "warning", data, [line for line, _ in in_messages],
                            f"{len(in_messages)} chat row(s) carry template markers inside their contents (rendered"
                            " twice)", f"line {in_messages[0][0]} contains {in_messages[0][1]!r}",
                            "put plain text in message contents; the template writes the markers"))
    return out


def words_of(data: ReadResult) -> list[list[str]]:
    """The normalised words of each row's text (`row_text`), computed once for both checks that use them."""
    return [normal_words(row_text(r)) for r in data.rows]


def duplicates(data: ReadResult, vocab: Vocabulary, words: list[list[str]]) -> list[Finding]:
    """Rows equal to an earlier row (exactly), and rows equal after normalisation or whose word
    3-grams overlap an earlier row's by Jaccard >= 0.8 (near)."""
    first_of: dict[tuple, int] = {}
    exact: list[tuple[int, int]] = []
    is_copy = np.zeros(len(data.rows), dtype=bool)
    for i, r in enumerate(data.rows):
        key = (r.kind, r.prompt, r.completion) if r.kind == "prompt" else (r.kind, row_text(r))
        j = first_of.setdefault(key, i)
        if j != i:
            exact.append((i, j))
            is_copy[i] = True
    first_norm: dict[str, int] = {}
    near: dict[int, tuple[int, float]] = {}
    for i, w in enumerate(words):
        if is_copy[i] or not w:
            continue
        j = first_norm.setdefault(" ".join(w), i)
        if j != i:
            near[i] = (j, 1.0)
    shingles = vocab.shingles(words)
    eligible = ~is_copy
    eligible[list(near)] = False
    near.update(near_duplicates(shingles, eligible))
    out = []
    rows = data.rows
    if exact:
        i, j = exact[0]
        out.append(_finding("exact_duplicate", "warning", data, [rows[i].line for i, _ in exact],
                            f"{len(exact)} row(s) repeat an earlier row exactly (each copy weighs once more in the loss)",
                            f"line {rows[i].line} repeats line {rows[j].line}: {clip(row_text(rows[i]), 60)!r}",
                            "keep one copy of each row"))
    if near:
        order = sorted(near)
        i = order[0]
        j, score = near[i]
        out.append(_finding("near_duplicate", "warning", data, [rows[k].line for k in order],
                            f"{len(near)} row(s) are near copies of an earlier row (same words after normalisation, or"
                            " word 3-gram Jaccard >= 0.8)",
                            f"line {rows[i].line} ~ line {rows[j].line} (Jaccard {score:.2f}):"
                            f" {clip(row_text(rows[i]), 60)!r}",
                            "deduplicate (keep one row per group), or vary the template these rows come from"))
    return out


def eval_overlap(train: ReadResult, evals: ReadResult, vocab: Vocabulary, train_words: list[list[str]]) -> list[Finding]:
    """Eval prompts that appear in training rows (contamination), and eval answers that appear in
    training prompts (leakage)."""
    out = []
    prompt_words = [normal_words(r.prompt) for r in train.rows]
    eval_prompts = [normal_words(r.prompt) for r in evals.rows]
    eval_answers = [normal_words(r.completion) for r in evals.rows]
    same_prompt: dict[str, int] = {}
    for j, w in enumerate(prompt_words):
        if w:
            same_prompt.setdefault(" ".join(w), j)
    hits: dict[int, tuple[int, float]] = {}
    for i, w in enumerate(eval_prompts):
        j = same_prompt.get(" ".join(w)) if w else None
        if j is not None:
            hits[i] = (j, 1.0)
    long_prompt = np.array([len(w) >= MIN_PROMPT_WORDS for w in eval_prompts], dtype=bool)
    long_prompt[list(hits)] = False
    hits.update(containments(vocab.shingles(eval_prompts), vocab.shingles(train_words), CONTAINED, long_prompt))
    if hits:
        order = sorted(hits)
        i, (j, share) = order[0], hits[order[0]]
        trained = sorted({train.rows[hits[k][0]].line for k in order})
        out.append(_finding("eval_contamination", "error", evals, [evals.rows[k].line for k in order],
                            f"{len(hits)} eval prompt(s) appear in training rows (the eval measures recall of"
                            " trained rows)",
                            f"eval line {evals.rows[i].line} is in train line {train.rows[j].line} ({share:.0%} of its"
                            f" word 3-grams): {clip(evals.rows[i].prompt, 60)!r}",
                            "remove these items from the eval set, or their matches from the training set (train"
                            f" line{'s' if len(trained) > 1 else ''} {', '.join(map(str, trained[:10]))}"
                            f"{' ...' if len(trained) > 10 else ''})", source="eval"))
    long_answer = np.array([len(w) >= MIN_ANSWER_WORDS for w in eval_answers], dtype=bool)
    leaks = containments(vocab.shingles(eval_answers), vocab.shingles(prompt_words), CONTAINED, long_answer)
    if leaks:
        order = sorted(leaks)
        i, (j, share) = order[0], leaks[order[0]]
        out.append(_finding("answer_leakage", "error", evals, [evals.rows[k].line for k in order],
                            f"{len(leaks)} eval answer(s) appear inside training prompts (the model can copy them"
                            " from context)",
                            f"the answer of eval line {evals.rows[i].line} is in the prompt of train line"
                            f" {train.rows[j].line}: {clip(evals.rows[i].completion, 60)!r}",
                            "remove those training rows (or the eval items), or rewrite the prompts (few-shot"
                            " examples, retrieved context) without the eval answers", source="eval"))
    return out
