"""bergson's side of bench_peers: index the docs and the queries with `bergson.build`, score by cosine.

Runs in `.venv-peers` (see scripts/peers/setup_peers.sh):

    .venv-peers/bin/python scripts/peers/worker_bergson.py --spec SPEC.json --out RESULT.json

bergson is called in-process through its own build entry point (what `bergson build` runs), with
the prompt/completion columns (loss on completion tokens only), float32, the spec's modules (the
others excluded through `filter_modules`), biases excluded, and a per-module two-sided projection of
sqrt(per_module_dim) x sqrt(per_module_dim): the same shape as Gradian's kronecker projection.
Timed: the docs build, from the JSONL file to bergson's on-disk index (model load included, as
for Gradian), the second time in the process (the first, reported as cold, pays the imports).
Scores: cosine of the stored rows, as Gradian's default `rank`.
"""

from __future__ import annotations

import math
import os
import sys
from importlib.metadata import version
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("WANDB_DISABLED", "true")
sys.path.insert(0, str(Path(__file__).resolve().parent))

from lmdata import cosine_scores, run_worker  # noqa: E402
from peak import measured  # noqa: E402


def excluded_modules(spec: dict) -> str | None:
    """bergson's `filter_modules` (globs of modules to leave out) for exactly the spec's modules.

    bergson hooks every linear module of `model.base_model` unless excluded; names are relative to
    the base model ("h.0.mlp.c_proj" for "transformer.h.0.mlp.c_proj").
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(spec["model_dir"]))
    prefix = model.base_model_prefix + "."
    wanted = {name.removeprefix(prefix) for name in spec["modules"]}
    linear = [name for name, m in model.base_model.named_modules() if type(m).__name__ in ("Linear", "Conv1D")]
    missing = wanted - set(linear)
    if missing:
        raise ValueError(f"modules not in the model: {sorted(missing)[:4]}")
    return ",".join(name for name in linear if name not in wanted) or None


def index(spec: dict, data_path: str, run_path: Path, token_batch_size: int):
    """bergson's `build` of one JSONL file into run_path; returns the (rows, width) gradients."""
    from bergson import load_gradients
    from bergson.build import build
    from bergson.config.config import DataConfig, IndexConfig, PreprocessConfig

    cfg = IndexConfig(
        run_path=str(run_path), overwrite=True, model=spec["model_dir"],
        precision={"float32": "fp32", "bfloat16": "bf16"}[spec.get("precision", "float32")],
        projection_dim=math.isqrt(spec["per_module_dim"]), projection_seed=spec["seed"],
        token_batch_size=token_batch_size, loss_reduction="sum", filter_modules=excluded_modules(spec),
        data=DataConfig(dataset=data_path, prompt_column="prompt", completion_column="completion"))
    build(cfg, PreprocessConfig())
    return load_gradients(run_path)


def as_tensor(rows):
    """bergson's stored rows (a numpy memmap, bfloat16 rows as ml_dtypes) as a float32 tensor."""
    import numpy as np
    import torch

    return torch.from_numpy(np.asarray(rows, dtype=np.float32))


def run(spec: dict, result: dict) -> None:
    from transformers import AutoTokenizer

    work = Path(spec["work_dir"])
    # bergson batches by tokens and refuses a budget above the tokenizer's model_max_length.
    context = AutoTokenizer.from_pretrained(spec["model_dir"]).model_max_length
    token_batch_size = min(context, spec.get("batch_tokens") or spec["batch_size"] * spec["max_length"])
    with measured() as cold:  # first build in this process: lazy imports, dataset caches
        index(spec, spec["docs"], work / "bergson_warmup", token_batch_size)
    with measured() as m:
        docs = index(spec, spec["docs"], work / "bergson_docs", token_batch_size)
    gradients_file = work / "bergson_docs" / "gradients.bin"
    scores, query_s = {}, 0.0
    for style, path in spec["queries"].items():
        with measured() as q:
            queries = index(spec, path, work / f"bergson_queries_{style}", token_batch_size)
        query_s += q.seconds
        scores[style] = cosine_scores(as_tensor(queries), as_tensor(docs))
    result.update({
        "method": f"bergson build, per-module {math.isqrt(spec['per_module_dim'])}x"
                  f"{math.isqrt(spec['per_module_dim'])} rademacher, {spec.get('precision', 'float32')} model,"
                  f" {docs.dtype} rows",
        "n_rows": int(docs.shape[0]), "cold_seconds": cold.seconds, "index_seconds": m.seconds,
        "index_peak_bytes": m.peak_bytes, "query_seconds": query_s, "row_width": int(docs.shape[1]),
        "bytes_per_row": gradients_file.stat().st_size / docs.shape[0],
        "scores": scores, "scoring": "cosine of bergson's stored rows",
        "notes": [f"token_batch_size {token_batch_size} (bergson batches by tokens, capped at the"
                  " tokenizer's model_max_length)"]})


if __name__ == "__main__":
    run_worker("bergson", lambda: version("bergson"), run)
