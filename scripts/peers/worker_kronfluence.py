"""Benchmark worker for Kronfluence (EK-FAC influence functions) on a Hugging Face causal LM.

    .venv-kronfluence/bin/python scripts/peers/worker_kronfluence.py --spec SPEC.json --out RESULT.json

What runs (the contract is in scripts/peers/lmdata.py):

* `Analyzer.fit_all_factors` with `FactorArguments(strategy="ekfac")` (Kronfluence's default: the
  true Fisher, labels sampled from the model's own predictions) over the docs, then
  `compute_pairwise_scores` of the queries against the docs. Kronfluence does not project: its
  factors are over the modules' full input and output dimensions.
* Loss, per row: the sum of the completion tokens' cross-entropies (`compute_train_loss`);
  the measurement of a query is the same summed cross-entropy (`compute_measurement`), so a
  positive score means "training on the doc lowers the query's loss", as for every tool here.
* Kronfluence tracks `nn.Linear` / `nn.Conv2d` only, and GPT-2's projections are transformers'
  `Conv1D`: each named module is replaced by the same function as a bias-free `nn.Linear` plus a
  separate bias (as worker_dattri.py does), tracked as `<module>.linear`.
* `scores`: damping `ScoreArguments.damping_factor=None` (Kronfluence's heuristic, 0.1 x the mean
  eigenvalue: Gradian's rule); `scores_default_damping`: Kronfluence's default damping 1e-8.
* `spec["empirical_fisher"]` (optional): also fit the factors with `use_empirical_fisher=True`
  (the data's labels, as Gradian's factors) and score with the heuristic damping: `scores_empirical`.
"""

from __future__ import annotations

import sys
import time
from functools import partial
from importlib.metadata import version
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from lmdata import collate, load_model_and_tokenizer, load_rows, pad_id, run_worker, tool_imports  # noqa: E402
from torch import nn  # noqa: E402
from transformers.pytorch_utils import Conv1D  # noqa: E402

with tool_imports("kronfluence"):
    from kronfluence.analyzer import Analyzer, prepare_model
    from kronfluence.arguments import FactorArguments, ScoreArguments
    from kronfluence.task import Task
    from kronfluence.utils.dataset import DataLoaderKwargs


class BiasFreeLinear(nn.Module):
    """y = x @ W^T + b as a bias-free nn.Linear plus a bias, so the tracked module is the weight alone."""

    def __init__(self, weight_out_in: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        out_features, in_features = weight_out_in.shape
        self.linear = nn.Linear(in_features, out_features, bias=False, dtype=weight_out_in.dtype)
        self.linear.weight.data.copy_(weight_out_in)
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x)
        return y if self.bias is None else y + self.bias


def linearize(model: nn.Module, modules: list[str]) -> list[str]:
    """Replace each named Conv1D by a BiasFreeLinear (nn.Linear kept as is); the names to track."""
    for p in model.parameters():
        p.requires_grad_(False)
    tracked = []
    for name in modules:
        old = model.get_submodule(name)
        if isinstance(old, nn.Linear):
            old.weight.requires_grad_(True)
            tracked.append(name)
            continue
        if not isinstance(old, Conv1D):
            raise TypeError(f"{name} is {type(old).__name__}, neither nn.Linear nor Conv1D")
        parent_name, _, child = name.rpartition(".")
        new = BiasFreeLinear(old.weight.detach().T, getattr(old, "bias", None))
        new.linear.weight.requires_grad_(True)
        setattr(model.get_submodule(parent_name), child, new)
        tracked.append(f"{name}.linear")
    return tracked


def summed_ce(model: nn.Module, batch: dict[str, torch.Tensor], sample: bool = False) -> torch.Tensor:
    """Σ over rows and supervised tokens of the next-token cross-entropy (labels sampled if asked)."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.float()
    logits, labels = logits[:, :-1], batch["labels"][:, 1:]
    mask = labels != -100
    flat = logits[mask]
    if sample:
        with torch.no_grad():
            targets = torch.multinomial(torch.softmax(flat, dim=-1), 1).flatten()
    else:
        targets = labels[mask]
    return torch.nn.functional.cross_entropy(flat, targets, reduction="sum")


class LMTask(Task):
    def __init__(self, tracked: list[str]) -> None:
        super().__init__()
        self.tracked = tracked

    def compute_train_loss(self, batch: Any, model: nn.Module, sample: bool = False) -> torch.Tensor:
        return summed_ce(model, batch, sample)

    def compute_measurement(self, batch: Any, model: nn.Module) -> torch.Tensor:
        return summed_ce(model, batch)

    def get_influence_tracked_modules(self) -> list[str]:
        return self.tracked

    def get_attention_mask(self, batch: Any) -> torch.Tensor:
        return batch["attention_mask"]


def run(spec: dict[str, Any], result: dict[str, Any]) -> None:
    torch.manual_seed(spec["seed"])
    model, tokenizer = load_model_and_tokenizer(spec["model_dir"])
    pad = pad_id(tokenizer)
    docs = load_rows(spec["docs"], tokenizer, spec["max_length"])
    queries = {style: load_rows(path, tokenizer, spec["max_length"]) for style, path in spec["queries"].items()}
    tracked = linearize(model, spec["modules"])
    task = LMTask(tracked)
    model = prepare_model(model, task)
    work = Path(spec["work_dir"])
    analyzer = Analyzer(analysis_name="bench", model=model, task=task, cpu=True, disable_tqdm=True,
                        output_dir=str(work / "kronfluence"))
    analyzer.set_dataloader_kwargs(DataLoaderKwargs(collate_fn=partial(collate, pad=pad)))
    result["method"] = "EK-FAC (true Fisher, full dimensions, no projection)"
    result["n_rows"] = len(docs)
    t0 = time.perf_counter()
    analyzer.fit_all_factors(factors_name="ekfac", dataset=docs, per_device_batch_size=spec["batch_size"],
                             factor_args=FactorArguments(strategy="ekfac"), overwrite_output_dir=True)
    result["index_seconds"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    scores: dict[str, dict[str, list]] = {"heuristic": {}, "default": {}}
    for label, damping in (("heuristic", None), ("default", 1e-8)):
        for style, rows in queries.items():
            name = f"scores_{label}_{style}"
            analyzer.compute_pairwise_scores(scores_name=name, factors_name="ekfac", query_dataset=rows,
                                             train_dataset=docs, per_device_query_batch_size=spec["batch_size"],
                                             per_device_train_batch_size=spec["batch_size"],
                                             score_args=ScoreArguments(damping_factor=damping),
                                             overwrite_output_dir=True)
            scores[label][style] = analyzer.load_pairwise_scores(name)["all_modules"].double().tolist()
        if label == "heuristic":
            result["query_seconds"] = time.perf_counter() - t0
    result["scores"] = scores["heuristic"]
    result["scores_default_damping"] = scores["default"]
    if spec.get("empirical_fisher"):
        analyzer.fit_all_factors(factors_name="ekfac_emp", dataset=docs, per_device_batch_size=spec["batch_size"],
                                 factor_args=FactorArguments(strategy="ekfac", use_empirical_fisher=True),
                                 overwrite_output_dir=True)
        result["scores_empirical"] = {}
        for style, rows in queries.items():
            name = f"scores_emp_{style}"
            analyzer.compute_pairwise_scores(scores_name=name, factors_name="ekfac_emp", query_dataset=rows,
                                             train_dataset=docs, per_device_query_batch_size=spec["batch_size"],
                                             per_device_train_batch_size=spec["batch_size"],
                                             score_args=ScoreArguments(damping_factor=None), overwrite_output_dir=True)
            result["scores_empirical"][style] = analyzer.load_pairwise_scores(name)["all_modules"].double().tolist()
    result["scoring"] = "Kronfluence pairwise influence, EK-FAC, damping 0.1 x mean eigenvalue (damping_factor=None)"
    result["notes"] = [f"tracked modules: {', '.join(tracked)}",
                       "scores_default_damping: the same factors with Kronfluence's default damping_factor 1e-8"]


if __name__ == "__main__":
    run_worker("kronfluence", lambda: version("kronfluence"), run)
