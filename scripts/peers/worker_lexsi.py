"""Peer worker: Lexsi Labs' CircuitKIT 0.2.0 node-level EAP / EAP-IG on a local HF model, in our JSON.

Runs under `.venv-lexsi/bin/python` (PyPI `circuitkit==0.2.0`, transformer-lens 3.8.0,
transformers 5.x). That package also imports as `circuitkit`, so this worker must never run
in the project venv; it checks that the `circuitkit` it imported is the Lexsi one. One
attribution per process, measured like every other worker (`peak.measured`: wall time and
peak resident memory added):

    python worker_lexsi.py MODEL_DIR TASK_FILE OUT_JSON --algorithm eap|eap-ig [--level node]
                           [--steps 5] [--batch 4] [--dtype float32] [--n-pairs N]
                           [--sparsity 0.3] [--sizes 7,14,28] [--no-faithfulness]

MODEL_DIR: a local HF causal-LM directory (GPT-2 or any architecture transformer-lens 3.8
converts, e.g. Llama / SmolLM2). TASK_FILE, either
  *.safetensors  CircuitKit's TaskData fields (clean_ids, corrupted_ids, attention_mask,
                 answer_pos, correct, incorrect), as worker_autocircuit.py takes: the exact
                 token ids are scored (no BOS is added);
  *.json/.jsonl  a list (or one object a line) of {"clean": str, "corrupted": str,
                 "correct": str | id, "incorrect": str | id}: the prompts are tokenized by
                 Lexsi's own path (transformer-lens `to_tokens`, BOS prepended), as its IOI
                 task does. String answers must be one token.
Each pair needs one correct and one incorrect token, scored at the clean prompt's last token
(Lexsi's metric reads logits[input_length - 1]).

What is called (Lexsi's source, circuitkit/...):
  quick.load_model(dir, dtype, algorithm)      HookedTransformer.from_pretrained on the local dir,
                                               no weight processing, EAP hook flags set
  backends.eap.attribute_node.attribute_node(  the call api.discover_circuit makes
      model, Graph.from_model(model, node_scores=True), dataloader, IOI metric,
      method="EAP" | "EAP-IG-inputs", ig_steps, intervention="patching")
  IOI metric: tasks/builtins/ioi.py IOITaskSpec.metric_fn() = -(logit[correct] - logit[incorrect])
  faithfulness: what `ck.faithfulness` does with its default two pillars: the pruned set
  (applications/pruning/node_pruner.get_nodes_to_prune at --sparsity), the circuit graph
  rebuilt from |scores| (api._reconstruct_circuit_graph), then Pillar 1 (causal patching) and
  Pillar 2 (zero ablation) on the same pairs; with --sizes, also Pillar 1 of the circuit of its
  k best heads by |score| (scope heads, every MLP kept), for each k.

The model directory is never modified: it is mirrored by symlinks into a temporary directory
(a neutral name: Lexsi refuses local paths containing "llama" or "gemma"), and a GPT-2
config.json saved by transformers 5 (no `n_ctx`, which transformer-lens 3.8 reads) gets
`n_ctx = n_positions` in the mirror. The hub is never contacted (HF_HUB_OFFLINE=1).
"""

from __future__ import annotations

import os

for _name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"):
    os.environ.setdefault(_name, "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from importlib.metadata import version  # noqa: E402
from pathlib import Path  # noqa: E402

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from peak import measured  # noqa: E402

LEXSI_VERSION = "0.2.0"
LOGIT_TOLERANCE = {"float32": 1e-3}  # max |HF - HookedTransformer| logit, relative to max(1, |logits|)
METHODS = {"eap": "EAP", "eap-ig": "EAP-IG-inputs"}  # as api.discover_circuit's _ALGO_METHOD_MAP
PLACEHOLDER = "\x00lexsi-peer-pair-{}-{}"


def lexsi():
    """Import Lexsi's circuitkit (before transformer_lens: it installs its TL patch hook)."""
    if "transformer_lens" in sys.modules:
        raise RuntimeError("transformer_lens was imported before circuitkit")
    import circuitkit

    where = Path(circuitkit.__file__).resolve()
    if "site-packages" not in where.parts or getattr(circuitkit, "__version__", None) != LEXSI_VERSION:
        raise SystemExit(f"`import circuitkit` gave {where} (version {getattr(circuitkit, '__version__', '?')}),"
                         f" not Lexsi's circuitkit {LEXSI_VERSION}: run this under .venv-lexsi/bin/python")
    return circuitkit


# -- model ----------------------------------------------------------------------------------

def mirror(model_dir: Path, into: Path) -> Path:
    """`model_dir` as symlinks in `into`/model, with a config transformer-lens 3.8 reads."""
    out = into / "model"
    out.mkdir()
    for item in model_dir.iterdir():
        if item.name != "config.json":
            (out / item.name).symlink_to(item.resolve())
    config = json.loads((model_dir / "config.json").read_text())
    if config.get("model_type") == "gpt2" and "n_ctx" not in config:
        config["n_ctx"] = config["n_positions"]
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def load(model_dir: Path, dtype: str, algorithm: str, check_ids):
    """Lexsi's HookedTransformer for the directory; its max logit difference from the HF model's."""
    import torch
    from transformers import AutoModelForCausalLM

    import circuitkit as ck

    model = ck.load_model(str(model_dir), dtype=dtype, device="cpu", algorithm=algorithm)
    model.eval()
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
    with torch.no_grad():
        ours, theirs = hf(check_ids).logits.float(), model(check_ids).float()
    del hf
    diff = float((ours - theirs).abs().max())
    tol = LOGIT_TOLERANCE.get(dtype)
    if tol is not None and not diff <= tol * max(1.0, float(ours.abs().max())):
        raise RuntimeError(f"Lexsi's HookedTransformer logits differ from the HF model's by {diff:.3e}: "
                           "the conversion does not compute the same function")
    return model, diff


# -- pairs ----------------------------------------------------------------------------------

@dataclass
class Pairs:
    clean: list[str]
    corrupted: list[str]
    labels: list[list[int]]  # [correct, incorrect] per pair
    ids: list[tuple[list[int], list[int]]] | None  # exact (clean, corrupted) ids, or None: Lexsi tokenizes
    templated: bool  # Lexsi's flag: True = no BOS prepended (the ids carry their own)


def _answer_id(tokenizer, value, where: str) -> int:
    if isinstance(value, list):
        if len(value) != 1:
            raise ValueError(f"{where}: Lexsi's IOI metric scores one correct and one incorrect token")
        value = value[0]
    if isinstance(value, int):
        return value
    ids = tokenizer(value, add_special_tokens=False)["input_ids"]
    if len(ids) != 1:
        raise ValueError(f"{where}: answer {value!r} is {len(ids)} tokens {ids}; it must be one")
    return ids[0]


def read_pairs(task_file: Path, tokenizer, n_pairs: int | None) -> Pairs:
    """The task file's pairs (the first n_pairs)."""
    if task_file.suffix == ".safetensors":
        from safetensors.torch import load_file

        t = load_file(str(task_file))
        n = t["clean_ids"].shape[0] if n_pairs is None else min(n_pairs, t["clean_ids"].shape[0])
        ids, labels = [], []
        for i in range(n):
            length = int(t["attention_mask"][i].sum())
            if not bool((t["attention_mask"][i, :length] == 1).all()):
                raise ValueError(f"pair {i}: the attention mask is not a right-padded prefix")
            if int(t["answer_pos"][i]) != length - 1:
                raise ValueError(f"pair {i}: Lexsi scores the last real token ({length - 1}), "
                                 f"answer_pos is {int(t['answer_pos'][i])}")
            good = t["correct"][i][t["correct"][i] >= 0].tolist()
            bad = t["incorrect"][i][t["incorrect"][i] >= 0].tolist()
            labels.append([_answer_id(tokenizer, good, f"pair {i} correct"),
                           _answer_id(tokenizer, bad, f"pair {i} incorrect")])
            ids.append((t["clean_ids"][i, :length].tolist(), t["corrupted_ids"][i, :length].tolist()))
        clean = [tokenizer.decode(c) for c, _ in ids]
        corrupted = [tokenizer.decode(c) for _, c in ids]
        return Pairs(clean, corrupted, labels, ids, templated=True)
    text = task_file.read_text()
    rows = json.loads(text) if task_file.suffix == ".json" else [json.loads(x) for x in text.splitlines() if x.strip()]
    rows = rows[:n_pairs] if n_pairs is not None else rows
    labels = [[_answer_id(tokenizer, r["correct"], f"pair {i} correct"),
               _answer_id(tokenizer, r["incorrect"], f"pair {i} incorrect")] for i, r in enumerate(rows)]
    return Pairs([r["clean"] for r in rows], [r["corrupted"] for r in rows], labels, None, templated=False)


def inject_ids(model, pairs: Pairs) -> None:
    """Serve the exact ids to Lexsi's tokenization (model.to_tokens) through placeholder strings.

    Used only when decoding the ids and re-tokenizing does not give them back (e.g. random
    tokens that BPE would merge). Other strings go to the real to_tokens.
    """
    import torch

    table = {}
    for i, (c, k) in enumerate(pairs.ids):
        table[PLACEHOLDER.format(i, "clean")] = c
        table[PLACEHOLDER.format(i, "corrupted")] = k
    original = model.to_tokens
    pad = model.tokenizer.pad_token_id or 0

    def to_tokens(inputs, *args, **kwargs):
        items = [inputs] if isinstance(inputs, str) else list(inputs)
        if not all(s in table for s in items):
            return original(inputs, *args, **kwargs)
        width = max(len(table[s]) for s in items)
        out = torch.full((len(items), width), pad, dtype=torch.long)
        for row, s in enumerate(items):  # right padding, as Lexsi's IOI (pair_padding_side="right")
            out[row, :len(table[s])] = torch.tensor(table[s])
        return out.to(model.cfg.device)

    model.to_tokens = to_tokens
    pairs.clean = [PLACEHOLDER.format(i, "clean") for i in range(len(pairs.ids))]
    pairs.corrupted = [PLACEHOLDER.format(i, "corrupted") for i in range(len(pairs.ids))]


def dataloader(pairs: Pairs, batch: int):
    from circuitkit.backends.eap.eap_utils import collate_EAP
    from torch.utils.data import DataLoader

    if len(pairs.labels) % batch:
        raise ValueError(f"{len(pairs.labels)} pairs do not split into batches of {batch}: Lexsi's scores weight "
                         "each pair by 1 / (its batch's size * pair count), so a shorter last batch would count "
                         "more per pair; use a pair count that is a multiple of the batch size")
    rows = list(zip(pairs.clean, pairs.corrupted, pairs.labels, strict=True))
    dl = DataLoader(rows, batch_size=batch, shuffle=False, collate_fn=collate_EAP)
    dl.pair_padding_side = "right"  # IOITaskSpec.pair_padding_side
    dl.templated = pairs.templated
    return dl


def verify_tokens(model, pairs: Pairs, dl) -> bool:
    """Whether Lexsi's own tokenize_batch_pair gives exactly the pairs' ids and answer positions."""
    from circuitkit.backends.eap.eap_utils import tokenize_batch_pair

    start = 0
    for clean, corrupted, _ in dl:
        ct, kt, _cm, _km, lengths, _ = tokenize_batch_pair(model, clean, corrupted, pair_padding_side="right",
                                                           templated=pairs.templated)
        for j in range(len(clean)):
            c, k = pairs.ids[start + j]
            if (int(lengths[j]) != len(c) or ct[j, :len(c)].tolist() != c or kt[j, :len(k)].tolist() != k):
                return False
        start += len(clean)
    return True


# -- the run --------------------------------------------------------------------------------

def _pillars(model, node_scores: dict, algorithm: str, scope: str, sparsity: float, dl, metric,
             ablation: bool) -> dict:
    """Lexsi's circuit at (scope, sparsity), rebuilt as api._reconstruct_circuit_graph does, and its
    Pillar 1 (causal patching) and, with `ablation`, Pillar 2 (zero ablation) on the pairs."""
    from circuitkit.api import _reconstruct_circuit_graph
    from circuitkit.evaluation.pillars import Pillar1_CausalPatching, Pillar2_Ablation

    discovery_cfg = {"algorithm": algorithm, "task": "ioi", "level": "node"}
    pruning_cfg = {"target_sparsity": sparsity, "scope": scope}
    circuit = _reconstruct_circuit_graph(model, {"node_scores": node_scores}, discovery_cfg, pruning_cfg, "cpu")
    patching = Pillar1_CausalPatching.run(model, circuit, dl, metric, device="cpu", quiet=True)
    keys = ("score", "raw_ratio", "raw_score", "clean_score", "corrupt_score", "status")
    out = {"circuit_nodes": [n for n in circuit.nodes if circuit.nodes[n].in_graph and n not in ("input", "logits")],
           "patching": {k: patching.get(k) for k in keys}}
    if ablation:
        zero = Pillar2_Ablation.run(model, circuit, dl, metric, intervention="zero", device="cpu", quiet=True,
                                    clean_score=patching["clean_score"], corrupt_score=patching["corrupt_score"])
        out["ablation"] = {k: zero.get(k) for k in keys}
    return out


def faithfulness(model, graph, dl, task_spec, algorithm: str, sparsity: float, sizes: list[int]) -> dict:
    """Lexsi's own faithfulness figures for its scores.

    default: what `ck.faithfulness` reports for the circuit its own pruning keeps at `sparsity`
    (node_pruner.get_nodes_to_prune, scope both; the graph rebuilt at the pruned share of the
    scoreable nodes), Pillars 1 and 2. sizes: for each k, the circuit of its k best heads by |score|
    (api._reconstruct_circuit_graph at scope heads, every MLP kept), Pillar 1.
    """
    from circuitkit.api import _convert_eap_scores_to_ck_format, _make_eval_metric
    from circuitkit.applications.pruning.node_pruner import get_nodes_to_prune

    t0 = time.perf_counter()
    node_scores = _convert_eap_scores_to_ck_format(graph)  # |score|, keyed "A0.0" / "MLP 0"
    metric = _make_eval_metric(task_spec)  # per-example logit difference (loss=False, mean=False)
    pruned = get_nodes_to_prune(node_scores, target_sparsity=sparsity, pruning_scope="both")
    n_scoreable = model.cfg.n_layers * (model.cfg.n_heads + 1)
    default = _pillars(model, node_scores, algorithm, "both", len(pruned) / n_scoreable, dl, metric, ablation=True)
    n_heads = model.cfg.n_layers * model.cfg.n_heads
    by_size = {}
    for k in sizes:
        # _compute_n_topn keeps int(n_heads * (1 - sparsity)) heads: this sparsity gives exactly k
        at_k = _pillars(model, node_scores, algorithm, "heads", 1 - (k + 0.5) / n_heads, dl, metric, ablation=False)
        at_k["n_heads_kept"] = sum(1 for n in at_k["circuit_nodes"] if n.startswith("a"))
        by_size[str(k)] = at_k
    return {"sparsity_requested": sparsity, "pruned": pruned, **default, "by_size": by_size,
            "seconds": time.perf_counter() - t0,
            "definition": "F = (m_circuit - m_corrupt) / (m_clean - m_corrupt), clipped to [0, 1] (raw_ratio "
                          "unclipped), m = mean logit difference; patching: edges out of the circuit get the "
                          "corrupted activations; ablation: they get zeros"}


def run(args: argparse.Namespace) -> dict:
    lexsi()
    import torch
    from circuitkit.api import _qkv_flags_enabled
    from circuitkit.backends.eap.attribute_node import attribute_node
    from circuitkit.backends.eap.graph import Graph
    from circuitkit.tasks.builtins.ioi import IOITaskSpec
    from transformers import AutoTokenizer

    with tempfile.TemporaryDirectory(prefix="lexsi-peer-") as tmp:
        model_dir = mirror(Path(args.model).resolve(), Path(tmp))
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        pairs = read_pairs(Path(args.task), tokenizer, args.n_pairs)
        first = pairs.ids[0][0] if pairs.ids else tokenizer(pairs.clean[0])["input_ids"]
        model, logit_diff = load(model_dir, args.dtype, args.algorithm, torch.tensor([first]))
        dl = dataloader(pairs, args.batch)
        token_path = "lexsi-tokenized (BOS prepended)"
        if pairs.ids is not None:
            token_path = "decoded text, re-tokenized to the same ids"
            if not verify_tokens(model, pairs, dl):
                inject_ids(model, pairs)
                dl = dataloader(pairs, args.batch)
                token_path = "exact ids served through model.to_tokens (decoding did not round-trip)"
                if not verify_tokens(model, pairs, dl):
                    raise RuntimeError("Lexsi's tokenization does not give the task's ids and answer positions "
                                       "(a real token equal to the pad id at a row's end?)")
        task_spec = IOITaskSpec()
        metric = task_spec.metric_fn()  # -(logit diff), batch mean: the IOI discovery metric
        graph = Graph.from_model(model, node_scores=True, neuron_level=False, mlp_hook="mlp_out")
        with _qkv_flags_enabled(model):
            with torch.no_grad():  # warm-up: one plain forward, as the other workers' logit check
                model(torch.tensor([first]))
            load_before = os.getloadavg()[0]
            with measured() as m:
                cpu0 = time.process_time()
                attribute_node(model, graph, dl, metric, method=METHODS[args.algorithm], ig_steps=args.steps,
                               neuron=False, intervention="patching", quiet=True)
                cpu_seconds = time.process_time() - cpu0
            L, H = model.cfg.n_layers, model.cfg.n_heads
            # Lexsi's metric is a batch mean and attribute_node divides the summed scores by the pair
            # count again, so its scores are per-pair means / batch size: times the batch size here, the
            # means other workers report (EAP head scores then equal CircuitKit's to float32 round-off,
            # tests/bench/test_bench_lexsi.py).
            scores = graph.nodes_scores.float() * args.batch
            head = [[float(scores[graph.forward_index(graph.nodes[f"a{layer}.h{h}"], attn_slice=False)])
                     for h in range(H)] for layer in range(L)]
            mlp = [float(scores[graph.forward_index(graph.nodes[f"m{layer}"], attn_slice=False)]) for layer in range(L)]
            ranking = sorted(([layer, h, head[layer][h]] for layer in range(L) for h in range(H)), key=lambda r: -abs(r[2]))
            result = {
                "tool": "lexsi-circuitkit", "algorithm": args.algorithm, "level": "node",
                "seconds": m.seconds, "peak_bytes": m.peak_bytes, "cpu_seconds": cpu_seconds,
                "loadavg_1min": [load_before, os.getloadavg()[0]],
                "grad_passes_per_batch": args.steps if args.algorithm == "eap-ig" else 1,
                "n_batches": len(dl), "n_pairs": len(pairs.labels), "batch": args.batch, "dtype": args.dtype,
                "ig_steps": args.steps if args.algorithm == "eap-ig" else None,
                "max_logit_diff_vs_hf": logit_diff, "threads": torch.get_num_threads(), "token_path": token_path,
                "versions": {name: version(name) for name in ("circuitkit", "transformer-lens", "transformers",
                                                              "torch")},
                "model": {"architecture": model.cfg.original_architecture, "n_layers": L, "n_heads": H,
                          "d_model": model.cfg.d_model},
                "call": f"attribute_node(model, Graph.from_model(model, node_scores=True), dataloader, "
                        f"IOITaskSpec().metric_fn(), method={METHODS[args.algorithm]!r}, ig_steps={args.steps}, "
                        "intervention='patching')",
                "score_convention": "signed; mean over pairs of the sum over positions and d_model of "
                                    "(clean - corrupted activation) * d(logit diff)/d(activation) (EAP-IG: the "
                                    "gradient averaged over embeddings interpolated corrupted->clean at k/steps, "
                                    "k = 1..steps); heads at attn.hook_result; MLPs: the MLP output difference "
                                    "times the gradient at hook_mlp_in (the MLP's input, not its output); "
                                    "Lexsi ranks and prunes by |score|",
                "lexsi_raw_scale": 1.0 / args.batch,
                "head": head, "mlp": mlp,
                "input_score": float(scores[graph.forward_index(graph.nodes["input"], attn_slice=False)]),
                "head_ranking": ranking,
            }
            if not args.no_faithfulness:
                result["faithfulness"] = faithfulness(model, graph, dl, task_spec, args.algorithm, args.sparsity,
                                                      args.sizes)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("task")
    parser.add_argument("out")
    parser.add_argument("--algorithm", choices=tuple(METHODS), required=True)
    parser.add_argument("--level", choices=("node",), default="node",
                        help="node only: Lexsi's discovery scores nodes (or neurons), not edges")
    parser.add_argument("--steps", type=int, default=5, help="ig_steps (eap-ig)")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    parser.add_argument("--n-pairs", type=int, default=None, help="use the first N pairs (default all)")
    parser.add_argument("--sparsity", type=float, default=0.3,
                        help="fraction Lexsi prunes for its faithfulness figure (its default 0.3)")
    parser.add_argument("--sizes", type=lambda v: [int(x) for x in v.split(",") if x], default=[],
                        help="also Lexsi's patching faithfulness of its k best heads, for each k (e.g. 7,14,28)")
    parser.add_argument("--no-faithfulness", action="store_true")
    args = parser.parse_args()
    result = run(args)
    Path(args.out).write_text(json.dumps(result))
    print(json.dumps({k: result[k] for k in ("tool", "algorithm", "seconds", "peak_bytes")}
                     | {"top5": result["head_ranking"][:5]}
                     | ({"faithfulness": {k: result["faithfulness"][k]["score"] for k in ("patching", "ablation")}}
                        if "faithfulness" in result else {})))


if __name__ == "__main__":
    main()
