"""Greater-than: "The war lasted from the year 1732 to the year 17" -> a year after 1732.

The prompt ends inside the second year, after its century "17"; the model should continue with
an ending larger than the first year's. Corruption (the standard one): the first year's ending
YY becomes "01" ("... from the year 1701 to the year 17"), which makes almost every ending
valid, so the difference isolates the comparison with YY.

How the answer is read depends on how the tokenizer splits numbers; the representation is
chosen once per tokenizer by tokenizing "...to the year 17" + ending:

* ``two_digit`` (GPT-2 style tokenizers): the ending "YY" is one token after "17". Answers are
  those two-digit tokens: correct = endings > YY, incorrect = endings <= YY. Endings whose
  "17YY" the tokenizer does not split as "17" + one token (e.g. a year that is a single token)
  are in neither set and never used as YY. Chosen when at least MIN_TWO_DIGIT of the 100
  endings "00".."99" split this way.
* ``tens_digit`` (tokenizers that write numbers digit by digit: Llama 2, Mistral, Gemma): the
  next token is the tens digit of the ending. correct = tens digits > YY's tens digit (every
  such year is later), incorrect = tens digits < YY's tens digit (every such year is earlier);
  the tie digit, which covers both, is in neither set. YY's tens digit is 1..8 so both sets are
  non-empty.

Any other split (e.g. numbers in groups of three digits, as in Llama 3) raises TaskError with
the split it found; use the jsonl task with your own prompts there.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from circuitkit.discovery.tasks.base import TaskData, TaskError, from_token_lists
from circuitkit.discovery.tasks.text import (
    continuation_ids,
    encode_prompt,
    pad_token_id,
    special_prefix,
    token_split,
)

CENTURY = "17"
CORRUPT_YY = "01"
TEMPLATE = "The {noun} lasted from the year {century}{yy} to the year {century}"
NOUNS: tuple[str, ...] = ("war", "siege", "drought", "famine", "expedition", "voyage", "reign", "truce",
                          "strike", "plague", "dynasty", "alliance", "empire", "festival", "rebellion")
MIN_TWO_DIGIT = 80  # two-digit endings that must be single tokens after "17" for the two_digit scheme
REFERENCE_NOUN = NOUNS[0]


@dataclass
class Scheme:
    """How answers are tokenized for this tokenizer.

    kind: "two_digit" or "tens_digit"; answer_ids: ending ("00".."99") or digit ("0".."9") ->
    its token id; clean_yy: the endings that can be the first year's YY.
    """

    kind: str
    answer_ids: dict[str, int]
    clean_yy: list[str]

    def answers(self, yy: str) -> tuple[list[int], list[int]]:
        """(correct ids, incorrect ids) for a first year ending in `yy`."""
        if self.kind == "two_digit":
            later = [tid for end, tid in self.answer_ids.items() if int(end) > int(yy)]
            earlier = [tid for end, tid in self.answer_ids.items() if int(end) <= int(yy)]
        else:
            later = [tid for d, tid in self.answer_ids.items() if int(d) > int(yy[0])]
            earlier = [tid for d, tid in self.answer_ids.items() if int(d) < int(yy[0])]
        return later, earlier


def prompt(noun: str, yy: str) -> str:
    """The prompt text for a first year 17`yy`, ending with the second year's century."""
    return TEMPLATE.format(noun=noun, century=CENTURY, yy=yy)


def _single_continuations(tokenizer, ref: str, endings: list[str]) -> dict[str, int]:
    """ending -> token id for the endings that are exactly one token after `ref`."""
    out: dict[str, int] = {}
    for end in endings:
        ids = continuation_ids(tokenizer, ref, end)
        if ids is not None and len(ids) == 1:
            out[end] = ids[0]
    return out


def _same_length_yy(tokenizer, candidates: list[str]) -> list[str]:
    """The endings whose clean prompt has as many tokens as the corrupted ("01") prompt."""
    n_corrupt = len(tokenizer.encode(prompt(REFERENCE_NOUN, CORRUPT_YY), add_special_tokens=False))
    return [yy for yy in candidates
            if len(tokenizer.encode(prompt(REFERENCE_NOUN, yy), add_special_tokens=False)) == n_corrupt]


def choose_scheme(tokenizer) -> Scheme:
    """Pick `two_digit` or `tens_digit` for this tokenizer (see the module docstring), or raise."""
    ref = prompt(REFERENCE_NOUN, "50")
    endings = [f"{v:02d}" for v in range(100)]
    two = _single_continuations(tokenizer, ref, endings)
    if len(two) >= MIN_TWO_DIGIT:
        clean_yy = _same_length_yy(tokenizer, [yy for yy in endings[2:99]
                                               if yy in two and any(int(e) > int(yy) for e in two)])
        if clean_yy:
            return Scheme("two_digit", two, clean_yy)
    digits = _single_continuations(tokenizer, ref, [str(d) for d in range(10)])
    if len(digits) == 10:
        clean_yy = _same_length_yy(tokenizer, [f"{v:02d}" for v in range(10, 90)])
        if clean_yy:
            return Scheme("tens_digit", digits, clean_yy)
    sample = ref + "32"
    split = token_split(tokenizer, tokenizer.encode(sample, add_special_tokens=False)[-4:])
    raise TaskError(
        f"greater_than cannot read a year ending from this tokenizer: after {ref!r} only {len(two)} of the 100"
        f" endings '00'..'99' are one token (need {MIN_TWO_DIGIT}) and only {len(digits)} of the 10 digits are"
        f" one token (need all 10, for tokenizers that split numbers into digits); e.g. {sample!r} ends as"
        f" {split}. Use another model, or the jsonl task with prompts and single-token answers of your own.")


def build(tokenizer, n: int, seed: int) -> TaskData:
    """`n` greater-than pairs generated from `seed` (noun and first-year ending per example).

    Shapes: clean/corrupted/mask (N, T) right-padded; answer_pos (N,) = last prompt token (the
    second year's century); correct (N, Kc) / incorrect (N, Ki) padded with -1 (Kc + Ki <= 100
    for two_digit, <= 9 for tens_digit).
    """
    scheme = choose_scheme(tokenizer)
    rng = random.Random(seed)
    prefix = special_prefix(tokenizer)
    clean, corrupted, correct, incorrect, row_names = [], [], [], [], []
    for i in range(n):
        noun, yy = rng.choice(NOUNS), rng.choice(scheme.clean_yy)
        clean_text = prompt(noun, yy)
        clean.append(encode_prompt(tokenizer, clean_text, prefix))
        corrupted.append(encode_prompt(tokenizer, prompt(noun, CORRUPT_YY), prefix))
        later, earlier = scheme.answers(yy)
        correct.append(later)
        incorrect.append(earlier)
        row_names.append(f"greater_than example {i} ({clean_text!r})")
    return from_token_lists(clean, corrupted, correct, incorrect, pad_token_id(tokenizer), row_names)
