"""Per-example weight gradients of selected linear modules from one batched forward+backward.

For example b with supervised targets (positions t with supervised[b, t], predicted by the
logits at t - 1) the loss is

    L_b = Σ_{t supervised} CE(softcap(U h_{b,t-1}), input_ids[b, t])     ("sum"; "mean" divides by
                                                                           the number of targets)

with h the base model's last hidden state (after the final norm) and U the unembedding
(``loss="ce"``), or, with ``loss="margin"``, TRAK's model output function turned into a loss:

    L_b = -Σ_t log(p_t / (1 - p_t)) = Σ_t (logsumexp_{j ≠ y_t} z_{t,j} - z_{t,y_t})

(z the logits, y_t the target; the negated log-odds of the correct token, so that its gradient
points the way cross-entropy's does where p_t is small). The margin keeps growing as a token
is learnt, where cross-entropy's gradient fades as p_t -> 1. The total loss Σ_b L_b is backpropagated once. Examples do not interact in a forward pass (causal
attention within a row, no batch statistics), so the gradient that reaches module output
y_{b,t} is exactly δ_{b,t} = dL_b/dy_{b,t}, and each example's weight gradient is

    G_b = Σ_t δ_{b,t} x_{b,t}ᵀ          (d_out, d_in), x the module input,

which the projector reduces to a row without forming G_b for the kronecker kind (see
`gradian.projection.projector`).

Memory: parameters stay frozen (no parameter gradient is ever allocated); only the hidden
states at supervised positions go through the unembedding, `logit_chunk_rows(V)` of them at a
time (`supervised_loss_grad`), so the float32 logits are (chunk, V) instead of (B, T, V): prompt
tokens and padding cost nothing there, and neither does a batch's count of supervised tokens.
Multi-op activations (GPT-2's tanh GELU) run as `grads.activations` says (`activation_mode`;
`circuitkit.models.recompute`): as the model writes them, recomputed in the backward (the same
bits, a lower peak, ~6% more time) or as one fused kernel of the same function (a lower peak,
less time, other rounding). For the kronecker kind each module keeps only P_in x (B, T, k_i)
between forward and backward.

`capture_batch` runs the passes: one forward, the backward of the data's labels and, for the true
Fisher, one of sampled labels; its hooks (`gradian.capture.hooks`) hand each module's projected pair
(P_in x, P_out δ) to the consumers that read that backward (`gradian.capture.consumers`: the rows,
the sampled rows; the K-FAC factor sums in `gradian.curvature.consumers`). `per_example_gradients`
is the capture of the rows alone.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from circuitkit.core.config import choices
from circuitkit.core.device import send
from circuitkit.models.placement import input_device
from circuitkit.models.recompute import fused_activations, recomputed_activations
from gradian.capture.consumers import DATA, SAMPLED, BatchFacts, Consumer, RowsConsumer
from gradian.capture.hooks import PairHooks
from gradian.data.batch import SUPERVISION, no_target_error
from gradian.projection.projector import Projector
from gradian.settings.grads import GradsConfig


class PerExampleGradients(dict):
    """name -> (B, width) float32 rows, in module order, plus per-example facts.

    Attributes: `losses` (B,) float32 per-example loss (sum or mean over its targets, as
    requested), `n_supervised` (B,) long number of supervised targets per example.
    """

    losses: torch.Tensor
    n_supervised: torch.Tensor

    def row(self) -> torch.Tensor:
        """The stored rows: the modules' blocks side by side, (B, Σ widths) float32."""
        return torch.cat(list(self.values()), dim=1)


def supervised_positions(batch: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(example index, hidden position, target id), each (N,), for all N supervised targets.

    supervised[b, t] means the logits at t - 1 predict input_ids[b, t]; position 0 has no
    predecessor, so supervising it is an error, and so is a supervised padding position.
    """
    ids, sup = batch["input_ids"], batch["supervised"].bool()
    if sup.shape != ids.shape:
        raise ValueError(f"supervised {tuple(sup.shape)} and input_ids {tuple(ids.shape)} differ in shape.")
    if sup[:, 0].any():
        raise ValueError("supervised[:, 0] is set: the first token has no preceding position to predict it.")
    mask = batch.get("attention_mask")
    if mask is not None and (sup & ~mask.bool()).any():
        raise ValueError("a padding position (attention_mask 0) is marked supervised.")
    b, t = sup.nonzero(as_tuple=True)  # row-major: grouped by example, in position order
    return b, t - 1, ids[b, t]


@dataclass(frozen=True)
class _Targets:
    """A batch's supervised targets on the device, with the host facts the capture needs."""

    example: torch.Tensor  # (N,) long
    position: torch.Tensor  # (N,) long: hidden position t - 1
    target: torch.Tensor  # (N,) long
    counts: torch.Tensor  # (B,) long
    host_counts: list[int]
    spans: list[int]  # per example: its last supervised hidden position + 1 (what can carry a gradient)
    real_tokens: int
    padded: bool

    def host(self) -> BatchFacts:
        """What a consumer may read of the batch (`gradian.capture.consumers.BatchFacts`)."""
        return BatchFacts(self.spans, self.real_tokens)

    def weights(self, loss_reduction: str) -> torch.Tensor:
        """d L_b / d loss_t per target (N,) float32: 1 ("sum") or 1 / n_b ("mean")."""
        if loss_reduction == "sum":
            return torch.ones(self.target.shape, dtype=torch.float32, device=self.target.device)
        return 1.0 / self.counts[self.example].float()


def _targets(batch: Mapping[str, torch.Tensor], device: torch.device) -> _Targets:
    """The batch's `_Targets`: from the host-side `gradian.data.batch.Supervision` that `collate` computed
    (copied to the device without a wait), else, for a hand-made batch, from its masks on the device."""
    facts = batch.get(SUPERVISION)
    if facts is not None:
        example, position, target = send(torch.from_numpy(np.stack([facts.example, facts.position, facts.target])),
                                         device)
        counts = send(torch.from_numpy(facts.counts), device)
        return _Targets(example, position, target, counts, facts.counts.tolist(), facts.spans.tolist(),
                        facts.real_tokens, facts.padded)
    mask = batch.get("attention_mask")
    on_device = {"input_ids": batch["input_ids"].to(device), "supervised": batch["supervised"].to(device),
                 **({} if mask is None else {"attention_mask": mask.to(device)})}
    example, position, target = supervised_positions(on_device)
    counts = torch.bincount(example, minlength=on_device["input_ids"].shape[0])
    if (counts == 0).any():
        raise no_target_error((counts == 0).nonzero().flatten().tolist())
    real = int(mask.sum()) if mask is not None else on_device["input_ids"].numel()
    spans = torch.zeros_like(counts).scatter_reduce(0, example, position + 1, "amax")
    return _Targets(example, position, target, counts, counts.tolist(), spans.tolist(), real, mask is not None)


def _softcap(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    # A family whose LM head applies cap * tanh(logits / cap) (Gemma 3, `adapter.logit_softcap`);
    # replicated so the loss is the model's own (done in float32 here, after the upcast).
    return logits if cap is None else torch.tanh(logits / cap) * cap


LOSSES = choices(GradsConfig, "loss")


class _Margin(torch.autograd.Function):
    """logsumexp_{j != y} z_j - z_y per row, keeping one (N, V) float32 tensor for the backward.

    Written out with autograd (a scattered copy of z, logsumexp, gather) the backward kept four to
    five (N, V) float32 tensors alive, a third more peak than the cross-entropy on vocabulary-bound
    batches (scripts/bench/check_memory_estimates.py). Here the forward saves only the softmax over the
    other classes, q_j = exp(z_j - lse) (q_y = 0), and the backward is g·q with -g at y: the same
    operations autograd would run, on one tensor."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        index = targets[:, None]
        others = logits.scatter(1, index, float("-inf"))
        lse = torch.logsumexp(others, dim=1)
        out = lse - logits.gather(1, index)[:, 0]
        ctx.save_for_backward(others.sub_(lse[:, None]).exp_(), index)  # in place: q, the one (N, V) kept
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        q, index = ctx.saved_tensors
        out = q * grad[:, None]
        return out.scatter_(1, index, -grad[:, None]), None


def token_losses(logits: torch.Tensor, targets: torch.Tensor, loss: str = "ce") -> torch.Tensor:
    """Per-target loss, (N,) float32, from logits (N, V) float32 and targets (N,) long.

    "ce": -log p_y. "margin": -log(p_y / (1 - p_y)) = logsumexp_{j != y} z_j - z_y, computed
    without forming 1 - p_y (which rounds to 0 for a confident token), by `_Margin`.
    """
    if loss == "ce":
        return F.cross_entropy(logits, targets, reduction="none")
    if loss == "margin":
        return _Margin.apply(logits, targets)
    raise ValueError(f"grads.loss={loss!r}; valid: {', '.join(LOSSES)}.")


# Rows of supervised positions unembedded at once, as (rows x V) elements per device type: the
# float32 (rows, V) logits and the two (rows, V) buffers of the loss's backward stay bounded
# instead of three (N_s, V) tensors that grow with the batch. A chunk costs about a dozen kernels
# whatever its size, so it is a trade of memory against launches:
# * CPU: 2^22 (16 MiB per buffer; GPT-2: 83 rows, Gemma 3's 262k vocabulary: 16). Measured
#   (scripts/bench/calibrate_device.py, SmolLM2's shape with its 49k vocabulary, float32, one
#   thread, 2-core AMD EPYC, load ~1): 2^20 takes 1.40-1.47x the time of 2^22, 2^24 0.86-0.97x,
#   2^26 0.83-1.06x over three runs. Larger chunks save a few percent of the loss step, itself a
#   small share of a batch, for 4-16x the buffers; 2^22 stays, and with it the CPU's rows and
#   estimates.
# * An accelerator: 2^24 (64 MiB per buffer, 192 MiB with the loss's three; Gemma 3: 64 rows). A
#   GPU runs a 2^22 chunk in tens of microseconds at SmolLM2's width, about what its dozen launches
#   cost, so a batch of 1,000 supervised positions would be launch-bound (12 chunks at 49k);
#   2^24 keeps the chunk's work above its launches at d >= 576 for a fourth of the launches, at a
#   size a 16 GB card affords. Not yet measured on a GPU: scripts/bench/calibrate_device.py (run by
#   bench_gpu.py) times 2^20-2^26 on the device it runs on.
LOGIT_CHUNK_ELEMENTS = {"cpu": 2**22}
ACCELERATOR_LOGIT_CHUNK_ELEMENTS = 2**24


def logit_chunk_rows(vocab_size: int, device: torch.device | str | None = None) -> int:
    """How many supervised positions go through the unembedding together on `device` (a
    torch.device or its type; None: the CPU's), >= 1."""
    kind = getattr(device, "type", device) or "cpu"
    return max(1, LOGIT_CHUNK_ELEMENTS.get(kind, ACCELERATOR_LOGIT_CHUNK_ELEMENTS) // vocab_size)


def supervised_loss_grad(adapter, h: torch.Tensor, targets: torch.Tensor, weights: torch.Tensor,
                         loss: str = "ce") -> tuple[torch.Tensor, torch.Tensor]:
    """Token losses (N,) float32 and d(Σ_t weights_t · loss_t)/dh (N, d) in h's dtype.

    h (N, d): final hidden states of the supervised positions (a leaf, no graph); targets (N,).
    The unembedding, softcap and loss run `logit_chunk_rows(V, device)` rows at a time, each row's
    gradient from its own logits only, so the result is the one-pass gradient, without ever
    holding more than one chunk's logits.
    """
    rows = logit_chunk_rows(int(adapter.config.vocab_size), h.device)
    token_loss = torch.empty(len(h), dtype=torch.float32, device=h.device)
    grad_h = torch.empty_like(h)
    for start in range(0, len(h), rows):
        chunk = slice(start, start + rows)
        h_chunk = h[chunk].detach().requires_grad_(True)
        # (rows, V) logits, unnamed: autograd keeps what the loss's backward needs, nothing more
        chunk_loss = token_losses(_softcap(adapter.unembed(h_chunk).float(), adapter.logit_softcap), targets[chunk], loss)
        (grad_h[chunk],) = torch.autograd.grad((chunk_loss * weights[chunk]).sum(), h_chunk)
        token_loss[chunk] = chunk_loss.detach()
    return token_loss, grad_h


def sampling_seed(seed: int, row_id: int) -> int:
    """The seed of row `row_id`'s label draws (`fisher_uniforms`): one generator per row, so any
    batching, sharding or resume draws the same labels for it."""
    return (int(seed) * 1_000_003 + int(row_id)) % (2**63 - 1)


def fisher_uniforms(row_ids: Sequence[int], n_supervised: Sequence[int], seed: int) -> torch.Tensor:
    """(N,) float64 uniforms in [0, 1), one per supervised position, row by row in position order
    (the order of `supervised_positions`), each row's drawn from its own seeded generator."""
    out = [torch.rand(int(n), dtype=torch.float64, generator=torch.Generator().manual_seed(sampling_seed(seed, r)))
           for r, n in zip(row_ids, n_supervised, strict=True)]
    return torch.cat(out) if out else torch.empty(0, dtype=torch.float64)


def sample_labels(logits: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Labels y ~ softmax(logits (rows, V)) by the inverse CDF of `uniforms` (rows,): y is the first
    index whose cumulative probability exceeds u · (the row's total). One float32 (rows, V) buffer
    (the softmax, summed in place), fewer than the cross-entropy's backward keeps, so the draw adds
    nothing to the peak. A draw moves only if u falls within rounding of a class boundary, so rows
    computed in other batches draw alike."""
    cdf = torch.softmax(logits.float(), dim=-1).cumsum_(dim=1)
    u = (uniforms.to(cdf.device, torch.float32) * cdf[:, -1]).unsqueeze(1)
    return torch.searchsorted(cdf, u, right=True).squeeze(1).clamp_max(logits.shape[1] - 1)


def sampled_loss_grad(adapter, h: torch.Tensor, uniforms: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The true Fisher's output gradient: sampled labels (N,) and d(Σ_t CE(z_t, y_t))/dh (N, d),
    y_t ~ softmax(z_t) drawn with `uniforms` (`sample_labels`), z_t = softcap(U h_t) as
    `supervised_loss_grad` computes it (the same chunks; the draw itself carries no gradient)."""
    rows = logit_chunk_rows(int(adapter.config.vocab_size), h.device)
    labels = torch.empty(len(h), dtype=torch.long, device=h.device)
    grad_h = torch.empty_like(h)
    for start in range(0, len(h), rows):
        chunk = slice(start, start + rows)
        h_chunk = h[chunk].detach().requires_grad_(True)
        logits = _softcap(adapter.unembed(h_chunk).float(), adapter.logit_softcap)
        with torch.no_grad():
            labels[chunk] = sample_labels(logits, uniforms[chunk]).to(h.device)
        (grad_h[chunk],) = torch.autograd.grad(F.cross_entropy(logits, labels[chunk], reduction="sum"), h_chunk)
    return labels, grad_h


# grads.activations mode -> a context manager (model, dtype) under which the gradient pass runs.
ACTIVATION_CONTEXTS = {"model": lambda model, dtype: contextlib.nullcontext(0),
                       "recompute": recomputed_activations, "fused": fused_activations}


def activation_mode(setting: str, dtype: torch.dtype) -> str:
    """What `grads.activations` = `setting` does for a model of `dtype`: "model", "recompute" or
    "fused"; auto is fused for 16-bit precision and the model's own ops for float32, the
    reference precision, where rows stay the bits of the model as written. Measured on GPT-2-small
    shape rows of 29-497 tokens (docs/benchmarks.md): in bfloat16 a fused pass takes 0.72x the
    time of a recomputed one at the same peak, and its rows are as close to float32 rows as the
    model's ops' (median 0.996% against 0.992%); in float32 fused rows differ from the model's by
    1.2e-6 relative."""
    if setting not in choices(GradsConfig, "activations"):
        raise ValueError(f"grads.activations={setting!r}; valid: {', '.join(choices(GradsConfig, 'activations'))}.")
    if setting != "auto":
        return setting
    return "fused" if torch.finfo(dtype).bits == 16 else "model"


def activation_numerics(mode: str) -> str:
    """What the index header records of an `activation_mode`: "fused", or "model" for the model's
    own ops (recomputed or not: the same bits). A resume or a query must use the same numerics."""
    return "fused" if mode == "fused" else "model"


@dataclass(frozen=True)
class LossSettings:
    """The loss whose gradients a batch gives and how its pass runs: `reduction` (grads.loss_reduction:
    an example's token losses summed or averaged), `loss` (grads.loss: "ce" or "margin", the module
    docstring) and `activations` (grads.activations, `activation_mode`: model and recompute give the
    same bits)."""

    reduction: str = "sum"
    loss: str = "ce"
    activations: str = "auto"

    def check(self) -> None:
        """ValueError naming the setting that is not one of its choices."""
        if self.reduction not in choices(GradsConfig, "loss_reduction"):
            raise ValueError(f"grads.loss_reduction={self.reduction!r}; valid: sum, mean.")
        if self.loss not in LOSSES:
            raise ValueError(f"grads.loss={self.loss!r}; valid: {', '.join(LOSSES)}.")


@dataclass(frozen=True)
class SampledLabels:
    """The label draws of the true Fisher's backward (consumers of SAMPLED labels): row `row_ids[b]`'s
    labels come from a generator seeded by `seed` and that id (`sampling_seed`), so they do not depend
    on the batching."""

    row_ids: Sequence[int]
    seed: int


@dataclass(frozen=True)
class BatchLosses:
    """`losses` (B,) float32: each example's loss (sum or mean over its targets, as asked);
    `n_supervised` (B,) long: its number of supervised targets. Both on the device."""

    losses: torch.Tensor
    n_supervised: torch.Tensor


class Capture:
    """One run's capture, set up once: the checks, the sites and one forward hook per module stay
    registered while the session is open (`with Capture(...) as capture:`), and each `batch` runs
    one forward and the backwards its consumers need (`capture_batch`'s docstring). Outside a
    batch the hooks pass the forward through untouched.

    modules: (name, module) pairs, or (name, module, input columns) sites (`gradian.capture.sites`:
    a head's d_head columns of the attention output projection), in row order. Parameters must be
    frozen (requires_grad False): the backward computes activation gradients only; the check reads
    the parameters here, once, not per batch."""

    def __init__(self, model: nn.Module, adapter, modules: Sequence[tuple], projector: Projector,
                 settings: LossSettings = LossSettings()) -> None:
        settings.check()
        trainable = [n for n, p in model.named_parameters() if p.requires_grad]
        if trainable:
            raise ValueError(f"parameters must be frozen (requires_grad_(False)); trainable: {trainable[:3]}.")
        self.sites = [tuple(m) if len(m) == 3 else (m[0], m[1], None) for m in modules]
        self.names = [name for name, _, _ in self.sites]
        missing = [n for n in self.names if n not in projector.shapes]
        if missing:
            raise ValueError(f"the projector has no shape for modules {missing[:3]}.")
        self.model, self.adapter, self.projector, self.settings = model, adapter, projector, settings
        self.dtype = next(model.parameters()).dtype
        self.mode = activation_mode(settings.activations, self.dtype)
        self.device = input_device(model)
        self.hooks = PairHooks(projector)
        self._handles: list = []

    def __enter__(self) -> Capture:
        self._handles = self.hooks.attach(self.sites)
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def batch(self, batch: Mapping[str, torch.Tensor], consumers: Sequence[Consumer],
              sampled: SampledLabels | None = None) -> BatchLosses:
        """One batch (`capture_batch`'s docstring), with this session's hooks and settings."""
        if not self._handles:
            raise RuntimeError("Capture.batch outside its `with` block: the hooks are not registered.")
        data = [c for c in consumers if c.labels == DATA]
        drawn = [c for c in consumers if c.labels == SAMPLED]
        if len(data) + len(drawn) != len(consumers):
            raise ValueError(f"a consumer reads labels {sorted({c.labels for c in consumers} - {DATA, SAMPLED})};"
                             f" valid: {DATA}, {SAMPLED}.")
        if drawn and (sampled is None or len(sampled.row_ids) != batch["input_ids"].shape[0]):
            raise ValueError("fisher='sampled' needs row_ids, one per example: each row's labels come from its own seed.")
        device, settings, adapter, hooks, names = self.device, self.settings, self.adapter, self.hooks, self.names
        facts = _targets(batch, device)
        input_ids = batch["input_ids"].to(device, non_blocking=True)
        # Rows are right-padded and attention is causal: a real position never reads a later (padding)
        # one, so the model runs without the mask (its mask checks read the device, twice per forward)
        # and only the padding positions' own values differ; they are zeroed after each projection.
        attention_mask = batch.get("attention_mask") if facts.padded else None
        pad = None if attention_mask is None else attention_mask.to(device, non_blocking=True)[..., None] == 0  # (B, T, 1)
        host = facts.host()
        hooks.begin(pad, input_ids.shape, host)
        try:
            with torch.enable_grad(), ACTIVATION_CONTEXTS[self.mode](self.model, self.dtype):
                # The embeddings are looked up here: given ids and no mask, GPT-2 reads the ids back for a padding check.
                hidden = adapter.base(inputs_embeds=adapter.embed(input_ids)).last_hidden_state
                hooks.flush()
                # Gather before the unembedding: only supervised positions reach the vocabulary.
                h_sup = hidden[facts.example, facts.position]  # (N, d)
                del hidden
                # Mean reduction: d L_b / d loss_t = 1 / n_b for each target t of example b.
                token_loss, grad_h = supervised_loss_grad(adapter, h_sup.detach(), facts.target,
                                                          facts.weights(settings.reduction), settings.loss)
                if data:  # the sampled labels' backward still needs the x_p: kept for it
                    hooks.run_backward(h_sup, grad_h, data, bool(drawn), names,
                                       "no gradient reached modules {}: they do not feed the supervised logits.")
                if drawn:
                    del grad_h
                    uniforms = fisher_uniforms(sampled.row_ids, facts.host_counts, sampled.seed).to(device, non_blocking=True)
                    _labels, grad_h = sampled_loss_grad(adapter, h_sup.detach(), uniforms)
                    hooks.run_backward(h_sup, grad_h, drawn, False, names,
                                       "the sampled-label backward reached no modules {}.")
        finally:
            hooks.end()
        for consumer in consumers:
            consumer.finish(host)
        losses = torch.zeros(input_ids.shape[0], dtype=torch.float32, device=device).index_add(0, facts.example, token_loss)
        if settings.reduction == "mean":
            losses = losses / facts.counts.float()
        return BatchLosses(losses, facts.counts)


def capture_batch(model: nn.Module, adapter, modules: Sequence[tuple], projector: Projector,
                  batch: Mapping[str, torch.Tensor], consumers: Sequence[Consumer],
                  settings: LossSettings = LossSettings(), sampled: SampledLabels | None = None) -> BatchLosses:
    """One forward and one backward per kind of labels the `consumers` read: each module's projected
    pair (x_p, d_p) handed to them (`gradian.capture.consumers`), then their `finish`. A loop over
    many batches opens one `Capture` instead (its hooks and checks once per run).

    batch: ``input_ids`` (B, T) long, right-padded; ``attention_mask`` (B, T); ``supervised``
    (B, T) bool (target t predicted from position t - 1). Every example needs >= 1 target.
    modules: as `Capture` takes them.
    DATA consumers read the backward of the loss `settings` describe, on the data's labels;
    SAMPLED consumers (the true Fisher) a second backward of the same forward with the loss
    Σ_t CE(z_t, y_t), y_t ~ softmax(z_t) sampled at each supervised position (`sampled_loss_grad`;
    always summed cross-entropy, whatever `settings`), with the draws of `sampled`.

    Parameters must be frozen (requires_grad False): the backward computes activation
    gradients only. An example's pairs do not depend on the rest of its batch: padding
    positions are masked out of x, and nothing downstream of a padding position feeds a loss.
    """
    with Capture(model, adapter, modules, projector, settings) as capture:
        return capture.batch(batch, consumers, sampled)


def per_example_gradients(model: nn.Module, adapter, modules: Sequence[tuple],
                          projector: Projector, batch: Mapping[str, torch.Tensor],
                          loss_reduction: str = "sum", loss: str = "ce",
                          activations: str = "auto", factored=None) -> PerExampleGradients:
    """Projected per-example gradients of `modules` for one batch, from one forward+backward
    (`capture_batch` with one `RowsConsumer`; batch and modules as there).

    Returns name -> (B, projector.width(name)) float32 (a `PerExampleGradients`, with ``.losses``
    (B,) and ``.n_supervised`` (B,)). `loss_reduction`, `loss`, `activations`: `LossSettings`.
    `factored`: a `gradian.index.formats.factored.FactoredRows`: each block is stored as its rank-c
    factors [U | V] (B, c (k_o + k_i)) instead of the dense (B, k_o k_i) block; None: dense.
    """
    names = [site[0] for site in modules]
    rows = RowsConsumer(projector, names, factored)
    got = capture_batch(model, adapter, modules, projector, batch, [rows],
                        LossSettings(loss_reduction, loss, activations))
    out = PerExampleGradients((name, rows.blocks[name]) for name in names)
    out.losses, out.n_supervised = got.losses, got.n_supervised
    return out
