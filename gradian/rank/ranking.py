"""`gradian rank`: the query rows' gradients against the index, top-k rows per query and for the aggregate.

The steps, each in its module: the query checked against the index (`gradian.rank.checks`), its
gradients computed as the index's rows were (`gradian.rank.queries`), the shards streamed and scored
(`gradian.rank.scores`), the rows' lines and previews added (`gradian.rank.results`).
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

from circuitkit.core.errors import UserError
from circuitkit.core.io import atomic_write_bytes, check_writable
from circuitkit.core.recorded import IndexIntegrityError, read_recorded
from circuitkit.models.config import ModelConfig
from circuitkit.models.loading import load_model
from gradian.build.checks import check_input_file
from gradian.curvature.allocation import check_allocation
from gradian.curvature.factors import has_kfac
from gradian.index.formats import format_of
from gradian.index.manifest import IndexMismatchError
from gradian.index.reader import IndexReader
from gradian.projection.projector import STORED_KINDS, WHITENING_FILE
from gradian.rank.checks import (
    asked_adapter,
    check_circuit,
    check_compatible,
    check_token_policy,
    compare_adapter,
)
from gradian.rank.queries import query_gradients
from gradian.rank.results import format_results
from gradian.rank.scores import (
    AGGREGATES,
    CURVATURE_SCORES,
    KRONECKER_SCORES,
    PRECONDITIONED_SCORES,
    SCORES,
    check_choice,
    check_kronecker,
    preconditioner_of,
    stream_topk,
)

log = logging.getLogger(__name__)

def check_output_file(path: Path, what: str) -> None:
    """`path` can be written as a file (UserError, exit code 2, if not): checked before any work."""
    if path.is_dir():
        raise UserError(f"{what} {str(path)!r} is a directory; give a file name (e.g. {path / 'ranked.jsonl'}).",
                        exit_code=2)
    check_writable(path, what)  # written atomically (a new file renamed over it): the directory decides


def default_score(manifest: dict[str, Any]) -> str:
    """What `score="auto"` ranks with: ekfac where the index holds K-FAC factors (the best score on
    most yardsticks, docs/benchmarks.md "Yardsticks"), else cosine."""
    return "ekfac" if has_kfac(manifest.get("preconditioner")) else "cosine"


def rank(index_dir: str | Path, queries_path: str | Path, top_k: int = 10, score: str = "auto",
         aggregate: str = "mean", out_path: str | Path | None = None,
         model_cfg: ModelConfig | None = None, loaded=None, verify: bool = True,
         circuit: str | Path | None = None, append_eos: bool | None = None,
         damping: float | None = None, adapter: str | None = "index") -> list[dict[str, Any]]:
    """Rank the index's training rows against the rows of `queries_path` (JSONL).

    Loads the model the manifest names (or `model_cfg`; or an already loaded `loaded`), refuses
    it if the weights, tokenizer or projection differ from the index's (IndexMismatchError naming
    the key), computes the query gradients, streams the index (`stream_topk`) and returns dicts
    {"query": query row id or "aggregate", "rank", "row_id", "score", "source_line",
    "text_preview"}, per query then the aggregate. Writes them as JSONL to `out_path` if given.
    `verify`: check every shard's sha256 as it is streamed (default; IndexIntegrityError on a
    mismatch). Everything that can fail without computing (arguments, the queries file, the
    manifest, where `out_path` goes) is checked before the model is loaded.

    `circuit`: the circuit.pt the queries are meant for. It must be the one a restricted index
    was built with (same sha256); against an unrestricted index it is refused. Without it,
    a restricted index's queries use the heads and MLPs its manifest records.

    `score`: cosine, dot, or (an index built with grads.preconditioner=module) influence or
    whitened, or (grads.preconditioner=kfac) kfac or ekfac, with `damping` (share of the mean
    eigenvalue, default 0.1 for influence / whitened, 0.01 for kfac / ekfac; `gradian.curvature.moments`,
    `gradian.curvature.factors`; refused with cosine / dot).
    "auto" (the default): ekfac on an index with K-FAC factors, else cosine (`default_score`).
    Query rows are tokenized with the index's token policy (manifest ``token_policy``);
    `append_eos`, when given, must be that policy's (IndexMismatchError otherwise).

    `adapter`: the LoRA adapter the queries' model carries: "index" (the default) = the one the
    manifest records, None = none, else a directory; with `model_cfg` its `adapter`, with `loaded`
    its record. Anything but the index's adapter (another file, none, or its file changed since) is
    refused before the model loads (IndexMismatchError naming the difference, `compare_adapter`).
    """
    check_choice("score", score, ("auto", *SCORES))
    check_choice("aggregate", aggregate, AGGREGATES)
    if top_k < 1:
        raise UserError(f"--top-k {top_k}: it must be >= 1.", exit_code=2)
    check_input_file(Path(queries_path), "--queries")
    if out_path is not None:
        check_output_file(Path(out_path), "--out")
    manifest = IndexReader(index_dir).manifest
    if score == "auto":
        score = default_score(manifest)
        if damping is not None and score not in CURVATURE_SCORES:
            raise UserError(f"--damping {damping}: {index_dir} holds no K-FAC factors (grads.preconditioner="
                            f"{manifest.get('preconditioner', 'none')}), so --score auto is cosine, which uses no"
                            f" damping. Drop --damping, or name a --score that uses it ({', '.join(CURVATURE_SCORES)}).",
                            exit_code=2)
    if not isinstance(manifest.get("model"), str):
        raise IndexIntegrityError(f"{Path(index_dir) / 'manifest.json'} names no model (model:"
                                  f" {manifest.get('model')!r}); rebuild the index with `gradian index`.")
    check_circuit(manifest, circuit)
    check_token_policy(manifest, append_eos)
    if damping is not None and score not in CURVATURE_SCORES:
        raise UserError(f"--damping {damping} with --score {score}: {score} uses no curvature, so there is nothing to"
                        f" damp. Drop --damping, or rank with --score {' / '.join(CURVATURE_SCORES)}.", exit_code=2)
    if damping is not None and not (math.isfinite(damping) and damping > 0):
        raise UserError(f"--damping {damping}: it must be a finite number > 0 (a share of each module's mean eigenvalue).",
                        exit_code=2)
    row_format = format_of(manifest)  # the scores its rows can be ranked by (gradian.index.formats)
    if score not in row_format.scores:
        raise UserError(row_format.score_refusal(index_dir, score), exit_code=2)
    if score in PRECONDITIONED_SCORES and IndexReader(index_dir).second_moment_blocks is None:
        preconditioner_of(IndexReader(index_dir), damping)  # raises, naming the fix, before the model loads
    if score in KRONECKER_SCORES:
        check_kronecker(IndexReader(index_dir))
    proj = manifest.get("projection")
    if isinstance(proj, dict):  # the stored projection files, before the model loads (IndexIntegrityError)
        check_allocation(index_dir, proj)
        if proj.get("kind") in STORED_KINDS:
            read_recorded(Path(index_dir), proj.get("whitening"), WHITENING_FILE, "the whitened projection's matrices")
    if loaded is not None:
        compare_adapter(manifest.get("adapter"), getattr(loaded, "lora", None), "the loaded model's adapter")
        if getattr(loaded, "lora", None) and not getattr(loaded, "adapter_kept", False):
            raise IndexMismatchError("the loaded model has its LoRA adapter merged into its weights; Gradian's queries"
                                     " need its LoRA linears kept: load_model(cfg, keep_adapter=True).")
    elif model_cfg is not None:
        asked_adapter(manifest, model_cfg.adapter or None)
    else:
        model_cfg = ModelConfig(name=manifest["model"], revision=manifest.get("revision"),
                                gguf_file=manifest.get("gguf_file"), precision=manifest.get("precision", "bfloat16"),
                                adapter=asked_adapter(manifest, adapter))
    if loaded is None:
        loaded = load_model(model_cfg, keep_adapter=True)
    projector = check_compatible(manifest, loaded, index_dir)
    q_grads, q_rows = query_gradients(manifest, loaded, projector, queries_path)
    top = stream_topk(index_dir, q_grads, top_k, score, aggregate, verify=verify, damping=damping)
    results = format_results(manifest, top, [r.row_id for r in q_rows], index_dir)
    if out_path is not None:
        payload = "".join(json.dumps(r) + "\n" for r in results).encode()
        atomic_write_bytes(Path(out_path), payload)
    return results
