"""Tasks that supply clean / corrupted pairs for attribution and faithfulness."""

from __future__ import annotations

from circuitkit.config import DataParams
from circuitkit.tasks.base import TaskData, TaskError

__all__ = ["TaskData", "TaskError", "build_task", "BUILT_TASKS"]

BUILT_TASKS = ("induction",)


def build_task(task: str, tokenizer, model_dir: str | None, dp: DataParams, n: int, seed: int) -> TaskData:
    """`n` examples of `task` for this tokenizer (model_dir lets fixtures name their symbols)."""
    if task == "induction":
        from circuitkit.tasks import induction

        return induction.build(tokenizer, model_dir, n, dp.seq_len, seed)
    raise TaskError(f"discovery.task={task!r} is not available in this version; available: {', '.join(BUILT_TASKS)}.")
