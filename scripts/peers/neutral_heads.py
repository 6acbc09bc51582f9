"""A neutral judge of head circuits: plain PyTorch hooks on a Hugging Face causal LM, no tool's code.

Used to compare the head sets two circuit-discovery tools choose (scripts/bench/bench_lexsi.py):
neither tool's attribution, graph, hooks nor evaluator runs here. Only torch, transformers and
safetensors are imported, and the attention output projection of each layer is found from the
model's own module tree (MODULE_PATHS), not through an adapter of either tool.

For a set S of heads (a (n_layers, n_heads) bool mask, True = kept) on pairs (clean, corrupted):

    m(S)  = mean over pairs of  logit[correct] - logit[incorrect]  at the pair's answer position,
            on the clean prompt, with every head outside S given its value from the corrupted
            prompt (counterfactual patching). A head's value is its slice of the input of the
            attention output projection, (B, T, n_heads * head_dim)[..., h*dh:(h+1)*dh]: what
            that head writes, before the projection mixes the heads.
    F(S)  = (m(S) - m(none)) / (m(all) - m(none))

m(all) is the clean run (no head patched), m(none) patches every head (MLPs and embeddings stay
live: only the choice of heads varies). F = 1: the kept heads recover the full model's logit
difference; 0: no better than no head. Also returned: m(corrupted), the corrupted prompt's own
metric, the baseline of Lexsi's pillars.

    .venv/bin/python scripts/peers/neutral_heads.py MODEL_DIR TASK.safetensors --heads 0.1,3.4
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

# model_type -> (the list of blocks, the attention output projection inside a block): attribute paths
MODULE_PATHS: dict[str, tuple[str, str]] = {
    "gpt2": ("transformer.h", "attn.c_proj"),
    "llama": ("model.layers", "self_attn.o_proj"),
    "mistral": ("model.layers", "self_attn.o_proj"),
    "qwen2": ("model.layers", "self_attn.o_proj"),
    "qwen3": ("model.layers", "self_attn.o_proj"),
}


def _get(obj, path: str):
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def out_projections(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The attention output projection of every layer, in order."""
    kind = model.config.model_type
    if kind not in MODULE_PATHS:
        raise ValueError(f"model_type {kind!r} has no module path here; known: {', '.join(MODULE_PATHS)}")
    blocks, proj = MODULE_PATHS[kind]
    return [_get(block, proj) for block in _get(model, blocks)]


@dataclass
class Pairs:
    """Right-padded clean / corrupted ids with one correct and one incorrect token per pair."""

    clean: torch.Tensor  # (N, T) long
    corrupted: torch.Tensor  # (N, T) long
    mask: torch.Tensor  # (N, T) long, 1 = real token
    answer_pos: torch.Tensor  # (N,) long
    correct: torch.Tensor  # (N,) long
    incorrect: torch.Tensor  # (N,) long

    @classmethod
    def load(cls, path: Path) -> Pairs:
        """A TaskData safetensors file (CircuitKit's field names), one answer token of each kind."""
        from safetensors.torch import load_file

        t = load_file(str(path))
        for key in ("correct", "incorrect"):
            if t[key].shape[1] > 1 and bool((t[key][:, 1:] >= 0).any()):
                raise ValueError(f"{path}: a pair has several {key} tokens; this judge scores one of each")
        return cls(t["clean_ids"], t["corrupted_ids"], t["attention_mask"], t["answer_pos"],
                   t["correct"][:, 0], t["incorrect"][:, 0])

    def __len__(self) -> int:
        return self.clean.shape[0]


class HeadPatcher:
    """Forward pre-hooks on the output projections that replace removed heads' slices.

    `record()` stores each layer's projection input (B, T, H * dh); `patch(removed, values)`
    writes `values[layer][..., h*dh:(h+1)*dh]` into the removed heads' slices.
    """

    def __init__(self, model: torch.nn.Module, n_heads: int) -> None:
        self.projections = out_projections(model)
        self.n_heads = n_heads

    @contextmanager
    def record(self) -> Iterator[list[torch.Tensor]]:
        store: list[torch.Tensor] = [None] * len(self.projections)  # type: ignore[list-item]

        def hook(module, args, layer):
            store[layer] = args[0].detach().clone()

        handles = [p.register_forward_pre_hook(lambda m, a, layer=i: hook(m, a, layer))
                   for i, p in enumerate(self.projections)]
        try:
            yield store
        finally:
            for h in handles:
                h.remove()

    @contextmanager
    def patch(self, removed: torch.Tensor, values: list[torch.Tensor]) -> Iterator[None]:
        handles = []
        for layer, proj in enumerate(self.projections):
            heads = removed[layer].nonzero().flatten().tolist()
            if not heads:
                continue

            def hook(module, args, layer=layer, heads=heads):
                z = args[0].clone()
                dh = z.shape[-1] // self.n_heads
                for h in heads:
                    z[..., h * dh:(h + 1) * dh] = values[layer][..., h * dh:(h + 1) * dh]
                return (z, *args[1:])
            handles.append(proj.register_forward_pre_hook(hook))
        try:
            yield
        finally:
            for h in handles:
                h.remove()


class NeutralJudge:
    """m(S) and F(S) of head sets on fixed pairs (module docstring); corrupted runs recorded once."""

    def __init__(self, model: torch.nn.Module, pairs: Pairs, batch_size: int = 8) -> None:
        self.model, self.pairs = model.eval(), pairs
        self.n_layers, self.n_heads = len(out_projections(model)), model.config.num_attention_heads
        self.patcher = HeadPatcher(model, self.n_heads)
        self.batches = []
        with torch.no_grad():
            for start in range(0, len(pairs), batch_size):
                idx = slice(start, start + batch_size)
                width = int(pairs.mask[idx].sum(1).max())  # trim padding after every row's end
                batch = {k: getattr(pairs, k)[idx] for k in ("correct", "incorrect", "answer_pos")}
                batch.update(clean=pairs.clean[idx, :width], corrupted=pairs.corrupted[idx, :width],
                             mask=pairs.mask[idx, :width])
                with self.patcher.record() as z:
                    corrupted_logits = self._logits(batch["corrupted"], batch["mask"])
                batch["corrupted_z"] = list(z)
                batch["corrupted_metric"] = self._metric(corrupted_logits, batch)
                self.batches.append(batch)
        self.m_corrupted = sum(float(b["corrupted_metric"].sum()) for b in self.batches) / len(pairs)
        all_heads = torch.ones(self.n_layers, self.n_heads, dtype=torch.bool)
        self.m_all, self.m_none = self.metric(all_heads), self.metric(~all_heads)

    def _logits(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=ids, attention_mask=mask).logits.float()

    @staticmethod
    def _metric(logits: torch.Tensor, batch: dict) -> torch.Tensor:
        rows = torch.arange(logits.shape[0])
        at = logits[rows, batch["answer_pos"]]  # (B, vocab)
        return at[rows, batch["correct"]] - at[rows, batch["incorrect"]]

    @torch.no_grad()
    def metric(self, kept: torch.Tensor) -> float:
        """m(kept): mean logit difference with the heads outside `kept` patched from the corrupted run."""
        if tuple(kept.shape) != (self.n_layers, self.n_heads):
            raise ValueError(f"kept has shape {tuple(kept.shape)}; expected ({self.n_layers}, {self.n_heads})")
        total = 0.0
        for b in self.batches:
            with self.patcher.patch(~kept.bool(), b["corrupted_z"]):
                total += float(self._metric(self._logits(b["clean"], b["mask"]), b).sum())
        return total / len(self.pairs)

    def faithfulness(self, kept: torch.Tensor) -> float:
        denom = self.m_all - self.m_none
        return (self.metric(kept) - self.m_none) / denom if abs(denom) > 1e-12 else float("nan")


def top_heads(head_scores: list[list[float]] | torch.Tensor, n_keep: int) -> torch.Tensor:
    """(n_layers, n_heads) bool mask of the n_keep heads of largest |score| (ties: lower index first)."""
    scores = torch.as_tensor(head_scores, dtype=torch.float64)
    mask = torch.zeros(scores.numel(), dtype=torch.bool)
    mask[scores.abs().flatten().argsort(descending=True, stable=True)[:n_keep]] = True
    return mask.view(scores.shape)


def load_model(model_dir: str | Path) -> torch.nn.Module:
    """The HF model in float32, eager attention (hooks see the same projection input under any kernel)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
    return model.eval().requires_grad_(False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("task")
    parser.add_argument("--heads", default="", help="kept heads as LAYER.HEAD, comma-separated")
    args = parser.parse_args()
    model = load_model(args.model)
    judge = NeutralJudge(model, Pairs.load(Path(args.task)))
    kept = torch.zeros(judge.n_layers, judge.n_heads, dtype=torch.bool)
    for item in filter(None, args.heads.split(",")):
        layer, head = map(int, item.split("."))
        kept[layer, head] = True
    print(json.dumps({"m_all": judge.m_all, "m_none": judge.m_none, "m_corrupted": judge.m_corrupted,
                      "m_kept": judge.metric(kept), "faithfulness": judge.faithfulness(kept)}))


if __name__ == "__main__":
    main()
