"""Check the attribution and gradient-indexing memory estimates (circuitkit.discovery.attribution.memory,
gradian.build.memory) against measured peaks on the CPU.

Builds random float32 models from transformers config classes (tiny fixture-like shapes and
GPT-2-small shapes), runs `attribute` on one batch of random TaskData inside `measure_peak`
(live tensor bytes + resident weights) and compares with the closed-form estimate. Exits 1
if any ratio estimate / measured is outside [0.75, 1.25]. The grads sweep runs
`gradian.capture.gradients.per_example_gradients` (mlp.c_proj / down_proj, rows of prompt + supervised
tokens, the default projection kind and loss at projection_dim 64, raw on tiny shapes) the same way.

    python scripts/bench/check_memory_estimates.py [--quick] [--json rows.json]

`--real` runs the real shapes of conf/model/*.yaml instead (gpt2, pythia70m, llama1b; gemma4b
with --real-models when ~20 GB are free) with random weights, in float32 and bfloat16, node and
edge level and the grads stage, batch 1 and 4 (--real-batches), 32 tokens, ig_steps 3, against
the tighter tolerance: estimate / measured within [0.95, 1.10]. `--layers N`
builds N layers of the real width instead of the full depth (every term is linear in the
depth but the score matrix, which is small).

    python scripts/bench/check_memory_estimates.py --real [--real-models gpt2 pythia70m llama1b] [--layers N]

`--pruning` measures the pruning stage (`circuitkit.discovery.pruning.heads.prune`: head scope, edge scope with
top_k, edge scope with edge_pruning; corrupted ablation) against `circuitkit.discovery.pruning.memory`:
SmolLM2 with its pretrained weights (`circuitkit fetch smollm2`) and real shapes with random
weights (NAME:L builds L layers of NAME's width), against [0.95, 1.10].

    python scripts/bench/check_memory_estimates.py --pruning [--pruning-models smollm2 gpt2 llama1b:4]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from functools import lru_cache
from pathlib import Path

import torch
import transformers as tf
from rich.console import Console
from rich.table import Table

from circuitkit.core.device import measure_peak, module_bytes
from circuitkit.discovery.attribution.eap import attribute
from circuitkit.discovery.attribution.memory import estimate_attribution
from circuitkit.discovery.tasks.base import random_pairs
from circuitkit.models.adapters import get_adapter
from circuitkit.models.linear_modules import module_shapes, select_modules
from circuitkit.preflight.memory import MiB, shape_from_config
from gradian.build.memory import estimate_grads
from gradian.capture.gradients import activation_mode, per_example_gradients
from gradian.projection.projector import Projector
from gradian.settings.grads import GradsConfig

REPO = Path(__file__).resolve().parents[2]
TOLERANCE = 0.25
REAL_RANGE = (0.95, 1.10)  # real shapes: within ±10 %, never more than 5 % below the measured peak


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
    return measure_model(build_model(name), name, level, batch, seq_len, ig_steps)


def measure_model(model: torch.nn.Module, name: str, level: str, batch: int, seq_len: int, ig_steps: int) -> Row:
    """One batch of eap-ig on `model` (its dtype): measured peak (weights resident) vs estimate."""
    adapter = get_adapter(model)
    data = random_pairs(batch, seq_len, model.config.vocab_size)
    with measure_peak(torch.device("cpu"), resident_bytes=lambda: module_bytes(model)) as peak:
        attribute(adapter, data, "eap-ig", level, ig_steps=ig_steps, batch_size=batch, progress=False)
    dtype_bytes = next(model.parameters()).element_size()
    est = estimate_attribution(shape_from_config(model.config), dtype_bytes, batch, seq_len, "eap-ig", level,
                               ig_steps)
    return Row(name, level, batch, seq_len, ig_steps, est.total_bytes / MiB, peak.peak_bytes / MiB,
               est.total_bytes / peak.peak_bytes, est.phase)


def config_from_shape(shape: dict, n_layers: int | None = None) -> tf.PretrainedConfig:
    """A transformers config of the shape of conf/model/NAME.yaml (n_layers: fewer layers, same width)."""
    L = n_layers or shape["n_layers"]
    fam = shape["family"]
    if fam == "gpt2":
        return tf.GPT2Config(n_layer=L, n_head=shape["n_heads"], n_embd=shape["d_model"], n_inner=shape["d_mlp"],
                             vocab_size=shape["vocab_size"], n_positions=1024)
    if fam == "gpt_neox":
        return tf.GPTNeoXConfig(num_hidden_layers=L, num_attention_heads=shape["n_heads"],
                                hidden_size=shape["d_model"], intermediate_size=shape["d_mlp"],
                                vocab_size=shape["vocab_size"], tie_word_embeddings=False,
                                max_position_embeddings=2048)
    common = dict(num_hidden_layers=L, num_attention_heads=shape["n_heads"], num_key_value_heads=shape["n_kv_heads"],
                  head_dim=shape["head_dim"], hidden_size=shape["d_model"], intermediate_size=shape["d_mlp"],
                  vocab_size=shape["vocab_size"], tie_word_embeddings=True, max_position_embeddings=2048)
    if fam == "llama":
        return tf.LlamaConfig(**common)
    if fam == "gemma3":
        return tf.Gemma3TextConfig(**common, query_pre_attn_scalar=shape["head_dim"], sliding_window=1024)
    raise KeyError(fam)


def build_real(name: str, dtype: torch.dtype, n_layers: int | None = None) -> torch.nn.Module:
    """A random model of conf/model/NAME.yaml's shape in `dtype`, frozen, eval mode."""
    from omegaconf import OmegaConf

    shape = OmegaConf.to_container(OmegaConf.load(REPO / "conf" / "model" / f"{name}.yaml").shape)
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(config_from_shape(shape, n_layers),
                                                attn_implementation="sdpa").to(dtype).eval()
    model.requires_grad_(False)
    return model


def real_points(models: Iterable[str], batches: Iterable[int], n_layers: int | None,
                dtypes: Iterable[torch.dtype] = (torch.float32, torch.bfloat16)):
    """Rows of the real-shape sweep: (name, dtype, stage, batch); stage node / edge / grads."""
    for name in models:
        for dtype in dtypes:
            for stage in ("node", "edge", "grads"):
                for batch in batches:
                    yield name, dtype, stage, batch


def run_real_sweep(models: Iterable[str], batches: Iterable[int] = (1, 4), n_layers: int | None = None,
                   seq_len: int = 32, ig_steps: int = 3,
                   dtypes: Iterable[torch.dtype] = (torch.float32, torch.bfloat16)) -> list[Row]:
    """The real-shape sweep; the model is built once per (name, dtype)."""
    rows, cache = [], {}
    for name, dtype, stage, batch in real_points(models, batches, n_layers, tuple(dtypes)):
        key = (name, dtype)
        if key not in cache:
            cache.clear()
            cache[key] = build_real(name, dtype, n_layers)
        model = cache[key]
        label = f"{name}{'' if n_layers is None else f'[{n_layers}L]'} {str(dtype).removeprefix('torch.')}"
        if stage == "grads":
            g = measure_grads_model(model, label, 64, batch, seq_len - 8, 8)
            rows.append(Row(label, "grads", batch, seq_len, 0, g.estimate_mib, g.measured_mib, g.ratio, g.phase))
        else:
            rows.append(measure_model(model, label, stage, batch, seq_len, ig_steps))
    return rows


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


GRADS_FILTER = {"gpt2": ["mlp.c_proj"], "llama": ["down_proj"], "gpt_neox": ["dense_4h_to_h"],
                "gemma3": ["down_proj"], "qwen3": ["down_proj"], "qwen3_moe": ["o_proj"]}


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
    defaults = GradsConfig()  # the product's projection kind and loss
    projector = Projector(shapes, defaults.projection, projection_dim, seed=0)  # fresh: matrices counted
    data = grads_batch(batch, prompt, supervised, model.config.vocab_size)
    with measure_peak(torch.device("cpu"), resident_bytes=lambda: module_bytes(model)) as peak:
        per_example_gradients(model, adapter, modules, projector, data, loss=defaults.loss)
    dtype = next(model.parameters()).dtype
    est = estimate_grads(shape, dtype.itemsize, batch, prompt + supervised, supervised, projector, 2, 0,
                         activations=activation_mode("auto", dtype), loss=defaults.loss)
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


def rows_table(rows: list[Row], title: str = "CPU, float32, eap-ig") -> Table:
    table = Table(title=f"attribution peak memory: estimate vs measured ({title})")
    for col in ("model", "level", "batch", "seq", "ig_steps", "estimate MiB", "measured MiB", "ratio"):
        table.add_column(col, justify="right")
    for r in rows:
        bad = abs(r.ratio - 1) > TOLERANCE
        table.add_row(r.model, r.level, str(r.batch), str(r.seq_len), str(r.ig_steps), f"{r.estimate_mib:.1f}",
                      f"{r.measured_mib:.1f}", f"{r.ratio:.3f}", style="red" if bad else None)
    return table


# --------------------------------------------------------------------------- the small-input grid

GRID_SEQS = (16, 32, 64, 128, 256, 512, 1024, 2048)
GRID_BATCHES = (1, 2, 4, 8, 16)
GRID_RANGE = (0.95, 1.10)  # every point within -5 % .. +10 % of the measured peak


def build_real_fast(name: str, dtype: torch.dtype, n_layers: int) -> torch.nn.Module:
    """`build_real`, without transformers' weight initialisation (minutes for a 128k x 2048
    embedding on a loaded CPU): parameters are allocated empty and filled with N(0, 0.02)
    directly. The peak memory does not depend on the values."""
    from omegaconf import OmegaConf
    from transformers.initialization import no_init_weights

    shape = OmegaConf.to_container(OmegaConf.load(REPO / "conf" / "model" / f"{name}.yaml").shape)
    torch.manual_seed(0)
    with no_init_weights():
        model = tf.AutoModelForCausalLM.from_config(config_from_shape(shape, n_layers), attn_implementation="sdpa",
                                                    dtype=dtype)
    model.tie_weights()  # skipped with the initialisation; the real model ties its embeddings
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.02)
        for module in model.modules():
            if "Norm" in type(module).__name__ and getattr(module, "weight", None) is not None:
                module.weight.fill_(1.0)
    model.eval().requires_grad_(False)
    return model


@dataclass
class GridRow:
    model: str
    dtype: str
    batch: int
    seq_len: int
    measured_layers: str  # "16" measured at full depth, or "1,2 -> 16" extrapolated (linear in depth)
    estimate_mib: float
    measured_mib: float
    ratio: float  # estimate / measured
    phase: str


def run_grid(name: str = "llama1b", dtypes: Iterable[torch.dtype] = (torch.float32, torch.bfloat16),
             seqs: Iterable[int] = GRID_SEQS, batches: Iterable[int] = GRID_BATCHES, layers: tuple[int, int] = (1, 2),
             max_measured_mib: float = 6000.0, ig_steps: int = 3) -> list[GridRow]:
    """Edge-level eap-ig peaks at `name`'s full width for every (seq, batch) whose estimate at the
    measured depth is under `max_measured_mib`, measured at two depths and extrapolated linearly
    to the full depth (every term but the tiny score matrix is linear in the number of layers);
    `layers=(L, L)` with L the full depth measures directly. The estimate is the full-depth one."""
    from omegaconf import OmegaConf

    full = OmegaConf.load(REPO / "conf" / "model" / f"{name}.yaml").shape
    L_full = int(full.n_layers)
    rows = []
    for dtype in dtypes:
        measured: dict[int, dict[tuple[int, int], float]] = {}
        for L in sorted(set(layers)):
            model = build_real_fast(name, dtype, L)
            shape_l = shape_from_config(model.config)
            measured[L] = {}
            for seq in seqs:
                for batch in batches:
                    est_l = estimate_attribution(shape_l, dtype.itemsize, batch, seq, "eap-ig", "edge", ig_steps)
                    if est_l.total_bytes / MiB > max_measured_mib:
                        continue
                    measured[L][(batch, seq)] = measure_model(model, name, "edge", batch, seq, ig_steps).measured_mib
                    print(f"{name} {dtype} L={L} batch {batch} seq {seq}: {measured[L][(batch, seq)]:.1f} MiB",
                          flush=True)
            del model
        shape = shape_from_config(config_from_shape(OmegaConf.to_container(full)))
        lo, hi = sorted(set(layers))[0], sorted(set(layers))[-1]
        for key in sorted(measured[hi], key=lambda k: (k[1], k[0])):
            if key not in measured[lo]:
                continue
            per_layer = (measured[hi][key] - measured[lo][key]) / (hi - lo) if hi > lo else 0.0
            meas = measured[hi][key] + per_layer * (L_full - hi)
            batch, seq = key
            est = estimate_attribution(shape, dtype.itemsize, batch, seq, "eap-ig", "edge", ig_steps)
            label = str(L_full) if lo == hi == L_full else f"{lo},{hi} -> {L_full}"
            rows.append(GridRow(name, str(dtype).removeprefix("torch."), batch, seq, label, est.total_bytes / MiB,
                                meas, est.total_bytes / MiB / meas, est.phase))
    return rows


def grid_table(rows: list[GridRow]) -> Table:
    table = Table(title="edge-level eap-ig peak: estimate vs measured (CPU dispatch tracker + weights, ig_steps 3)")
    for col in ("dtype", "batch", "seq", "layers measured", "estimate MiB", "measured MiB", "ratio", "phase"):
        table.add_column(col, justify="right")
    lo, hi = GRID_RANGE
    for r in rows:
        table.add_row(r.dtype, str(r.batch), str(r.seq_len), r.measured_layers, f"{r.estimate_mib:.0f}",
                      f"{r.measured_mib:.0f}", f"{r.ratio:.3f}", r.phase,
                      style=None if lo <= r.ratio <= hi else "red")
    return table


# --------------------------------------------------------------------------- the pruning stage

PRUNING_CASES = (("heads", "top_k"), ("heads", "mask"), ("edges", "top_k"), ("edges", "edge_pruning"))
PRETRAINED = {"smollm2": "fetched:smollm2"}  # loaded with their real weights


@dataclass
class PruneRow:
    model: str
    scope: str
    selection: str
    batch: int
    seq_len: int
    n_eval: int
    estimate_mib: float
    measured_mib: float
    ratio: float  # estimate / measured
    phase: str


def random_scores(adapter, seed: int = 0):
    """AttributionScores of random values on the adapter's graph (the peak does not depend on them)."""
    from circuitkit.discovery.attribution.eap import AttributionScores, graph_of

    g = graph_of(adapter)
    gen = torch.Generator().manual_seed(seed)
    valid = g.edge_mask()
    return AttributionScores(torch.randn(g.n_layers, g.n_heads, generator=gen), torch.randn(g.n_layers, generator=gen),
                             torch.tensor(0.0), g, torch.randn(valid.shape, generator=gen) * valid)


def measure_pruning(model: torch.nn.Module, name: str, scope: str, selection: str, batch: int, seq_len: int,
                    n_eval: int, n_attr: int, mask_steps: int = 2, ablation: str = "corrupted") -> PruneRow:
    """`prune` on random pairs (n_attr attribution + n_eval held out) inside measure_peak (weights
    resident) against `estimate_pruning`, with the edge record budget the evaluator reads."""
    from circuitkit.core.device import free_memory_bytes
    from circuitkit.discovery.config import PruningConfig
    from circuitkit.discovery.pruning.edges import RECORD_SHARE
    from circuitkit.discovery.pruning.heads import prune
    from circuitkit.discovery.pruning.memory import estimate_pruning

    adapter = get_adapter(model)
    shape = shape_from_config(model.config)
    data = random_pairs(n_attr + n_eval, seq_len, model.config.vocab_size)
    p = PruningConfig(scope=scope, selection=selection, ablation=ablation, mask_steps=mask_steps,
                      bootstrap_resamples=0, graph=False)
    budget = int(RECORD_SHARE * free_memory_bytes(torch.device("cpu")))
    with measure_peak(torch.device("cpu"), resident_bytes=lambda: module_bytes(model)) as peak:
        prune(adapter, random_scores(adapter), data[:n_attr], data[n_attr:], p, "logit_diff", batch)
    est = estimate_pruning(shape, next(model.parameters()).element_size(), batch, seq_len, n_eval, scope, ablation,
                           selection, n_attr, mask_steps, budget)
    return PruneRow(name, scope, selection, batch, seq_len, n_eval, est.total_bytes / MiB, peak.peak_bytes / MiB,
                    est.total_bytes / peak.peak_bytes, est.phase)


def pruning_model(spec: str, dtype: torch.dtype) -> tuple[torch.nn.Module, str]:
    """'smollm2' (pretrained), 'gpt2' (conf/model shape, random weights) or 'llama1b:4' (4 layers)."""
    name, _, layers = spec.partition(":")
    label = f"{name}{f'[{layers}L]' if layers else ''} {str(dtype).removeprefix('torch.')}"
    if name in PRETRAINED and not layers:
        from circuitkit.models.config import ModelConfig
        from circuitkit.models.loading import load_model

        precision = str(dtype).removeprefix("torch.")
        return load_model(ModelConfig(name=PRETRAINED[name], precision=precision), torch.device("cpu")).model, \
            f"{label} (pretrained)"
    return build_real_fast(name, dtype, int(layers) if layers else None), f"{label} (random)"


def run_pruning_sweep(specs: Iterable[str], dtypes: Iterable[torch.dtype], batch: int = 4, seq_len: int = 32,
                      n_eval: int = 8, n_attr: int = 8, mask_steps: int = 2) -> list[PruneRow]:
    """PRUNING_CASES for each model spec and dtype; one model in memory at a time."""
    rows = []
    for spec in specs:
        for dtype in dtypes:
            model, label = pruning_model(spec, dtype)
            for scope, selection in PRUNING_CASES:
                rows.append(measure_pruning(model, label, scope, selection, batch, seq_len, n_eval, n_attr,
                                            mask_steps))
                r = rows[-1]
                print(f"{r.model} {scope} {selection}: estimate {r.estimate_mib:.1f} MiB, measured"
                      f" {r.measured_mib:.1f} MiB, ratio {r.ratio:.3f}", flush=True)
            del model
    return rows


def pruning_table(rows: list[PruneRow]) -> Table:
    table = Table(title="pruning stage peak: estimate vs measured (CPU dispatch tracker + weights)")
    for col in ("model", "scope", "selection", "batch", "seq", "held-out", "estimate MiB", "measured MiB", "ratio",
                "phase"):
        table.add_column(col, justify="right")
    lo, hi = REAL_RANGE
    for r in rows:
        table.add_row(r.model, r.scope, r.selection, str(r.batch), str(r.seq_len), str(r.n_eval),
                      f"{r.estimate_mib:.1f}", f"{r.measured_mib:.1f}", f"{r.ratio:.3f}", r.phase,
                      style=None if lo <= r.ratio <= hi else "red")
    return table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny shapes only (~30 s)")
    parser.add_argument("--json", default=None, help="write the rows here too")
    parser.add_argument("--real", action="store_true", help="real shapes of conf/model (see the module docstring)")
    parser.add_argument("--real-models", nargs="+", default=["gpt2", "pythia70m", "llama1b"])
    parser.add_argument("--real-batches", nargs="+", type=int, default=[1, 4])
    parser.add_argument("--layers", type=int, default=None, help="real width, this many layers")
    parser.add_argument("--real-dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"],
                        help="e.g. bfloat16 alone for gemma4b (its float32 weights alone are 16 GB)")
    parser.add_argument("--grid", action="store_true",
                        help="llama1b edge level over seq 16..2048 x batch 1..16, both precisions, measured at"
                             " --grid-layers depths and extrapolated to 16 layers; points over --grid-max-mib skipped")
    parser.add_argument("--grid-layers", nargs=2, type=int, default=[1, 2])
    parser.add_argument("--grid-max-mib", type=float, default=6000.0)
    parser.add_argument("--grid-seqs", nargs="+", type=int, default=list(GRID_SEQS))
    parser.add_argument("--grid-batches", nargs="+", type=int, default=list(GRID_BATCHES))
    parser.add_argument("--pruning", action="store_true", help="the pruning stage (see the module docstring)")
    parser.add_argument("--pruning-models", nargs="+", default=["smollm2", "gpt2", "llama1b:4"])
    parser.add_argument("--pruning-shape", nargs=4, type=int, default=[4, 32, 8, 8],
                        metavar=("BATCH", "SEQ", "HELD_OUT", "ATTR"))
    args = parser.parse_args(argv)
    console = Console()
    if args.pruning:
        batch, seq, n_eval, n_attr = args.pruning_shape
        prows = run_pruning_sweep(args.pruning_models, [getattr(torch, d) for d in args.real_dtypes], batch, seq,
                                  n_eval, n_attr)
        console.print(pruning_table(prows))
        lo, hi = REAL_RANGE
        bad = [r for r in prows if not lo <= r.ratio <= hi]
        console.print(f"{len(prows) - len(bad)}/{len(prows)} within [{lo}, {hi}]"
                      f"; ratios {min(r.ratio for r in prows):.3f}..{max(r.ratio for r in prows):.3f}")
        if args.json:
            with open(args.json, "w") as fh:
                json.dump({"pruning": [asdict(r) for r in prows]}, fh, indent=2)
        return 0 if not bad else 1
    if args.grid:
        grid = run_grid("llama1b", dtypes=[getattr(torch, d) for d in args.real_dtypes], seqs=args.grid_seqs,
                        batches=args.grid_batches, layers=tuple(args.grid_layers), max_measured_mib=args.grid_max_mib)
        console.print(grid_table(grid))
        lo, hi = GRID_RANGE
        bad = [r for r in grid if not lo <= r.ratio <= hi]
        console.print(f"{len(grid) - len(bad)}/{len(grid)} within [{lo}, {hi}]" + (
            f"; ratios {min(r.ratio for r in grid):.3f}..{max(r.ratio for r in grid):.3f}" if grid else ""))
        if args.json:
            with open(args.json, "w") as fh:
                json.dump({"grid": [asdict(r) for r in grid]}, fh, indent=2)
        return 0 if not bad else 1
    if args.real:
        rows = run_real_sweep(args.real_models, args.real_batches, args.layers,
                              dtypes=[getattr(torch, d) for d in args.real_dtypes])
        console.print(rows_table(rows, "real shapes, random weights, 32 tokens, ig_steps 3; grads: 24 + 8 tokens"))
        lo, hi = REAL_RANGE
        bad = [r for r in rows if not lo <= r.ratio <= hi]
        console.print(f"{len(rows) - len(bad)}/{len(rows)} within [{lo}, {hi}]"
                      f"; ratios {min(r.ratio for r in rows):.3f}..{max(r.ratio for r in rows):.3f}")
        if args.json:
            with open(args.json, "w") as fh:
                json.dump({"real": [asdict(r) for r in rows]}, fh, indent=2)
        return 0 if not bad else 1
    rows = run_sweep(args.quick)
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
