"""Gradian's side of bench_peers, in a process of its own like every peer.

    .venv/bin/python scripts/peers/worker_gradian.py --spec SPEC.json --out RESULT.json

The spec's `storage_dtype` (default float16) is the dtype of the stored rows.

`build_index` from the JSONL file to the on-disk index (model load included, as for bergson;
timed the second time in the process, the first, reported as cold, pays the imports),
kronecker projection of per_module_dim per module over the spec's modules (full names),
float32 model; then `rank` with the cosine score for each query file (all docs returned, so the
orchestrator can compute recall and MRR from the full score matrix).
"""

from __future__ import annotations

import itertools
import logging
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

from lmdata import run_worker  # noqa: E402
from peak import measured  # noqa: E402


def score_matrix(results: list[dict], n_queries: int, n_docs: int) -> list[list[float]]:
    """Rank results (query, row_id, score) as an n_queries x n_docs matrix."""
    matrix = [[float("-inf")] * n_docs for _ in range(n_queries)]
    for r in results:
        if r["query"] != "aggregate":
            matrix[r["query"]][r["row_id"]] = r["score"]
    return matrix


def floor_passes(spec: dict) -> tuple[dict[str, object], dict[str, int]]:
    """The floor of any per-example method: one batched forward+backward of the same batches with
    frozen parameters, activation gradients only, loss over the completion tokens. Returns
    (name -> a callable doing one pass, token counts). Passes: with logits everywhere (a plain
    model call, `floor_seconds`) and only where supervised (`floor_supervised_seconds`); with
    `padding_free_floor` in the spec also `floor_padding_free_seconds`: the rows bucketed by exact
    length (batches of at most batch_size rows of one length, so no token is padding).
    `full_logits_floor: false` in the spec leaves out the full-logits pass."""
    import torch
    import torch.nn.functional as F

    from circuitkit.core.batching import batch_overhead_tokens, padded_tokens, plan_batches
    from circuitkit.models.config import ModelConfig
    from circuitkit.models.loading import load_model
    from gradian.capture.gradients import ACTIVATION_CONTEXTS, activation_mode, supervised_positions
    from gradian.data.batch import collate
    from gradian.data.rows import load_rows

    loaded = load_model(ModelConfig(name=spec["model_dir"], precision=spec.get("precision", "float32")))
    rows, _ = load_rows(spec["docs"], loaded.tokenizer, spec["max_length"])
    pad = loaded.tokenizer.pad_token_id if loaded.tokenizer.pad_token_id is not None else 0
    embed = loaded.model.get_input_embeddings()

    lengths = [len(r.input_ids) for r in rows]
    # The same batches as the index: Gradian's plan for the spec's batching.
    plan = plan_batches(lengths, spec["batch_size"], spec.get("batch_tokens"), spec.get("group_by_length", True),
                        batch_overhead_tokens(loaded.device))
    by_length: dict[int, list[int]] = {}
    for i, n in enumerate(lengths):
        by_length.setdefault(n, []).append(i)
    padding_free = [ids[k:k + spec["batch_size"]] for ids in by_length.values()
                    for k in range(0, len(ids), spec["batch_size"])]

    # The activations run as in Gradian's own pass (`grads.activations`), so that the floor is the
    # least work of the same computation.
    dtype = next(loaded.model.parameters()).dtype
    activations = ACTIVATION_CONTEXTS[activation_mode(spec.get("activations", "auto"), dtype)]

    def one_pass(supervised_logits_only: bool, batches_of: list[list[int]]) -> None:
        with activations(loaded.model, dtype):
            for idx in batches_of:
                batch = collate([rows[i] for i in idx], pad)
                ex, pos, target = supervised_positions(batch)
                embeds = embed(batch["input_ids"]).detach().requires_grad_(True)
                if supervised_logits_only:
                    hidden = loaded.adapter.base(inputs_embeds=embeds, attention_mask=batch["attention_mask"])
                    logits = loaded.adapter.unembed(hidden.last_hidden_state[ex, pos])
                else:
                    logits = loaded.model(inputs_embeds=embeds, attention_mask=batch["attention_mask"]).logits[ex, pos]
                loss = F.cross_entropy(logits.float(), target, reduction="sum")
                torch.autograd.grad(loss, embeds)

    passes = {"floor_supervised_seconds": lambda: one_pass(True, plan)}
    if spec.get("full_logits_floor", True):
        passes["floor_seconds"] = lambda: one_pass(False, plan)
    if spec.get("padding_free_floor"):
        passes["floor_padding_free_seconds"] = lambda: one_pass(True, padding_free)
    tokens = {"computed_tokens": padded_tokens(lengths, plan), "real_tokens": sum(lengths)}
    return passes, tokens


def timed(fn) -> float:
    with measured() as m:
        fn()
    return m.seconds


def floor_seconds(spec: dict, paired: object = None) -> dict[str, object]:
    """Each floor pass timed like the index (a warm-up pass first, then the timed one).

    `paired`: a callable doing Gradian's own work on the same batches (the index built with the
    model loaded before the clock). With `floor_rounds` in the spec it is then timed alternately with the supervised-logits floor,
    `floor_rounds` times, so that both see the same machine; the result gets
    both lists of seconds, their medians, and `floor_ratio`, the median of the per-round ratios
    (Gradian / floor). On a machine whose speed drifts from minute to minute, the ratio of two
    runs taken next to each other is what holds; two medians taken minutes apart are not."""
    import statistics

    passes, out = floor_passes(spec)
    for key, one_pass in passes.items():
        one_pass()
        if key == "floor_supervised_seconds" and paired is not None and spec.get("floor_rounds"):
            paired()
            ours, floor = [], []
            for _ in range(spec["floor_rounds"]):
                ours.append(timed(paired))
                floor.append(timed(one_pass))
            out.update(index_preloaded_runs=ours, floor_supervised_runs=floor,
                       index_seconds_preloaded=statistics.median(ours),
                       floor_ratio=statistics.median(a / b for a, b in zip(ours, floor, strict=True)))
            out[key] = statistics.median(floor)
        else:
            out[key] = timed(one_pass)
    return out


def run(spec: dict, result: dict) -> None:
    from rich.console import Console

    from circuitkit.models.config import ModelConfig
    from gradian.build.indexer import build_index
    from gradian.rank.ranking import rank
    from gradian.settings.grads import GradsConfig

    logging.getLogger("circuitkit.models.loading").setLevel(logging.ERROR)  # the float32 notice
    work = Path(spec["work_dir"])
    storage = spec.get("storage_dtype", "float16")
    model_cfg = ModelConfig(name=spec["model_dir"], precision=spec.get("precision", "float32"))
    grads = GradsConfig(data_path=spec["docs"], batch_size=spec["batch_size"], max_seq_length=spec["max_length"],
                        module_filter=spec["modules"], projection="kronecker", projection_dim=spec["per_module_dim"],
                        projection_seed=spec["seed"], storage_dtype=storage,
                        group_by_length=spec.get("group_by_length", True), batch_tokens=spec.get("batch_tokens"),
                        activations=spec.get("activations", "auto"), loss="ce",  # the peers' cross-entropy
                        preconditioner="none")  # ranked with cosine, like the peers' cosine: no curvature to store
    index_dir = work / f"gradian_{storage}"
    quiet = Console(stderr=True, quiet=True)
    with measured() as cold:  # first build in this process: lazy imports
        build_index(model_cfg, grads, work / f"gradian_{storage}_warmup", quiet)
    with measured() as m:
        summary = build_index(model_cfg, grads, index_dir, quiet)
    n_docs = summary["n_rows"]
    shard_bytes = sum(p.stat().st_size for p in index_dir.glob("*.safetensors"))
    scores, query_s = {}, 0.0
    for style, path in spec["queries"].items():
        n_queries = sum(1 for line in Path(path).read_text().splitlines() if line.strip())
        with measured() as q:
            results = rank(index_dir, path, top_k=n_docs, score="cosine", aggregate="mean")
        query_s += q.seconds
        scores[style] = score_matrix(results, n_queries, n_docs)
    result.update({
        "method": f"gradian build_index, kronecker {spec['per_module_dim']} per module,"
                  f" {spec.get('precision', 'float32')} model, {storage} rows",
        "n_rows": n_docs, "cold_seconds": cold.seconds, "index_seconds": m.seconds, "index_peak_bytes": m.peak_bytes,
        "query_seconds": query_s, "row_width": summary["row_width"], "bytes_per_row": shard_bytes / n_docs,
        "scores": scores, "scoring": "gradian rank, cosine",
        "padding_share": summary.get("padding_share"), "real_tokens": summary.get("real_tokens"),
        "computed_tokens": summary.get("computed_tokens")})
    if spec.get("floor") and spec.get("floor_rounds"):
        # The floors are compute only (their model is loaded before the clock starts): the index
        # they are compared with is built with its model loaded before the clock too.
        from circuitkit.models.loading import load_model

        loaded = load_model(model_cfg)
        builds = itertools.count()

        def preloaded() -> None:
            build_index(model_cfg, grads, work / f"gradian_{storage}_preloaded{next(builds)}", quiet, loaded=loaded)

        result.update(floor_seconds(spec, preloaded))
    elif spec.get("floor"):
        result.update(floor_seconds(spec))


if __name__ == "__main__":
    from gradian import __version__

    run_worker("gradian", lambda: __version__, run)
