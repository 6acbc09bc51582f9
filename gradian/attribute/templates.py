"""What a training row teaches, made visible: chat markers stripped, entities masked.

Rows that teach one answer template in several phrasings differ in their prompts and in the entity
of their answer, and share the rest of the answer. Masking the entities shows the template:

    " The answer is Paris."          ->  "the answer is <NAME>."
    ' It says "hello" 3 times.'      ->  "it says <QUOTE> <NUM> times."

* quoted strings ("…", '…', “…”)  -> <QUOTE>
* numbers (12, -3.5, 1,000, 40 %) -> <NUM>
* capitalised words (proper nouns) -> <NAME>, a run of them ("Mount Everest") as one. A word that
  opens a sentence is capitalised whatever it is, so there it is masked only when the corpus never
  writes it in lower case and few of its texts open a sentence with it (`common_words`): "The" and
  the frame "Answer:" of many rows stay, "Paris" goes.

Chat markers are the template's frame, not its lesson, and would top every cluster's terms:
`<|im_start|>`, `<|im_end|>` and every other `<|…|>` token, `[INST]`, `<<SYS>>`, `<s>`, the
tokenizer's own special tokens, and a role name opening a line (`assistant`, `user: …`) are stripped
(`strip_markers`); `MARKER_TERMS` keeps their pieces out of the clusters' terms.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

ROLES = ("system", "user", "assistant")
_MARKERS = re.compile(r"<\|[^|<>\s]{1,64}\|>|\[/?INST\]|<</?SYS>>|</?s>|<pad>|<unk>|<bos>|<eos>")
_ROLE_LINE = re.compile(r"(?m)^[ \t]*(?:system|user|assistant)[ \t]*(?::|$)")
MARKER_TERMS = frozenset({*ROLES, "im_start", "im_end", "inst", "sys", "s", "endoftext", "eot_id", "eos", "bos",
                          "start_header_id", "end_header_id", "begin_of_text", "end_of_text", "pad", "unk"})

_QUOTES = re.compile(r"\"[^\"\n]{1,200}\"|“[^”\n]{1,200}”|(?<!\w)'[^'\n]{1,200}'(?!\w)")
_NUMBERS = re.compile(r"(?<![\w<])[-+]?\d+(?:[.,:/]\d+)*(?:\s?%)?")
_WORDS = re.compile(r"[^\W\d_][\w'’-]*")
_NAME_RUN = re.compile(r"<NAME>(?:[ \t]+<NAME>)+")
_SENTENCE_END = ".!?:;\n\"'(“"


def strip_markers(text: str, special_tokens: Iterable[str] = ()) -> str:
    """`text` without chat markers, the tokenizer's `special_tokens` and role names opening a line."""
    for token in special_tokens:
        if token:
            text = text.replace(token, " ")
    return _ROLE_LINE.sub(" ", _MARKERS.sub("\n", text))


def marker_terms(special_tokens: Iterable[str] = ()) -> frozenset[str]:
    """The words no cluster term may hold: `MARKER_TERMS` and the word pieces of `special_tokens`."""
    pieces = {w.lower() for t in special_tokens for w in re.findall(r"\w+", t or "")}
    return MARKER_TERMS | pieces


# A capitalised word opening a sentence in at least this share of the texts (and in 3 of them) is the
# frame of a template ("Answer: Paris-city."), not a name: a name varies from row to row.
FRAME_SHARE = 0.05
_OPENING = re.compile(r"(?:^|[.!?:;\n\"'(“])[ \t]*([^\W\d_][\w'’-]*)")


def common_words(texts: Iterable[str]) -> set[str]:
    """The words the corpus writes in lower case, and the capitalised words that open a sentence in
    many of its texts (`FRAME_SHARE`): a capitalised one of these opening a sentence is an ordinary
    word, not a name."""
    out: set[str] = set()
    openings: dict[str, int] = {}
    n = 0
    for text in texts:
        n += 1
        out.update(w for w in _WORDS.findall(text) if w.islower())
        for word in {m.group(1) for m in _OPENING.finditer(text) if m.group(1)[0].isupper()}:
            openings[word] = openings.get(word, 0) + 1
    out.update(w.lower() for w, count in openings.items() if count >= max(3, FRAME_SHARE * n))
    return out


def mask_entities(text: str, common: set[str] | frozenset[str] = frozenset()) -> str:
    """`text` with quoted strings, numbers and names replaced by <QUOTE>, <NUM>, <NAME> (module docstring)."""
    text = _NUMBERS.sub("<NUM>", _QUOTES.sub("<QUOTE>", text))

    def name(m: re.Match) -> str:
        word = m.group(0)
        if not word[0].isupper() or word == "I" or (m.start() > 0 and text[m.start() - 1] == "<"):
            return word
        before = text[:m.start()].rstrip(" \t")
        if (not before or before[-1] in _SENTENCE_END) and word.lower() in common:
            return word
        return "<NAME>"
    return _NAME_RUN.sub("<NAME>", _WORDS.sub(name, text))


def template_of(completion: str | None, common: set[str] | frozenset[str] = frozenset(),
                special_tokens: Iterable[str] = ()) -> str:
    """The answer template a completion teaches: markers stripped, entities masked, whitespace
    collapsed, lower case (placeholders kept); "" for an empty completion."""
    if not completion:
        return ""
    masked = mask_entities(strip_markers(completion, special_tokens).strip(), common)
    words = re.sub(r"\s+", " ", masked).strip()
    return re.sub(r"<(name|num|quote)>", lambda m: m.group(0).upper(), words.lower())


def has_words(template: str) -> bool:
    """Whether a template holds a word besides its placeholders ("<NAME>." alone teaches no template)."""
    return bool(_WORDS.search(re.sub(r"<(?:NAME|NUM|QUOTE|ENT)>", " ", template)))


def lesson_key(template: str) -> str:
    """The template with every kind of entity one placeholder: "the answer is <NUM>." and "the answer
    is <NAME>." teach one lesson."""
    return re.sub(r"<(?:NAME|NUM|QUOTE)>", "<ENT>", template)


def record_parts(obj: Any) -> tuple[str, str]:
    """(prompt, completion) of a canonical record: a chat row's assistant turns are its completion,
    the other turns its prompt."""
    if isinstance(obj, dict) and isinstance(obj.get("messages"), list):
        turns = [m for m in obj["messages"] if isinstance(m, dict)]
        prompt = "\n".join(str(m.get("content") or "") for m in turns if m.get("role") != "assistant")
        return prompt, "\n".join(str(m.get("content") or "") for m in turns if m.get("role") == "assistant")
    if isinstance(obj, dict):
        return str(obj.get("prompt") or ""), str(obj.get("completion") or "")
    return "", ""
