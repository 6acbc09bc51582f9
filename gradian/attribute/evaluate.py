"""The eval set, scored on one model: per item the answer's log-probability, whether greedy
decoding gives it, and how thin its margin is.

An eval item is a `{"prompt", "completion"}` row; the completion is the answer. Its tokens are made
as an index's prompt/completion rows are (`gradian.data.rows`: prompt and answer tokenized apart, BOS
under the index's token policy) except that no EOS is appended: the answer is what is scored.

With the answer a_1..a_n teacher-forced after the prompt, z_t the (soft-capped) logits that
predict a_t and log p_t = log_softmax(z_t):

    logprob   = Σ_t log p_t(a_t)                                       (nats, <= 0)
    first     = argmax z_1 == a_1        greedy decoding starts with the answer's first token
    exact     = argmax z_t == a_t for every t
                                         greedy decoding reproduces the answer: if every teacher-
                                         forced argmax is the answer's token, the greedy prefix is
                                         the answer's prefix at every step, so one forward decides it
    margin    = min_t (log p_t(a_t) - max_{j != a_t} log p_t(j))       (nats; > 0 iff exact, ties aside)

`margin` is the weakest step of the answer: a base model whose margin is thin was already close
to saying something else (`gradian.attribute.regression`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from circuitkit.core.errors import UserError
from gradian.capture.gradients import logit_chunk_rows, supervised_positions
from gradian.data.encode import bos_for_prompt_rows, check_row, encode_prompt_completion
from gradian.data.rows import TokenPolicy, preview_text
from gradian.data.sources import DataError, Source, SourceSpec

EVAL_BATCH = 16  # items per teacher-forced forward
MAX_LINES_SHOWN = 10


@dataclass(frozen=True)
class EvalItem:
    """One eval row, tokenized: `prompt_ids` (BOS included under the policy), `answer_ids` (>= 1)."""

    item: int  # 0-based among the eval rows
    line: int  # source position: 1-based JSONL line, or 0-based table row
    prompt: str
    answer: str
    prompt_ids: list[int]
    answer_ids: list[int]


@dataclass
class ItemScores:
    """Per-item scores of one model, each (n_items,): float64 `logprob` and `margin`, bool `first`
    and `exact` (see the module docstring)."""

    logprob: torch.Tensor
    margin: torch.Tensor
    first: torch.Tensor
    exact: torch.Tensor

    @property
    def accuracy(self) -> float:
        """Share of items whose greedy continuation reproduces the answer."""
        return float(self.exact.double().mean())


def read_eval_rows(path: str | Path) -> list[tuple[int, str, str]]:
    """(line, prompt, answer) of every row of the eval set, before any tokenizer.

    Refused with one line (UserError, exit code 1: the file's content is wrong) naming the lines:
    a row that is not a prompt/completion row (chat rows are not eval items yet), a blank
    answer, a file with no row. A line that is not JSON is a DataError from the reader (exit 1).
    """
    where = f"--eval-dataset {path}"
    rows: list[tuple[int, str, str]] = []
    chat, empty = [], []
    try:
        for position, at, obj in Source(SourceSpec(path=str(path))).records():
            if check_row(obj, at) == "messages":
                chat.append(position)
                continue
            if not obj["completion"].strip():
                empty.append(position)
                continue
            rows.append((position, obj["prompt"], obj["completion"]))
    except DataError as err:
        raise UserError(f"{where}: {err}", exit_code=1) from None
    if chat:
        raise UserError(f"{where}: {len(chat)} row(s) are chat rows ('messages', lines {_lines(chat)}); an eval item"
                        " is a {\"prompt\", \"completion\"} row whose completion is the answer: write each as one.",
                        exit_code=1)
    if empty:
        raise UserError(f"{where}: {len(empty)} row(s) have no answer (an empty completion, lines {_lines(empty)});"
                        " every eval item needs the answer the model should give: fill them in or drop them.",
                        exit_code=1)
    if not rows:
        raise UserError(f"{where} holds no eval rows; give a JSONL of {{\"prompt\", \"completion\"}} rows whose"
                        " completions are the answers.", exit_code=1)
    return rows


def _lines(lines: Sequence[int]) -> str:
    shown = ", ".join(map(str, lines[:MAX_LINES_SHOWN]))
    return shown + (" …" if len(lines) > MAX_LINES_SHOWN else "")


def tokenize_items(rows: Sequence[tuple[int, str, str]], tokenizer, policy: TokenPolicy,
                   context: int | None, where: str) -> list[EvalItem]:
    """The eval rows as `EvalItem`s, tokenized as the index's prompt/completion rows (no EOS).

    UserError (exit code 1) naming the lines whose answer has no token, whose answer has nothing
    before it (an empty prompt without BOS), or whose prompt + answer exceed the model's context
    (`context` tokens, None: unknown)."""
    bos = bos_for_prompt_rows(tokenizer, policy.prepend_bos)
    items, tokenless, too_long, headless = [], [], [], []
    for i, (line, prompt, answer) in enumerate(rows):
        ids, sup, _ = encode_prompt_completion(tokenizer, prompt, answer, bos, append_eos=False)
        n_answer = sum(sup)
        if n_answer == 0:
            tokenless.append(line)
        elif n_answer == len(ids):
            headless.append(line)
        elif context is not None and len(ids) > context:
            too_long.append(line)
        items.append(EvalItem(i, line, prompt, answer, ids[: len(ids) - n_answer], ids[len(ids) - n_answer:]))
    if headless:
        raise UserError(f"{where}: lines {_lines(headless)} have an empty prompt and the tokenizer adds no BOS, so"
                        " nothing predicts the answer's first token; give them a prompt.", exit_code=1)
    if tokenless:
        raise UserError(f"{where}: the answers of lines {_lines(tokenless)} have no token under the model's tokenizer;"
                        " give answers of at least one token.", exit_code=1)
    if too_long:
        raise UserError(f"{where}: lines {_lines(too_long)} are longer than the model's context of {context} tokens"
                        " (prompt + answer); shorten their prompts.", exit_code=1)
    return items


def teacher_forced_batch(prompts: Sequence[list[int]], answers: Sequence[list[int]],
                         pad: int) -> dict[str, torch.Tensor]:
    """Right-padded `input_ids`, `attention_mask` (B, T) long and `supervised` (B, T) bool, the
    answer tokens supervised (the layout `gradian.data.batch.collate` gives, for `gradian.capture.gradients`)."""
    lengths = [len(p) + len(a) for p, a in zip(prompts, answers, strict=True)]
    width = max(lengths)
    ids = torch.full((len(lengths), width), pad, dtype=torch.long)
    mask = torch.zeros((len(lengths), width), dtype=torch.long)
    sup = torch.zeros((len(lengths), width), dtype=torch.bool)
    for b, (p, a) in enumerate(zip(prompts, answers, strict=True)):
        ids[b, :lengths[b]] = torch.tensor(p + a, dtype=torch.long)
        mask[b, :lengths[b]] = 1
        sup[b, len(p):lengths[b]] = True
    return {"input_ids": ids, "attention_mask": mask, "supervised": sup}


def pad_id(tokenizer) -> int:
    """The tokenizer's padding id (0 when it has none: padded positions are masked anyway)."""
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0


def final_logits(adapter, h: torch.Tensor) -> torch.Tensor:
    """Float32 logits of final hidden states h (N, d), soft-capped as the model's head does."""
    z = adapter.unembed(h).float()
    cap = adapter.logit_softcap
    return z if cap is None else torch.tanh(z / cap) * cap


@torch.no_grad()
def score_items(loaded, items: Sequence[EvalItem], batch_size: int = EVAL_BATCH, bar=None) -> ItemScores:
    """Teacher-forced scores of every item on one model (`circuitkit.models.loading.LoadedModel`);
    `bar` (`circuitkit.core.progress.Progress`, optional) advances by each batch's items.

    Only the answer positions go through the unembedding, `logit_chunk_rows(V, device)` at a time, so the
    float32 logits never exceed one chunk whatever the prompt length."""
    n = len(items)
    logprob = torch.zeros(n, dtype=torch.float64)
    margin = torch.full((n,), float("inf"), dtype=torch.float64)
    first = torch.zeros(n, dtype=torch.bool)
    misses = torch.zeros(n, dtype=torch.long)  # answer tokens that are not the argmax
    adapter, device = loaded.adapter, loaded.device
    chunk = logit_chunk_rows(int(adapter.config.vocab_size), device)
    for start in range(0, n, batch_size):
        part = items[start:start + batch_size]
        batch = {k: v.to(device) for k, v in teacher_forced_batch(
            [it.prompt_ids for it in part], [it.answer_ids for it in part], pad_id(loaded.tokenizer)).items()}
        hidden = adapter.base(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).last_hidden_state
        ex, pos, targets = supervised_positions(batch)  # grouped by item, in answer order
        is_first = torch.ones_like(ex, dtype=torch.bool)
        is_first[1:] = ex[1:] != ex[:-1]
        for c in range(0, len(ex), chunk):
            sl = slice(c, c + chunk)
            logp = torch.log_softmax(final_logits(adapter, hidden[ex[sl], pos[sl]]), dim=-1)  # (rows, V)
            tok = logp.gather(1, targets[sl, None])[:, 0]
            others = logp.scatter(1, targets[sl, None], float("-inf")).amax(dim=1)
            hit = logp.argmax(dim=1) == targets[sl]
            rows = (ex[sl] + start).cpu()
            logprob.index_add_(0, rows, tok.double().cpu())
            margin.scatter_reduce_(0, rows, (tok - others).double().cpu(), reduce="amin")
            misses.index_add_(0, rows, (~hit).long().cpu())
            first_rows = is_first[sl].cpu()
            first[rows[first_rows]] = hit.cpu()[first_rows]
        del hidden
        if bar is not None:
            bar.advance(len(part))
    return ItemScores(logprob, margin, first, misses == 0)


SAID_MAX_TOKENS = 32  # the longest greedy answer read from a model (`greedy_continuations`)


@torch.no_grad()
def greedy_continuations(loaded, items: Sequence[EvalItem], max_tokens: int = SAID_MAX_TOKENS,
                         batch_size: int = EVAL_BATCH) -> list[list[int]]:
    """What the model says after each item's prompt: its own greedy answer, the argmax at every
    step until it says EOS (kept: ending there is part of the answer) or `max_tokens` tokens, so
    between 1 and `max_tokens` token ids per item, whatever the length of the item's answer.

    Items go `batch_size` at a time, right-padded; each step is one forward of the items still
    speaking (no key/value cache: answers are short, and the cache's API differs between
    transformers versions), of which only each item's last position is unembedded."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens {max_tokens}: a greedy answer needs at least one token.")
    adapter, device = loaded.adapter, loaded.device
    eos = loaded.tokenizer.eos_token_id
    out: list[list[int]] = []
    for start in range(0, len(items), batch_size):
        part = items[start:start + batch_size]
        seqs = [list(it.prompt_ids) for it in part]
        said: list[list[int]] = [[] for _ in part]
        open_ = list(range(len(part)))
        while open_:
            batch = teacher_forced_batch([seqs[b] for b in open_], [[] for _ in open_], pad_id(loaded.tokenizer))
            ids, mask = batch["input_ids"].to(device), batch["attention_mask"].to(device)
            hidden = adapter.base(input_ids=ids, attention_mask=mask).last_hidden_state
            last = mask.sum(dim=1) - 1  # (B,) each item's last real position
            nxt = final_logits(adapter, hidden[torch.arange(len(open_), device=device), last]).argmax(dim=-1).tolist()
            for b, token in zip(open_, nxt, strict=True):
                said[b].append(int(token))
                seqs[b].append(int(token))
            open_ = [b for b in open_ if said[b][-1] != eos and len(said[b]) < max_tokens]
        out.extend(said)
    return out


def ended_by(said: Sequence[int], tokenizer) -> str:
    """How a greedy answer ended: "eos", or "max_tokens" when it was cut at the limit."""
    return "eos" if said and said[-1] == tokenizer.eos_token_id else "max_tokens"


def preview(text: str) -> str:
    """A one-line preview of a prompt or answer (the index's preview length)."""
    return preview_text(text)
