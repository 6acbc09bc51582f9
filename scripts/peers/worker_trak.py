"""Benchmark worker for TRAK (PyPI `traker`, import `trak`) on a Hugging Face causal LM, on CPU.

    .venv-peers/bin/python scripts/peers/worker_trak.py --spec SPEC.json --out RESULT.json

What runs (the contract is in scripts/peers/lmdata.py and the benchmark's orchestrator):

* `TRAKer(device="cpu", use_half_precision=False)` with a `BasicProjector` (Gaussian, as TRAKer picks on CPU) of
  `total_dim` columns over the weights of `spec["modules"]` (`grad_wrt`), seed `spec["seed"]`.
* Model output, TRAK's convention for language models: per row, the sum over completion tokens of
  the log-odds log(p / (1 - p)) of the target token; out-to-loss gradient Q = the mean over those
  tokens of (1 - p), the per-token dloss/dmargin of the cross-entropy.
* Index (timed, peak memory): TRAKer construction, `load_checkpoint`, `featurize` over the docs,
  `finalize_features`. Query: `start_scoring_checkpoint` + `score` + `finalize_scores` per query set.
* A second score, `scores_cosine`: cosine of TRAK's projected gradients (its `grads` store for the
  docs, `<exp>_grads` for the queries), i.e. the same features without (X^T X)^-1 and Q.
"""

from __future__ import annotations

import shutil
import sys
import time
from importlib.metadata import version
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from lmdata import (  # noqa: E402
    IGNORE,
    batches,
    cosine_scores,
    load_model_and_tokenizer,
    load_rows,
    pad_id,
    run_worker,
    tool_imports,
)
from peak import measured  # noqa: E402

with tool_imports("traker"):
    from trak import TRAKer
    from trak.gradient_computers import FunctionalGradientComputer
    from trak.modelout_functions import AbstractModelOutput
    from trak.projectors import BasicProjector, ProjectionType

MODEL_ID = 0  # one checkpoint


def causal_mask_4d(attention_mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(B, 1, T, T) additive mask: 0 where a query may attend (causal, not padding), dtype-min elsewhere.

    Handed to the model already 4-D, transformers uses it as is; from a 2-D mask it would build one
    with data-dependent branches (`padding_mask.all()`), which torch.func.vmap cannot trace. Additive
    rather than boolean because eager attention adds the mask to the scores.
    """
    t = attention_mask.shape[-1]
    causal = torch.ones(t, t, dtype=torch.bool, device=attention_mask.device).tril()
    allowed = (causal & attention_mask.bool()[:, None, :])[:, None]
    return torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)


def target_margins(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-odds of each next-token target and the supervision mask, both (B, T-1).

    log(p / (1 - p)) = logit[target] - logsumexp(logits of all other tokens).
    """
    logits = logits[:, :-1]  # (B, T-1, V): position t predicts token t+1
    targets = labels[:, 1:]
    supervised = targets != IGNORE
    safe = targets.clamp(min=0)[..., None]  # (B, T-1, 1)
    correct = logits.gather(-1, safe).squeeze(-1)
    others = logits.scatter(-1, safe, float("-inf")).logsumexp(-1)
    return (correct - others) * supervised, supervised


class CausalLMModelOutput(AbstractModelOutput):
    """TRAK model output for completion rows: summed log-odds of the completion tokens."""

    def __init__(self) -> None:
        super().__init__()

    @staticmethod
    def get_output(model: torch.nn.Module, weights: dict, buffers: dict, input_ids: torch.Tensor,
                   attention_mask: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """f(z, theta) for ONE row (no batch dim; TRAK vmaps over the batch): sum of target log-odds."""
        mask = causal_mask_4d(attention_mask[None], next(iter(weights.values())).dtype)
        logits = torch.func.functional_call(model, (weights, buffers), args=(),
                                            kwargs={"input_ids": input_ids[None], "attention_mask": mask,
                                                    "use_cache": False}).logits
        margins, _ = target_margins(logits, labels[None])
        return margins.sum()

    def get_out_to_loss_grad(self, model: torch.nn.Module, weights: dict, buffers: dict,
                             batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """Q, (B, 1): mean over completion tokens of (1 - p(target)); the loss is CE = log(1 + e^-margin)."""
        input_ids, attention_mask, labels = batch
        with torch.no_grad():
            logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits
            margins, supervised = target_margins(logits, labels)
            one_minus_p = torch.sigmoid(-margins) * supervised
            q = one_minus_p.sum(1) / supervised.sum(1).clamp(min=1)
        return q[:, None]


class WrtOnlyGradientComputer(FunctionalGradientComputer):
    """TRAK's vmap gradient computer, differentiating only the `grad_wrt` weights.

    The stock class differentiates every parameter per example and then deletes those not in
    `grad_wrt`; here the other parameters are left to the module (constants to torch.func.grad), so
    the per-example gradients of the embedding matrix etc. are never materialised. Same values.
    """

    def __init__(self, model: torch.nn.Module, task: AbstractModelOutput, grad_dim: int, dtype: torch.dtype,
                 device: Any, grad_wrt: list[str] | None = None) -> None:
        super().__init__(model, task, grad_dim, dtype, device, grad_wrt)
        self.load_model_params(model)  # the parent loads before it knows grad_wrt

    def load_model_params(self, model: torch.nn.Module) -> None:
        wrt = getattr(self, "grad_wrt", None)
        self.func_weights = {n: p for n, p in model.named_parameters() if wrt is None or n in wrt}
        self.func_buffers = dict(model.named_buffers())


def trak_batches(rows: list, batch_size: int, pad: int):
    """Batches as the (input_ids, attention_mask, labels) tuples TRAK's model output unpacks."""
    for b in batches(rows, batch_size, pad):
        yield b["input_ids"], b["attention_mask"], b["labels"]


def weight_names(model: torch.nn.Module, modules: list[str]) -> list[str]:
    """`<module>.weight` for each module, checked against the model's parameters."""
    params = dict(model.named_parameters())
    names = [f"{m}.weight" for m in modules]
    missing = [n for n in names if n not in params]
    if missing:
        raise KeyError(f"no parameter {missing[0]} in the model; modules must name weight-bearing modules")
    return names


def build_index(model, doc_rows, spec, save_dir: Path, grad_wrt: list[str], pad: int) -> tuple[TRAKer, list[float]]:
    """TRAKer over the docs: featurize every batch, then finalize_features. Returns it and per-batch seconds."""
    grad_dim = sum(dict(model.named_parameters())[n].numel() for n in grad_wrt)
    projector = BasicProjector(grad_dim=grad_dim, proj_dim=spec["total_dim"], seed=spec["seed"],
                               proj_type=ProjectionType.normal, device="cpu", dtype=torch.float32)
    traker = TRAKer(model=model, task=CausalLMModelOutput(), train_set_size=len(doc_rows), save_dir=str(save_dir),
                    device="cpu", gradient_computer=WrtOnlyGradientComputer,
                    projector=projector, use_half_precision=False, grad_wrt=grad_wrt,
                    projector_seed=spec["seed"], logging_level=40)
    traker.load_checkpoint(model.state_dict(), model_id=MODEL_ID)
    per_batch = []
    for batch in trak_batches(doc_rows, spec["batch_size"], pad):
        t0 = time.perf_counter()
        traker.featurize(batch=batch, num_samples=batch[0].shape[0])
        per_batch.append(time.perf_counter() - t0)
    traker.score_computer.lambda_reg = ridge(traker.saver.current_store["grads"])
    traker.finalize_features()
    return traker, per_batch


def ridge(grads: np.ndarray) -> float:
    """lambda_reg for (X^T X + lambda I)^-1: the mean diagonal entry of X^T X, trace / proj_dim.

    TRAK's default is 0, and X^T X (proj_dim x proj_dim) is singular whenever there are fewer docs
    than proj_dim, which makes its scores noise. This scale is fixed in advance, not tuned on the
    benchmark: about a tenth of the mean non-zero eigenvalue when n_docs = proj_dim / 10.
    """
    x = torch.from_numpy(np.asarray(grads, dtype=np.float64))
    return float((x * x).sum() / x.shape[1])


def score_queries(traker: TRAKer, model, rows, spec, exp_name: str, pad: int) -> np.ndarray:
    """TRAK scores (n_queries, n_docs) of one query set."""
    traker.start_scoring_checkpoint(exp_name=exp_name, checkpoint=model.state_dict(), model_id=MODEL_ID,
                                    num_targets=len(rows))
    for batch in trak_batches(rows, spec["batch_size"], pad):
        traker.score(batch=batch, num_samples=batch[0].shape[0])
    scores = traker.finalize_scores(exp_name=exp_name)  # (n_docs, n_queries)
    return np.asarray(scores, dtype=np.float64).T


def stored_bytes(model_dir: Path) -> dict[str, int]:
    """Size of every file TRAK keeps for the docs of one checkpoint (call before scoring adds query files)."""
    return {p.name: p.stat().st_size for p in model_dir.iterdir() if p.is_file()}


def projected_cosine(model_dir: Path, styles: list[str]) -> dict[str, list[list[float]]]:
    """Cosine (n_queries, n_docs) of the projected gradients TRAK stored for docs and each query set."""
    docs = torch.from_numpy(np.load(model_dir / "grads.mmap", mmap_mode="r")[:].copy())
    return {style: cosine_scores(torch.from_numpy(np.load(model_dir / f"{style}_grads.mmap", mmap_mode="r")[:].copy()),
                                 docs) for style in styles}


def projection_cost(grad_dim: int, spec: dict, proj_type: ProjectionType, n_rows: int, repeats: int = 1) -> float:
    """Seconds BasicProjector takes to project one batch of `n_rows` gradients (sketch regenerated per call)."""
    proj = BasicProjector(grad_dim=grad_dim, proj_dim=spec["total_dim"], seed=spec["seed"],
                          proj_type=proj_type, device="cpu", dtype=torch.float32)
    grads = torch.randn(n_rows, grad_dim)
    t0 = time.perf_counter()
    for _ in range(repeats):
        proj.project(grads, model_id=MODEL_ID)
    return (time.perf_counter() - t0) / repeats


def run(spec: dict[str, Any], result: dict[str, Any]) -> None:
    torch.manual_seed(spec["seed"])
    model, tokenizer = load_model_and_tokenizer(spec["model_dir"])
    for p in model.parameters():
        p.requires_grad_(False)  # grads come from torch.func over grad_wrt only
    pad = pad_id(tokenizer)
    grad_wrt = weight_names(model, spec["modules"])
    grad_dim = sum(dict(model.named_parameters())[n].numel() for n in grad_wrt)
    doc_rows = load_rows(spec["docs"], tokenizer, spec["max_length"])
    save_dir = Path(spec["work_dir"]) / "trak"
    shutil.rmtree(save_dir, ignore_errors=True)
    shutil.rmtree(save_dir.with_name("trak_warmup"), ignore_errors=True)

    result["method"] = (f"TRAK, BasicProjector normal {spec['total_dim']} over {grad_dim} weight grads "
                        f"of {len(grad_wrt)} modules, vmap (FunctionalGradientComputer), float32, CPU")
    result["n_rows"] = len(doc_rows)
    # Warm-up, as every worker does before the timed build: the first batches pay the lazy imports
    # and functorch's first traces (TRAK's cost is its per-batch sketch, so two batches suffice).
    warmup_rows = doc_rows[:2 * spec["batch_size"]]
    with measured() as cold:
        build_index(model, warmup_rows, spec, save_dir.with_name("trak_warmup"), grad_wrt, pad)
    result["cold_seconds"] = cold.seconds
    with measured() as m:
        traker, per_batch = build_index(model, doc_rows, spec, save_dir, grad_wrt, pad)
    result["index_seconds"], result["index_peak_bytes"] = m.seconds, m.peak_bytes

    files = stored_bytes(save_dir / str(MODEL_ID))
    result["row_width"] = spec["total_dim"]
    result["bytes_per_row"] = sum(files.values()) / len(doc_rows)

    scores, t0 = {}, time.perf_counter()
    for style, path in spec["queries"].items():
        scores[style] = score_queries(traker, model, load_rows(path, tokenizer, spec["max_length"]), spec,
                                      style, pad).tolist()
    result["query_seconds"] = time.perf_counter() - t0
    result["scores"] = scores
    result["scores_cosine"] = projected_cosine(save_dir / str(MODEL_ID), list(spec["queries"]))
    lam = traker.score_computer.lambda_reg
    result["scoring"] = ("TRAK score (featurize + finalize_features + score + finalize_scores): "
                         f"phi_q . (Phi^T Phi + lambda I)^-1 phi_doc * Q_doc, lambda_reg {lam:.4g} = trace/proj_dim")

    proj_s = {t: projection_cost(grad_dim, spec, t, spec["batch_size"]) for t in ProjectionType}
    result["notes"] = [
        "HF GPT-2 runs under TRAK's vmap gradient computer once the attention mask is handed over 4-D "
        "(causal & padding, additive): from a 2-D mask transformers builds the mask with data-dependent "
        "branches that vmap rejects ('padding_mask.all()'); IterativeGradientComputer was not needed.",
        "Gradients restricted to the modules' weights via grad_wrt (gradient dim "
        f"{grad_dim}); the vmap computer is a 10-line subclass that differentiates only those weights, "
        "since the stock one differentiates every parameter per example and then drops the rest.",
        f"lambda_reg {lam:.4g} (trace(Phi^T Phi) / proj_dim), set on the score computer before "
        "finalize_features; TRAK's default 0 leaves (Phi^T Phi)^-1 singular with "
        f"{len(doc_rows)} docs < proj_dim {spec['total_dim']}, and its scores are then at chance or below.",
        "Model output: sum over completion tokens (and EOS) of log(p/(1-p)) of the target token; "
        "Q = mean over those tokens of (1 - p).",
        "use_half_precision=False (float32 store). BasicProjector (TRAK's CPU projector, block_size 100) "
        "regenerates its sketch for every batch and dominates the time: per batch of "
        f"{spec['batch_size']} rows {proj_s[ProjectionType.normal]:.2f} s with the Gaussian sketch used here "
        f"(TRAKer's own choice on CPU), {proj_s[ProjectionType.rademacher]:.2f} s with Rademacher; "
        f"featurize per batch, median {sorted(per_batch)[len(per_batch) // 2]:.2f} s.",
        "bytes_per_row counts every file TRAK keeps per checkpoint: "
        + ", ".join(f"{k} {v / len(doc_rows):.0f} B" for k, v in sorted(files.items()))
        + "; finalize_features keeps grads (needed for scores_cosine), features alone would be "
        f"{4 * spec['total_dim']} B.",
        "scores_cosine: cosine of the projected gradients TRAK stores (grads.mmap and <exp>_grads.mmap).",
        f"query_seconds covers both query sets ({', '.join(spec['queries'])}) scored one after the other.",
    ]


if __name__ == "__main__":
    run_worker("traker", lambda: version("traker"), run)
