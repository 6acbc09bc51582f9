"""The hooks of one capture: each selected module's projected (input, output-gradient) pair, handed on.

A module's forward projects its input, x_p = P_in x (B, T, k_i); the gradient δ that reaches its
output in a backward is projected, d_p = P_out δ (B, T, k_o), and the pair goes to that backward's
consumers (`gradian.capture.consumers`). For the kronecker kinds only x_p is kept between forward and
backward, never x; the loss and the backward themselves are `gradian.capture.gradients.capture_batch`'s.
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn

from gradian.capture.consumers import BatchFacts, Consumer
from gradian.projection.projector import Projector


class PairHooks:
    """The hooks of one capture (the module docstring), x_p zero at padding.

    A site is (name, module, input columns or None) (`gradian.capture.sites`: the kept heads of one
    o_proj); one hook per module serves every site on it. Modules that read one input one after
    another (q, k, v; gate, up) are projected together, in one matmul, when the next hook sees
    another input or the forward ends (`flush`). `run_backward` runs one backward for its consumers.
    The hooks are registered once (`attach`) and serve every batch between `begin` and `end`."""

    def __init__(self, projector: Projector) -> None:
        self.projector = projector
        self.active = False  # inside a batch (`begin` .. `end`): outside, the forward hooks do nothing
        self.pad: torch.Tensor | None = None
        self.shape: torch.Size | None = None
        self.batch: BatchFacts | None = None
        self.x_proj: dict[str, torch.Tensor] = {}
        self.shared: list = []  # [x, [names]] while modules reading one input wait for their projection
        self.consumers: list[Consumer] = []  # the running backward's
        self.keep_inputs = False  # a later backward reads the x_p again
        self.reached: set[str] = set()  # the sites whose gradient the running backward brought

    def begin(self, pad: torch.Tensor | None, shape: torch.Size, batch: BatchFacts) -> None:
        """A batch starts: its padding mask (B, T, 1) or None, its (B, T) and its host facts."""
        self.pad, self.shape, self.batch, self.active = pad, shape, batch, True

    def end(self) -> None:
        """The batch is over (or failed): drop what it left (a failed pass's projected inputs too)."""
        self.x_proj.clear()
        self.shared = []
        self.pad = self.shape = self.batch = None
        self.active, self.reached, self.consumers = False, set(), []

    def attach(self, sites: list[tuple[str, nn.Module, slice | None]]) -> list:
        """Register one forward hook per module; returns the handles."""
        by_module: dict[int, tuple[nn.Module, list[tuple[str, slice | None]]]] = {}
        for name, module, columns in sites:
            by_module.setdefault(id(module), (module, []))[1].append((name, columns))
        return [module.register_forward_hook(partial(self.forward, group)) for module, group in by_module.values()]

    def _masked(self, xp: torch.Tensor) -> torch.Tensor:
        # Zero padded positions: their δ is zero anyway (right padding, causal attention), but a
        # non-finite activation there would turn 0 * x into NaN. Masked after the projection, on
        # (B, T, k_i) rather than (B, T, d_in): a projected row depends on its own position only,
        # so this is the same as projecting a masked x, without a copy of every module input.
        return xp if self.pad is None else xp.masked_fill(self.pad, 0.0)

    def flush(self) -> None:
        """Project the input the waiting modules share."""
        if self.shared:
            (x, names), self.shared = self.shared, []
            for name, xp in zip(names, self.projector.project_inputs(names, x), strict=True):
                self.x_proj[name] = self._masked(xp)

    def forward(self, group: list[tuple[str, slice | None]], module: nn.Module, args: tuple, output):
        """The forward hook of `group`'s module: its input projected (now, or with the next `flush`),
        its output hooked for δ; outside a batch, nothing."""
        if not self.active:
            return None
        for name, _ in group:
            if name in self.x_proj or name in self.reached or (self.shared and name in self.shared[1]):
                raise RuntimeError(f"module {name} ran twice in one forward; cannot attribute its gradient.")
        x = args[0].detach()
        if x.dim() != 3 or x.shape[:2] != self.shape:
            raise RuntimeError(f"module {group[0][0]} input is {tuple(x.shape)}, expected (B, T, d_in).")
        if self.shared and self.shared[0] is not x:
            self.flush()
        for name, columns in group:
            if columns is not None:
                self.x_proj[name] = self._masked(self.projector.project_input(name, x[..., columns]))
                continue
            if not self.shared:
                self.shared = [x, []]
            self.shared[1].append(name)
        out = _output_tensor(output)
        if not out.requires_grad:
            # Frozen weights and an input that needs no gradient (the earliest selected modules):
            # attach the output to the graph with an exact +0 from a leaf, so that backward starts
            # here and stops here (no in-place trouble with a grad leaf).
            out = out + torch.zeros((), dtype=out.dtype, device=out.device, requires_grad=True)
        out.register_hook(partial(self.backward, group))
        return out

    def backward(self, group: list[tuple[str, slice | None]], delta: torch.Tensor) -> None:
        """The gradient hook of `group`'s module output: δ (B, T, d_out) projected, each site's pair handed on."""
        for name, _ in group:
            # (B, T, k_o); zero at padding already: a real position never reads a later one, so no
            # gradient reaches the padding (a non-finite one would show in the row, refused)
            dp = self.projector.project_output(name, delta)
            xp = self.x_proj[name] if self.keep_inputs else self.x_proj.pop(name)
            for consumer in self.consumers:
                consumer.take(name, xp, dp, self.batch)
            self.reached.add(name)

    def run_backward(self, h: torch.Tensor, grad_h: torch.Tensor, consumers: list[Consumer], keep_inputs: bool,
                     names: list[str], absent_error: str) -> None:
        """h.backward(grad_h), each module's pair to `consumers`; RuntimeError `absent_error` (formatted
        with the first missing names) when the gradient reached no site of some of `names`."""
        self.consumers, self.keep_inputs, self.reached = consumers, keep_inputs, set()
        h.backward(grad_h, retain_graph=keep_inputs)
        absent = [n for n in names if n not in self.reached]
        if absent:
            raise RuntimeError(absent_error.format(absent[:3]))


def _output_tensor(output):
    if isinstance(output, torch.Tensor):
        return output
    raise TypeError(f"a selected linear module returned {type(output).__name__}, expected a tensor.")
