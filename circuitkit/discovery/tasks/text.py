"""Text helpers the file and template tasks share: prompt encoding, single-token answers in
context, padding id, seeded row sampling and data paths."""

from __future__ import annotations

import logging
import random
from collections.abc import Iterator, Sequence
from pathlib import Path

from circuitkit.core.io import jsonl_objects as read_jsonl
from circuitkit.discovery.tasks.base import TaskError

log = logging.getLogger(__name__)


def pad_token_id(tokenizer) -> int:
    """Id used to right-pad prompts: the pad token, else EOS, else 0 (masked out either way)."""
    for attr in ("pad_token_id", "eos_token_id"):
        value = getattr(tokenizer, attr, None)
        if isinstance(value, int):
            return value
    return 0


def special_prefix(tokenizer) -> list[int]:
    """Special tokens the tokenizer puts before a text (e.g. Llama/Gemma BOS; GPT-2: none).

    Found by encoding a probe with and without special tokens, so suffix tokens such as a
    trailing EOS are never added to a prompt (the last prompt token is the scored position).
    """
    probe = "Hello"
    plain = tokenizer.encode(probe, add_special_tokens=False)
    full = tokenizer.encode(probe, add_special_tokens=True)
    for start in range(len(full) - len(plain) + 1):
        if full[start:start + len(plain)] == plain:
            return list(full[:start])
    return []


def encode_prompt(tokenizer, text: str, prefix: Sequence[int] | None = None) -> list[int]:
    """Token ids of a prompt as the model reads it: special prefix (BOS if any) + the text.

    `prefix` is `special_prefix(tokenizer)`, passed in by callers that encode many prompts.
    """
    head = special_prefix(tokenizer) if prefix is None else list(prefix)
    # verbose=False: no "longer than the maximum ... will result in indexing errors" warning; a
    # prompt beyond the model's context is reported by the task with its file:line instead.
    return head + list(tokenizer.encode(text, add_special_tokens=False, verbose=False))


def continuation_ids(tokenizer, prompt: str, answer: str) -> list[int] | None:
    """Tokens that `answer` adds after `prompt`, tokenized in context.

    Returns None when appending the answer changes the prompt's own tokens (the answer merges
    with the prompt's last token, e.g. "Paris" without its leading space after "is").
    """
    base = tokenizer.encode(prompt, add_special_tokens=False, verbose=False)
    full = tokenizer.encode(prompt + answer, add_special_tokens=False, verbose=False)
    if full[:len(base)] != base:
        return None
    return list(full[len(base):])


def token_split(tokenizer, ids: Sequence[int]) -> str:
    """Readable split of `ids`, e.g. `[' Par', 'is']`."""
    return "[" + ", ".join(repr(tokenizer.decode([i])) for i in ids) + "]"


def single_token_answer(tokenizer, prompt: str, answer: str, where: str, role: str) -> int:
    """The one token `answer` contributes after `prompt`; TaskError naming `where` otherwise.

    `role` ("correct", "incorrect", ...) only goes into the message.
    """
    ids = continuation_ids(tokenizer, prompt, answer)
    if ids is None:
        merged = token_split(tokenizer, tokenizer.encode(prompt + answer, add_special_tokens=False)[-3:])
        hint = f" Did you mean {' ' + answer!r} (with a leading space)?" if not answer[:1].isspace() else ""
        raise TaskError(f"{where}: {role} answer {answer!r} merges with the end of the prompt (the prompt"
                        f" ends as {merged} once the answer is appended), so it is not a separate next"
                        f" token.{hint}")
    if len(ids) != 1:
        first = repr(tokenizer.decode(ids[:1])) if ids else "(nothing)"
        raise TaskError(f"{where}: {role} answer {answer!r} is {len(ids)} tokens after the prompt"
                        f" {token_split(tokenizer, ids)}; each answer must be exactly one token. Use the"
                        f" first token of the continuation instead, here {first}.")
    return ids[0]


def sample_indices(total: int, n: int, seed: int, source: str) -> list[int]:
    """`n` row indices out of `total`, drawn without replacement with `seed` (a seeded shuffle).

    When `total < n` all rows are used (shuffled) and a warning names both numbers.
    """
    if total == 0:
        raise TaskError(f"{source}: no rows found; add at least one row.")
    rng = random.Random(seed)
    if total < n:
        log.warning("%s has %d rows but %d examples were requested (discovery.data_params.num_examples"
                    " + eval_examples); using all %d rows.", source, total, n, total)
        return rng.sample(range(total), total)
    return rng.sample(range(total), n)


def as_path(data_path: str | Path, task: str) -> Path:
    """`data_path` as an existing Path; TaskError naming the key and the resolved path otherwise."""
    path = Path(data_path).expanduser()
    if not path.exists():
        raise TaskError(f"discovery.data_params.data_path={str(data_path)!r} does not exist (resolved to"
                        f" {path.resolve()}); point it at the {task} data file.")
    return path


def jsonl_objects(path: Path, expected: str) -> Iterator[tuple[int, str, dict]]:
    """(line number, `file:line`, object) for every non-blank line of a JSONL file; TaskError naming
    `file:line` for a line that is not a JSON object (`expected` says what it should be)."""
    for lineno, where, obj in read_jsonl(path, expected, TaskError):
        if not isinstance(obj, dict):
            raise TaskError(f"{where}: expected {expected}, got {type(obj).__name__}.")
        yield lineno, where, obj
