"""Benchmark worker for dattri's LoGra (`dattri.algorithm.logra.LoGraAttributor`) on a Hugging Face causal LM.

    .venv-peers/bin/python scripts/peers/worker_dattri.py --spec SPEC.json --out RESULT.json

What runs (the contract is in scripts/peers/lmdata.py and the benchmark's orchestrator):

* LoGra with `proj_dim = per_module_dim` (a sqrt x sqrt Kronecker projection per module, Gaussian),
  `hessian="Identity"`, `offload="cpu"`, on CPU: scores are inner products of projected gradients.
* Loss, per row: the sum of the completion tokens' cross-entropies. dattri's hooks multiply each
  row's gradient by the batch size (they assume a batch-mean loss), so the batch loss handed over is
  the mean over rows of the per-row sums; a row's gradient is then exactly that of its own loss,
  whatever the size of its batch.
* dattri's hooks only wrap `nn.Linear` and its compressor setup rejects other module types, while
  GPT-2's projections are transformers' `Conv1D` (weight stored (in, out)). Each named module is
  therefore replaced by the same function written as `x @ W.T + b` with a bias-free `nn.Linear`
  (weight W^T, shape (out, in)) plus a separate bias: hooked as `<module>.linear`, the gradient is
  that of the weights only (the hooks would otherwise fold the bias into the input factor).
  A self-check compares dattri's unprojected per-row gradients of one module with autograd's.
* Index (timed, peak memory): attributor construction, `cache(docs)` and `compute_ifvp()` (for the
  identity hessian a copy of the cached gradients; `attribute` would otherwise do it on first use).
  Query: `attribute(docs, queries)` per query set.
* Extra scores: `scores_cosine` (the same inner products divided by both gradient norms) and
  `scores_efim` (the cached gradients reused with `hessian="eFIM"`, dattri's default damping).
"""

from __future__ import annotations

import copy
import os
import shutil
import sys
import time
from functools import partial
from importlib.metadata import version
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from lmdata import (  # noqa: E402
    Row,
    collate,
    error_text,
    load_model_and_tokenizer,
    load_rows,
    pad_id,
    run_worker,
    tool_imports,
)
from peak import measured  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402
from transformers.pytorch_utils import Conv1D  # noqa: E402

with tool_imports("dattri"):
    from dattri.algorithm.block_projected_if.block_projected_if import BlockProjectedIFAttributor
    from dattri.algorithm.logra import LoGraAttributor
    from dattri.task import AttributionTask

CHECK_ROWS = 4  # rows in the Conv1D gradient self-check


class BiasFreeLinear(nn.Module):
    """y = x @ W^T + b as a bias-free nn.Linear plus a bias, so hooks on `.linear` see the weight alone."""

    def __init__(self, weight_out_in: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        out_features, in_features = weight_out_in.shape
        self.linear = nn.Linear(in_features, out_features, bias=False, dtype=weight_out_in.dtype)
        self.linear.weight.data.copy_(weight_out_in)
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x)
        return y if self.bias is None else y + self.bias


def weight_out_in(module: nn.Module) -> torch.Tensor:
    """The module's weight as (out, in): nn.Linear stores it so, transformers' Conv1D as (in, out)."""
    if isinstance(module, nn.Linear):
        return module.weight.detach()
    if isinstance(module, Conv1D):
        return module.weight.detach().T
    raise TypeError(f"{type(module).__name__} is neither nn.Linear nor transformers' Conv1D; LoGra's "
                    "Kronecker factors need a linear map with input and output activations.")


def linearize(model: nn.Module, modules: list[str]) -> list[str]:
    """Replace each named module by a BiasFreeLinear in place; returns the names of the layers to hook.

    Only those layers' weights keep requires_grad; every other parameter is frozen.
    """
    for p in model.parameters():
        p.requires_grad_(False)
    hooked = []
    for name in modules:
        old = model.get_submodule(name)
        parent_name, _, child = name.rpartition(".")
        new = BiasFreeLinear(weight_out_in(old), getattr(old, "bias", None))
        new.linear.weight.requires_grad_(True)
        setattr(model.get_submodule(parent_name), child, new)
        hooked.append(f"{name}.linear")
    return hooked


def counted_collate(rows: list[Row], pad: int) -> dict[str, torch.Tensor]:
    """lmdata.collate plus `num_items_in_batch` = B: transformers' loss then is sum(token CE) / B.

    dattri computes query gradients with `model(**batch).loss`, so this is how that loss becomes the
    mean over rows of the per-row sums, the same as `lm_loss` for the docs. input_ids stays the
    first key: dattri reads the batch size off the first value.
    """
    batch = collate(rows, pad)
    batch["num_items_in_batch"] = torch.tensor(len(rows), dtype=torch.float32)
    return batch


def lm_loss(model: nn.Module, batch: dict[str, torch.Tensor], device: str = "cpu") -> torch.Tensor:
    """The batch loss LoGra differentiates for the docs: mean over rows of summed completion CE."""
    return model(**{k: v.to(device) for k, v in batch.items()}, use_cache=False).loss


def loader(rows: list[Row], batch_size: int, pad: int) -> DataLoader:
    """Rows in file order (dattri warns on shuffling), batches collated with counted_collate."""
    return DataLoader(rows, batch_size=batch_size, shuffle=False, collate_fn=partial(counted_collate, pad=pad))


def make_task(model: nn.Module) -> AttributionTask:
    return AttributionTask(loss_func=lm_loss, model=model, checkpoints=model.state_dict())


def stock_logra_error(model: nn.Module, modules: list[str], rows: list[Row], pad: int, cache_dir: Path) -> str | None:
    """What LoGra does with the unmodified model's Conv1D modules: the error text, or None if it ran."""
    try:
        attributor = LoGraAttributor(task=make_task(model), layer_names=modules, hessian="Identity",
                                     device="cpu", proj_dim=4, offload="cpu", cache_dir=str(cache_dir))
        attributor.cache(loader(rows[:2], 2, pad))
    except Exception as exc:
        return error_text(exc, last_lines=2)
    return None


def conv1d_gradient_check(raw: nn.Module, converted: nn.Module, module: str, rows: list[Row], pad: int,
                          cache_dir: Path) -> float:
    """Max relative difference between dattri's and autograd's per-row gradient Gram matrices.

    dattri side: BlockProjectedIFAttributor (LoGra's base) with identity sparsifier and projector on
    `<module>.linear`, identity hessian, attribute(rows, rows) = G G^T. Autograd side: the gradient of
    each row's summed completion CE w.r.t. the unmodified model's weight, one row at a time.
    """
    identity = {"device": "cpu", "proj_dim": -1, "proj_max_batch_size": 64, "proj_type": "identity"}
    attributor = BlockProjectedIFAttributor(task=make_task(converted), layer_names=[f"{module}.linear"],
                                            hessian="Identity", device="cpu", sparsifier_kwargs=identity,
                                            projector_kwargs=identity, offload="cpu", cache_dir=str(cache_dir))
    data = loader(rows, len(rows), pad)
    attributor.cache(data)
    gram_dattri = attributor.attribute(data, data).double()

    weight = raw.get_submodule(module).weight
    grads = []
    for row in rows:
        batch = counted_collate([row], pad)
        grads.append(torch.autograd.grad(lm_loss(raw, batch), weight)[0].flatten())
    g = torch.stack(grads).double()
    gram_ref = g @ g.T
    return float((gram_dattri - gram_ref).abs().max() / gram_ref.abs().max())


def stored_bytes(attributor: LoGraAttributor) -> dict[str, int]:
    """Bytes of the tensors the attributor keeps per checkpoint for the docs (cpu offload)."""
    manager = attributor.offload_manager
    return {kind: sum(t.numel() * t.element_size() for t in store.values())
            for kind, store in (("gradients", manager.cached_gradients), ("ifvp", manager.cached_ifvp))}


def query_norms(attributor: LoGraAttributor, data: DataLoader) -> torch.Tensor:
    """Norms of the queries' projected gradients (a second, untimed pass; dattri has no public call)."""
    grads, _ = attributor._compute_test_gradients(data)
    return grads.double().norm(dim=1)


def build_index(model: nn.Module, layer_names: list[str], docs: DataLoader, spec: dict[str, Any],
                cache_dir: Path) -> LoGraAttributor:
    """LoGra over the docs: construction, cache (projected per-row gradients), IFVP (identity: a copy)."""
    attributor = LoGraAttributor(task=make_task(model), layer_names=layer_names, hessian="Identity", device="cpu",
                                 proj_dim=spec["per_module_dim"], offload="cpu", cache_dir=str(cache_dir))
    attributor.sparsifier_kwargs["proj_seed"] = spec["seed"]  # LoGraAttributor takes no seed
    attributor.cache(docs)
    attributor.compute_ifvp()
    return attributor


def cosine_from_inner(attributor: LoGraAttributor, scores: dict[str, torch.Tensor],
                      queries: dict[str, DataLoader]) -> dict[str, list]:
    """Inner-product scores (n_queries, n_docs) divided by both gradient norms."""
    doc_norms = attributor.compute_self_attribution().double().clamp(min=0).sqrt()  # g.g with identity IFVP
    return {style: (scores[style] / query_norms(attributor, data)[:, None] / doc_norms[None, :]).tolist()
            for style, data in queries.items()}


def efim_scores(attributor: LoGraAttributor, docs: DataLoader, queries: dict[str, DataLoader]) -> dict[str, list]:
    """Scores with hessian='eFIM' from the already cached doc gradients (dattri's default damping)."""
    attributor.hessian = "eFIM"
    attributor.compute_preconditioners()
    attributor.compute_ifvp()
    return {style: attributor.attribute(docs, data).T.tolist() for style, data in queries.items()}


def run(spec: dict[str, Any], result: dict[str, Any]) -> None:
    work = Path(spec["work_dir"]) / "dattri"
    shutil.rmtree(work, ignore_errors=True)
    # A cold, private Inductor cache: LoGra's compressor is @torch.compile'd, and a warm cache shared
    # between runs would make index_seconds depend on what ran before.
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(work / "inductor")
    torch.manual_seed(spec["seed"])
    raw, tokenizer = load_model_and_tokenizer(spec["model_dir"], spec.get("precision", "float32"))
    pad = pad_id(tokenizer)
    doc_rows = load_rows(spec["docs"], tokenizer, spec["max_length"])
    docs = loader(doc_rows, spec["batch_size"], pad)
    queries = {style: loader(load_rows(path, tokenizer, spec["max_length"]), spec["batch_size"], pad)
               for style, path in spec["queries"].items()}
    notes = result["notes"]

    stock_error = stock_logra_error(copy.deepcopy(raw), spec["modules"], doc_rows, pad, work / "stock")
    notes.append("LoGra on the unmodified GPT-2 (transformers Conv1D): "
                 + (f"fails: {stock_error}" if stock_error else "ran (conversion kept for the bias)")
                 + ". Worked around by rewriting each module as a bias-free nn.Linear (weight W^T) plus a"
                 " separate bias, hooked as <module>.linear: same function, weight gradients only.")
    model = copy.deepcopy(raw)
    layer_names = linearize(model, spec["modules"])

    per_side = int(round(spec["per_module_dim"] ** 0.5))
    result["method"] = (f"LoGra {per_side}x{per_side} per module ({len(layer_names)} modules, weights only), "
                        f"Gaussian factors, Identity hessian, offload cpu, {spec.get('precision', 'float32')}, CPU")
    result["n_rows"] = len(doc_rows)
    # Timed as every worker: the second build in the process. The first (cold) pays the lazy imports
    # and Inductor's compilation of LoGra's compressor for every sequence length.
    with measured() as cold:
        build_index(model, layer_names, docs, spec, work / "index_cold")
    result["cold_seconds"] = cold.seconds
    with measured() as m:
        attributor = build_index(model, layer_names, docs, spec, work / "index")
    result["index_seconds"], result["index_peak_bytes"] = m.seconds, m.peak_bytes
    kept = stored_bytes(attributor)
    result["row_width"] = attributor.total_proj_dim
    result["bytes_per_row"] = sum(kept.values()) / len(doc_rows)

    t0 = time.perf_counter()
    scores = {style: attributor.attribute(docs, data).T.double() for style, data in queries.items()}
    result["query_seconds"] = time.perf_counter() - t0
    result["scores"] = {style: s.tolist() for style, s in scores.items()}
    result["scoring"] = "LoGra attribute(docs, queries) with Identity hessian: inner product of projected gradients"

    result["scores_cosine"] = cosine_from_inner(attributor, scores, queries)
    if spec.get("dattri_efim", True):
        result["scores_efim"] = efim_scores(attributor, docs, queries)
    check = conv1d_gradient_check(raw, model, spec["modules"][0], doc_rows[:CHECK_ROWS], pad, work / "check")

    notes += [
        f"Self-check on {spec['modules'][0]}: dattri's unprojected per-row gradients (identity compressors) "
        f"vs autograd on the unmodified Conv1D, Gram matrix of {CHECK_ROWS} rows: max relative difference "
        f"{check:.2e}.",
        "Batch loss = mean over rows of each row's summed completion CE (dattri's hooks rescale by the "
        "batch size); queries go through model(**batch).loss with num_items_in_batch = rows in the batch.",
        "LoGra's compressor is @torch.compile'd (Inductor, cold cache per run) and recompiles as sequence "
        f"lengths change: the first build in the process (cold_seconds) took {result['cold_seconds']:.1f} s, "
        f"the timed second build {result['index_seconds']:.1f} s.",
        f"proj_seed {spec['seed']} set through attributor.sparsifier_kwargs (LoGraAttributor has no seed "
        "argument).",
        "bytes_per_row counts what the cpu offload keeps: "
        + ", ".join(f"{k} {v / len(doc_rows):.0f} B" for k, v in kept.items())
        + " (with the identity hessian the IFVP store is a copy of the gradients).",
        "scores_cosine: the attribute() scores divided by the doc norms (compute_self_attribution) and the "
        "query norms (a second pass through dattri's private _compute_test_gradients, untimed).",
        f"query_seconds covers both query sets ({', '.join(queries)}) scored one after the other.",
    ]
    if "scores_efim" in result:
        notes.append("scores_efim: the same cached doc gradients with hessian='eFIM' (per-module empirical "
                     "Fisher of the projected gradients, damping 1e-5 x trace/dim, dattri's default); untimed.")


if __name__ == "__main__":
    run_worker("dattri", lambda: version("dattri"), run)
