"""Circuit discovery's schemas: the `discovery` group (with its task data, `discovery.data_params`),
`pruning` and `export`, and the rules that read several discovery keys together (`check_discovery`).

The keys' docs, choices and ranges are the fields' metadata (`circuitkit.core.config._f`), read by
validation, docs/configuration.md and the command-line flags that mirror a key.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from circuitkit.core.config import ConfigError, _f


@dataclass
class DataParams:
    # Upper bounds: generating and evaluating the pairs is sequential work with no output meanwhile;
    # a faithfulness mean over 100k pairs already has a standard error of 0.3% of the per-pair spread.
    num_examples: int = _f(128, "examples used for attribution (at most 1000000)", ge=1, le=1_000_000)
    eval_examples: int = _f(64, "held-out examples for faithfulness (at most 100000)", ge=1, le=100_000)
    data_path: Optional[str] = _f(None, "file or directory for the mmlu and jsonl tasks")
    seq_len: int = _f(128, "sequence length of synthetic tasks (induction)", ge=8)
    prepend_bos: bool = _f(True, "every prompt starts with the tokenizer's BOS token, added when the tokenizer"
                           " does not add one (as TransformerLens and the EAP-IG reference do)")
    ioi_corruption: str = _f("s2", "ioi task: what the corrupted prompt replaces. s2 (the default) = the second"
                             " mention of the subject only, by a third name (one token differs); abc = all three"
                             " name positions by three other names (the ABC corruption of the IOI paper and"
                             " MIB). Recorded in the manifest and circuit.pt", choices=("s2", "abc"))
    induction_format: str = _f("repeat", "induction task: repeat (the default) = a random span"
                               " repeated after some filler, cut short (corrupted: in the first copy the query token"
                               " swapped with the answer after it, so the answer's successor follows it and is the"
                               " incorrect answer; both answers in context); single = one `A B` among random symbols, `A` last (corrupted: the first"
                               " A replaced; incorrect answer a random symbol; the fixtures' format, which a"
                               " pretrained model barely does). Recorded in the manifest", choices=("single", "repeat"))
    corruption: Optional[str] = _f(None, "jsonl task: generate the corrupted prompts instead of reading them."
                                   " entity_swap = the row's `entity` replaced by another row's (same token length,"
                                   " another correct answer, which becomes the incorrect one); name_swap = the"
                                   " prompt's first person's name replaced everywhere by another of the same token"
                                   " length; token_replace = the entity's tokens replaced by random word tokens."
                                   " Deterministic in the seed; each pair checked with the model; recorded."
                                   " null = rows carry their own `corrupted`",
                                   choices=("entity_swap", "name_swap", "token_replace"))
    min_valid_share: float = _f(0.5, "generated corruptions: the share of rows that must give a valid pair (same"
                                " token length, and the corruption changes the model's greedy answer); below it"
                                " the data stage stops, listing the failed rows by line", ge=0.0, le=1.0)
    induction_corruption: str = _f("swap", "induction task, repeat format: what the corrupted prompt changes."
                                   " swap (the default) = in the first copy the query token and the answer after it"
                                   " exchanged (the previous-token signal survives, so a circuit found with it may"
                                   " leave out the early previous-token heads); fresh = the first copy replaced by"
                                   " fresh random tokens (no induction possible; the incorrect answer is the span's"
                                   " token after the answer, as with swap). The single format always uses its key"
                                   " corruption. Recorded in the manifest and circuit.pt", choices=("swap", "fresh"))
    heldout_template_examples: Optional[int] = _f(None, "pairs from the task's held-out templates (sentences"
                                                  " attribution never saw; ioi has them), on which pruning also"
                                                  " measures faithfulness, with the same ablation, beside the"
                                                  " in-distribution figure; null = eval_examples for a task with"
                                                  " held-out templates (ioi), off for the others; 0 = off; at"
                                                  " most 100000, as eval_examples", ge=0, le=100_000)
    corruptions: Optional[list[str]] = _f(None, "several corruptions in one discovery: each pair is built under each"
                                          " (the same clean prompts), attribution scores each and combines the scores"
                                          " (discovery.corruption_scores), pruning keeps the circuit's faithfulness"
                                          " under all of them (discovery.corruption_faithfulness). ioi: s2, abc;"
                                          " induction (repeat format): swap, fresh; jsonl: any of the generated kinds."
                                          " The first is the primary one (data.safetensors, the metric figures);"
                                          " null = the task's single corruption (ioi_corruption, induction_corruption,"
                                          " corruption)", choices=("s2", "abc", "swap", "fresh", "entity_swap",
                                                                   "name_swap", "token_replace"))


# The attribution methods that integrate along a path: they read discovery.ig_steps and ig_rule.
IG_ALGORITHMS = ("eap-ig", "eap-ig-activations", "eap-gp")
# eap-gp builds its path one point after another: only the rules whose points are path points.
GRADPATH_RULES = ("right", "left")


@dataclass
class DiscoveryConfig:
    algorithm: str = _f("eap-ig", "attribution method (eap-ig = EAP-IG-inputs; eap-ig-activations: IG along each layer's"
                        " own activations, ig_steps x (2 x layers + 1) passes per batch; eap-gp: EAP-IG along a"
                        " gradient-guided path (GradPath), ig_steps passes, ig_rule right or left; acdc: iterative"
                        " edge (node) removal by patching, one forward over all examples per edge tested)",
                        choices=("eap", "eap-ig", "clean-corrupted", "exact", "eap-ig-activations", "eap-gp", "acdc"))
    level: str = _f("node", "score nodes or edges", choices=("node", "edge"))
    task: str = _f("induction", "task that supplies clean/corrupted pairs",
                   choices=("induction", "ioi", "greater_than", "mmlu", "jsonl", "sva", "capitals"))
    metric: str = _f("logit_diff", "scalar per example", choices=("logit_diff", "prob_diff", "logprob", "kl"))
    ig_steps: Optional[int] = _f(5, "integration steps of EAP-IG (null = 30, 1 = EAP)", ge=1)
    ig_rule: str = _f("right", "EAP-IG quadrature rule; ig_steps is its number of passes (the reference EAP-IG:"
                      " right at node level, left at edge level)",
                      choices=("right", "midpoint", "trapezoid", "gauss_legendre", "left"))
    acdc_threshold: float = _f(0.01, "algorithm=acdc: an edge (node) is removed when removing it changes the metric by"
                               " less than this, in the metric's units (m(circuit) - m(circuit without it) < threshold);"
                               " larger = smaller circuit", ge=0.0)
    corruption_scores: str = _f("mean", "several corruptions (data_params.corruptions): how their scores combine."
                                " Each corruption's scores are first divided by its metric gap m(clean) - m(corrupted)"
                                " (a share of what that corruption moves), then: mean = their mean; min = per"
                                " component the share of smallest magnitude (a component counts only where every"
                                " corruption needs it); max = the share of largest magnitude (a component counts where"
                                " any corruption needs it); the result is scaled by the corruptions' mean gap, back to"
                                " the metric's units", choices=("mean", "min", "max"))
    corruption_faithfulness: str = _f("worst", "several corruptions: the faithfulness that pruning reports, draws"
                                      " (the curve, CPR/CMD) and judges: worst = the lowest over the corruptions"
                                      " (a circuit holds only if it holds under each), mean = their mean",
                                      choices=("worst", "mean"))
    batch_size: int = _f(4, "examples per forward/backward pass", ge=1)
    device_batch: str = _f("auto", "auto = on an accelerator (CUDA, MPS) the attribution stage runs the largest batch"
                           " whose memory estimate fits 90% of the device's free memory, never below batch_size (scores"
                           " do not depend on it; recorded in the stage's record); off = batch_size as set. The CPU"
                           " always uses batch_size", choices=("auto", "off"))
    num_shards: int = _f(1, "jobs splitting the attribution examples (contiguous ranges; merged by the last to finish)", ge=1)
    shard_index: int = _f(0, "this job's share of the attribution examples, 0 <= shard_index < num_shards", ge=0)
    shard_dir: Optional[str] = _f(None, "where attribution shards meet and are merged; null = <run dir>/../attribution_shards"
                                  " (the sweep dir in a multirun)")
    per_example: bool = _f(True, "also keep every example's scores in scores.safetensors (N x heads; edge level N x"
                           " edges), for pruning.selection=bootstrap and the stability report; shards keep theirs and the merge"
                           " concatenates them")
    data_params: DataParams = field(default_factory=DataParams, metadata={"doc": "task data"})


@dataclass
class PruningConfig:
    scope: str = _f("heads", "what is pruned", choices=("heads", "edges"))
    target_sparsity: float = _f(0.5, "fraction of heads (or edges) removed", ge=0.0, lt=1.0)
    rank_by: str = _f("abs", "order of removal: lowest |score| or lowest signed score", choices=("abs", "signed"))
    ablation: str = _f("corrupted", "value given to removed heads/edges: corrupted = counterfactual patching from the"
                       " pair's corrupted prompt (what the scores measure; MIB's), mean = position-wise mean over the"
                       " attribution examples, zero", choices=("mean", "zero", "corrupted"))
    graph: bool = _f(True, "also draw the circuit as a layered graph (circuit_graph.png and .svg)")
    graph_top_edges: int = _f(40, "at most this many edges in the circuit graph, strongest |score| first", ge=1)
    graph_backend: str = _f("auto", "who draws the graph: Graphviz if `dot` is installed (auto), or matplotlib",
                            choices=("auto", "matplotlib", "graphviz"))
    selection: str = _f("top_k", "how the kept set is chosen from the scores: top_k = the best n by rank_by;"
                        " bootstrap = the n most often in a bootstrap resample's top n (per-example scores,"
                        " no model pass; circuitkit.discovery.pruning.selection); edge_pruning = edges ranked by a mask optimized on"
                        " the attribution pairs, warm-started from the scores (scope=edges only;"
                        " circuitkit.discovery.pruning.optimize); ip = the connected edge set of n edges with the largest"
                        " total score by rank_by, by integer programming (scope=edges; at head scope every set is"
                        " connected and ip is top_k; circuitkit.discovery.pruning.selection_ip); positive = the best n by signed"
                        " score among the positive ones only (fewer when fewer are positive); mean_rank / vote = the n with the"
                        " best mean per-example rank / in the most examples' own top n (per-example scores, no model"
                        " pass; circuitkit.discovery.pruning.selection); mask = heads (or edges) ranked by a soft mask optimized on the"
                        " attribution pairs under counterfactual ablation, warm-started from the scores (at"
                        " scope=edges the same as edge_pruning; circuitkit.discovery.pruning.optimize)",
                        choices=("top_k", "bootstrap", "edge_pruning", "ip", "positive", "mean_rank", "vote", "mask"))
    bootstrap_resamples: int = _f(100, "resamples of the attribution examples for selection=bootstrap and the"
                                  " stability report (Jaccard of the kept set); 0 = no stability report", ge=0)
    random_baselines: int = _f(100, "the verdict's baselines (circuit.pt `verdict`, `circuitkit show`, the report):"
                               " the circuit's percentile among this many random circuits with its per-layer head"
                               " counts, beside the magnitude and Wanda circuits of its size, all measured on the"
                               " held-out pairs (one pass over them per random circuit); under 100 the percentile"
                               " is coarse; 0 = no baselines (necessity, robustness, generalization and stability"
                               " are still measured); at most 10000", ge=0, le=10_000)
    mask_steps: Optional[int] = _f(None, "selection=edge_pruning or mask: optimizer steps on the mask (one forward"
                                   " and backward of one attribution batch each); null = 40 at scope=heads, 20 at"
                                   " scope=edges (SmolLM2 induction: 20 head-mask steps keep 0.74 at 27 heads, 40"
                                   " keep 0.80 at 24)", ge=1)
    mask_lr: float = _f(0.1, "selection=edge_pruning or mask: Adam learning rate on the mask logits", gt=0.0)
    mask_penalty: float = _f(1.0, "selection=edge_pruning or mask: weight of the mask's mean density in the loss (the"
                             " faithfulness term is normalized by the clean-corrupted gap)", ge=0.0)
    ip_connectivity: str = _f("path", "selection=ip: every kept edge lies on a kept path from the embedding to the"
                              " logits (path), or only leaves the embedding or a node with a kept input edge (input)",
                              choices=("path", "input"))
    ip_time_limit_s: float = _f(60.0, "selection=ip: HiGHS time limit per circuit size (the curve solves up to 9"
                                " sizes); a stopped solve uses its best circuit, none found is an error", gt=0.0)


def mask_steps_of(p: PruningConfig) -> int:
    """pruning.mask_steps, or its default for the scope when null (40 over heads, 20 over edges)."""
    return p.mask_steps if p.mask_steps is not None else (40 if p.scope == "heads" else 20)


@dataclass
class ExportConfig:
    format: Optional[str] = _f(None, "the export stage (after pruning): hf = a Hugging Face checkpoint of the model"
                               " with the circuit's removed heads folded into its weights (safetensors, config,"
                               " tokenizer, circuitkit_export.json provenance), loadable by plain"
                               " AutoModelForCausalLM.from_pretrained; null = no export (the stage is skipped)",
                               choices=("hf",))
    ablation: str = _f("mean", "what a removed head becomes in the weights: mean = its mean output over every token of"
                       " the attribution examples (one vector per head) folded into the attention output"
                       " projection's bias; zero = nothing. The pruning stage reports the circuit's faithfulness"
                       " under both (circuit.pt weight_ablations)", choices=("mean", "zero"))
    dir: Optional[str] = _f(None, "where the checkpoint directory is written; null = <run dir>/pruned_model")



def check_discovery(d: DiscoveryConfig) -> None:
    """The discovery keys that must agree with each other (shards, the IG rule and its steps)."""
    if d.shard_index >= d.num_shards:
        raise ConfigError(f"Config key 'discovery.shard_index' = {d.shard_index} must be < discovery.num_shards"
                          f" = {d.num_shards} (jobs are numbered 0..num_shards-1).")
    if d.num_shards > d.data_params.num_examples:
        raise ConfigError(f"Config key 'discovery.num_shards' = {d.num_shards} exceeds"
                          f" discovery.data_params.num_examples = {d.data_params.num_examples}: every shard needs"
                          " at least one example; use fewer shards.")
    if d.algorithm in IG_ALGORITHMS and d.ig_rule == "trapezoid" and d.ig_steps == 1:
        raise ConfigError("Config key 'discovery.ig_steps' = 1 is too few for discovery.ig_rule=trapezoid (its"
                          " points include both ends, α = 0 and α = 1): set ig_steps >= 2, or ig_rule=right for EAP.")
    if d.algorithm == "eap-gp" and d.ig_rule not in GRADPATH_RULES:
        raise ConfigError(f"Config key 'discovery.ig_rule' = {d.ig_rule!r} does not apply to discovery.algorithm=eap-gp,"
                          " which builds its path one point after another from the gradients: it must be one of"
                          f" {', '.join(GRADPATH_RULES)} (right is the default).")
    if d.algorithm == "acdc" and d.num_shards > 1:
        raise ConfigError(f"Config key 'discovery.num_shards' = {d.num_shards} cannot split discovery.algorithm=acdc:"
                          " it decides each edge on the metric over all the examples; set num_shards=1.")
