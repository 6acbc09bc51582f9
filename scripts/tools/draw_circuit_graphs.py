"""Draw the circuit-graph pictures shown in README and docs (docs/images/circuit_graph_*.png/.svg).

Two runs of the pipeline (data -> attribution at edge level -> pruning, which draws the graph):

* the trained induction model (`builtin:induction`), whose circuit is known (L0H2 -> L1H1);
* a GPT-2-small-shaped model (12 layers x 12 heads, d_model 768) with random weights and the
  fixtures' 1024-token vocabulary, built locally: the picture's readability at 12 layers is what
  it shows (its scores are those of random weights).

    python scripts/tools/draw_circuit_graphs.py [--out docs/images] [--work outputs/circuit_graphs]
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import torch

from circuitkit.core.pipeline import make_console
from circuitkit_app.config import compose
from circuitkit_app.stage_list import run_pipeline


def gpt2_small_shape(directory: Path) -> Path:
    """Save a random GPT-2-small-shaped model with the fixtures' tokenizer into `directory`."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from circuitkit.fixtures.models import build_tokenizer

    if (directory / "config.json").is_file():
        return directory
    tok = build_tokenizer()
    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=12, n_head=12, n_embd=768, vocab_size=len(tok), n_positions=256,
                     bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    GPT2LMHeadModel(cfg).save_pretrained(directory)
    tok.save_pretrained(directory)
    return directory


def run(name: str, overrides: list[str], work: Path, out: Path) -> None:
    _, cfg = compose(["stages=[data,attribution,pruning]", "discovery.level=edge", "model.precision=float32",
                      *overrides])
    run_dir = work / name
    run_pipeline(cfg, run_dir, make_console())
    for suffix in (".png", ".svg"):
        shutil.copyfile(run_dir / f"circuit_graph{suffix}", out / f"circuit_graph_{name}{suffix}")
    print(f"wrote {out / f'circuit_graph_{name}.png'} (+ .svg)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("docs/images"))
    parser.add_argument("--work", type=Path, default=Path("outputs/circuit_graphs"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    run("induction", ["model=induction", "discovery.ig_steps=5", "discovery.data_params.num_examples=16",
                      "discovery.data_params.eval_examples=8", "discovery.data_params.seq_len=64",
                      "pruning.target_sparsity=0.75"], args.work, args.out)
    model_dir = gpt2_small_shape(args.work / "gpt2-small-shape-model")
    run("gpt2_small_shape", [f"model.name={model_dir}", "discovery.task=ioi", "discovery.ig_steps=1",
                             "discovery.batch_size=4", "discovery.data_params.num_examples=4",
                             "discovery.data_params.eval_examples=4", "pruning.target_sparsity=0.8",
                             "pruning.graph_top_edges=40"], args.work, args.out)


if __name__ == "__main__":
    main()
