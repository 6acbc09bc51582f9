"""One row's tokens and supervised mask: a {prompt, completion} row encoded as the trainer does (BOS
by the tokenizer's own rule, EOS by the token policy), a chat row rendered by the tokenizer's template
with only the assistant's content supervised, and truncation that keeps what is supervised."""

from __future__ import annotations

import json
import re
from typing import Any

from gradian.data.sources import EXPECTED as _EXPECTED
from gradian.data.sources import DataError

ROLES = ("system", "user", "assistant")
_GENERATION_TAG = re.compile(r"{%-?\s*generation\s*-?%}")


def check_row(obj: Any, where: str) -> str:
    """Validate one parsed line; returns its format, "prompt" or "messages"."""
    if not isinstance(obj, dict):
        raise DataError(f"{where}: expected {_EXPECTED}, got a JSON {type(obj).__name__}.")
    if "messages" in obj:
        if "prompt" in obj or "completion" in obj:
            raise DataError(f"{where}: a row has either 'messages' or 'prompt'+'completion', not both.")
        msgs = obj["messages"]
        if not isinstance(msgs, list) or not msgs:
            raise DataError(f"{where}: 'messages' must be a non-empty list of {{\"role\", \"content\"}} objects,"
                            f" got {type(msgs).__name__}{'' if msgs else ' (empty)'}.")
        for i, msg in enumerate(msgs):
            if not isinstance(msg, dict) or "role" not in msg or "content" not in msg:
                raise DataError(f"{where}: messages[{i}] must be an object with keys 'role' and 'content',"
                                f" got {json.dumps(msg)[:60]}.")
            if msg["role"] not in ROLES:
                raise DataError(f"{where}: messages[{i}] has unknown role {msg['role']!r}; use one of"
                                f" {', '.join(ROLES)}.")
            if not isinstance(msg["content"], str):
                raise DataError(f"{where}: messages[{i}].content must be a string, got"
                                f" {type(msg['content']).__name__}.")
        return "messages"
    missing = [k for k in ("prompt", "completion") if k not in obj]
    if missing:
        raise DataError(f"{where}: missing key{'s' if len(missing) > 1 else ''} {', '.join(missing)}; expected"
                        f" {_EXPECTED} (keys found: {', '.join(sorted(obj)) or 'none'}).")
    for key in ("prompt", "completion"):
        if not isinstance(obj[key], str):
            raise DataError(f"{where}: '{key}' must be a string, got {type(obj[key]).__name__}.")
    return "prompt"


# ----------------------------------------------------------------------------- tokenizing


def _adds_bos(tokenizer: Any) -> bool:
    """Whether the tokenizer prepends BOS by itself (Llama-style) rather than leaving it out (GPT-2)."""
    bos = tokenizer.bos_token_id
    if bos is None:
        return False
    with_special = tokenizer("a", add_special_tokens=True)["input_ids"]
    without = tokenizer("a", add_special_tokens=False)["input_ids"]
    return bool(with_special) and with_special[0] == bos and (not without or without[0] != bos)


def bos_for_prompt_rows(tokenizer: Any, prepend_bos: bool | None) -> bool:
    """Whether prompt/completion rows start with BOS under ``grads.prepend_bos``."""
    if prepend_bos is None:
        return _adds_bos(tokenizer)
    if prepend_bos and tokenizer.bos_token_id is None:
        raise DataError("grads.prepend_bos=true, but the tokenizer has no BOS token; set grads.prepend_bos=null"
                        " (as the tokenizer does) or false.")
    return bool(prepend_bos)


def encode_prompt_completion(tokenizer: Any, prompt: str, completion: str, bos: bool,
                              append_eos: bool) -> tuple[list[int], list[bool], bool]:
    """(ids, supervised, whether EOS was appended)."""
    # Separate calls so no BPE merge spans the boundary and the mask is exact; special tokens are
    # placed by hand so they are neither doubled nor missing.
    p_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"] if prompt else []
    c_ids = tokenizer(completion, add_special_tokens=False)["input_ids"] if completion else []
    head = [tokenizer.bos_token_id] if bos else []
    eos = tokenizer.eos_token_id
    # An empty completion gets no EOS: predicting only "end" right after the prompt is not a
    # training signal for that row, so the row ends up unsupervised and is dropped and reported.
    tail = [eos] if (append_eos and eos is not None and c_ids) else []
    ids = head + p_ids + c_ids + tail
    sup = [False] * (len(head) + len(p_ids)) + [True] * (len(c_ids) + len(tail))
    return ids, sup, bool(tail)


def _has_generation_tags(tokenizer: Any) -> bool:
    template = tokenizer.chat_template
    if isinstance(template, dict):  # several named templates: apply_chat_template uses "default"
        template = template.get("default", "")
    return bool(template) and bool(_GENERATION_TAG.search(template))


def encode_messages(tokenizer: Any, messages: list[dict], where: str,
                     end_of_turn: bool = True) -> tuple[list[int], list[bool]]:
    """(ids, supervised) of a conversation: the assistant turns as the template marks them, or,
    with ``end_of_turn=False``, only the tokens of the assistant contents (`_content_only`)."""
    if not getattr(tokenizer, "chat_template", None):
        raise DataError(f"{where}: 'messages' rows need a tokenizer with a chat template, and this one has"
                        " none; convert the data to {\"prompt\", \"completion\"} rows or use a chat model's"
                        " tokenizer.")
    msgs = [{"role": m["role"], "content": m["content"]} for m in messages]
    if _has_generation_tags(tokenizer):
        enc = tokenizer.apply_chat_template(msgs, tokenize=True, return_dict=True,
                                            return_assistant_tokens_mask=True)
        ids = list(enc["input_ids"])
        sup = [bool(m) for m in enc["assistant_masks"]]
    else:
        ids, sup = _encode_messages_by_prefix(tokenizer, msgs, where)
    if not end_of_turn:
        sup = _content_only(tokenizer, msgs, ids, sup, where)
    return ids, sup


def _content_only(tokenizer: Any, msgs: list[dict], ids: list[int], sup: list[bool], where: str) -> list[bool]:
    """Narrow an assistant mask to the tokens that overlap an assistant message's content.

    Each content is searched, in message order, in the rendered text with every character outside
    the template's assistant mask blanked (so a content repeated in a user turn is never taken for
    it), then mapped to tokens through the offsets of a fast tokenizer. Tokens the template adds
    around the content (end-of-turn marker, newline) drop out; a token that straddles the
    content's edge stays (it carries content characters).
    """
    if not getattr(tokenizer, "is_fast", False):
        raise DataError(f"{where}: grads.append_eos=false supervises only the assistant contents, which needs a"
                        " fast tokenizer to map them to tokens; set grads.append_eos=true (the template's whole"
                        " assistant turns) or use prompt/completion rows.")
    full = tokenizer.apply_chat_template(msgs, tokenize=False)
    enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    offsets = enc["offset_mapping"]
    if list(enc["input_ids"]) != list(ids):
        raise DataError(f"{where}: tokenizing the rendered conversation does not give the template's tokens, so"
                        " the assistant contents cannot be located; set grads.append_eos=true.")
    visible = ["\0"] * len(full)
    for s, (a, b) in zip(sup, offsets, strict=True):
        if s:
            visible[a:b] = full[a:b]
    masked = "".join(visible)
    spans: list[tuple[int, int]] = []
    cursor = 0
    for msg in msgs:
        if msg["role"] != "assistant" or not msg["content"].strip():
            continue
        text = msg["content"]
        start = masked.find(text, cursor)
        if start < 0:  # templates often trim the content
            text = text.strip()
            start = masked.find(text, cursor)
        if start < 0:
            raise DataError(f"{where}: the chat template changes an assistant message's text (content"
                            f" {msg['content'][:40]!r} is not in its assistant turn), so its tokens cannot be"
                            " located; set grads.append_eos=true to supervise the template's assistant turns.")
        spans.append((start, start + len(text)))
        cursor = start + len(text)
    return [bool(s) and any(a < end and b > begin for begin, end in spans)
            for s, (a, b) in zip(sup, offsets, strict=True)]


def _encode_messages_by_prefix(tokenizer: Any, msgs: list[dict], where: str) -> tuple[list[int], list[bool]]:
    """Assistant spans for a template without ``{% generation %}``: render prefixes as text.

    For assistant turn i, render(messages[:i], add_generation_prompt=True) ends where the assistant
    text starts and render(messages[:i + 1]) ends where it stops (including whatever the template
    writes after the turn, e.g. an end marker and newline). Those character spans in the full
    rendering map to tokens through the offsets of a fast tokenizer. This needs each rendering to be
    a prefix of the next, which holds for ordinary templates and is checked.
    """
    if not getattr(tokenizer, "is_fast", False):
        raise DataError(f"{where}: the chat template has no {{% generation %}} markers and the tokenizer is not"
                        " a fast tokenizer, so assistant tokens cannot be located; add {% generation %}..."
                        "{% endgeneration %} around assistant content in the template, or use prompt/completion"
                        " rows.")
    full = tokenizer.apply_chat_template(msgs, tokenize=False)
    spans: list[tuple[int, int]] = []
    for i, msg in enumerate(msgs):
        if msg["role"] != "assistant":
            continue
        start_text = tokenizer.apply_chat_template(msgs[:i], tokenize=False, add_generation_prompt=True) if i else ""
        end_text = tokenizer.apply_chat_template(msgs[: i + 1], tokenize=False)
        if not (end_text.startswith(start_text) and full.startswith(end_text)):
            raise DataError(f"{where}: the chat template has no {{% generation %}} markers and rendering the"
                            " conversation turn by turn does not give prefixes of the whole, so assistant tokens"
                            " cannot be located; add {% generation %}...{% endgeneration %} around assistant"
                            " content in the template.")
        spans.append((len(start_text), len(end_text)))
    # Special tokens are part of the rendered text (templates write BOS themselves).
    enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    ids = list(enc["input_ids"])
    sup = [any(s < end and e > start for start, end in spans) for s, e in enc["offset_mapping"]]
    return ids, sup


def truncate(ids: list[int], sup: list[bool], max_len: int, side: str, head: int) -> tuple[list[int], list[bool], bool]:
    """Fit a row into ``max_len`` tokens; returns (ids, supervised, lost_supervised_tokens).

    ``head`` is 1 when the row starts with a BOS that prompt_left must keep.
    """
    if len(ids) <= max_len:
        return ids, sup, False
    if side == "prompt_left" and any(sup):
        first = sup.index(True)
        # Keep at least one token before the first supervised one, else nothing predicts it.
        removable = max(0, first - max(head, 1))
        drop = min(len(ids) - max_len, removable)
        ids = ids[:head] + ids[head + drop:]
        sup = sup[:head] + sup[head + drop:]
        if len(ids) <= max_len:
            return ids, sup, False
    lost = any(sup[max_len:])
    return ids[:max_len], sup[:max_len], lost


# ----------------------------------------------------------------------------- loading


