"""Rows, batches and the worker contract shared by the peer-library workers (traker, dattri).

Tokenization is Gradian's own (`gradian.data.rows.load_rows`, importable here: it needs only torch and
safetensors), so every tool sees the same tokens and the same supervised positions: prompt and
completion tokenized separately and concatenated, BOS only when the tokenizer adds one itself,
a supervised EOS after the completion.

Labels follow the Hugging Face convention: same positions as ``input_ids`` (the model shifts them),
-100 on prompt and padding. A row's loss is the SUM of the token cross-entropies of its supervised
tokens. Rows are never dropped: a row with no supervised token raises, so score columns always line
up with the lines of the JSONL file.

Only torch, transformers, gradian.data.rows and the standard library are imported: this runs in the
peer venvs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository, for gradian.data.rows

IGNORE = -100
Row = tuple[list[int], list[int]]  # (input ids, labels with -100 where not supervised)


# ----------------------------------------------------------------------------- tokenizing


def load_model_and_tokenizer(model_dir: str, precision: str = "float32") -> tuple[torch.nn.Module, Any]:
    """The causal LM in `model_dir` in eval mode on CPU in `precision` (a torch dtype name), and its
    tokenizer (local files only)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True, dtype=getattr(torch, precision))
    model.eval()
    return model, tokenizer


def load_rows(path: str, tokenizer: Any, max_length: int) -> list[Row]:
    """All rows of a JSONL file, tokenized by Gradian's own reader (gradian/data/rows.py), in file order.

    Rows are never dropped: a row cut or left without a supervised token raises, so the score
    columns line up with the lines of the file.
    """
    from gradian.data.rows import load_rows as gradian_rows

    rows, report = gradian_rows(path, tokenizer, max_length, on_truncation="error")
    if report.dropped_unsupervised:
        raise ValueError(f"{path}: {report.summary()}: rows without a supervised token would be dropped;"
                         " fix them (scores must keep the file's row order).")
    return [(r.input_ids, [tok if sup else IGNORE for tok, sup in zip(r.input_ids, r.supervised, strict=True)])
            for r in rows]


def pad_id(tokenizer: Any) -> int:
    """The id used for right padding: the tokenizer's pad id, else 0 (masked out either way)."""
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0


def collate(rows: list[Row], pad: int) -> dict[str, torch.Tensor]:
    """Right-padded batch: input_ids, attention_mask, labels, each (B, T) with T the longest row."""
    width = max(len(ids) for ids, _ in rows)
    input_ids = torch.full((len(rows), width), pad, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
    labels = torch.full((len(rows), width), IGNORE, dtype=torch.long)
    for i, (ids, lab) in enumerate(rows):
        input_ids[i, : len(ids)] = torch.tensor(ids)
        attention_mask[i, : len(ids)] = 1
        labels[i, : len(lab)] = torch.tensor(lab)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def batches(rows: list[Row], batch_size: int, pad: int) -> Iterator[dict[str, torch.Tensor]]:
    """Consecutive slices of `rows` (file order), collated."""
    for start in range(0, len(rows), batch_size):
        yield collate(rows[start:start + batch_size], pad)


def row_token_losses(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Per-token cross-entropy (B, T-1) of next-token prediction, 0 where the label is -100."""
    shift_logits = logits[:, :-1].float()  # (B, T-1, V)
    shift_labels = labels[:, 1:]  # (B, T-1)
    flat = torch.nn.functional.cross_entropy(shift_logits.reshape(-1, shift_logits.shape[-1]),
                                             shift_labels.reshape(-1), ignore_index=IGNORE, reduction="none")
    return flat.view(shift_labels.shape)


# ----------------------------------------------------------------------------- contract


def read_spec(path: str) -> dict[str, Any]:
    """The benchmark spec (model_dir, docs, queries, modules, per_module_dim, total_dim, ...)."""
    with open(path) as fh:
        spec = json.load(fh)
    missing = [k for k in ("model_dir", "docs", "queries", "modules", "per_module_dim", "total_dim",
                           "batch_size", "max_length", "seed", "work_dir") if k not in spec]
    if missing:
        raise KeyError(f"{path}: spec lacks {', '.join(missing)}")
    return spec


def cosine_scores(queries: torch.Tensor, docs: torch.Tensor) -> list[list[float]]:
    """Cosine similarity (n_queries, n_docs) of two feature matrices, as nested lists."""
    q = torch.nn.functional.normalize(queries.double(), dim=1)
    d = torch.nn.functional.normalize(docs.double(), dim=1)
    return (q @ d.T).tolist()


def error_text(exc: BaseException, last_lines: int = 12) -> str:
    """Exception type and message, then the last lines of its traceback."""
    tb = traceback.format_exception(type(exc), exc, exc.__traceback__)
    tail = "".join(tb).rstrip().splitlines()[-last_lines:]
    return f"{type(exc).__name__}: {exc}\n" + "\n".join(tail)


def empty_result(tool: str) -> dict[str, Any]:
    """RESULT.json with every contract key, nothing measured yet."""
    return {"tool": tool, "version": None, "method": None, "n_rows": None, "index_seconds": None,
            "index_peak_bytes": None, "query_seconds": None, "row_width": None, "bytes_per_row": None,
            "scores": None, "scoring": None, "notes": [], "error": None}


def write_result(path: str, result: dict[str, Any]) -> None:
    """Write RESULT.json whole or not at all (temp file, then rename)."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(result))
    tmp.replace(out)


@contextmanager
def tool_imports(tool: str) -> Iterator[None]:
    """Wrap the worker's imports of the tool: if they fail, RESULT.json still says why, exit status 0.

    Only when run as a worker (`--out` on the command line); imported elsewhere, the error propagates.
    """
    try:
        yield
    except Exception as exc:
        argv = sys.argv[1:]
        if "--out" not in argv or argv.index("--out") + 1 >= len(argv):
            raise
        result = empty_result(tool)
        result["error"] = error_text(exc)
        write_result(argv[argv.index("--out") + 1], result)
        print(result["error"], file=sys.stderr)
        sys.exit(0)


def run_worker(tool: str, version: Callable[[], str], body: Callable[[dict[str, Any], dict[str, Any]], None]) -> None:
    """Command line of every worker: `--spec SPEC.json --out RESULT.json`.

    `body(spec, result)` fills `result` in place, so what it measured before an exception is kept;
    any exception is recorded in `result["error"]` and the process still exits 0, so the benchmark
    table can show the failure.
    """
    parser = argparse.ArgumentParser(description=f"Benchmark worker for {tool}.")
    parser.add_argument("--spec", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    result = empty_result(tool)
    try:
        result["version"] = version()
        body(read_spec(args.spec), result)
    except Exception as exc:  # the contract: report, never crash
        result["error"] = error_text(exc)
        print(result["error"], file=sys.stderr)
    write_result(args.out, result)
