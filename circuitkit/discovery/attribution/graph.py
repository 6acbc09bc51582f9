"""The computational graph that attribution scores: nodes, and edges between them.

Upstream nodes (what writes to the residual stream), in forward order:
    "input"          the token (+ position) embedding entering block 0
    "a{l}.h{h}"      attention head h of layer l (its value is z_h, its write W_O[h] z_h)
    "m{l}"           the MLP of layer l
Downstream inputs (what reads the residual stream), in forward order:
    "a{l}.h{h}<q>"   the query input of head h          (one per query head)
    "a{l}.g{g}<k>"   the key input of KV head g          (one per KV head: GQA native)
    "a{l}.g{g}<v>"   the value input of KV head g
    "m{l}<in>"       the MLP input
    "logits"         the final norm's input

An edge u -> v exists when v reads what u writes: u is the embedding or an earlier layer, or
u is an attention head of the same layer and v that layer's MLP, unless the model has a
parallel residual (GPT-NeoX), where attention and MLP of one layer both read the residual
entering the layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Graph:
    n_layers: int
    n_heads: int
    n_kv_heads: int
    parallel_residual: bool

    # -- upstream --------------------------------------------------------------------------
    @property
    def upstream(self) -> list[str]:
        names = ["input"]
        for layer in range(self.n_layers):
            names += [f"a{layer}.h{h}" for h in range(self.n_heads)] + [f"m{layer}"]
        return names

    def head_index(self, layer: int, head: int) -> int:
        """Row of head (layer, head) among the upstream nodes."""
        return 1 + layer * (self.n_heads + 1) + head

    def mlp_index(self, layer: int) -> int:
        return 1 + layer * (self.n_heads + 1) + self.n_heads

    # -- downstream ------------------------------------------------------------------------
    @property
    def per_layer_inputs(self) -> int:
        return self.n_heads + 2 * self.n_kv_heads + 1

    @property
    def downstream(self) -> list[str]:
        names = []
        for layer in range(self.n_layers):
            names += [f"a{layer}.h{h}<q>" for h in range(self.n_heads)]
            names += [f"a{layer}.g{g}<k>" for g in range(self.n_kv_heads)]
            names += [f"a{layer}.g{g}<v>" for g in range(self.n_kv_heads)]
            names.append(f"m{layer}<in>")
        return names + ["logits"]

    def layer_columns(self, layer: int) -> slice:
        """Columns of layer `layer`'s inputs (q heads, k groups, v groups, MLP)."""
        start = layer * self.per_layer_inputs
        return slice(start, start + self.per_layer_inputs)

    @property
    def logits_column(self) -> int:
        return self.n_layers * self.per_layer_inputs

    def upstream_before_attn(self, layer: int) -> int:
        """Number of upstream rows (a prefix) that attention of `layer` reads."""
        return 1 + layer * (self.n_heads + 1)

    def upstream_before_mlp(self, layer: int) -> int:
        """Number of upstream rows (a prefix) that the MLP of `layer` reads."""
        return self.upstream_before_attn(layer) + (0 if self.parallel_residual else self.n_heads)

    def edge_mask(self) -> torch.Tensor:
        """(n_upstream, n_downstream) bool: which edges exist."""
        mask = torch.zeros(len(self.upstream), len(self.downstream), dtype=torch.bool)
        for layer in range(self.n_layers):
            cols = self.layer_columns(layer)
            attn_cols = slice(cols.start, cols.stop - 1)
            mask[: self.upstream_before_attn(layer), attn_cols] = True
            mask[: self.upstream_before_mlp(layer), cols.stop - 1] = True
        mask[:, self.logits_column] = True
        return mask

    @property
    def n_edges(self) -> int:
        return int(self.edge_mask().sum())
