"""Several corruptions of one task in one discovery (`discovery.data_params.corruptions`).

The pairs of every corruption share their clean prompts, attention mask, answer positions and
correct answers; only `corrupted_ids` and `incorrect` differ. The first corruption is the primary
one: its pairs are data.safetensors as a single-corruption run writes it, the others sit beside it
(`corruption_file`). `corruptions: null` (or one entry) is the task's single corruption, built
exactly as before.

    ioi        s2, abc             (data_params.ioi_corruption names the single one)
    induction  swap, fresh         (repeat format; data_params.induction_corruption)
    jsonl      entity_swap, name_swap, token_replace  (generated; data_params.corruption)
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from circuitkit.core.config import choices
from circuitkit.discovery.config import DataParams
from circuitkit.discovery.tasks.base import TaskData, TaskError

# Per task: the DataParams key that names its single corruption, and the corruptions it offers.
SINGLE_KEY = {"ioi": "ioi_corruption", "induction": "induction_corruption", "jsonl": "corruption"}
SHARED = ("clean_ids", "attention_mask", "answer_pos", "correct")  # what every corruption's pairs share


def offered(task: str) -> tuple[str, ...]:
    """The corruptions `task` offers for `corruptions` (empty for a task with one corruption)."""
    return choices(DataParams, SINGLE_KEY[task]) if task in SINGLE_KEY else ()


def discovery_corruptions(task: str, dp: DataParams) -> list[str]:
    """The corruptions discovery uses, primary first; [] when the task has its single corruption
    (`corruptions` null or one entry: the task's own key decides, as without the list)."""
    if not dp.corruptions or len(dp.corruptions) < 2:
        return []
    return list(dp.corruptions)


def single(task: str, dp: DataParams, corruption: str) -> DataParams:
    """`dp` with `task`'s single corruption set to `corruption` and the list cleared."""
    return dataclasses.replace(dp, corruptions=None, **{SINGLE_KEY[task]: corruption})


def effective(task: str, dp: DataParams) -> DataParams:
    """`dp` as the data builders read it: a one-entry list becomes the task's single key."""
    if dp.corruptions and len(dp.corruptions) == 1 and task in SINGLE_KEY:
        return single(task, dp, dp.corruptions[0])
    return dp


def check_corruptions(task: str, dp: DataParams, num_shards: int = 1, scope: str = "heads") -> str | None:
    """Why `dp.corruptions` cannot run (one line naming the keys), or None."""
    wanted = dp.corruptions
    if wanted is None:
        return None
    key = "discovery.data_params.corruptions"
    if not wanted:
        return f"{key}=[] names no corruption: list at least one, or set it to null for the task's own."
    if task not in SINGLE_KEY:
        return (f"{key}={wanted} but the {task} task has one corruption; tasks with several:"
                f" {', '.join(SINGLE_KEY)}. Set it to null.")
    if task == "induction" and dp.induction_format != "repeat":
        return (f"{key}={wanted} needs discovery.data_params.induction_format=repeat (the single format has one"
                " corruption, key).")
    bad = [c for c in wanted if c not in offered(task)]
    if bad:
        return f"{key}={wanted}: {', '.join(bad)} is not a corruption of the {task} task; allowed: {', '.join(offered(task))}."
    if len(set(wanted)) != len(wanted):
        return f"{key}={wanted} names a corruption twice; list each once."
    own = SINGLE_KEY[task]
    value, default = getattr(dp, own), getattr(DataParams(), own)
    if value != default and value != wanted[0]:
        return (f"discovery.data_params.{own}={value!r} contradicts {key}={wanted} (whose first entry is the"
                f" primary corruption): leave {own} at its default or set it to {wanted[0]!r}.")
    if len(wanted) > 1 and num_shards > 1:
        return (f"{key}={wanted} with discovery.num_shards={num_shards}: sharded attribution scores one corruption;"
                " set num_shards=1, or run one corruption.")
    if len(wanted) > 1 and scope != "heads":
        return (f"{key}={wanted} with pruning.scope={scope}: the joint selection is measured on head circuits;"
                " set pruning.scope=heads, or run one corruption.")
    return None


def corruption_file(data_file: Path, corruption: str) -> Path:
    """Where the pairs of a non-primary corruption are stored, beside data.safetensors."""
    return data_file.with_name(f"{data_file.stem}.{corruption}{data_file.suffix}")


def check_same_clean(primary: TaskData, other: TaskData, corruption: str) -> None:
    """TaskError unless `other` has `primary`'s clean prompts, mask, answer positions and answers."""
    for name in SHARED:
        a, b = getattr(primary, name), getattr(other, name)
        if a.shape != b.shape or not torch.equal(a, b):
            raise TaskError(f"the {corruption} corruption's pairs differ from the primary's in {name}: the corruptions"
                            " of one discovery must share their clean prompts; choose corruptions of the same rows.")


def build_corruption_set(task: str, tokenizer, model_dir: str | None, dp: DataParams, names: list[str], n: int,
                         seed: int, max_tokens: int | None = None, pair_check=None,
                         report: dict | None = None) -> dict[str, TaskData]:
    """{corruption: n pairs} for each of `names` (primary first), sharing their clean prompts.

    ioi and induction draw the clean prompts from the seed alone, so each corruption is the task
    built again; the jsonl task keeps the rows valid under every generated corruption
    (`jsonl.build_generated_set`). The BOS policy applies to each as in `build_task`.
    """
    from circuitkit.discovery.tasks import apply_bos_policy, build_task
    from circuitkit.discovery.tasks.jsonl import build_generated_set

    if task == "jsonl":
        from circuitkit.discovery.tasks import data_path_for

        built = build_generated_set(tokenizer, data_path_for(task, dp.data_path), n, seed, max_tokens, names,
                                    pair_check, dp.min_valid_share, report)
        by = {c: apply_bos_policy(pairs, tokenizer, dp.prepend_bos) for c, pairs in built.items()}
    else:
        by = {c: build_task(task, tokenizer, model_dir, single(task, dp, c), n, seed, max_tokens=max_tokens,
                            pair_check=pair_check) for c in names}
    for c in names[1:]:
        check_same_clean(by[names[0]], by[c], c)
    return by
