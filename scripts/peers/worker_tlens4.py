"""Peer worker: TransformerLens 4.x attribution patching (EAP) on a local GPT-2, in CircuitKit's names.

Runs under `.venv-tlens4/bin/python` (transformer-lens 4.3.0, transformers >= 5.9); it must not
import circuitkit. Same command line as worker_autocircuit.py:

    python worker_tlens4.py MODEL_DIR TASK_FILE OUT_JSON --algorithm eap --level node|edge [--batch 4]

What transformer-lens 4.3.0 ships for circuit discovery (read in its source,
transformer_lens/tools/analysis/attribution_patching.py): `attribution_patch(model, clean,
corrupt, metric_fn, EdgeAttributionConfig(granularity="node"|"edge", ig_steps=1))` on a
`TransformerBridge`: node and edge attribution patching (EAP) with plain gradients, and
`faithfulness` (ablate every edge outside a circuit). EAP-IG (`ig_steps > 1`) is declared but
raises NotImplementedError in 4.3.0, so only `--algorithm eap` runs. Its convention is the
denoising one: the gradient is taken on the *corrupted* run and multiplied by (clean − corrupted)
activations; CircuitKit's EAP takes the gradient at the clean run. Scores are per pair, averaged
over pairs, per position: summed over positions here (CircuitKit's node score of a head or MLP
is the sum over positions).

The bridge wraps the HF model itself (`TransformerBridge.boot_transformers(MODEL_DIR)`); its
logits are checked against the HF model's.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from importlib.metadata import version
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

LOGIT_TOLERANCE = 1e-4


def our_name(node, side: str) -> str:
    """A transformer-lens Node in CircuitKit's graph names (circuitkit/discovery/attribution/graph.py)."""
    kind, layer, head = node.kind, node.layer, node.head
    names = {"embed": "input", "attn_head_out": f"a{layer}.h{head}", "mlp_out": f"m{layer}",
             "q_input": f"a{layer}.h{head}<q>", "k_input": f"a{layer}.g{head}<k>", "v_input": f"a{layer}.g{head}<v>",
             "mlp_in": f"m{layer}<in>", "logits": "logits"}
    if kind not in names:
        raise ValueError(f"unknown {side} node kind {kind!r}")
    return names[kind]


def run(args: argparse.Namespace) -> dict:
    import torch
    from peak import measured
    from safetensors.torch import load_file
    from transformer_lens.model_bridge import TransformerBridge
    from transformer_lens.tools.analysis.attribution_patching import EdgeAttributionConfig, attribution_patch
    from transformers import AutoModelForCausalLM

    if args.algorithm != "eap":
        raise SystemExit("transformer-lens 4.3.0 implements plain attribution patching only (ig_steps=1);"
                         " EAP-IG raises NotImplementedError")
    t = load_file(args.task)
    clean, corrupt = t["clean_ids"], t["corrupted_ids"]
    answer_pos, correct, incorrect = t["answer_pos"], t["correct"], t["incorrect"]
    hf = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    bridge = TransformerBridge.boot_transformers(args.model, device="cpu", dtype=torch.float32)
    bridge.eval()
    with torch.no_grad():
        ours, theirs = hf(clean[:args.batch]).logits, bridge(clean[:args.batch])
    diff = float((ours - theirs).abs().max())
    if not diff <= LOGIT_TOLERANCE * max(1.0, float(ours.abs().max())):
        raise RuntimeError(f"TransformerBridge logits differ from the HF model's by {diff:.3e}")
    L, H = bridge.cfg.n_layers, bridge.cfg.n_heads
    head = torch.zeros(L, H, dtype=torch.float64)
    mlp = torch.zeros(L, dtype=torch.float64)
    edges: dict[tuple[str, str], float] = {}
    n = clean.shape[0]
    load_before = os.getloadavg()[0]
    with measured() as m:
        cpu0 = time.process_time()
        for i in range(n):  # one pair at a time: each has its own answer position and tokens
            pos, good, bad = int(answer_pos[i]), correct[i][correct[i] >= 0], incorrect[i][incorrect[i] >= 0]

            def metric(logits, pos=pos, good=good, bad=bad):
                row = logits[0, pos] if logits.ndim == 3 else logits[pos]
                return row[good].mean() - row[bad].mean()

            result = attribution_patch(bridge, clean[i:i + 1], corrupt[i:i + 1], metric,
                                       EdgeAttributionConfig(granularity=args.level))
            for node, score in result.node_scores.items():
                if node.kind == "attn_head_out":
                    head[node.layer, node.head] += score / n
                elif node.kind == "mlp_out":
                    mlp[node.layer] += score / n
            for (src, dst), score in result.edge_scores.items():
                key = (our_name(src, "source"), our_name(dst, "destination"))  # summed over positions
                edges[key] = edges.get(key, 0.0) + score / n
        cpu_seconds = time.process_time() - cpu0
    out = {"tool": "transformer-lens-4", "algorithm": args.algorithm, "level": args.level, "seconds": m.seconds,
           "peak_bytes": m.peak_bytes, "cpu_seconds": cpu_seconds, "loadavg_1min": [load_before, os.getloadavg()[0]],
           "grad_passes_per_batch": 1, "n_batches": n, "max_logit_diff_vs_hf": diff,
           "threads": torch.get_num_threads(),
           "versions": {name: version(name) for name in ("transformer-lens", "transformers", "torch")},
           "call": f"attribution_patch(bridge, clean, corrupt, logit_diff, EdgeAttributionConfig(granularity="
                   f"'{args.level}')) per pair, node scores summed over positions",
           "head": head.tolist(), "mlp": mlp.tolist()}
    if edges:
        out["edges"] = [(up, down, score) for (up, down), score in sorted(edges.items())]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("task")
    parser.add_argument("out")
    parser.add_argument("--algorithm", choices=("eap", "eap-ig"), required=True)
    parser.add_argument("--level", choices=("node", "edge"), required=True)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--batch", type=int, default=4)
    args = parser.parse_args()
    Path(args.out).write_text(json.dumps(run(args)))


if __name__ == "__main__":
    main()
