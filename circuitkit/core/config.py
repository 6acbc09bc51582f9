"""Typed configuration schema, registered in Hydra's ConfigStore, and strict validation.

Every config group (`model`, `discovery`, `pruning`, `grads`, `preflight`) has a dataclass
here. YAML files under `conf/` only set values. Validation is strict: an unknown key, a
wrong type or an out-of-range value raises :class:`ConfigError` naming the key, the value
and what is allowed, before any work starts. Overrides are checked before Hydra composes
(so `discovery.memory_efficient=true` gets our message, not Hydra's), and the composed
config is checked again (choices, ranges, cross-field rules).
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from circuitkit.core.errors import EXIT_USAGE, UserError

CONF_DIR = Path(__file__).resolve().parents[2] / "conf"
ALL_STAGES = ("preflight", "data", "attribution", "pruning", "export", "grads", "attribute")
# What a run without `stages=` runs: every stage but `attribute`, which needs an eval set of its own
# (attribute.eval_path) and a fine-tuned model; list it to run it.
DEFAULT_STAGES = ALL_STAGES[:-1]


# torch.manual_seed and numpy take seeds up to 2**32 - 1 (numpy) / 2**64 - 1 (torch); the smaller
# bound holds everywhere a seed goes.
MAX_SEED = 2**32 - 1


class ConfigError(UserError, ValueError):
    """A configuration value or key that cannot be used; the message says what to change."""

    exit_code = EXIT_USAGE


def _f(default: Any, doc: str, *, choices: Iterable[Any] | None = None, ge: float | None = None,
       gt: float | None = None, lt: float | None = None, le: float | None = None, finite: bool = True) -> Any:
    """A dataclass field with its documentation and allowed values in the metadata.

    finite: a float key refuses NaN and ±infinity unless this is False (its doc then says what they mean).
    """
    meta = {"doc": doc, "choices": tuple(choices) if choices else None, "ge": ge, "gt": gt, "lt": lt, "le": le,
            "finite": finite}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda d=default: type(d)(d), metadata=meta)
    return field(default=default, metadata=meta)


def choices(schema: type, key: str) -> tuple[Any, ...]:
    """The allowed values of `key` in the dataclass `schema` (its field's `choices`): the one
    list that validation, argument parsers and the code that branches on the value all read."""
    for f in dataclasses.fields(schema):
        if f.name == key and f.metadata.get("choices"):
            return f.metadata["choices"]
    raise KeyError(f"{schema.__name__}.{key} has no choices")


@dataclass
class ModelShape:
    """Shape of a model, known without loading weights (used by the memory estimate)."""

    # Not a closed list here: a family is a module of circuitkit/models/families/, which names it
    # (an unknown name is refused where the shape is used, listing the known ones).
    family: Optional[str] = _f(None, "architecture family: the name of a module of circuitkit/models/families/"
                               " (gpt2, gpt_neox, llama, gemma3, qwen3, qwen3_moe, ...)")
    n_layers: Optional[int] = _f(None, "transformer blocks", ge=1)
    n_heads: Optional[int] = _f(None, "attention (query) heads per layer", ge=1)
    n_kv_heads: Optional[int] = _f(None, "key/value heads per layer (GQA when < n_heads)", ge=1)
    head_dim: Optional[int] = _f(None, "width of one head", ge=1)
    d_model: Optional[int] = _f(None, "residual stream width", ge=1)
    d_mlp: Optional[int] = _f(None, "MLP hidden width", ge=1)
    vocab_size: Optional[int] = _f(None, "vocabulary size (rows of the unembedding)", ge=1)
    n_params: Optional[int] = _f(None, "parameter count", ge=1)


@dataclass
class ModelConfig:
    name: str = _f("builtin:tiny-gpt2", "hub name, local directory, a .gguf file, builtin:NAME (a local fixture) or"
                   " fetched:NAME (a model `circuitkit fetch NAME` installed, e.g. fetched:smollm2)")
    gguf_file: Optional[str] = _f(None, "a GGUF file inside model.name (a directory or hub id), loaded through"
                                  " transformers and dequantized to float32; null = model.name is not a GGUF")
    revision: Optional[str] = _f(None, "hub revision (branch, tag or commit); null = default branch")
    adapter: Optional[str] = _f(None, "a PEFT LoRA adapter directory (what save_pretrained wrote: adapter_config.json"
                                " and adapter_model.safetensors) applied on top of model.name; circuit discovery runs"
                                " on the merged weights, Gradian keeps the LoRA linears (grads.module_filter=[adapter]"
                                " selects them). Needs peft (pip install 'circuitkit-gradian[peft]'); null = none")
    base_name: Optional[str] = _f(None, "for a full fine-tune in model.name: the model it was tuned from (hub name,"
                                  " local directory or builtin:NAME, loaded at its default revision), recorded in the"
                                  " run manifest and the index; null = none")
    precision: str = _f("auto", "weight dtype: auto = bfloat16 where the device computes it natively (CUDA"
                        " compute capability 8.0+, MPS on macOS 14+, a CPU with AVX512-BF16 or AMX), else float32;"
                        " bfloat16, float16, float32 = that dtype everywhere",
                        choices=("auto", "bfloat16", "float16", "float32"))
    trust_remote_code: bool = _f(False, "allow model code from the hub; off unless you set it")
    attn_implementation: str = _f("sdpa", "attention kernel", choices=("sdpa", "eager"))
    device_map: Any = _f(None, "split the model over devices with accelerate: null = whole model on one device;"
                         " auto, balanced, balanced_low_0, sequential; or {module name: GPU number, cpu or disk}")
    max_memory: Any = _f(None, "with device_map: the most each device may hold, e.g. {0: 20GiB, 1: 20GiB, cpu: 64GiB};"
                         " null = what accelerate finds free")
    offload_folder: Optional[str] = _f(None, "with device_map: where layers mapped to 'disk' are stored")
    shape: ModelShape = field(default_factory=ModelShape, metadata={"doc": "shape known without loading"})


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


@dataclass
class GradsConfig:
    enabled: bool = _f(True, "run the gradient-indexing stage")
    data_path: Optional[str] = _f(None, "training data: a JSONL, Parquet or Arrow file, a datasets.save_to_disk"
                                  " directory, or a hub dataset name (prompt+completion or messages rows)")
    batch_size: int = _f(8, "rows per forward/backward (first memory lever)", ge=1)
    max_seq_length: int = _f(512, "tokens per row after truncation (second memory lever)", ge=2)
    on_truncation: str = _f("warn", "when a completion is cut", choices=("warn", "error", "drop"))
    truncation_side: str = _f("right", "what truncation removes", choices=("right", "prompt_left"))
    loss_reduction: str = _f("sum", "per-example loss over supervised tokens", choices=("sum", "mean"))
    loss: str = _f("margin", "per-token function whose gradient is indexed: margin = TRAK's negated log-odds"
                   " -log(p/(1-p)) of the correct token, ce = cross-entropy", choices=("ce", "margin"))
    append_eos: bool = _f(False, "prompt/completion rows end with the tokenizer's EOS, supervised; chat rows also"
                          " supervise the template's end-of-turn tokens (false: only what the rows wrote)")
    prepend_bos: Optional[bool] = _f(None, "prompt/completion rows start with BOS: true, false, or null = as the"
                                     " tokenizer does by itself (chat rows: as the template writes)")
    module_filter: Optional[list[str]] = _f(None, "name patterns of linear modules; null = all in the blocks (the index size, and the peak a little: activations kept from the first selected module on, capture buffers). With model.adapter: adapter (or lora_A, lora_B) = the LoRA linears, which a base module's pattern does not select")
    projection: str = _f("kronecker_orthogonal", "random projection kind: kronecker_orthogonal = Kronecker factors with"
                         " orthonormal rows, kronecker = Rademacher (±1) factors, dense = one Gaussian matrix,"
                         " whitened = kronecker_orthogonal after each module's damped full K-FAC whitening (a"
                         " factor pass over the data before any row; the matrices are stored with the index),"
                         " eigen = kronecker_orthogonal rotated into the eigenbasis of each module's projected"
                         " K-FAC factors (the same factor pass; dense rows score as kronecker_orthogonal's; each"
                         " coordinate one K-FAC eigen-direction, what row_format signs keeps the sign of)",
                         choices=("kronecker", "kronecker_orthogonal", "dense", "whitened", "eigen"))
    projection_dim: Optional[int] = _f(1024, "projected width per module; null = raw gradients (the index size, and the peak a little: capture buffers, projection matrices)", ge=1)
    projection_seed: int = _f(0, "seed of the projection matrices", ge=0, le=MAX_SEED)
    width_allocation: str = _f("uniform", "how the row's total width, n_modules x projection_dim, is split among"
                               " the modules: uniform = projection_dim each; spectrum = in proportion to each"
                               " module's effective dimension under its damped K-FAC curvature (a factor pass over"
                               " the data before any row, as whitened's; each width at least projection_dim / 4, a"
                               " balanced Kronecker size; the widths stored with the index). Kronecker projections"
                               " only, not with preconditioner module", choices=("uniform", "spectrum"))
    preconditioner: str = _f("kfac", "curvature stored with the index: each module's second moment of the rows"
                             " (module, for `gradian rank --score influence|whitened`), K-FAC factors of the"
                             " projected activations and output gradients (kfac, for --score kfac|ekfac), or both",
                             choices=("none", "module", "kfac", "module+kfac"))
    fisher: str = _f("empirical", "the Fisher whose K-FAC factors and EK-FAC eigenvalues kfac stores: empirical ="
                     " output gradients of the data's own labels; sampled = the true Fisher, of labels sampled"
                     " from the model's own prediction at each supervised position (Kronfluence's default; one"
                     " more backward per batch and the sampled rows stored beside the rows; the stored rows keep"
                     " the data's labels)", choices=("empirical", "sampled"))
    storage_dtype: str = _f("float16", "dtype of stored rows (on-disk index size only, not the peak)",
                          choices=("float16", "bfloat16", "float32"))
    factor_rows: Optional[int] = _f(None, "rows the factor pass reads before any row is written (projection whitened,"
                                    " width_allocation spectrum): null = every row (a second pass over the data);"
                                    " m = an evenly spaced sample of at most m rows (every ceil(n/m)-th), recorded"
                                    " in the stored matrices' settings", ge=1)
    row_format: str = _f("dense", "how each module's projected gradient G (k_o x k_i) is stored: dense = G itself;"
                         " factored = rank-c factors U (k_o x c), V (k_i x c), c = row_rank, with G ~ U V^T:"
                         " c (k_o + k_i) values, exact for a row with at most c positions carrying gradient, else"
                         " G's best rank-c approximation (gradian.index.formats.factored). Kronecker projections or raw rows, not"
                         " dense; not with preconditioner module; signs = one bit per projected coordinate (its sign,"
                         " 1/32 of float32's bytes), scored by n - 2 x Hamming distance (gradian.index.formats.signs): rank with"
                         " cosine or dot, preconditioner none (projection eigen, the grads=signs preset, or whitened"
                         " for a K-FAC-preconditioned score; storage_dtype does not apply)",
                         choices=("dense", "factored", "signs"))
    row_rank: int = _f(8, "c, the rank of each module's factors with row_format=factored (at most min(k_o, k_i)"
                       " of every module; unused with dense)", ge=1, le=4096)
    batch_tokens: Optional[int] = _f(None, "token budget of one batch: rows x longest row (padding included);"
                                     " null = batch_size x max_seq_length", ge=1)
    group_by_length: bool = _f(True, "batch rows of similar length together (false: batches in source order)")
    device_batch: str = _f("auto", "auto = on an accelerator (CUDA, MPS) raise the token budget and the row cap to the"
                           " largest batch the memory estimate fits in 90% of the device's free memory (never below"
                           " batch_size / batch_tokens; recorded in the index summary); off = batch_size and"
                           " batch_tokens as set. The CPU always uses them as set", choices=("auto", "off"))
    activations: str = _f("auto", "how multi-op activations (GPT-2's tanh GELU) run in the gradient pass: model"
                          " (the model's own ops, intermediates kept), recompute (the same ops re-run in the"
                          " backward: same bits, lower peak, ~6% slower), fused (one torch kernel for the same"
                          " function: lower peak, faster, other rounding); auto = fused for 16-bit model"
                          " precision, model for float32", choices=("auto", "model", "recompute", "fused"))
    data_format: str = _f("auto", "format of data_path", choices=("auto", "jsonl", "parquet", "arrow", "hf"))
    data_split: Optional[str] = _f("train", "split of a DatasetDict directory or a hub dataset")
    data_row_range: Optional[list[int]] = _f(None, "[start, end): read only these records of the source"
                                              " (0-based, source order); null = all")
    prompt_column: str = _f("prompt", "column (JSONL key) holding the prompt")
    completion_column: str = _f("completion", "column (JSONL key) holding the completion")
    messages_column: str = _f("messages", "column (JSONL key) holding chat messages")
    rows_per_shard: int = _f(4096, "rows per safetensors shard", ge=1)
    num_shards: int = _f(1, "workers splitting the data", ge=1)
    shard_index: int = _f(0, "this worker's share, 0 <= shard_index < num_shards", ge=0)
    index_dir: Optional[str] = _f(None, "where the index goes; null = <run dir>/index")
    circuit: Optional[str] = _f(None, "restrict the index to a circuit's kept heads/MLPs: null = no,"
                                " 'run' = this run's circuit.pt, or a path to a circuit.pt")
    circuit_mlps: str = _f("kept", "with grads.circuit: index the kept MLPs' output projections too, or heads only",
                           choices=("kept", "none"))


# The choices of attribute.query_loss and attribute.engines; gradian.attribute's QUERY_LOSSES and ENGINES
# (plus "auto") are the same lists (a test compares): the runner core does not import gradian.
ATTRIBUTE_QUERY_LOSSES = ("contrastive", "ce", "margin")
ATTRIBUTE_ENGINES = ("auto", "dot", "cosine", "influence", "kfac", "ekfac")


@dataclass
class AttributeConfig:
    eval_path: Optional[str] = _f(None, "the attribute stage (after grads; not in the default stages): a JSONL of"
                                  " {prompt, completion} eval items, the completion being the answer, on which the"
                                  " tuned model (model.name with model.adapter, or a full fine-tune with"
                                  " model.base_name) is compared with its base model; the training rows of this run's"
                                  " index that caused the regression are accused (gradian attribute). Required when"
                                  " stages lists attribute; null = none")
    query_loss: str = _f("contrastive", "the regressed items' query gradient: contrastive = ∇[ℓ(answer) − ℓ(what the"
                         " tuned model says)], ce = ∇ℓ(answer), margin = ∇ of the answer tokens' negated log-odds",
                         choices=ATTRIBUTE_QUERY_LOSSES)
    engines: list[str] = _f(["auto"], "scoring engines, the first accuses and the others report their rank"
                            " agreement with it: auto = gradian rank's default score for the index (ekfac with"
                            " K-FAC factors, else cosine)", choices=ATTRIBUTE_ENGINES)
    top_k: int = _f(40, "training rows accused (most negative score first)", ge=1, le=100_000)
    bootstrap: int = _f(2000, "paired bootstrap resamples of the regression's 95 % interval (seeded with the"
                        " top-level seed)", ge=100, le=1_000_000)
    thin_margin: float = _f(1.0, "nats: a flipped item whose base margin was below this, and that the tuned model"
                            " gets wrong by less than this, counts toward base-model blame", ge=0.0)
    span_min_tokens: int = _f(64, "accused rows with at least this many supervised tokens get one gradient per"
                              " sentence (the drill-down); 0 = none", ge=0)


@dataclass
class PreflightConfig:
    on_exceed: str = _f("error", "when the estimate exceeds free memory", choices=("error", "warn"))
    headroom: float = _f(0.9, "fraction of free device memory a run may plan to use", gt=0.0, le=1.0)
    ig_error_budget: float = _f(0.01, "EAP-IG score error (relative L2) the ig_rule/ig_steps advice stays within",
                                gt=0.0, lt=1.0)


@dataclass
class ReportConfig:
    enabled: bool = _f(True, "write report.html (the run as one self-contained page: circuitkit_app.report) in the"
                       " run dir at the end of every run, and one comparing the jobs in a multirun's sweep dir")
    top_edges: int = _f(2000, "the strongest edges of the circuit embedded in the report's graph (its edge"
                        " control ranges over them); every other edge is counted in per-layer totals", ge=1,
                        le=20000)


@dataclass
class AppConfig:
    model: ModelConfig = field(default_factory=ModelConfig, metadata={"doc": "model group"})
    discovery: DiscoveryConfig = field(default_factory=DiscoveryConfig, metadata={"doc": "discovery group"})
    pruning: PruningConfig = field(default_factory=PruningConfig, metadata={"doc": "pruning group"})
    export: ExportConfig = field(default_factory=ExportConfig, metadata={"doc": "export group"})
    grads: GradsConfig = field(default_factory=GradsConfig, metadata={"doc": "grads group"})
    attribute: AttributeConfig = field(default_factory=AttributeConfig, metadata={"doc": "attribute group"})
    preflight: PreflightConfig = field(default_factory=PreflightConfig, metadata={"doc": "preflight group"})
    report: ReportConfig = field(default_factory=ReportConfig, metadata={"doc": "report group"})
    stages: list[str] = _f(list(DEFAULT_STAGES), "stages to run, in pipeline order (attribute runs only when listed)",
                           choices=ALL_STAGES)
    output_path: Optional[str] = _f(None, "where circuit.pt is written; null = <run dir>/circuit.pt")
    seed: int = _f(0, "seed for data sampling and anything random", ge=0, le=MAX_SEED)
    skip_completed: bool = _f(True, "skip stages whose artifacts and config hash match the manifest")


GROUPS = {"model": ModelConfig, "discovery": DiscoveryConfig, "pruning": PruningConfig,
          "export": ExportConfig, "grads": GradsConfig, "attribute": AttributeConfig, "preflight": PreflightConfig,
          "report": ReportConfig}


def register_configs() -> None:
    """Register the root schema `schema` in Hydra's ConfigStore.

    `conf/config.yaml` lists it first in its defaults, so every group file is merged into its
    typed dataclass (ModelConfig, DiscoveryConfig, ...). Group-level entries are not stored:
    they would show up as a bogus choice (`model=schema`) in Hydra's option lists.
    """
    ConfigStore.instance().store(name="schema", node=AppConfig)


register_configs()


# --------------------------------------------------------------------------- validation

def _unwrap_optional(tp: Any) -> tuple[Any, bool]:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return tp, False


def _type_hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _describe_allowed(tp: Any, optional: bool, meta: Mapping[str, Any]) -> str:
    if tp is Any:  # the free-form placement keys
        return "null, a name or a mapping (see below)"
    parts = []
    if meta.get("choices"):
        parts.append("one of " + ", ".join(repr(c) for c in meta["choices"]))
    else:
        name = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}.get(tp)
        if typing.get_origin(tp) is list:
            name = "a list of integers" if typing.get_args(tp) == (int,) else "a list of strings"
        parts.append(name or str(tp))
    bounds = []
    if meta.get("ge") is not None:
        bounds.append(f">= {meta['ge']}")
    if meta.get("gt") is not None:
        bounds.append(f"> {meta['gt']}")
    if meta.get("le") is not None:
        bounds.append(f"<= {meta['le']}")
    if meta.get("lt") is not None:
        bounds.append(f"< {meta['lt']}")
    if bounds:
        parts.append(" and ".join(bounds))
    if optional:
        parts.append("or null")
    return " ".join(parts)


def _find_leaf_elsewhere(name: str, cls: type = AppConfig, prefix: str = "") -> list[str]:
    """Full paths of schema keys called `name` anywhere in the schema."""
    found = []
    for f in dataclasses.fields(cls):
        path = f"{prefix}{f.name}"
        if f.name == name:
            found.append(path)
        tp, _ = _unwrap_optional(_type_hints(cls)[f.name])
        if dataclasses.is_dataclass(tp):
            found.extend(_find_leaf_elsewhere(name, tp, path + "."))
    return found


def unknown_key_error(path: str, cls: type) -> ConfigError:
    """The error for `path` whose last part is not a field of `cls`."""
    block, _, key = path.rpartition(".")
    valid = [f.name for f in dataclasses.fields(cls)]
    where = f"'{block}'" if block else "the top level"
    msg = f"Unknown config key '{path}': '{key}' is not a key of {where}."
    elsewhere = [p for p in _find_leaf_elsewhere(key) if p != path]
    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.6)
    if elsewhere:
        msg += f" '{key}' belongs at {' or '.join(elsewhere)}: set it there instead."
    elif close:
        prefix = f"{block}." if block else ""
        msg += f" Did you mean '{prefix}{close[0]}'?"
    msg += f" Valid keys of {where}: {', '.join(valid)}."
    if key in ("memory_efficient", "use_half_precision_activations"):
        msg += (" This key does nothing in CircuitKit (older docs of similar tools accept it silently);"
                " what lowers the attribution peak is discovery.batch_size first, then"
                " discovery.data_params.seq_len, discovery.level=node and model.precision"
                " (ig_steps and num_examples change the time, not the peak; see docs/memory.md).")
    return ConfigError(msg)


def _is_finite(value: float) -> bool:
    """NaN, ±inf and an integer beyond float's range are not finite."""
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def _check_value(path: str, value: Any, tp: Any, meta: Mapping[str, Any]) -> Any:
    """Validate one leaf value; returns it (ints accepted for floats)."""
    if tp is Any:  # free-form keys (model.device_map, model.max_memory): checked in _check_placement
        return value
    base, optional = _unwrap_optional(tp)
    allowed = _describe_allowed(base, optional, meta)
    if value is None:
        if optional:
            return None
        raise ConfigError(f"Config key '{path}' is null, but it must be {allowed}.")
    if typing.get_origin(base) is list:
        if not isinstance(value, (list, tuple, ListConfig)):
            raise ConfigError(f"Config key '{path}' = {value!r} must be {allowed}.")
        items = list(value)
        item_type = (typing.get_args(base) or (str,))[0]
        for item in items:
            if item_type is int and (not isinstance(item, int) or isinstance(item, bool)):
                raise ConfigError(f"Config key '{path}' contains {item!r} ({type(item).__name__});"
                                  f" it must be {allowed}.")
            if item_type is str and not isinstance(item, str):
                raise ConfigError(f"Config key '{path}' contains {item!r} ({type(item).__name__});"
                                  f" it must be {allowed}.")
            if meta.get("choices") and item not in meta["choices"]:
                raise ConfigError(f"Config key '{path}' contains {item!r}; each entry must be {allowed}.")
        return items
    ok = {
        bool: isinstance(value, bool),
        int: isinstance(value, int) and not isinstance(value, bool),
        float: isinstance(value, (int, float)) and not isinstance(value, bool),
        str: isinstance(value, str),
    }.get(base, True)
    if not ok:
        raise ConfigError(f"Config key '{path}' = {value!r} ({type(value).__name__}) has the wrong type;"
                          f" it must be {allowed}.")
    if base is float and meta.get("finite", True) and not _is_finite(value):
        raise ConfigError(f"Config key '{path}' = {value!r} is not a finite number; it must be {allowed} (NaN and"
                          " infinity are refused: give a number).")
    if meta.get("choices") and value not in meta["choices"]:
        close = difflib.get_close_matches(str(value), [str(c) for c in meta["choices"]], n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ConfigError(f"Config key '{path}' = {value!r} is not allowed; it must be {allowed}.{hint}")
    for bound, test in (("ge", lambda v, b: v >= b), ("gt", lambda v, b: v > b),
                        ("le", lambda v, b: v <= b), ("lt", lambda v, b: v < b)):
        if meta.get(bound) is not None and not test(value, meta[bound]):
            raise ConfigError(f"Config key '{path}' = {value!r} is out of range; it must be {allowed}.")
    return float(value) if base is float else value


def _validate_block(data: Mapping[str, Any], cls: type, prefix: str) -> Any:
    hints = _type_hints(cls)
    names = {f.name: f for f in dataclasses.fields(cls)}
    for key in data:
        if key not in names:
            raise unknown_key_error(f"{prefix}{key}", cls)
    kwargs = {}
    for name, f in names.items():
        path = f"{prefix}{name}"
        tp, optional = _unwrap_optional(hints[name])
        if name not in data:
            continue
        value = data[name]
        if dataclasses.is_dataclass(tp):
            if value is None and optional:
                kwargs[name] = None
                continue
            if not isinstance(value, Mapping):
                raise ConfigError(f"Config key '{path}' = {value!r} must be a block of keys"
                                  f" ({', '.join(x.name for x in dataclasses.fields(tp))}).")
            kwargs[name] = _validate_block(value, tp, path + ".")
        else:
            kwargs[name] = _check_value(path, value, hints[name], f.metadata)
    return cls(**kwargs)


DEVICE_MAP_STRATEGIES = ("auto", "balanced", "balanced_low_0", "sequential")


def _check_placement(m: ModelConfig) -> None:
    dm = m.device_map
    if dm is None:
        if m.max_memory is not None or m.offload_folder is not None:
            raise ConfigError("Config keys 'model.max_memory' / 'model.offload_folder' only apply with"
                              " model.device_map set (e.g. model.device_map=auto).")
        return
    if isinstance(dm, str):
        if dm not in DEVICE_MAP_STRATEGIES:
            raise ConfigError(f"Config key 'model.device_map' = {dm!r} is not allowed; it must be null, one of"
                              f" {', '.join(DEVICE_MAP_STRATEGIES)}, or a mapping {{module name: device}}.")
    elif isinstance(dm, Mapping):
        bad = [f"{k}: {v!r}" for k, v in dm.items()
               if not (isinstance(v, int) and not isinstance(v, bool) or isinstance(v, str))]
        if not dm or bad:
            raise ConfigError(f"Config key 'model.device_map' has {', '.join(bad) or 'no entries'}; each module"
                              " must map to a GPU number, a device name (cuda:1, cpu) or 'disk'.")
        if "disk" in dm.values() and m.offload_folder is None:
            raise ConfigError("Config key 'model.device_map' maps modules to 'disk', so model.offload_folder must"
                              " name a directory for them.")
    else:
        raise ConfigError(f"Config key 'model.device_map' = {dm!r} must be null, a strategy name"
                          f" ({', '.join(DEVICE_MAP_STRATEGIES)}) or a mapping {{module name: device}}.")
    if m.max_memory is not None and not isinstance(m.max_memory, Mapping):
        raise ConfigError(f"Config key 'model.max_memory' = {m.max_memory!r} must be a mapping {{device: size}},"
                          " e.g. {0: 20GiB, cpu: 64GiB}.")


def _check_attribute(cfg: AppConfig) -> None:
    """The attribute stage's settings agree with `stages`: listed, it needs an eval set, a base model
    and an index; attribute.eval_path without the stage would be silently ignored."""
    a, listed = cfg.attribute, "attribute" in cfg.stages
    if a.eval_path is not None and not listed:
        with_it = [s for s in ALL_STAGES if s in cfg.stages or s == "attribute"]
        raise ConfigError(f"Config key 'attribute.eval_path' = {a.eval_path!r} is set, but stages does not list"
                          f" attribute, so nothing would read it: add the stage (stages=[{','.join(with_it)}]) or"
                          " drop attribute.eval_path.")
    if not listed:
        return
    if a.eval_path is None:
        raise ConfigError("Config key 'attribute.eval_path' is null, but stages lists attribute, which measures the"
                          " fine-tune's regression on an eval set: set attribute.eval_path=EVAL.jsonl ({prompt,"
                          " completion} rows, the completion being the answer), or drop attribute from stages.")
    if not a.eval_path.strip():
        raise ConfigError("Config key 'attribute.eval_path' is empty: give the eval set's JSONL file.")
    if not cfg.model.adapter and not cfg.model.base_name:
        raise ConfigError("stages lists attribute, which compares the tuned model with the model it was tuned from,"
                          f" but model.name {cfg.model.name!r} has neither: set model.adapter=DIR (a LoRA fine-tune"
                          " of model.name) or model.base_name=NAME_OR_DIR (model.name is a full fine-tune of it).")
    if not cfg.grads.enabled and not cfg.grads.index_dir:
        raise ConfigError("Config key 'grads.enabled' = False, but stages lists attribute, which ranks the rows of"
                          " the gradient index the grads stage writes: set grads.enabled=true, or grads.index_dir="
                          "INDEX for an index made before.")


def _check_cross_fields(cfg: AppConfig) -> None:
    _check_placement(cfg.model)
    g = cfg.grads
    if g.shard_index >= g.num_shards:
        raise ConfigError(f"Config key 'grads.shard_index' = {g.shard_index} must be < grads.num_shards"
                          f" = {g.num_shards} (workers are numbered 0..num_shards-1).")
    if g.module_filter and "adapter" in g.module_filter and not cfg.model.adapter:
        raise ConfigError("Config key 'grads.module_filter' names 'adapter' (the linears of a LoRA adapter), but"
                          " model.adapter is null: set model.adapter=DIR, or drop 'adapter' from the filter.")
    if g.data_row_range is not None and (len(g.data_row_range) != 2 or not 0 <= g.data_row_range[0] < g.data_row_range[1]):
        raise ConfigError(f"Config key 'grads.data_row_range' = {list(g.data_row_range)} must be [start, end] with"
                          " 0 <= start < end (records start..end-1), or null for all.")
    order = [s for s in ALL_STAGES if s in cfg.stages]
    if list(cfg.stages) != order:
        raise ConfigError(f"Config key 'stages' = {list(cfg.stages)} must list stages in pipeline order"
                          f" {list(ALL_STAGES)}; e.g. stages=[{','.join(order)}].")
    if len(set(cfg.stages)) != len(cfg.stages):
        raise ConfigError(f"Config key 'stages' = {list(cfg.stages)} names a stage twice.")
    _check_attribute(cfg)
    d = cfg.discovery
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


def validate(cfg: DictConfig | Mapping[str, Any] | AppConfig) -> AppConfig:
    """Check a composed config (or a plain dict shaped like it) and return the typed AppConfig.

    Missing keys take the schema defaults; anything unknown, mistyped or out of range raises
    ConfigError naming the key, the value and what is allowed.
    """
    try:
        if isinstance(cfg, AppConfig):
            cfg = OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)
        elif isinstance(cfg, DictConfig):
            cfg = OmegaConf.to_container(cfg, resolve=True)
    except OmegaConfBaseException as err:
        raise config_error_from_omegaconf(err) from None
    if not isinstance(cfg, Mapping):
        raise ConfigError(f"A config must be a mapping of groups to keys, got {type(cfg).__name__}.")
    data = {k: v for k, v in cfg.items() if k != "hydra"}
    typed = _validate_block(data, AppConfig, "")
    _check_cross_fields(typed)
    return typed


def config_error_from_omegaconf(err: OmegaConfBaseException) -> ConfigError:
    """One line for an OmegaConf error (an interpolation that does not resolve, a bad type)."""
    key = getattr(err, "full_key", None)
    text = str(getattr(err, "msg", None) or err).splitlines()[0].strip()
    where = f"Config key '{key}'" if key else "The config"
    if "nterpolation" in type(err).__name__ or "${" in text:
        return ConfigError(f"{where} has an interpolation that cannot be resolved ({text}); write the value"
                           " itself, or ${other.key} naming an existing key.")
    return ConfigError(f"{where}: {text}.")


def _parse_overrides(overrides: list[str]) -> list:
    """Hydra's parse of the overrides; ConfigError naming the one that does not parse."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    parser = OverridesParser.create()
    out = []
    for text in overrides:
        try:
            out.extend(parser.parse_overrides([text]))
        except HydraException as err:
            detail = str(err).splitlines()[0].strip()
            raise ConfigError(f"Override {text!r} is not valid override syntax ({detail}). Write key=value;"
                              " quote values with brackets, commas or spaces in the shell, e.g."
                              " 'stages=[data,attribution]'.") from None
    return out


def _schema_at(path: list[str]) -> tuple[type | None, Any, Mapping[str, Any] | None]:
    """Walk the schema along `path`; returns (block class, leaf type, leaf metadata)."""
    cls: type = AppConfig
    for i, part in enumerate(path):
        names = {f.name: f for f in dataclasses.fields(cls)}
        if part not in names:
            raise unknown_key_error(".".join(path[: i + 1]), cls)
        tp, _ = _unwrap_optional(_type_hints(cls)[part])
        if i == len(path) - 1:
            return cls, _type_hints(cls)[part], names[part].metadata
        if not dataclasses.is_dataclass(tp):
            raise ConfigError(f"Config key '{'.'.join(path[: i + 1])}' is a value, not a block;"
                              f" '{'.'.join(path)}' does not exist.")
        cls = tp
    return cls, None, None


def _check_group_choice(group: str, values: list[Any]) -> None:
    """A group choice (`model=gpt2`) must name a file of conf/<group>/ (each value of a sweep too,
    so a sweep with one bad option stops before any job instead of in the middle)."""
    options = sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))
    for value in values:
        if value is not None and str(value) not in options:
            close = difflib.get_close_matches(str(value), options, n=1)
            hint = f" Did you mean {group}={close[0]}?" if close else ""
            raise ConfigError(f"'{group}={value}' names no config file conf/{group}/{value}.yaml; options:"
                              f" {', '.join(options)}.{hint}")


def _unquoted(value: Any) -> Any:
    """A parsed override element as the job will get it: quoted strings (Hydra's QuotedString, also
    inside lists and dicts) as their text."""
    from hydra.core.override_parser.types import QuotedString

    if isinstance(value, QuotedString):
        return value.text
    if isinstance(value, list):
        return [_unquoted(v) for v in value]
    if isinstance(value, dict):
        return {k: _unquoted(v) for k, v in value.items()}
    return value


def check_overrides(overrides: Iterable[str], ranges: bool = True) -> None:
    """Validate command-line overrides against the schema before Hydra composes them.

    Group choices (`model=gpt2`) are left to Hydra, which lists the available options;
    `hydra.*` overrides are Hydra's own. Every other key must exist in the schema and its
    value (each value of a sweep) must have the right type and, with `ranges`, be an allowed
    choice in range. A sweep passes ranges=False: one job's out-of-range value fails that
    job alone, not the sweep.
    """
    parsed = _parse_overrides(list(overrides))
    for ov in parsed:
        key = ov.key_or_group
        if key.startswith(("hydra.", "hydra/")) or key == "hydra" or ov.is_delete():
            continue
        parts = key.split(".")
        if len(parts) == 1 and parts[0] in GROUPS and ov.package is None:
            _check_group_choice(key, list(ov.sweep_iterator()) if ov.is_sweep_override() else [ov.value()])
            continue
        _, leaf_tp, meta = _schema_at(parts)
        if leaf_tp is None or meta is None:
            continue
        base, _ = _unwrap_optional(leaf_tp)
        if dataclasses.is_dataclass(base):
            continue
        # A sweep's elements come raw (a quoted value is a QuotedString): unquote them as Hydra does for a job.
        values = ([_unquoted(v) for v in ov.sweep_iterator()] if ov.is_sweep_override() else [ov.value()])
        if not ranges:
            meta = {"doc": meta.get("doc"), "finite": False}  # NaN / inf: out of range, the job's own error
        for v in values:
            _check_value(key, v, leaf_tp, meta)


def _yaml_error(err: Exception) -> ConfigError:
    """One line for a YAML syntax error: the file, line and column, and what the parser expected."""
    mark = getattr(err, "problem_mark", None) or getattr(err, "context_mark", None)
    problem = getattr(err, "problem", None) or " ".join(str(err).split())
    where = f"{mark.name}, line {mark.line + 1}, column {mark.column + 1}" if mark is not None else "a config file"
    context, start = getattr(err, "context", None), getattr(err, "context_mark", None)
    if context and start is not None and mark is not None and start.line != mark.line:
        problem += f" ({context} from line {start.line + 1}, column {start.column + 1})"
    return ConfigError(f"YAML syntax error in {where}: {problem}; fix the file (quote values with ':', '[' or '{{').")


def _missing_config(config_name: str, config_dir: str | None) -> ConfigError:
    dirs = [Path(config_dir).expanduser()] if config_dir else []
    dirs.append(CONF_DIR)
    options = sorted({p.stem for d in dirs if d.is_dir() for p in d.glob("*.yaml")})
    close = difflib.get_close_matches(config_name, options, n=1)
    hint = f" Did you mean --config-name {close[0]}?" if close else ""
    return ConfigError(f"--config-name {config_name}: there is no {config_name}.yaml in"
                       f" {' or '.join(str(d) for d in dirs)} (add --config-dir DIR for your own); configs there:"
                       f" {', '.join(options) or 'none'}.{hint}")


def _hydra_compose(overrides: list[str], config_name: str, with_hydra: bool, keep: bool = False,
                   config_dir: str | None = None) -> DictConfig:
    """Hydra's compose API on conf/, its errors turned into ConfigError naming the problem.

    with_hydra: include the `hydra` block (run and sweep dirs). keep: leave Hydra's global
    state initialized afterwards (as `compose` always has), else clear it. config_dir: a user's
    directory of configs (`--config-dir`), searched for `config_name` first, with conf/ behind it
    for the groups and defaults it names.
    """
    import yaml
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException, MissingConfigException

    if GlobalHydra.instance().is_initialized():
        GlobalHydra.instance().clear()
    primary = str(CONF_DIR)
    if config_dir is not None:
        user_dir = Path(config_dir).expanduser().resolve()
        if not user_dir.is_dir():
            raise ConfigError(f"--config-dir {config_dir}: {user_dir} is not a directory; give the directory that"
                              " holds your .yaml config.")
        if (user_dir / f"{config_name}.yaml").is_file():  # else conf/ holds it: Hydra's CLI finds it there too
            primary = str(user_dir)
            overrides = [*overrides, f"hydra.searchpath=[file://{CONF_DIR}]"]
    try:
        with initialize_config_dir(config_dir=primary, version_base="1.3"):
            return hydra_compose(config_name=config_name, overrides=overrides, return_hydra_config=with_hydra)
    except yaml.YAMLError as err:
        raise _yaml_error(err) from None
    except OmegaConfBaseException as err:
        raise config_error_from_omegaconf(err) from None
    except MissingConfigException as err:
        if "primary config" in str(err):
            raise _missing_config(config_name, config_dir) from None
        raise ConfigError(" ".join(str(err).split())) from None
    except HydraException as err:  # e.g. a group option that does not exist (model=nope)
        raise _unknown_key_in_file(err, [primary, str(CONF_DIR)]) or ConfigError(" ".join(str(err).split())) from None
    finally:
        if not keep:
            GlobalHydra.instance().clear()


def _unknown_key_in_file(err: Exception, dirs: list[str]) -> ConfigError | None:
    """Hydra's "In 'X': ConfigKeyError raised while composing config" (a config file sets a key the
    schema lacks) as the sentence of `unknown_key_error`, after the file's path; None otherwise."""
    import re

    from omegaconf.errors import ConfigKeyError

    cause = err.__cause__ or err.__context__
    key = getattr(cause, "full_key", None)
    if not isinstance(cause, ConfigKeyError) or not key:
        return None
    try:
        _schema_at(str(key).split("."))
    except ConfigError as unknown:
        found = re.match(r"In '([^']+)'", str(err))
        name = found.group(1) if found else None
        files = [Path(d) / f"{name}.yaml" for d in dirs] if name else []
        where = next((str(f) for f in files if f.is_file()), f"{name}.yaml" if name else "a config file")
        return ConfigError(f"{where}: {unknown}")
    return None


def compose(overrides: Iterable[str] = (), config_name: str = "config") -> tuple[DictConfig, AppConfig]:
    """Compose the config like `python -m circuitkit.run` would, with Hydra's compose API.

    Returns the composed DictConfig and its validated AppConfig.
    """
    overrides = list(overrides)
    check_overrides(overrides)
    cfg = _hydra_compose(overrides, config_name, with_hydra=False, keep=True)
    return cfg, validate(cfg)


def compose_with_run_dir(overrides: Iterable[str], config_name: str = "config",
                         config_dir: str | None = None) -> tuple[AppConfig, str]:
    """One composition that gives what `compose` validates and `hydra.run.dir` resolved now,
    so a single run is checked before Hydra creates its directory (a composition takes
    seconds on a busy machine: one, not two)."""
    overrides = list(overrides)
    check_overrides(overrides)
    cfg = _hydra_compose(overrides, config_name, with_hydra=True, config_dir=config_dir)
    try:
        run_dir = str(OmegaConf.select(cfg, "hydra.run.dir", throw_on_resolution_failure=True))
        typed = validate(OmegaConf.masked_copy(cfg, [k for k in cfg if k != "hydra"]))
    except OmegaConfBaseException as err:
        raise config_error_from_omegaconf(err) from None
    return typed, run_dir


def hydra_dir(overrides: Iterable[str], kind: str = "run", config_name: str = "config",
              config_dir: str | None = None) -> str:
    """`hydra.run.dir` (kind "run") or `hydra.sweep.dir` ("sweep") as these overrides set it,
    resolved now (so it can be checked before Hydra creates it)."""
    overrides = list(overrides)
    # A sweep's values do not decide its directory; compose cannot take them.
    single = [text for text, ov in zip(overrides, _parse_overrides(overrides), strict=True)
              if not ov.is_sweep_override()]
    cfg = _hydra_compose(single, config_name, with_hydra=True, config_dir=config_dir)
    try:
        return str(OmegaConf.select(cfg, f"hydra.{kind}.dir", throw_on_resolution_failure=True))
    except OmegaConfBaseException as err:
        raise config_error_from_omegaconf(err) from None


def to_dict(cfg: AppConfig) -> dict[str, Any]:
    """The typed config as plain Python containers (for hashing, manifests and circuit.pt)."""
    return dataclasses.asdict(cfg)


def flatten(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """A nested config dict as {dotted key: value} (`{"a": {"b": 1}}` -> `{"a.b": 1}`)."""
    out: dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, Mapping):
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def iter_keys(cls: type = AppConfig, prefix: str = "") -> Iterable[tuple[str, Any, Mapping[str, Any]]]:
    """Every leaf key of the schema as (path, type, metadata); used by the docs check."""
    hints = _type_hints(cls)
    for f in dataclasses.fields(cls):
        tp, _ = _unwrap_optional(hints[f.name])
        if dataclasses.is_dataclass(tp):
            yield from iter_keys(tp, f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}", hints[f.name], f.metadata
