"""Gradian training data: JSONL rows -> token ids + a mask of the tokens the loss predicts.

Two row formats, one per line (blank lines are skipped):

* ``{"prompt": str, "completion": str}``: tokens are ``[BOS] + prompt + completion [+ EOS]``.
  Prompt and completion are tokenized separately and concatenated, so the boundary between them is
  exact (no BPE merge across it). The completion's tokens are supervised. BOS follows
  ``prepend_bos`` (None: only if the tokenizer adds one by itself, as Llama's does and GPT-2's
  does not; True / False: always / never). The tokenizer's EOS is appended and supervised only
  with ``append_eos=True`` (the default is False: see `TokenPolicy`).
* ``{"messages": [{"role": "system"|"user"|"assistant", "content": str}, ...]}``: rendered with the
  tokenizer's chat template, which writes its own special tokens (BOS included: ``prepend_bos``
  does not apply). With ``append_eos=False`` only each assistant message's content is supervised;
  with ``append_eos=True`` also what the template adds to the turn after it: whatever it wraps in
  ``{% generation %}`` (usually the content plus the end-of-turn marker), or, for a template
  without those markers, everything up to the next turn (end marker and newline).

Truncation to ``max_seq_length``:

* ``right`` cuts the end of the row. A row loses supervised tokens -> it is *truncated*.
* ``prompt_left`` first drops unsupervised tokens from the left (after BOS, before the first
  supervised token), so the completion survives whole when it fits; if it still does not fit, the
  end is cut as with ``right`` and the row counts as truncated.

``on_truncation`` then decides: ``warn`` (keep, log the line numbers), ``error`` (raise naming the
lines), ``drop`` (skip and report). A row with no supervised token left is never kept: its loss and
gradient would be zero and its index entry meaningless. It is dropped and reported; when truncation
emptied it and ``on_truncation=error``, loading raises instead.

Row ids follow the source order. Batches are planned per shard of rows (`plan_batches`): with
length grouping on, rows of similar length share a batch and a batch holds at most
``batch_tokens`` padded tokens and ``batch_size`` rows, cut where padding would cost more than
another batch (`circuitkit.core.batching.batch_overhead_tokens`: a few tokens on a CPU, 256 on an
accelerator), so little compute goes to padding; the plan depends only on the rows' lengths and
the device type, so an index built in batches is deterministic, resumes at any shard and gives
every worker the same rows.

Rows come from any `gradian.data.sources` source (JSONL, Parquet, Arrow, hub datasets) and are
encoded one at a time (`iter_rows`); the report keeps counts and the first
``REPORT_LINES`` positions of each kind, so it stays small for files of millions of rows.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from circuitkit.core.config import choices
from gradian.data.encode import (
    bos_for_prompt_rows,
    check_row,
    encode_messages,
    encode_prompt_completion,
    truncate,
)
from gradian.data.sources import DataError, Source, SourceSpec
from gradian.settings.grads import GradsConfig

logger = logging.getLogger(__name__)

ON_TRUNCATION = choices(GradsConfig, "on_truncation")
TRUNCATION_SIDES = choices(GradsConfig, "truncation_side")
PREVIEW_CHARS = 80
# Error messages list at most this many line numbers; the count says how many there are in all.
MAX_LINES_SHOWN = 10
# A report lists at most this many positions per kind (truncated, dropped, ...); counts are exact.
REPORT_LINES = 100



@dataclass(frozen=True)
class TokenPolicy:
    """Which tokens a row has and which of them the loss supervises, beyond what the user wrote.

    append_eos (``grads.append_eos``): prompt/completion rows get the tokenizer's EOS after the
        completion, supervised; chat rows also supervise the tokens the template adds to an
        assistant turn after its content (the end-of-turn marker). False (default): only the
        completion's / the assistant contents' own tokens. On a model whose training rows did
        not end in EOS, that one token can carry almost all of a row's gradient (docs/
        configuration.md, "Token policy").
    prepend_bos (``grads.prepend_bos``): prompt/completion rows start with the tokenizer's BOS
        (True), never (False), or as the tokenizer does by itself (None). Never supervised.
    """

    append_eos: bool = False
    prepend_bos: bool | None = None

    def resolve(self, tokenizer: Any) -> dict[str, Any]:
        """The policy as applied with `tokenizer` (JSON-ready, for the manifest): the keys, whether
        BOS / EOS are really added (a tokenizer may have none), and the tokens themselves."""
        bos = bos_for_prompt_rows(tokenizer, self.prepend_bos)
        return {"append_eos": self.append_eos, "prepend_bos": self.prepend_bos,
                "bos_added": bos, "bos_token": tokenizer.bos_token if bos else None,
                "eos_added": self.append_eos and tokenizer.eos_token_id is not None,
                "eos_token": tokenizer.eos_token if self.append_eos else None,
                "chat_supervised": "assistant content and the template's end of turn" if self.append_eos
                else "assistant content only"}


# Indexes written before the policy was a key appended EOS and took BOS from the tokenizer.
LEGACY_POLICY = TokenPolicy(append_eos=True, prepend_bos=None)


def policy_of(manifest: dict[str, Any]) -> TokenPolicy:
    """The token policy an index's rows were made with (its manifest's ``token_policy``)."""
    recorded = manifest.get("token_policy")
    if not isinstance(recorded, dict):
        return LEGACY_POLICY
    return TokenPolicy(append_eos=bool(recorded.get("append_eos")), prepend_bos=recorded.get("prepend_bos"))


@dataclass
class Row:
    """One usable training row.

    ``input_ids`` and ``supervised`` have the same length T <= max_seq_length. ``supervised[t]``
    is True where token t is predicted by the loss (from the logits at t - 1); it is never True at
    t = 0, since no position predicts the first token.
    """

    row_id: int  # 0-based index among the kept rows, in source order
    line: int  # position in the source: 1-based JSONL line number, or 0-based table row index
    input_ids: list[int]
    supervised: list[bool]
    preview: str  # first ~80 characters of the row's text, for reports
    truncated: bool = False  # supervised tokens were cut to fit max_seq_length


@dataclass
class DataReport:
    """What loading did to the source: exact counts, and the first positions behind each count.

    ``rows_read == kept + dropped_truncated + dropped_unsupervised``. ``truncated`` counts every
    row that lost supervised tokens, kept or not; a row truncated to nothing is listed both in
    ``truncated_lines`` and ``dropped_unsupervised_lines``. The ``*_lines`` lists hold the first
    ``REPORT_LINES`` positions (JSONL line numbers, or table row indices) of each kind, so the
    report stays small whatever the size of the data.
    """

    path: str
    max_seq_length: int
    on_truncation: str
    truncation_side: str
    rows_read: int = 0
    kept: int = 0
    truncated: int = 0
    dropped_truncated: int = 0
    dropped_unsupervised: int = 0
    real_tokens: int = 0  # tokens of the kept rows
    truncated_lines: list[int] = field(default_factory=list)
    dropped_truncated_lines: list[int] = field(default_factory=list)
    dropped_unsupervised_lines: list[int] = field(default_factory=list)
    first_token_lines: list[int] = field(default_factory=list)  # rows whose token 0 was a target
    limit: str = ""  # how messages name the length bound ("max_seq_length=512", or the model's context)
    policy: TokenPolicy = field(default_factory=TokenPolicy)
    eos_appended: int = 0  # kept rows that end with the appended, supervised EOS
    bos_first: int = 0  # kept rows whose token 0 is BOS (prepended, or written by a chat template)

    def note(self, kind: str, position: int) -> None:
        """Count one row of `kind` (truncated, dropped_truncated, dropped_unsupervised)."""
        setattr(self, kind, getattr(self, kind) + 1)
        lines = getattr(self, f"{kind}_lines")
        if len(lines) < REPORT_LINES:
            lines.append(position)

    def summary(self) -> dict[str, Any]:
        """JSON-ready counts and the first positions of each kind (for the manifest and the CLI)."""
        return {
            "path": self.path,
            "max_seq_length": self.max_seq_length,
            "on_truncation": self.on_truncation,
            "truncation_side": self.truncation_side,
            "rows_read": self.rows_read,
            "kept": self.kept,
            "truncated": self.truncated,
            "dropped_truncated": self.dropped_truncated,
            "dropped_unsupervised": self.dropped_unsupervised,
            "real_tokens": self.real_tokens,
            "append_eos": self.policy.append_eos,
            "prepend_bos": self.policy.prepend_bos,
            "eos_appended": self.eos_appended,
            "bos_first": self.bos_first,
            "lines_listed_at_most": REPORT_LINES,
            "truncated_lines": list(self.truncated_lines),
            "dropped_truncated_lines": list(self.dropped_truncated_lines),
            "dropped_unsupervised_lines": list(self.dropped_unsupervised_lines),
        }


# ----------------------------------------------------------------------------- parsing


def _lines_text(lines: Sequence[int], total: int | None = None) -> str:
    total = len(lines) if total is None else total
    shown = ", ".join(str(n) for n in lines[:MAX_LINES_SHOWN])
    more = f" and {total - min(len(lines), MAX_LINES_SHOWN)} more" if total > MAX_LINES_SHOWN else ""
    return f"line{'s' if total != 1 else ''} {shown}{more}"


def preview_text(text: str) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= PREVIEW_CHARS else flat[: PREVIEW_CHARS - 3] + "..."


def length_limit(max_seq_length: int, context_length: int | None) -> tuple[int, str]:
    """(tokens a row may have, how to name that limit in messages).

    The model's context bounds every length: a row longer than its position table cannot run.
    """
    if context_length is not None and context_length < max_seq_length:
        return context_length, (f"{context_length} tokens (the model's context length; grads.max_seq_length="
                                f"{max_seq_length} is above it)")
    return max_seq_length, f"max_seq_length={max_seq_length}"


def _check_settings(max_seq_length: int, on_truncation: str, truncation_side: str) -> None:
    if on_truncation not in ON_TRUNCATION:
        raise ValueError(f"on_truncation={on_truncation!r}; use one of {', '.join(ON_TRUNCATION)}.")
    if truncation_side not in TRUNCATION_SIDES:
        raise ValueError(f"truncation_side={truncation_side!r}; use one of {', '.join(TRUNCATION_SIDES)}.")
    if max_seq_length < 2:
        raise ValueError(f"max_seq_length={max_seq_length}; it must be >= 2 (one context token and one"
                         " predicted token).")


def as_source(data: str | Path | SourceSpec | Source) -> Source:
    """A Source for a path (format picked from it), a SourceSpec, or a Source."""
    if isinstance(data, Source):
        return data
    return Source(data if isinstance(data, SourceSpec) else SourceSpec(path=str(data)))


def iter_rows(source: Source, tokenizer: Any, report: DataReport) -> Iterator[Row]:
    """Encode the source's records one at a time; yields the kept rows (row ids 0, 1, ...).

    Counts what is truncated or dropped in `report` (whose settings decide the truncation).
    Call `finish_report` after the last row: it raises for ``on_truncation="error"`` and logs
    the warnings. Raises DataError naming the record for a malformed one.
    """
    _check_settings(report.max_seq_length, report.on_truncation, report.truncation_side)
    policy = report.policy
    bos = bos_for_prompt_rows(tokenizer, policy.prepend_bos)
    bos_id = tokenizer.bos_token_id
    if policy.append_eos and tokenizer.eos_token_id is None:
        logger.warning("grads.append_eos=true, but the tokenizer has no EOS token: prompt/completion rows end"
                       " with their completion.")
    for position, where, obj in source.records():
        kind = check_row(obj, where)
        report.rows_read += 1
        eos_added = False
        if kind == "prompt":
            ids, sup, eos_added = encode_prompt_completion(tokenizer, obj["prompt"], obj["completion"], bos,
                                                            policy.append_eos)
            preview = preview_text(obj["prompt"] + obj["completion"])
        else:
            ids, sup = encode_messages(tokenizer, obj["messages"], where, end_of_turn=policy.append_eos)
            preview = preview_text(" / ".join(f"{m['role']}: {m['content']}" for m in obj["messages"]))
        head = 1 if (ids and bos_id is not None and ids[0] == bos_id and not sup[0]) else 0
        ids, sup, truncated = truncate(ids, sup, report.max_seq_length, report.truncation_side, head)
        if sup and sup[0]:
            # Only reachable with no BOS and an empty prompt (or a template starting with the
            # assistant turn): no logits predict token 0, so it cannot be in the loss.
            sup[0] = False
            if len(report.first_token_lines) < REPORT_LINES:
                report.first_token_lines.append(position)
        if truncated:
            report.note("truncated", position)
        if not any(sup):
            report.note("dropped_unsupervised", position)
            continue
        if truncated and report.on_truncation == "drop":
            report.note("dropped_truncated", position)
            continue
        row = Row(row_id=report.kept, line=position, input_ids=ids, supervised=sup, preview=preview,
                  truncated=truncated)
        report.kept += 1
        report.real_tokens += len(ids)
        # Truncation only ever cuts the end, and EOS is the last (supervised) token: an untruncated
        # row still ends with it.
        report.eos_appended += int(eos_added and not truncated)
        report.bos_first += int(bos_id is not None and ids[0] == bos_id)
        yield row


def finish_report(report: DataReport) -> None:
    """After `iter_rows`: raise for truncated rows under ``on_truncation="error"``, log the rest."""
    path, side = report.path, report.truncation_side
    limit = report.limit or f"max_seq_length={report.max_seq_length}"
    if report.on_truncation == "error" and report.truncated:
        raise DataError(f"{path}: {report.truncated} row(s) lose completion tokens at {limit}"
                        f" (truncation_side={side}): {_lines_text(report.truncated_lines, report.truncated)}"
                        f" (first at {path}:{report.truncated_lines[0]}). Raise grads.max_seq_length, set"
                        " grads.truncation_side=prompt_left, or set grads.on_truncation=drop or warn.")
    if report.truncated and report.on_truncation == "warn":
        emptied = set(report.dropped_unsupervised_lines)
        kept_cut = [n for n in report.truncated_lines if n not in emptied]
        n_kept_cut = report.truncated - report.dropped_unsupervised if report.truncated > REPORT_LINES else len(kept_cut)
        if kept_cut:
            logger.warning("%s: %d row(s) kept with completions cut at %s (truncation_side=%s):"
                           " %s. Their gradients see only part of the target; raise grads.max_seq_length,"
                           " try truncation_side=prompt_left, or set on_truncation=drop.", path, n_kept_cut,
                           limit, side, _lines_text(kept_cut))
    if report.dropped_truncated:
        logger.warning("%s: dropped %d row(s) whose completions did not fit %s: %s.", path,
                       report.dropped_truncated, limit,
                       _lines_text(report.dropped_truncated_lines, report.dropped_truncated))
    if report.dropped_unsupervised:
        logger.warning("%s: dropped %d row(s) with no supervised token (empty completion, no assistant turn,"
                       " or truncated to nothing): %s.", path, report.dropped_unsupervised,
                       _lines_text(report.dropped_unsupervised_lines, report.dropped_unsupervised))
    logger.info("%s: %s", path, policy_line(report))
    first = report.first_token_lines
    if first:
        logger.warning("%s: %d row(s) start with a completion token, which nothing predicts, so it is left out"
                       " of the loss: %s. Give these rows a prompt.", path, len(first), _lines_text(first))


def policy_line(report: DataReport | dict[str, Any]) -> str:
    """One line on the token policy as applied: "EOS appended to N rows, BOS first in M rows; ..."
    (from a report, or its `summary()` as stored in a manifest; older manifests lack the counts)."""
    info = report.summary() if isinstance(report, DataReport) else report
    if "eos_appended" not in info:
        return "token policy not recorded (an index from before grads.append_eos: EOS appended to every row)"
    chat = ("chat rows: assistant content and the template's end of turn supervised" if info.get("append_eos")
            else "chat rows: assistant content only supervised")
    return (f"EOS appended to {info['eos_appended']} of {info.get('kept')} rows (grads.append_eos="
            f"{str(bool(info.get('append_eos'))).lower()}), BOS first in {info['bos_first']} rows"
            f" (grads.prepend_bos={_yaml(info.get('prepend_bos'))}); {chat}")


def _yaml(value: Any) -> str:
    return "null" if value is None else str(value).lower()


def new_report(source: Source, max_seq_length: int, on_truncation: str, truncation_side: str,
               context_length: int | None = None, policy: TokenPolicy | None = None) -> DataReport:
    """An empty report for reading `source`, its length bound the smaller of max_seq_length and
    the model's context (`length_limit`), its rows made under `policy` (default `TokenPolicy()`)."""
    _check_settings(max_seq_length, on_truncation, truncation_side)
    tokens, limit = length_limit(max_seq_length, context_length)
    return DataReport(path=source.name, max_seq_length=tokens, on_truncation=on_truncation,
                      truncation_side=truncation_side, limit=limit, policy=policy or TokenPolicy())


def load_rows(data: str | Path | SourceSpec | Source, tokenizer: Any, max_seq_length: int,
              on_truncation: str = "warn", truncation_side: str = "right",
              context_length: int | None = None, policy: TokenPolicy | None = None) -> tuple[list[Row], DataReport]:
    """Read every row of a source (a JSONL path, or any `gradian.data.sources` source) into memory.

    Returns the kept rows (``row_id`` 0..n-1 in source order) and a report of what was truncated
    or dropped, by position. Raises ``DataError`` naming ``file:line`` for a malformed line (or
    one that is not UTF-8), and, with ``on_truncation="error"``, naming the lines whose
    completions do not fit. ``context_length`` (the model's, if known) bounds
    ``max_seq_length``: rows are cut at the smaller of the two, and the messages name which
    limit it was. `policy`: BOS / EOS and chat supervision (`TokenPolicy`; default: no EOS, BOS as
    the tokenizer adds it). For large data, index through `gradian.data.corpus.TokenizedCorpus`, which keeps
    the tokens on disk.
    """
    _check_settings(max_seq_length, on_truncation, truncation_side)
    source = as_source(data)
    report = new_report(source, max_seq_length, on_truncation, truncation_side, context_length, policy)
    rows = list(iter_rows(source, tokenizer, report))
    finish_report(report)
    return rows, report


# ----------------------------------------------------------------------------- batching


