"""Peer worker: auto-circuit's EAP / EAP-IG on a local GPT-2, scores written in CircuitKit's names.

Runs under `.venv-autocircuit/bin/python` (auto-circuit 1.0.1, transformer-lens 2.x,
transformers 4.x); it must not import circuitkit. One attribution per process, so each is
measured from the same fresh state (`peak.measured`: wall time and peak resident memory added):

    python worker_autocircuit.py MODEL_DIR TASK_FILE OUT_JSON --algorithm eap|eap-ig --level node|edge
                                 [--steps 5] [--batch 4]

MODEL_DIR holds a GPT2LMHeadModel saved with `save_pretrained`; TASK_FILE a safetensors file
of CircuitKit's TaskData fields (clean_ids, corrupted_ids, attention_mask, answer_pos, correct,
incorrect; (N, T) rows of one length, answers padded with -1).

The HookedTransformer is built without the hub: its config from the HF config, the weights by
transformer-lens's GPT-2 conversion, with no LayerNorm folding, centering or bias folding, so
it computes the HF model's function; its logits are checked against the HF model's.

Both methods are auto-circuit's `mask_gradient_prune_scores` (resample ablation from the
corrupted prompt, logit-difference gradient at the last position):
  eap     mask_val=0: the gradient at the clean run ("exactly equivalent" to their
          edge_attribution_patching_prune_scores, per their docstring)
  eap-ig  integrated_grad_samples=steps: masks at k/steps, k = 0..steps (steps + 1 passes)
Edge level uses their factorized graph (separate Q/K/V inputs per head); node level their
unfactorized ("residual") graph, where the edge from head (l, h) to the next residual node
carries the gradient at that head's output, i.e. a node score. Their scores are sums over
batches of batch means (and, for IG, over points); they are divided here by batches and points
so they are means over examples, as CircuitKit's are.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from importlib.metadata import version
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from peak import measured  # noqa: E402

LOGIT_TOLERANCE = 1e-4  # max |HF - HookedTransformer| logit difference, relative to max(1, |logits|)


# -- names: auto-circuit's nodes -> CircuitKit's graph (circuitkit/discovery/attribution/graph.py) ---------

def our_upstream(src_name: str) -> str:
    """auto-circuit factorized source name -> CircuitKit upstream name.

    "Resid Start" -> "input", "A3.7" -> "a3.h7", "MLP 3" -> "m3".
    """
    if src_name == "Resid Start":
        return "input"
    if m := re.fullmatch(r"A(\d+)\.(\d+)", src_name):
        return f"a{m[1]}.h{m[2]}"
    if m := re.fullmatch(r"MLP (\d+)", src_name):
        return f"m{m[1]}"
    raise ValueError(f"unknown auto-circuit source node {src_name!r}")


def our_downstream(dest_name: str) -> str:
    """auto-circuit factorized destination name -> CircuitKit downstream name.

    "A3.7.Q" -> "a3.h7<q>", "A3.7.K" -> "a3.g7<k>", "A3.7.V" -> "a3.g7<v>" (GPT-2: one KV head
    per head), "MLP 3" -> "m3<in>", "Resid End" -> "logits".
    """
    if dest_name == "Resid End":
        return "logits"
    if m := re.fullmatch(r"A(\d+)\.(\d+)\.([QKV])", dest_name):
        layer, head, letter = m[1], m[2], m[3].lower()
        return f"a{layer}.h{head}<q>" if letter == "q" else f"a{layer}.g{head}<{letter}>"
    if m := re.fullmatch(r"MLP (\d+)", dest_name):
        return f"m{m[1]}<in>"
    raise ValueError(f"unknown auto-circuit destination node {dest_name!r}")


def node_of_residual_edge(src_name: str, dest_name: str) -> tuple[str, int, int] | None:
    """An unfactorized-graph edge that carries a node score -> ("head", layer, head) or ("mlp", layer, 0).

    Head (l, h) writes to "Resid Mid l", MLP l to "Resid Post l" (or "Resid End" in the last
    layer); the residual-to-residual edges (the skip paths) carry no node score: None.
    """
    if m := re.fullmatch(r"A(\d+)\.(\d+)", src_name):
        if dest_name == f"Resid Mid {m[1]}":
            return "head", int(m[1]), int(m[2])
    if m := re.fullmatch(r"MLP (\d+)", src_name):
        if dest_name in (f"Resid Post {m[1]}", "Resid End"):
            return "mlp", int(m[1]), 0
    return None


# -- model ----------------------------------------------------------------------------------

def hooked_gpt2(model_dir: Path, level: str, clean_ids):
    """HookedTransformer with the HF GPT-2's exact function, configured for auto-circuit's `level` graph.

    Returns (model, max_logit_diff). Fails when the logits differ from the HF model's.
    """
    import torch
    from transformer_lens import HookedTransformer, HookedTransformerConfig
    from transformer_lens.pretrained.weight_conversions.gpt2 import convert_gpt2_weights
    from transformers import GPT2LMHeadModel

    hf = GPT2LMHeadModel.from_pretrained(model_dir, dtype=torch.float32).eval()
    hc = hf.config
    cfg = HookedTransformerConfig(
        n_layers=hc.n_layer, d_model=hc.n_embd, n_ctx=hc.n_positions, d_head=hc.n_embd // hc.n_head,
        n_heads=hc.n_head, d_mlp=hc.n_inner or 4 * hc.n_embd, d_vocab=hc.vocab_size,
        act_fn=hc.activation_function,
        eps=hc.layer_norm_epsilon, use_attn_scale=hc.scale_attn_weights,
        scale_attn_by_inverse_layer_idx=hc.scale_attn_by_inverse_layer_idx, normalization_type="LN",
        positional_embedding_type="standard", original_architecture="GPT2LMHeadModel", init_weights=False,
        dtype=torch.float32, device="cpu",
        # what auto-circuit needs (as its own load_tl_model sets): per-head outputs, and at edge
        # level separate Q/K/V inputs per head and the MLP input before its LayerNorm
        use_attn_result=True, use_split_qkv_input=level == "edge", use_hook_mlp_in=level == "edge",
    )
    model = HookedTransformer(cfg)
    model.load_and_process_state_dict(convert_gpt2_weights(hf, cfg), fold_ln=False,
                                      center_writing_weights=False, center_unembed=False,
                                      fold_value_biases=False)
    model.eval()
    model.requires_grad_(False)  # as auto-circuit's load_tl_model: only the masks get gradients
    with torch.no_grad():
        ours, theirs = hf(clean_ids).logits, model(clean_ids)
    diff = float((ours - theirs).abs().max())
    scale = max(1.0, float(ours.abs().max()))
    if not diff <= LOGIT_TOLERANCE * scale:
        raise RuntimeError(f"HookedTransformer logits differ from the HF model's by {diff:.3e} "
                           f"(allowed {LOGIT_TOLERANCE * scale:.1e}): the conversion does not compute "
                           "the same function")
    del hf
    return model, diff


# -- data -----------------------------------------------------------------------------------

def prompt_loader(task_file: Path, batch_size: int):
    """auto-circuit PromptDataLoader over the task's pairs (no padding; answer at the last position)."""
    from auto_circuit.data import PromptDataLoader, PromptDataset
    from safetensors.torch import load_file

    t = load_file(str(task_file))
    n, seq = t["clean_ids"].shape
    if not bool((t["attention_mask"] == 1).all()):
        raise ValueError("auto-circuit takes no attention mask: every row must be unpadded "
                         "(attention_mask all 1)")
    if not bool((t["answer_pos"] == seq - 1).all()):
        raise ValueError("auto-circuit scores the last position (slice_output='last_seq'): "
                         f"answer_pos must be {seq - 1} in every row")
    if n % batch_size:
        raise ValueError(f"{n} pairs do not split into batches of {batch_size}: auto-circuit would drop "
                         "the last batch; use a pair count that is a multiple of the batch size")
    answers = [row[row >= 0] for row in t["correct"]]
    wrong = [row[row >= 0] for row in t["incorrect"]]
    dataset = PromptDataset(t["clean_ids"], t["corrupted_ids"], answers, wrong)
    loader = PromptDataLoader(dataset, seq_len=seq, diverge_idx=0, batch_size=batch_size, shuffle=False)
    return loader, t["clean_ids"][:batch_size]


# -- scores ---------------------------------------------------------------------------------

def edge_list(model, prune_scores: dict, scale: float) -> list[tuple[str, str, float]]:
    """Every factorized edge as (our upstream, our downstream, score * scale)."""
    return [(our_upstream(e.src.name), our_downstream(e.dest.name),
             float(e.prune_score(prune_scores)) * scale) for e in model.edges]


def node_table(model, prune_scores: dict, scale: float, n_layers: int, n_heads: int) -> tuple[list, list]:
    """Head [L][H] and MLP [L] scores from the unfactorized graph's node-output edges."""
    head = [[0.0] * n_heads for _ in range(n_layers)]
    mlp = [0.0] * n_layers
    for e in model.edges:
        node = node_of_residual_edge(e.src.name, e.dest.name)
        if node is None:
            continue
        value = float(e.prune_score(prune_scores)) * scale
        kind, layer, h = node
        if kind == "head":
            head[layer][h] = value
        else:
            mlp[layer] = value
    return head, mlp


def outgoing_sums(edges: list[tuple[str, str, float]], n_layers: int, n_heads: int) -> tuple[list, list]:
    """Head [L][H] and MLP [L] scores as the sum of each node's outgoing edge scores."""
    totals: dict[str, float] = {}
    for up, _, score in edges:
        totals[up] = totals.get(up, 0.0) + score
    head = [[totals.get(f"a{layer}.h{h}", 0.0) for h in range(n_heads)] for layer in range(n_layers)]
    mlp = [totals.get(f"m{layer}", 0.0) for layer in range(n_layers)]
    return head, mlp


def run(args: argparse.Namespace) -> dict:
    """Build, attribute (measured), and convert the scores; the JSON-ready result."""
    import torch
    from auto_circuit.prune_algos.mask_gradient import mask_gradient_prune_scores
    from auto_circuit.utils.graph_utils import patchable_model

    loader, first_clean = prompt_loader(Path(args.task), args.batch)
    model, logit_diff = hooked_gpt2(Path(args.model), args.level, first_clean)
    L, H = model.cfg.n_layers, model.cfg.n_heads
    edge_level = args.level == "edge"
    patchable = patchable_model(model, factorized=edge_level, slice_output="last_seq", seq_len=None,
                                separate_qkv=edge_level, device=torch.device("cpu"))
    ig = args.algorithm == "eap-ig"
    kwargs = {"integrated_grad_samples": args.steps} if ig else {"mask_val": 0.0}
    load_before = os.getloadavg()[0]
    with measured() as m:
        cpu0 = time.process_time()
        prune_scores = mask_gradient_prune_scores(patchable, loader, None, grad_function="logit",
                                                  answer_function="avg_diff", clean_corrupt="corrupt",
                                                  **kwargs)
        cpu_seconds = time.process_time() - cpu0
    n_points = args.steps + 1 if ig else 1
    scale = 1.0 / (n_points * len(loader))
    result = {
        "tool": "auto-circuit", "algorithm": args.algorithm, "level": args.level, "seconds": m.seconds,
        "peak_bytes": m.peak_bytes, "cpu_seconds": cpu_seconds,
        "loadavg_1min": [load_before, os.getloadavg()[0]],
        "grad_passes_per_batch": n_points, "n_batches": len(loader),
        "max_logit_diff_vs_hf": logit_diff, "threads": torch.get_num_threads(),
        "versions": {name: version(name)
                     for name in ("auto-circuit", "transformer-lens", "transformers", "torch")},
        "call": f"mask_gradient_prune_scores(factorized={edge_level}, grad_function='logit', "
                f"answer_function='avg_diff', clean_corrupt='corrupt', "
                + (f"integrated_grad_samples={args.steps})" if ig else "mask_val=0.0)"),
        "n_edges": patchable.n_edges,
    }
    if edge_level:
        result["edges"] = edge_list(patchable, prune_scores, scale)
        result["head"], result["mlp"] = outgoing_sums(result["edges"], L, H)
        result["node_scores_from"] = "sum of outgoing factorized edge scores"
    else:
        result["head"], result["mlp"] = node_table(patchable, prune_scores, scale, L, H)
        result["node_scores_from"] = "unfactorized graph: edge head->Resid Mid, MLP->Resid Post"
    return result


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
