"""Many head circuits in one forward: the pairs repeated once per circuit along the batch, each
circuit's removed heads ablated on its own rows, through the adapter's hook on z.

    rows      c·B for c circuits and B pairs, example-major: row b·c + j runs pair b in circuit j
    ablation  z_row[..., head h] = value[b, t, head h] where circuit j removes h, else z_row itself
              (`torch.where`: the live or the ablated value bit for bit)

Under corrupted ablation a pair's clean and corrupted prompts agree up to the first token the
corruption changes (IOI's s2: the second subject, two thirds into the prompt), and attention is
causal, so there every head's z is the clean one whatever the circuit ablates: every circuit's
residual stream equals the clean run's. `circuit_answer_logits` runs those shared positions once
per batch (the clean prompt, keys and values cached), and only the rest once per circuit: for IOI
about a third of the tokens. Mean and zero ablation change z from the first position on; they
run every position per circuit.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import fields

import torch
from transformers.modeling_outputs import CausalLMOutputWithPast

from circuitkit.discovery.pruning.edges import fit_positions
from circuitkit.discovery.tasks.base import TaskData
from circuitkit.models.adapters import ModelAdapter
from circuitkit.models.hooks import HookSet

# Tokens (circuits x pairs x positions) one batched circuit forward may run: the evaluator puts
# max(1, CIRCUIT_FORWARD_TOKENS // (B·T)) circuits side by side per held-out batch of B pairs of
# T tokens. A CPU forward gains little per token past a few hundred tokens (SmolLM2-135M, one
# thread: 200 rows of 18 tokens at 0.85x the time of 25 forwards of 8 rows), an accelerator much
# more; the forward's temporaries grow with it (`circuitkit.discovery.pruning.memory` counts them).
CIRCUIT_FORWARD_TOKENS = 4096
# transformers 5 renamed the forward's `past_key_values` to `cache` (the old name still works, with a warning).
CACHE_KWARG = "cache" if "cache" in {f.name for f in fields(CausalLMOutputWithPast)} else "past_key_values"


@contextmanager
def ablate_heads(adapter: ModelAdapter, removed: torch.Tensor, values: list[torch.Tensor | None],
                 start: int = 0) -> Iterator[None]:
    """Replace z of removed heads with `values[layer]`.

    removed: (L, H) bool, True = removed, the same for every row of the forward; or (c, L, H), one
    mask per circuit, for a forward of B·c rows laid out example-major (row b·c + j: pair b,
    circuit j). values[layer]: (B or 1, T, H * head_dim), shared by the circuits, or None for
    zeros. `start`: the position of the forward's first token (a forward over cached positions
    reads values[layer][..., start:, :]).
    """
    per_circuit = removed.bool().cpu()
    per_circuit = per_circuit if per_circuit.dim() == 3 else per_circuit[None]
    n_circuits, dh = per_circuit.shape[0], adapter.head_dim
    with HookSet() as hk:
        for layer in range(adapter.n_layers):
            if not per_circuit[:, layer].any():
                continue
            # (1, c, 1, H * dh): moved to z's device at the first call, then reused.
            columns = [per_circuit[:, layer].repeat_interleave(dh, dim=1)[None, :, None, :]]

            def hook(module, args, layer=layer, columns=columns):
                z = args[0]  # (B·c, T, H * dh)
                if columns[0].device != z.device:
                    columns[0] = columns[0].to(z.device)
                v = values[layer]
                if v is not None:  # (B or 1, 1, T, H * dh)
                    v = fit_positions(v, start + z.shape[-2])[..., start:, :].to(z.dtype)[:, None]
                out = torch.where(columns[0], 0.0 if v is None else v, z.unflatten(0, (-1, n_circuits)))
                return (out.flatten(0, 1), *args[1:])
            hk.pre(adapter.z_input(layer), hook)
        yield


def shared_prefix(data: TaskData) -> torch.Tensor:
    """(N,) long: the positions before the first token where the clean and corrupted prompts of each
    pair differ, at most its answer position (which every circuit computes)."""
    differ = data.clean_ids != data.corrupted_ids  # (N, T)
    first = torch.where(differ.any(dim=1), differ.int().argmax(dim=1), data.clean_ids.shape[1])
    return torch.minimum(first, data.answer_pos)


class PrefixCache:
    """The keys and values of a batch's clean prompts up to `prefix` (B pairs), computed once and
    copied for each group of circuits (`circuit_answer_logits`)."""

    def __init__(self, model: torch.nn.Module, batch: TaskData, prefix: int) -> None:
        self.prefix = prefix
        out = model(input_ids=batch.clean_ids[:, :prefix], attention_mask=batch.attention_mask[:, :prefix],
                    use_cache=True, logits_to_keep=1)
        self.cache = out[CACHE_KWARG]

    def repeated(self, n_circuits: int):
        """A copy with every pair's row repeated n_circuits times, example-major."""
        cache = copy.deepcopy(self.cache)
        cache.batch_repeat_interleave(n_circuits)
        return cache


def circuit_answer_logits(adapter: ModelAdapter, batch: TaskData, answer_pos: torch.Tensor, removed: torch.Tensor,
                          values: list[torch.Tensor | None], prefix: PrefixCache | None = None) -> torch.Tensor:
    """Answer logits of B pairs under c circuits: (B·c, V), row b·c + j = pair b in circuit j.

    answer_pos: (B,) the batch's answer positions on the host (the model call's columns come from
    them, with no wait for the device). removed: (c, L, H) bool, True = ablated; values:
    `ablate_heads`' (per pair of `batch`, or one row for all). `prefix`: the batch's clean keys and
    values up to a position where every circuit's residual stream is still the clean one (corrupted
    ablation, `shared_prefix`); the forward then runs only the positions after it.
    """
    c, device = removed.shape[0], batch.clean_ids.device
    start = 0 if prefix is None else prefix.prefix
    keep, column = torch.unique(answer_pos.cpu() - start, return_inverse=True)  # host data: no wait
    rows = torch.arange(len(batch), device=device).repeat_interleave(c)
    kwargs = {} if prefix is None else {CACHE_KWARG: prefix.repeated(c), "use_cache": True}
    with ablate_heads(adapter, removed, values, start):
        logits = adapter.model(input_ids=batch.clean_ids[rows, start:], attention_mask=batch.attention_mask[rows],
                               logits_to_keep=keep.to(device), **kwargs).logits  # (B·c, k, V)
    return logits[torch.arange(len(rows), device=logits.device), column.repeat_interleave(c).to(logits.device)]
