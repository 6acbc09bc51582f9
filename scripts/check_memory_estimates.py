"""Check circuitkit.memory.estimate_attribution and estimate_grads against measured peaks on the CPU.

Builds random float32 models from transformers config classes (tiny fixture-like shapes and
GPT-2-small shapes), runs `attribute` on one batch of random TaskData inside `measure_peak`
(live tensor bytes + resident weights) and compares with the closed-form estimate. Exits 1
if any ratio estimate / measured is outside [0.75, 1.25]. The grads sweep runs
`gradian.capture.per_example_gradients` (mlp.c_proj / down_proj, rows of prompt + supervised
tokens, kronecker projection_dim 64, raw on tiny shapes) the same way.

    python scripts/check_memory_estimates.py [--quick] [--json rows.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from functools import lru_cache

import torch
import transformers as tf
from rich.console import Console
from rich.table import Table

from circuitkit.attribution.eap import attribute
from circuitkit.device import measure_peak, module_bytes
from circuitkit.memory import MiB, estimate_attribution, estimate_grads, shape_from_config
from circuitkit.models.adapters import get_adapter
from circuitkit.tasks.base import random_pairs
from gradian.capture import per_example_gradients
from gradian.projection import Projector, module_shapes, select_modules

TOLERANCE = 0.25


def _tiny(family: str) -> tf.PretrainedConfig:
    v = {"vocab_size": 1024}
    if family == "gpt2":
        return tf.GPT2Config(n_layer=2, n_head=4, n_embd=64, n_inner=256, n_positions=256, **v)
    if family == "gpt_neox":
        return tf.GPTNeoXConfig(num_hidden_layers=2, num_attention_heads=4, hidden_size=64, intermediate_size=256,
                                max_position_embeddings=256, tie_word_embeddings=False, **v)
    if family == "llama":
        return tf.LlamaConfig(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                              hidden_size=64, intermediate_size=128, max_position_embeddings=256, **v)
    if family == "gemma3":
        return tf.Gemma3TextConfig(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                   hidden_size=64, intermediate_size=128, query_pre_attn_scalar=16,
                                   max_position_embeddings=256, sliding_window=8,
                                   layer_types=["sliding_attention", "full_attention"], **v)
    raise KeyError(family)


def _small(family: str) -> tf.PretrainedConfig:
    """GPT-2-small shape: 12 layers, 12 heads, d_model 768, vocab 50257 (llama: 4 KV heads, f 2048)."""
    v = {"vocab_size": 50257}
    if family == "gpt2":
        return tf.GPT2Config(n_layer=12, n_head=12, n_embd=768, n_positions=1024, **v)
    if family == "llama":
        return tf.LlamaConfig(num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=4, head_dim=64,
                              hidden_size=768, intermediate_size=2048, max_position_embeddings=1024, **v)
    raise KeyError(family)


@lru_cache(maxsize=2)
def build_model(name: str) -> torch.nn.Module:
    """'tiny-gpt2', 'small-llama', ...: a random float32 model, frozen, eval mode."""
    size, family = name.split("-", 1)
    config = (_tiny if size == "tiny" else _small)(family)
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(config).float().eval()
    model.requires_grad_(False)
    return model


@dataclass
class Row:
    model: str
    level: str
    batch: int
    seq_len: int
    ig_steps: int
    estimate_mib: float
    measured_mib: float
    ratio: float  # estimate / measured
    phase: str


def measure(name: str, level: str, batch: int, seq_len: int, ig_steps: int) -> Row:
    """One batch of eap-ig: measured peak vs estimate."""
    model = build_model(name)
    adapter = get_adapter(model)
    data = random_pairs(batch, seq_len, model.config.vocab_size)
    with measure_peak(torch.device("cpu"), resident_bytes=lambda: module_bytes(model)) as peak:
        attribute(adapter, data, "eap-ig", level, ig_steps=ig_steps, batch_size=batch, progress=False)
    est = estimate_attribution(shape_from_config(model.config), 4, batch, seq_len, "eap-ig", level, ig_steps)
    return Row(name, level, batch, seq_len, ig_steps, est.total_bytes / MiB, peak.peak_bytes / MiB,
               est.total_bytes / peak.peak_bytes, est.phase)


def sweep_points(quick: bool) -> Iterable[tuple[str, str, int, int, int]]:
    """(model, level, batch, seq_len, ig_steps) of the quick or full sweep."""
    tiny = ("tiny-gpt2", "tiny-llama", "tiny-gpt_neox", "tiny-gemma3")
    if quick:
        for name in tiny:
            for level in ("node", "edge"):
                for batch, seq in ((1, 32), (4, 64)):
                    for steps in (1, 5):
                        yield name, level, batch, seq, steps
        return
    for name in (*tiny, "small-gpt2", "small-llama"):
        seqs = (32, 64) if name.startswith("tiny") else (32,)
        for level in ("node", "edge"):
            for seq in seqs:
                for batch in (1, 2, 4, 8):
                    for steps in (1, 5):
                        yield name, level, batch, seq, steps


def run_sweep(quick: bool = True) -> list[Row]:
    return [measure(*point) for point in sweep_points(quick)]


GRADS_FILTER = {"gpt2": ["mlp.c_proj"], "llama": ["down_proj"]}


@dataclass
class GradsRow:
    model: str
    projection: str
    batch: int
    prompt: int
    supervised: int
    estimate_mib: float
    measured_mib: float
    ratio: float  # estimate / measured
    phase: str


def grads_batch(batch: int, prompt: int, supervised: int, vocab: int) -> dict[str, torch.Tensor]:
    """Random rows of prompt + supervised tokens, the last `supervised` of each row supervised."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (batch, prompt + supervised), generator=g)
    sup = torch.zeros_like(ids, dtype=torch.bool)
    sup[:, prompt:] = True
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "supervised": sup}


def measure_grads_model(model: torch.nn.Module, name: str, projection_dim: int | None, batch: int, prompt: int,
                        supervised: int) -> GradsRow:
    """One batch of per_example_gradients on `model`: measured peak (weights resident) vs estimate."""
    adapter = get_adapter(model)
    shape = shape_from_config(model.config)
    modules = select_modules(model, adapter, GRADS_FILTER[shape["family"]])
    shapes = module_shapes(modules)
    projector = Projector(shapes, "kronecker", projection_dim, seed=0)  # fresh: matrices counted
    data = grads_batch(batch, prompt, supervised, model.config.vocab_size)
    with measure_peak(torch.device("cpu"), resident_bytes=lambda: module_bytes(model)) as peak:
        per_example_gradients(model, adapter, modules, projector, data)
    est = estimate_grads(shape, 4, batch, prompt + supervised, supervised, shapes, "kronecker", projection_dim, 2, 0)
    return GradsRow(name, projector.kind, batch, prompt, supervised, est.total_bytes / MiB, peak.peak_bytes / MiB,
                    est.total_bytes / peak.peak_bytes, est.phase)


def grads_points(quick: bool) -> Iterable[tuple[str, int | None, int, int, int]]:
    """(model, projection_dim, batch, prompt, supervised): batch 1/2/4/8 x (prompt 16/64/240 at 16
    supervised, supervised 8/32 at prompt 64); tiny shapes kronecker 64 and raw, GPT-2-small
    kronecker 64 (full sweep only)."""
    names = ("tiny-gpt2", "tiny-llama") if quick else ("tiny-gpt2", "tiny-llama", "small-gpt2")
    for name in names:
        for dim in ((64, None) if name.startswith("tiny") else (64,)):
            for batch in (1, 2, 4, 8):
                for prompt, sup in ((16, 16), (64, 16), (240, 16), (64, 8), (64, 32)):
                    yield name, dim, batch, prompt, sup


def run_grads_sweep(quick: bool = True) -> list[GradsRow]:
    return [measure_grads_model(build_model(name), name, dim, b, p, s)
            for name, dim, b, p, s in grads_points(quick)]


def grads_table(rows: list[GradsRow]) -> Table:
    table = Table(title="gradient indexing peak memory: estimate vs measured (CPU, float32, per_example_gradients)")
    for col in ("model", "projection", "batch", "prompt", "supervised", "estimate MiB", "measured MiB", "ratio"):
        table.add_column(col, justify="right")
    for r in rows:
        bad = abs(r.ratio - 1) > TOLERANCE
        table.add_row(r.model, r.projection, str(r.batch), str(r.prompt), str(r.supervised), f"{r.estimate_mib:.2f}",
                      f"{r.measured_mib:.2f}", f"{r.ratio:.3f}", style="red" if bad else None)
    return table


def rows_table(rows: list[Row]) -> Table:
    table = Table(title="attribution peak memory: estimate vs measured (CPU, float32, eap-ig)")
    for col in ("model", "level", "batch", "seq", "ig_steps", "estimate MiB", "measured MiB", "ratio"):
        table.add_column(col, justify="right")
    for r in rows:
        bad = abs(r.ratio - 1) > TOLERANCE
        table.add_row(r.model, r.level, str(r.batch), str(r.seq_len), str(r.ig_steps), f"{r.estimate_mib:.1f}",
                      f"{r.measured_mib:.1f}", f"{r.ratio:.3f}", style="red" if bad else None)
    return table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny shapes only (~30 s)")
    parser.add_argument("--json", default=None, help="write the rows here too")
    args = parser.parse_args(argv)
    rows = run_sweep(args.quick)
    console = Console()
    console.print(rows_table(rows))
    worst = max(rows, key=lambda r: abs(r.ratio - 1))
    console.print(f"worst ratio {worst.ratio:.3f} ({worst.model} {worst.level} batch {worst.batch}"
                  f" seq {worst.seq_len} ig_steps {worst.ig_steps}); tolerance ±{TOLERANCE:.0%}")
    grows = run_grads_sweep(args.quick)
    console.print(grads_table(grows))
    gworst = max(grows, key=lambda r: abs(r.ratio - 1))
    console.print(f"grads worst ratio {gworst.ratio:.3f} ({gworst.model} {gworst.projection} batch {gworst.batch}"
                  f" prompt {gworst.prompt} supervised {gworst.supervised}); tolerance ±{TOLERANCE:.0%}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"attribution": [asdict(r) for r in rows], "grads": [asdict(r) for r in grows]}, fh, indent=2)
    ok = all(abs(r.ratio - 1) <= TOLERANCE for r in [*rows, *grows])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
