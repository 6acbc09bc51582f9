"""Peak device memory of the pruning stage, from the model's shape alone (no weights).

`estimate_pruning` is the closed form (notation in `circuitkit.preflight.memory`; n_eval held-out pairs,
batched B at a time, T tokens); `pruning_estimate(cfg)` applies it to a config, `pruning_advice`
names the settings that bring it under a budget, and `PRUNING_MEMORY` hands both to the
preflight through the pruning stage.

What the stage (`circuitkit.discovery.pruning.heads.prune`) holds, phase by phase:

* **heads** (`Evaluator`): per held-out batch the clean answer logits and, under corrupted
  ablation, the corrupted run's z of every layer (kept for the whole curve); recording the
  last batch's two runs (`cached_run`) on top of them, or a batched circuit forward: c circuits
  side by side, c·B rows (`circuitkit.discovery.pruning.circuit_forward`, c from
  CIRCUIT_FORWARD_TOKENS and the circuits evaluated together: the curve's points in `prune`,
  the random circuits in the verdict). The verdict measures an edge circuit's head set the same
  way, with a head evaluator.
* **edges** (`circuitkit.discovery.pruning.edges.EdgeEvaluator`): per held-out batch the ablated writes
  of every upstream node, (n_up, B, T, d) float32, kept while they fit in RECORD_SHARE of the
  free memory. Recording a batch holds its writes three times at once (clean writes, Δ,
  their difference) beside both recorded runs; a circuit forward holds one more (n_up, B, T, d)
  buffer of d_u, the running sums and each layer's per-input residual copies.
* **mask at head scope** (`circuitkit.discovery.pruning.optimize.learn_head_mask`): a second Evaluator over
  the first mask_steps x B attribution pairs, then a forward+backward of the soft-masked model
  (the model's activations and each layer's z - z(corrupted) saved for the mask's gradient).
* **edge_pruning** (`circuitkit.discovery.pruning.optimize.learn_edge_mask`; `mask` at edge scope): a second EdgeEvaluator over
  the first mask_steps x B attribution pairs (while the held-out one is alive), then a
  forward+backward of the soft-masked model: the groups of d_u, the per-input normed residuals
  and the model's own activations saved for the mask's gradient.

The coefficients below were fitted phase by phase (CPU dispatch tracker, sdpa) on random
GPT-2-small- and SmolLM2-shaped models at 2 and 4 layers (B 1-8, 16-64 tokens, float32 and
bfloat16) and checked whole with `scripts/bench/check_memory_estimates.py --pruning`; docs/memory.md
has the ratios.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from circuitkit.core.device import free_memory_bytes, model_dtype
from circuitkit.core.pipeline import StageMemory
from circuitkit.discovery.config import mask_steps_of
from circuitkit.discovery.pruning.circuit_forward import CIRCUIT_FORWARD_TOKENS
from circuitkit.discovery.pruning.edges import RECORD_SHARE
from circuitkit.discovery.pruning.heads import CURVE_PERCENTS
from circuitkit.discovery.tasks import heldout_template_count
from circuitkit.discovery.tasks.corruption_sets import discovery_corruptions
from circuitkit.preflight.memory import FP32, MemoryEstimate, calibrated, largest_fitting, shape_for

# No-grad forward temporaries above what is recorded, units N·p·d and N·p·f (one block's
# intermediates). Measured: 4·d + 2·f for Llama-shaped blocks (SiLU gate), 4·f for GPT-2 (its
# tanh GELU runs as seven ops).
FWD_TMP_D = 4.0
FWD_TMP_F = {"gpt2": 4.0}
FWD_TMP_F_DEFAULT = 2.0
# A circuit forward at edge scope: temporaries of one layer's attention-input hook (the shift,
# the per-input residual, its norm, the Q/K/V contractions), units (H + 2·KV)·N·d float32.
# Measured 2.5-2.8 (float32 and bfloat16, B 1-8).
EDGE_SHIFT_TMP = 2.8
# A batched head-circuit forward (no recording: only the hooks' ablated z beside the forward's own
# temporaries), as a share of `fwd` for its rows: measured 0.72 (GPT-2) and 0.84 (Llama-shaped),
# float32, 4-64 rows of 32 tokens.
BATCHED_FWD = {"gpt2": 0.72}
BATCHED_FWD_DEFAULT = 0.84
# Soft-mask forward+backward (edge_pruning), units N·d float32: saved per layer for the mask's
# gradient EP_SAVED·(H + KV) (the per-input residuals and their norms) on top of the model's
# own activations (its family's act_per_layer) and the d_u groups; the backward's peak adds
# EP_BWD·(H + 2·KV) (one layer's input gradients).
EP_SAVED = 2.0
EP_BWD = 3.7
# Soft head-mask forward+backward (selection=mask at head scope): saved per layer the model's own
# activations (its family's act_per_layer) and HM_SAVED·H·dh per token (z - z(corrupted), in the
# model's dtype); the backward's peak adds HM_BWD·N·d float32 (one layer's gradients) and the
# answer logits.
HM_SAVED = 1.0
HM_BWD = 8.0


def _batches(n: int, batch_size: int) -> list[int]:
    """Sizes of `TaskData.batches(batch_size)` over n examples."""
    b = max(1, min(batch_size, n))
    return [b] * (n // b) + ([n % b] if n % b else [])


@dataclass
class _Shape:
    """The shape's numbers and the per-batch sizes every phase is made of (bytes)."""

    s: dict[str, Any]
    p: int
    T: int
    scope: str
    ablation: str

    def __post_init__(self) -> None:
        s = self.s
        self.L, self.H, self.KV, self.dh = s["n_layers"], s["n_heads"], s["n_kv_heads"], s["head_dim"]
        self.d, self.f, self.V = s["d_model"], s["d_mlp"], s["vocab_size"]
        self.n_up = 1 + self.L * (self.H + 1)
        self.c_d, self.c_f = calibrated(s)[1]
        self.post_norm = s["family"] == "gemma3"
        self.fwd_f = FWD_TMP_F.get(s["family"], FWD_TMP_F_DEFAULT)

    def u(self, b: int) -> int:  # one float32 residual-stream row of a batch: b·T·d·4
        return b * self.T * self.d * FP32

    def fwd(self, b: int) -> int:  # one no-grad forward's temporaries, KV cache and answer logits
        N = b * self.T
        return int(N * self.p * (FWD_TMP_D * self.d + self.fwd_f * self.f + 2 * self.L * self.KV * self.dh)
                   + b * self.V * self.p)

    def run(self, b: int) -> int:  # what one cached_run records (z, MLP writes, embedding)
        extra = self.d if self.scope == "edges" and self.post_norm else 0
        return b * self.T * self.p * (self.L * (self.H * self.dh + self.d + extra) + self.d)

    def writes(self, b: int) -> int:  # (n_up, b, T, d) float32
        return self.n_up * self.u(b)

    def record(self, b: int) -> int:
        """What an evaluator keeps of a batch (its clean answer logits and, under corrupted
        ablation, the corrupted z (heads) or the ablated writes (edges))."""
        logits = b * self.V * FP32
        if self.ablation != "corrupted":
            return logits
        if self.scope == "heads":
            return logits + b * self.T * self.L * self.H * self.dh * self.p
        return logits + self.writes(b)

    def recording(self, b: int) -> int:
        """Recording one batch, above the records before it (that batch's own record included)."""
        if self.scope == "heads":
            corrupted_rest = b * self.T * self.p * (self.L * self.d + self.d) if self.ablation == "corrupted" else 0
            return self.record(b) + self.run(b) + corrupted_rest + self.fwd(b)
        if self.ablation != "corrupted":
            return self.record(b) + self.run(b) + self.fwd(b)
        delta = b * self.T * FP32 * (self.d + self.L * (self.H * self.dh + self.d))
        return max(3 * self.writes(b) + 2 * self.run(b) + delta + 2 * b * self.V * FP32,
                   2 * self.run(b) + self.fwd(b))

    def batched(self, b: int, n_circuits: int) -> int:
        """A batched head-circuit forward on b pairs: BATCHED_FWD of a forward's temporaries for c·b
        rows (KV cache and answer logits included) and the float32 answer logits the metric reads,
        c = min(n_circuits, CIRCUIT_FORWARD_TOKENS // (b·T))."""
        rows = b * min(n_circuits, max(1, CIRCUIT_FORWARD_TOKENS // (b * self.T)))
        return int(BATCHED_FWD.get(self.s["family"], BATCHED_FWD_DEFAULT) * self.fwd(rows)) + rows * self.V * FP32

    def circuit(self, b: int) -> int:
        """One circuit forward's buffers at edge scope (d_u, running sums, one layer's shifted inputs)."""
        u = self.u(b)
        return int(self.writes(b) + (2 * self.L + 2) * u + EDGE_SHIFT_TMP * (self.H + 2 * self.KV) * u)


def _evaluator(m: _Shape, base: int, n: int, batch_size: int, budget: int | None, label: str,
               phases: list[tuple[int, str, dict[str, int]]]) -> int:
    """Add an evaluator's phases over n pairs (on top of `base` bytes) to `phases`; returns what it
    keeps. At edge scope a batch's writes are kept while the total fits `budget` (None: all); a
    batch not kept records them again at each of its circuit forwards."""
    sizes = _batches(n, batch_size)
    kept, held, total = [], [], 0
    for b in sizes:
        keep = m.scope == "heads" or m.ablation != "corrupted" or budget is None or total + m.writes(b) <= budget
        size = m.record(b) if keep else b * m.V * FP32
        total += m.writes(b) if keep and m.scope == "edges" and m.ablation == "corrupted" else 0
        kept.append(keep)
        held.append(size)
    before = 0
    for i, b in enumerate(sizes):
        phases.append((base + before + m.recording(b), f"recording {label}",
                       {"recorded runs": base + before, "recording temporaries": m.recording(b)}))
        before += held[i]
    if m.scope == "edges":
        for b, keep in zip(sizes, kept, strict=True):
            again = 0 if keep else m.writes(b)
            if not keep:
                phases.append((base + before + m.recording(b), f"re-recording a batch of {label} past the record budget",
                               {"recorded runs": base + before, "recording temporaries": m.recording(b)}))
            phases.append((base + before + again + m.circuit(b) + m.fwd(b), f"a circuit forward on {label}",
                           {"recorded runs": base + before + again, "circuit-forward buffers": m.circuit(b),
                            "forward temporaries": m.fwd(b)}))
    return before


def estimate_pruning(shape: dict[str, Any], dtype_bytes: int, batch_size: int, seq_len: int, n_eval: int,
                     scope: str = "heads", ablation: str = "corrupted", selection: str = "top_k",
                     n_attr: int | None = None, mask_steps: int = 20, record_budget_bytes: int | None = None,
                     n_templates: int = 0, templates_seq_len: int | None = None,
                     n_circuits: int | None = None, target_sparsity: float | None = None,
                     n_corruptions: int = 1) -> MemoryEstimate:
    """Peak device bytes of the pruning stage (`circuitkit.discovery.pruning.heads.prune`).

    Terms (notation in `circuitkit.preflight.memory`; N = B·T, u = N·d·4, for one batch of B pairs):

        weights                       P·p
        recorded runs                 per held-out pair its clean answer logits V·4 and, under
                                      corrupted ablation, heads: its corrupted z T·L·H·dh·p;
                                      edges: its ablated writes n_up·T·d·4 (while within the
                                      record budget); mean ablation: the means
        recording temporaries         heads: a batch's clean run N·p·(L·(H·dh + d) + d), the
                                      corrupted run's MLP writes and a forward's temporaries;
                                      edges: 3·n_up·u + both runs + Δ (float32) + 2·B·V·4
        circuit-forward buffers       edges: n_up·u (d_u) + (2L + 2)·u (running sums)
                                      + EDGE_SHIFT_TMP·(H + 2·KV)·u
        forward temporaries           N·p·(FWD_TMP_D·d + c_f·f + 2·L·KV·dh) + B·V·p (KV cache, logits);
                                      a batched head-circuit forward: BATCHED_FWD of that for c·B
                                      rows, + c·B·V·4 (the metric's logits)
        edge_pruning recorded runs    the same writes for min(mask_steps·B, n_attr) attribution pairs
        mask gradient (saved)         n_up·u + L·(EP_SAVED·(H + KV)·u + N·p·(c_d·d + c_f·f))
                                      + EP_BWD·(H + 2·KV)·u (+ L·(2H + 2·KV)·dh·d·4 in 16 bits:
                                      the float32 copies of W_Q, W_K, W_V, W_O the hooks contract with)

    The peak is the largest phase: the mean-ablation pass, recording each held-out batch (on the
    batches recorded before it), a circuit forward (every kept record; a batch past the record
    budget records its writes again there), for edge_pruning its own recording and its
    forward+backward, and the held-out templates' evaluator (`n_templates` pairs), the last two
    on top of the held-out records. `record_budget_bytes`: RECORD_SHARE of the free memory
    (None: unbounded); an evaluator built while another's records are alive gets RECORD_SHARE
    of what those left. `templates_seq_len`: the padded width of the held-out templates' pairs
    (default seq_len). `n_circuits`: the most head circuits evaluated together (the verdict's
    random circuits; default: `prune`'s own, the empty circuit, the curve's points and ours at
    `target_sparsity`, or ours among the curve's points when None).
    """
    m = _Shape(shape, dtype_bytes, seq_len, scope, ablation)
    phases: list[tuple[int, str, dict[str, int]]] = []
    B = _batches(n_eval, batch_size)[0]
    means = 0
    if ablation == "mean":  # mean_z / mean_writes over the attribution pairs, then the means (float32)
        if scope == "heads":
            means = m.L * seq_len * m.H * m.dh * FP32
            work = m.run(B) + 2 * m.L * B * seq_len * m.H * m.dh * FP32
        else:
            means = m.n_up * seq_len * m.d * FP32
            work = 3 * m.writes(B) + m.run(B)
        phases.append((work + m.fwd(B), "mean ablation values", {"recording temporaries": work,
                                                                 "forward temporaries": m.fwd(B)}))

    def left(budget: int | None, held: int) -> int | None:
        return None if budget is None else int(RECORD_SHARE * max(budget / RECORD_SHARE - held, 0))

    held = _evaluator(m, means, n_eval, batch_size, record_budget_bytes, "the held-out pairs", phases)
    n_heads = m.L * m.H
    curve = {int(pct / 100 * n_heads + 1e-9) for pct in CURVE_PERCENTS} - {n_heads}
    ours = {n_heads - round(target_sparsity * n_heads)} if target_sparsity is not None else set()
    together = max(n_circuits or 0, len(curve | {0} | ours - {n_heads}))
    # Head scope: on the held-out records. Edge scope: the verdict's head evaluator, once the edge
    # records are gone (its records: the heads' figure; its means: per position, as mean_z).
    heads = m if scope == "heads" else _Shape(shape, dtype_bytes, seq_len, "heads", ablation)
    head_means = means if scope == "heads" else (m.L * seq_len * m.H * m.dh * FP32 if ablation == "mean" else 0)
    head_held = held if scope == "heads" else sum(heads.record(b) for b in _batches(n_eval, batch_size))
    phases.append((head_means + head_held + heads.batched(B, together), "a batched circuit forward on the held-out pairs",
                   {"recorded runs": head_means + head_held, "circuit-forward buffers": heads.batched(B, together)}))
    several = n_corruptions > 1 and scope == "heads"
    if several:  # another corruption's Evaluator beside the primary's; its circuits: the primary's set, batched
        other = _evaluator(m, means + held, n_eval, batch_size, None, "another corruption's held-out pairs", phases)
        phases.append((means + held + other + m.batched(B, together),
                       "a batched circuit forward on another corruption's held-out pairs",
                       {"recorded runs": means + held, "another corruption's recorded runs": other,
                        "circuit-forward buffers": m.batched(B, together)}))
    if scope == "edges" and selection == "edge_pruning":
        opt_m = _Shape(shape, dtype_bytes, seq_len, scope, "corrupted")
        n_opt = min(mask_steps * B, n_attr if n_attr is not None else n_eval)
        opt_phases: list[tuple[int, str, dict[str, int]]] = []
        opt = _evaluator(opt_m, means + held, n_opt, B, left(record_budget_bytes, held), "the edge_pruning pairs",
                         opt_phases)
        phases += [ph for ph in opt_phases if "circuit forward" not in ph[1]]  # it runs soft forwards instead
        u = m.u(B)
        # A model in 16 bits: the float32 copies of W_Q, W_K, W_V and W_O that the hooks contract
        # with are saved for the backward too, every layer's (in float32 they are the parameters).
        weight_copies = m.L * (2 * m.H + 2 * m.KV) * m.dh * m.d * FP32 if dtype_bytes < FP32 else 0
        grad = int(m.writes(B) + m.L * (EP_SAVED * (m.H + m.KV) * u + B * seq_len * dtype_bytes
                                        * (m.c_d * m.d + m.c_f * m.f))
                   + EP_BWD * (m.H + 2 * m.KV) * u + weight_copies)
        phases.append((means + held + opt + grad, "edge_pruning: forward+backward of the soft mask",
                       {"recorded runs": means + held, "edge_pruning recorded runs": opt,
                        "mask gradient (saved)": grad}))
    if scope == "heads" and selection == "mask":
        opt_m = _Shape(shape, dtype_bytes, seq_len, scope, "corrupted")
        n_opt = min(mask_steps * B, n_attr if n_attr is not None else n_eval)
        opt = 0
        for _ in range(n_corruptions if several else 1):  # each corruption's pairs recorded, then kept
            opt_phases: list[tuple[int, str, dict[str, int]]] = []
            opt += _evaluator(opt_m, means + held + opt, n_opt, B, None, "the mask's pairs", opt_phases)
            phases += opt_phases
        N = B * seq_len
        grad = int(m.L * N * dtype_bytes * (m.c_d * m.d + m.c_f * m.f + HM_SAVED * m.H * m.dh)
                   + HM_BWD * N * m.d * FP32 + B * m.V * FP32)
        phases.append((means + held + opt + grad, "mask: forward+backward of the soft head mask",
                       {"recorded runs": means + held, "mask recorded runs": opt, "mask gradient (saved)": grad}))
    if n_templates > 0:
        templates_m = _Shape(shape, dtype_bytes, templates_seq_len or seq_len, scope, ablation)
        _evaluator(templates_m, means + held, n_templates, batch_size, left(record_budget_bytes, held),
                   "the held-out templates", phases)
    total, phase, terms = max(phases, key=lambda ph: ph[0])
    return MemoryEstimate({"weights": m.s["n_params"] * dtype_bytes, **{k: int(v) for k, v in terms.items()}},
                          phase=phase)


def pruning_estimate(cfg: Any, batch_size: int | None = None, seq_len: int | None = None,
                     n_eval: int | None = None, n_attr: int | None = None,
                     free_bytes: int | None = None, n_templates: int | None = None,
                     weights_loaded: bool = False, templates_seq_len: int | None = None) -> MemoryEstimate:
    """Estimated peak of the pruning stage for `cfg`: discovery.batch_size held-out pairs per
    batch, discovery.data_params.seq_len tokens (the length assumed before tokenizing),
    eval_examples held out, the held-out templates' pairs (`heldout_template_count`), and edge
    records bounded by RECORD_SHARE of the memory free once the weights are loaded: `free_bytes`
    (default: the device's free memory now) less the weights unless `weights_loaded` (the stage
    itself, where the free memory already excludes them). The tokenized lengths of the run's pairs,
    when known, come as `seq_len` and `templates_seq_len` (`circuitkit.discovery.data_lengths`)."""
    d, p = cfg.discovery, cfg.pruning
    shape = shape_for(cfg.model)
    dtype_bytes = model_dtype(cfg.model).itemsize  # the dtype the run uses (auto resolved)
    budget = None
    if p.scope == "edges":
        free = free_memory_bytes() if free_bytes is None else free_bytes
        budget = int(RECORD_SHARE * max(free - (0 if weights_loaded else shape["n_params"] * dtype_bytes), 0))
    selection = p.selection if p.scope == "edges" or p.selection == "mask" else "top_k"
    if n_templates is None:
        n_templates = heldout_template_count(d.task, d.data_params)
    return estimate_pruning(shape, dtype_bytes, batch_size or d.batch_size, seq_len or d.data_params.seq_len,
                            n_eval or d.data_params.eval_examples, p.scope, p.ablation, selection,
                            n_attr or d.data_params.num_examples, mask_steps_of(p), budget, n_templates,
                            templates_seq_len, p.random_baselines, p.target_sparsity,
                            max(len(discovery_corruptions(d.task, d.data_params)), 1))


def pruning_advice(cfg: Any, budget_bytes: int, **at: Any) -> list[str]:
    """Knobs that bring the pruning peak under `budget_bytes`, in the order to try them. `at`:
    arguments of `pruning_estimate` that the run's data fixes (seq_len, n_attr, n_templates,
    templates_seq_len: `circuitkit.discovery.data_lengths`)."""
    d, p = cfg.discovery, cfg.pruning
    free = int(budget_bytes / cfg.preflight.headroom)
    tips = []

    def fits(**kw: Any) -> bool:
        return pruning_estimate(cfg, free_bytes=free, **{**at, **kw}).total_bytes <= budget_bytes

    best = largest_fitting(lambda b: fits(batch_size=b), d.batch_size)
    if 0 < best < d.batch_size:
        tips.append(f"discovery.batch_size={best} (largest that fits; the held-out pairs per circuit forward)")
    if best == 0 or p.scope == "heads":
        n = largest_fitting(lambda n: fits(batch_size=1, n_eval=n), d.data_params.eval_examples)
        if 0 < n < d.data_params.eval_examples:
            tips.append(f"discovery.data_params.eval_examples={n} (fewer held-out pairs recorded)")
    if p.selection == "mask" or (p.scope == "edges" and p.selection == "edge_pruning"):
        tips.append("pruning.selection=top_k (no second recorded evaluator, no backward over the mask)")
    if best == 0:
        seq = at.get("seq_len") or d.data_params.seq_len
        while seq > 8 and not fits(batch_size=1, seq_len=seq):
            seq //= 2
        if fits(batch_size=1, seq_len=seq):
            tips.append(f"discovery.batch_size=1 with discovery.data_params.seq_len={seq} (shorter prompts)")
        if p.scope == "edges":
            tips.append("pruning.scope=heads (no per-edge writes recorded)")
        if model_dtype(cfg.model) == torch.float32:
            tips.append("model.precision=bfloat16 (half the weight bytes)")
        tips.append("a device with more memory, or a smaller model")
    return tips


def _stage_estimate(cfg: Any) -> MemoryEstimate:
    return pruning_estimate(cfg)


PRUNING_MEMORY = StageMemory(estimate=_stage_estimate, advice=pruning_advice)
