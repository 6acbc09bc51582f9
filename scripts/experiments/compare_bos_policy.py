"""How much the BOS token policy changes a circuit: edge and node Spearman between
`discovery.data_params.prepend_bos=true` and `false`, same pairs otherwise.

    python scripts/experiments/compare_bos_policy.py [--task ioi] [--model builtin:tiny-gpt2] [--n 32]
"""

from __future__ import annotations

import argparse
import io
import tempfile

from rich.console import Console
from scipy.stats import spearmanr

from circuitkit.discovery.attribution import load_scores
from circuitkit_app.config import compose
from circuitkit_app.stage_list import run_pipeline


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", default="ioi")
    parser.add_argument("--model", default="builtin:tiny-gpt2")
    parser.add_argument("--n", type=int, default=32)
    args = parser.parse_args()
    scores = {}
    with tempfile.TemporaryDirectory() as work:
        for bos in ("true", "false"):
            _, cfg = compose(["stages=[data,attribution]", "model.precision=float32", f"model.name={args.model}",
                              f"discovery.task={args.task}", "discovery.level=edge", "discovery.ig_steps=5",
                              f"discovery.data_params.num_examples={args.n}",
                              f"discovery.data_params.prepend_bos={bos}"])
            run_pipeline(cfg, f"{work}/{bos}", Console(file=io.StringIO()))
            scores[bos] = load_scores(f"{work}/{bos}/scores.safetensors")
    exists = scores["true"].graph.edge_mask()
    edge = spearmanr(scores["true"].edges[exists], scores["false"].edges[exists]).statistic
    node = spearmanr(scores["true"].head.flatten(), scores["false"].head.flatten()).statistic
    print(f"{args.model}, {args.task}, {args.n} pairs, EAP-IG m=5: prepend_bos true vs false:"
          f" edge Spearman {edge:.3f}, head-node Spearman {node:.3f}")


if __name__ == "__main__":
    main()
