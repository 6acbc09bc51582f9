"""Plots people would rather look at than tables: head score heatmaps (PNG, headless)."""

from __future__ import annotations

from pathlib import Path

import torch

from circuitkit.core.io import _atomic


def head_heatmap(head_scores: torch.Tensor, path: Path, title: str, kept: torch.Tensor | None = None) -> Path:
    """Heatmap of head scores (n_layers, n_heads), diverging around 0; kept heads outlined."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scores = head_scores.float().numpy()
    n_layers, n_heads = scores.shape
    limit = float(abs(scores).max()) or 1.0
    fig, ax = plt.subplots(figsize=(max(5.5, 0.45 * n_heads + 2), max(3, 0.35 * n_layers + 1.5)))
    im = ax.imshow(scores, cmap="RdBu_r", vmin=-limit, vmax=limit, aspect="auto")
    ax.set_xlabel("head")
    ax.set_ylabel("layer")
    ax.set_xticks(range(n_heads))
    ax.set_yticks(range(n_layers))
    ax.set_title(title, fontsize=9, wrap=True)
    if kept is not None:
        for layer, head in kept.nonzero().tolist():
            ax.add_patch(plt.Rectangle((head - 0.5, layer - 0.5), 1, 1, fill=False, edgecolor="black", lw=3))
    fig.colorbar(im, ax=ax, label="score")
    fig.tight_layout()
    _atomic(Path(path), lambda tmp: fig.savefig(tmp, format="png", dpi=120))
    plt.close(fig)
    return Path(path)


def faithfulness_curve(rows: list[dict], path: Path, title: str) -> Path:
    """Faithfulness against the percentage of heads (or edges) kept, log-scaled x axis."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [r["percent_kept"] for r in rows]
    fs = [r["faithfulness"] for r in rows]
    fig, ax = plt.subplots(figsize=(5.5, 3.5))
    ax.plot(xs, fs, marker="o")
    ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax.axhline(0.0, color="grey", lw=0.8)
    ax.set_xscale("log")
    ax.set_xlabel("% kept")
    ax.set_ylabel("faithfulness")
    ax.set_title(title)
    fig.tight_layout()
    _atomic(Path(path), lambda tmp: fig.savefig(tmp, format="png", dpi=120))
    plt.close(fig)
    return Path(path)
