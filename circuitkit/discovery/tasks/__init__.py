"""Tasks that supply clean / corrupted pairs for attribution and faithfulness.

* ``induction``: synthetic repeated symbols; ``data_params.induction_format``: repeat (a repeated
  random span, the default) or single (one `A B` pair) (``tasks/induction.py``).
* ``ioi``: indirect object identification; ``data_params.ioi_corruption``: s2 (second subject
  mention only, the default) or abc (all three names); held-out templates (``tasks/ioi.py``).
* ``greater_than``: "from the year 17YY to the year 17", YY -> 01 (``tasks/greater_than.py``).
* ``mmlu``: multiple choice from ``data_path`` (MMLU CSV or JSONL), options swapped (``tasks/mmlu.py``).
* ``jsonl``: the user's own pairs from ``data_path`` (``tasks/jsonl.py``).
* ``sva``: subject-verb agreement across an attractor, "The keys near the cabinet" -> " are"; the
  subject's number flipped (``tasks/sva.py``).
* ``capitals``: factual recall, "The capital of France is" -> " Paris"; another country of the
  same token length (``tasks/capitals.py``).

Synthetic tasks generate their examples from the seed; file tasks sample rows with it. Without
``data_path``, mmlu and jsonl read the small sample files shipped in ``tasks/data/``.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from circuitkit.core.config import choices
from circuitkit.discovery.config import DataParams, DiscoveryConfig
from circuitkit.discovery.tasks import capitals, greater_than, induction, ioi, jsonl, mmlu, sva
from circuitkit.discovery.tasks.base import TaskData, TaskError

__all__ = ["TaskData", "TaskError", "apply_bos_policy", "build_task", "build_heldout_templates", "corruption_of",
           "heldout_template_count", "keys_that_do_not_apply", "BUILT_TASKS", "SAMPLE_FILES", "HELDOUT_TEMPLATE_TASKS"]

log = logging.getLogger(__name__)

BUILT_TASKS = choices(DiscoveryConfig, "task")
DATA_DIR = Path(__file__).resolve().parent / "data"
SAMPLE_FILES = {"mmlu": DATA_DIR / "mmlu_sample.csv", "jsonl": DATA_DIR / "jsonl_sample.jsonl"}
HELDOUT_TEMPLATE_TASKS = ("ioi",)  # tasks with templates attribution never sees (data_params.heldout_template_examples)


def corruption_of(task: str, dp: DataParams) -> str | None:
    """The configured corruption of `task` when it has a choice of them (ioi: s2 or abc; induction: key
    with the single format, swap or fresh with the repeat format; jsonl: the generating strategy, if
    any), else None."""
    if task == "jsonl":
        return dp.corruption
    if task == "induction":
        return dp.induction_corruption if dp.induction_format == "repeat" else "key"
    return dp.ioi_corruption if task == "ioi" else None


def heldout_template_count(task: str, dp: DataParams) -> int:
    """Pairs from `task`'s held-out templates: `dp.heldout_template_examples`, or when null eval_examples
    for a task that has held-out templates and 0 otherwise. An explicit count > 0 for a task without
    them is a TaskError naming the key."""
    n = dp.heldout_template_examples
    if n is None:
        return dp.eval_examples if task in HELDOUT_TEMPLATE_TASKS else 0
    if n > 0 and task not in HELDOUT_TEMPLATE_TASKS:
        raise TaskError(f"discovery.data_params.heldout_template_examples={n}, but the {task} task has no held-out"
                        f" templates (tasks that have them: {', '.join(HELDOUT_TEMPLATE_TASKS)}); set it to null or 0.")
    return n


def keys_that_do_not_apply(task: str, dp: DataParams) -> list[str]:
    """The data_params keys set away from their default that `task` does not read, each as
    `key=value (read by ...)`: a configuration that says something the run would not do."""
    default = DataParams()
    out = []

    def unread(key: str, readers: str) -> None:
        value = getattr(dp, key)
        if value != getattr(default, key):
            out.append(f"discovery.data_params.{key}={value!r} (read by {readers})")
    if task != "jsonl":
        unread("corruption", "the jsonl task only, which generates its corrupted prompts with it")
    if task != "jsonl" or dp.corruption is None:
        unread("min_valid_share", "the jsonl task with a generated corruption only")
    if task != "ioi":
        unread("ioi_corruption", "the ioi task only")
    if task != "induction":
        unread("induction_format", "the induction task only")
    if task != "induction" or dp.induction_format != "repeat":
        unread("induction_corruption", "the induction task in the repeat format only")
    if task not in SAMPLE_FILES:
        unread("data_path", f"the {' and '.join(SAMPLE_FILES)} tasks only; {task} generates its examples")
    return out


def build_heldout_templates(task: str, tokenizer, dp: DataParams, n: int, seed: int,
                            max_tokens: int | None = None) -> TaskData:
    """`n` pairs of `task` from its held-out templates (sentences attribution never sees), with the
    configured corruption and BOS policy; same layout as `build_task`."""
    if task != "ioi":
        raise TaskError(f"the {task} task has no held-out templates; tasks that have them:"
                        f" {', '.join(HELDOUT_TEMPLATE_TASKS)}.")
    data = apply_bos_policy(ioi.build(tokenizer, n, seed, dp.ioi_corruption, templates="heldout"), tokenizer,
                            dp.prepend_bos)
    if max_tokens is not None and data.clean_ids.shape[1] > max_tokens:
        raise TaskError(f"the longest held-out-template prompt is {data.clean_ids.shape[1]} tokens, beyond the"
                        f" model's context of {max_tokens}; set discovery.data_params.heldout_template_examples=0.")
    return data


def data_path_for(task: str, data_path: str | None) -> Path:
    """The file a file-based task reads: `data_path`, or the shipped sample (with a warning)."""
    if data_path is None:
        sample = SAMPLE_FILES[task]
        log.warning("discovery.data_params.data_path is null: the %s task uses the shipped sample %s"
                    " (a few hand-written examples, for trying the pipeline); set data_path to your data.",
                    task, sample.name)
        return sample
    return Path(data_path)


def apply_bos_policy(data: TaskData, tokenizer, prepend_bos: bool) -> TaskData:
    """`discovery.data_params.prepend_bos`: every prompt starts with BOS (True) or never does (False).

    Tasks encode prompts as the tokenizer does (Llama/Gemma add BOS, GPT-2/NeoX do not); this
    puts one BOS column in front of rows that lack it, or removes a leading BOS column, and
    shifts the answer positions. Rows are right-padded, so every prompt starts in column 0.
    A tokenizer without a BOS token is left as it is.
    """
    bos = getattr(tokenizer, "bos_token_id", None)
    if not isinstance(bos, int) or len(data) == 0:
        return data
    starts = (data.clean_ids[:, 0] == bos) & (data.corrupted_ids[:, 0] == bos)
    if prepend_bos and not bool(starts.all()):
        if bool(starts.any()):
            raise TaskError("some prompts of the task start with BOS and some do not; cannot apply"
                            " discovery.data_params.prepend_bos=true uniformly.")
        col = torch.full((len(data), 1), bos, dtype=data.clean_ids.dtype)
        ones = torch.ones((len(data), 1), dtype=data.attention_mask.dtype)
        return TaskData(torch.cat([col, data.clean_ids], 1), torch.cat([col, data.corrupted_ids], 1),
                        torch.cat([ones, data.attention_mask], 1), data.answer_pos + 1, data.correct, data.incorrect)
    if not prepend_bos and bool(starts.all()):
        if bool((data.answer_pos < 1).any()):
            raise TaskError("a prompt is only its BOS token; discovery.data_params.prepend_bos=false would empty it.")
        return TaskData(data.clean_ids[:, 1:], data.corrupted_ids[:, 1:], data.attention_mask[:, 1:],
                        data.answer_pos - 1, data.correct, data.incorrect)
    return data


def build_task(task: str, tokenizer, model_dir: str | None, dp: DataParams, n: int, seed: int,
               max_tokens: int | None = None, pair_check=None, report: dict | None = None) -> TaskData:
    """`n` examples of `task` for this tokenizer (model_dir lets fixtures name their symbols),
    with the BOS policy `dp.prepend_bos` applied (`apply_bos_policy`).

    max_tokens: the model's context; a prompt longer than it raises TaskError naming the row.
    pair_check, report: for corruptions generated by `dp.corruption` (jsonl task): a function of
    TaskData -> (N,) bool (True where the corruption changes the model's answer), and a dict
    filled with what the generation found (tasks/jsonl.py).

    Returns TaskData with (N, T) clean/corrupted ids and mask, (N,) answer positions and -1 padded
    answer ids; N == n except for file tasks whose file has fewer rows (then all rows, warned).
    """
    data = apply_bos_policy(_build_task(task, tokenizer, model_dir, dp, n, seed, max_tokens, pair_check, report),
                            tokenizer, dp.prepend_bos)
    if max_tokens is not None and data.clean_ids.shape[1] > max_tokens:
        # Only a BOS the policy added can take a prompt past the context the task builder checked.
        raise TaskError(f"with discovery.data_params.prepend_bos=true the longest prompt is {data.clean_ids.shape[1]}"
                        f" tokens (BOS included), beyond the model's context of {max_tokens} tokens; shorten it by"
                        " one token or set discovery.data_params.prepend_bos=false.")
    return data


def _build_task(task: str, tokenizer, model_dir: str | None, dp: DataParams, n: int, seed: int,
                max_tokens: int | None, pair_check=None, report: dict | None = None) -> TaskData:
    if dp.corruption is not None and task != "jsonl":
        raise TaskError(f"discovery.data_params.corruption={dp.corruption!r} generates corrupted prompts for the jsonl"
                        f" task only; the {task} task has its own corruption. Set it to null.")
    if task != "ioi" and dp.ioi_corruption != DataParams.ioi_corruption:
        log.warning("discovery.data_params.ioi_corruption=%r is not used: the %s task has its own corruption"
                    " (ioi_corruption is read by the ioi task only).", dp.ioi_corruption, task)
    if task != "induction" and dp.induction_format != DataParams.induction_format:
        log.warning("discovery.data_params.induction_format=%r is not used: it is read by the induction task"
                    " only.", dp.induction_format)
    if dp.induction_corruption != DataParams.induction_corruption and (task != "induction"
                                                                      or dp.induction_format != "repeat"):
        log.warning("discovery.data_params.induction_corruption=%r is not used: it is read by the induction task"
                    " in the repeat format only (the single format has its key corruption).", dp.induction_corruption)
    if task not in SAMPLE_FILES and task in BUILT_TASKS and dp.data_path is not None:
        log.warning("discovery.data_params.data_path=%r is not used: the %s task generates its examples"
                    " (data_path is read by the mmlu and jsonl tasks only).", dp.data_path, task)
    if max_tokens is not None and task == "induction" and dp.seq_len > max_tokens:
        raise TaskError(f"discovery.data_params.seq_len={dp.seq_len} exceeds the model's context of {max_tokens}"
                        f" tokens; set it to at most {max_tokens}.")
    if task == "induction":
        return induction.build(tokenizer, model_dir, n, dp.seq_len, seed, dp.induction_format,
                               dp.induction_corruption)
    if task == "ioi":
        return ioi.build(tokenizer, n, seed, dp.ioi_corruption)
    if task == "greater_than":
        return greater_than.build(tokenizer, n, seed)
    if task == "sva":
        return sva.build(tokenizer, n, seed)
    if task == "capitals":
        return capitals.build(tokenizer, n, seed)
    if task == "mmlu":
        return mmlu.build(tokenizer, data_path_for(task, dp.data_path), n, seed, max_tokens)
    if task == "jsonl":
        return jsonl.build(tokenizer, data_path_for(task, dp.data_path), n, seed, max_tokens, dp.corruption,
                           pair_check, dp.min_valid_share, report)
    raise TaskError(f"discovery.task={task!r} is not available in this version; available: {', '.join(BUILT_TASKS)}.")
