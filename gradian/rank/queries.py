"""Query gradients: the query rows tokenized, captured and projected exactly as the index's rows were."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from circuitkit.core.batching import batch_overhead_tokens, plan_batches
from circuitkit.models.loading import context_length
from gradian.build.checks import check_input_file
from gradian.capture.gradients import per_example_gradients
from gradian.capture.sites import sites_from_names
from gradian.data.batch import collate, to_device
from gradian.data.rows import load_rows, policy_of
from gradian.projection.projector import Projector
from gradian.rank.scores import QUERY_BATCH_SIZE


def query_gradients(manifest: dict[str, Any], loaded, projector: Projector, queries_path: str | Path,
                    batch_size: int = QUERY_BATCH_SIZE) -> tuple[torch.Tensor, list]:
    """Projected gradients of the query rows, as the index's rows were made.

    Returns (grads (Q, width) float32 on the CPU, the query Rows from gradian.data.rows.load_rows with
    the manifest's max_seq_length / truncation settings and token policy: a query's tokens are
    made exactly as a training row's, EOS / BOS and chat supervision included). Its activations
    run as the index's did (the manifest's `activations`; "model" for indexes made before 4).
    """
    queries_path = Path(queries_path)
    check_input_file(queries_path, "--queries")
    rows, report = load_rows(queries_path, loaded.tokenizer, manifest.get("max_seq_length", 512),
                             manifest.get("on_truncation", "warn"), manifest.get("truncation_side", "right"),
                             context_length=context_length(loaded.model.config), policy=policy_of(manifest))
    if not rows:
        raise ValueError(f"{queries_path}: no query row has a supervised token ({report.summary()}).")
    model, tokenizer = loaded.model, loaded.tokenizer
    modules = sites_from_names(model, loaded.adapter, projector.names)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    lengths = [len(r.input_ids) for r in rows]
    out = torch.empty(len(rows), projector.total_width, dtype=torch.float32)
    budget = batch_size * max(lengths)
    for plan in plan_batches(lengths, batch_size, budget, overhead_tokens=batch_overhead_tokens(loaded.device)):
        batch = to_device(collate([rows[i] for i in plan], pad_id), loaded.device)
        out[plan] = per_example_gradients(model, loaded.adapter, modules, projector, batch,
                                          manifest.get("loss_reduction", "sum"),
                                          manifest.get("loss", "ce"),
                                          manifest.get("activations", "model")).row().float().cpu()
    return out, rows


# ----------------------------------------------------------------------------- output


