"""The lengths the circuit stages will run at, read from the task's prompts before the model loads.

`discovery.data_params.seq_len` is the length of the induction task only; every other task's
prompts are as long as their tokens (IOI on SmolLM2's tokenizer: at most 18 tokens, 23 for the
held-out templates, whatever seq_len says), so an estimate at seq_len can be far off: SmolLM2-135M's
IOI attribution at edge level was estimated at 3.63 GB for 128 tokens against 0.99 GB measured
(0.98 GB at the tokenized lengths; docs/memory.md, "At the lengths that will run"). The tasks build their pairs from
the tokenizer alone, so `task_lengths` builds them as the data stage will (the same task,
counts, seed and BOS policy; the tokenizer read from local files only, never the weights) and
keeps each pair's length. Each stage's estimate is then the largest over the batches it runs:

* attribution: `TaskData.length_batches` (pairs grouped by length, each batch cut to its own
  longest pair) for the algorithms in LENGTH_BATCHED; any other (`exact`) is estimated at
  the padded width of all the pairs. With `discovery.num_shards` > 1, this job's
  range of pairs.
* pruning: the held-out pairs in consecutive slices at the padded width of all the pairs, the
  held-out templates' pairs at theirs.

Where the pairs cannot be built before the model loads (a jsonl task whose generated
corruptions the model checks, a tokenizer not on this machine, a task error the data stage
will report), the configured seq_len is used and the reason is given. Both go into the
estimate's `lengths` (`MemoryEstimate.lengths`), which the preflight prints and records in the
manifest; `ATTRIBUTION_AT_DATA` and `PRUNING_AT_DATA` hand the estimates and their advice to it
through the stages.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from circuitkit.core.batching import plan_batches
from circuitkit.core.config import to_dict
from circuitkit.core.pipeline import StageMemory
from circuitkit.discovery.attribution.memory import advice as configured_attribution_advice
from circuitkit.discovery.attribution.memory import attribution_estimate, ig_advice
from circuitkit.discovery.attribution.shards import shard_range
from circuitkit.discovery.pruning.memory import pruning_advice, pruning_estimate
from circuitkit.discovery.tasks import build_heldout_templates, build_task, heldout_template_count
from circuitkit.discovery.tasks.corruption_sets import discovery_corruptions, effective, single
from circuitkit.models.loading import model_context, pretrained_args
from circuitkit.preflight.memory import DEVICE_FREE_SHARE, MemoryEstimate, largest_fitting

# Algorithms whose batches are `TaskData.length_batches` and whose peak is one batch's (eap.attribute,
# eap_activations, eap_gp); any other is estimated at the padded width of all pairs, which no batch
# exceeds (exact; acdc, whose estimate also holds every example's corrupted run).
LENGTH_BATCHED = ("eap", "eap-ig", "clean-corrupted", "eap-ig-activations", "eap-gp")
# Past this many pairs (attribution, held-out and held-out templates) the preflight does not build
# them: it would take as long as the data stage (IOI: about 0.3 ms a pair on a CPU core).
MAX_TOKENIZED_PAIRS = 50_000
_CACHE_SIZE = 8


@dataclass(frozen=True)
class TaskLengths:
    """Tokens per pair of the data the stages will run (or the configured length, `tokenized` False)."""

    tokenized: bool
    reason: str  # where the lengths come from, or why they are the configured ones
    attr: tuple[int, ...]  # real tokens of each attribution pair, in data order
    width: int  # padded width of all the pairs (attribution and held-out): data.clean_ids.shape[1]
    n_eval: int  # held-out pairs
    templates_width: int = 0  # padded width of the held-out templates' pairs
    n_templates: int = 0


def split_sizes(n_rows: int, n_attr: int, n_eval: int) -> tuple[int, int]:
    """Attribution / held-out counts: as configured, or in the same ratio when a data file has
    fewer rows than asked for (at least one of each)."""
    if n_rows >= n_attr + n_eval:
        return n_attr, n_eval
    if n_rows < 2:
        raise ValueError(f"the task yielded {n_rows} example(s); attribution and faithfulness need at least 2.")
    attr = min(n_rows - 1, max(1, round(n_rows * n_attr / (n_attr + n_eval))))
    return attr, n_rows - attr


# --------------------------------------------------------------------------- the lengths

_cache: dict[str, TaskLengths] = {}


def task_lengths(cfg: Any) -> TaskLengths:
    """The lengths of the pairs the data stage will build for `cfg` (cached: the preflight's advice
    and `discover-smart` ask for many batch sizes)."""
    plain = to_dict(cfg)
    key = json.dumps([plain["model"], cfg.discovery.task, plain["discovery"]["data_params"], cfg.seed],
                     sort_keys=True, default=str)
    if key not in _cache:
        if len(_cache) >= _CACHE_SIZE:
            _cache.clear()
        _cache[key] = _build_lengths(cfg)
    return _cache[key]


def configured_lengths(cfg: Any, why: str) -> TaskLengths:
    """Every pair `discovery.data_params.seq_len` tokens long, with the reason they are not known."""
    dp = cfg.discovery.data_params
    seq = dp.seq_len
    try:
        n_templates = heldout_template_count(cfg.discovery.task, dp)
    except ValueError:  # a count the task cannot have: the data stage's check reports it
        n_templates = 0
    return TaskLengths(False, f"discovery.data_params.seq_len={seq} as configured: {why}", (seq,) * dp.num_examples,
                       seq, dp.eval_examples, seq if n_templates else 0, n_templates)


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return (text.splitlines()[0] if text else type(err).__name__)[:200]


@contextmanager
def _quiet_tasks() -> Iterator[None]:
    """The tasks' warnings (an unused key, the shipped sample) are the data stage's to print."""
    logger = logging.getLogger("circuitkit.discovery.tasks")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def _local_tokenizer(cfg: Any):
    """The model's tokenizer from files on this machine (a local or fetched directory, the
    Hugging Face cache); never the network: the preflight runs before anything is downloaded.
    The same source as `circuitkit.models.loading.load_tokenizer`."""
    from transformers import AutoTokenizer

    path, kwargs = pretrained_args(cfg.model)
    return AutoTokenizer.from_pretrained(path, revision=cfg.model.revision, trust_remote_code=cfg.model.trust_remote_code,
                                         local_files_only=True, **kwargs)


def _build_lengths(cfg: Any) -> TaskLengths:
    d, dp = cfg.discovery, cfg.discovery.data_params
    # several corruptions share their clean prompts, so their pairs' lengths: the primary's are built
    names = discovery_corruptions(d.task, dp)
    dp = single(d.task, dp, names[0]) if names else effective(d.task, dp)
    if d.task == "jsonl" and dp.corruption is not None:
        return configured_lengths(cfg, f"the jsonl task keeps a generated ({dp.corruption}) pair only where the"
                                       " model's answer changes, known once the model is loaded")
    try:
        n_pairs = dp.num_examples + dp.eval_examples + heldout_template_count(d.task, dp)
    except ValueError as err:  # a count the task cannot have: the data stage's check reports it
        return configured_lengths(cfg, _first_line(err))
    if n_pairs > MAX_TOKENIZED_PAIRS:
        return configured_lengths(cfg, f"{n_pairs} pairs are more than the {MAX_TOKENIZED_PAIRS} the preflight"
                                       " tokenizes (it would take as long as the data stage)")
    try:
        tokenizer = _local_tokenizer(cfg)
    except Exception as err:  # noqa: BLE001 - any failure means "not readable offline": fall back, say why
        return configured_lengths(cfg, f"the tokenizer of {cfg.model.name} is not on this machine yet"
                                       f" ({_first_line(err)})")
    try:
        with _quiet_tasks():
            path, max_tokens = pretrained_args(cfg.model)[0], model_context(cfg.model)
            data = build_task(d.task, tokenizer, path, dp, dp.num_examples + dp.eval_examples, cfg.seed,
                              max_tokens=max_tokens)
            n_attr, n_eval = split_sizes(len(data), dp.num_examples, dp.eval_examples)
            n_templates = heldout_template_count(d.task, dp)
            templates = (build_heldout_templates(d.task, tokenizer, dp, n_templates, cfg.seed, max_tokens=max_tokens)
                         if n_templates else None)
    except (OSError, ValueError) as err:  # TaskError is a ValueError; the data stage reports it in full
        return configured_lengths(cfg, f"building the {d.task} pairs failed, which the data stage will report"
                                       f" ({_first_line(err)})")
    lengths = data.lengths()
    used = "" if d.task == "induction" else f" (discovery.data_params.seq_len={dp.seq_len} is read by induction only)"
    return TaskLengths(True, f"the {d.task} prompts tokenized as the data stage will build them{used}",
                       tuple(int(n) for n in lengths[:n_attr]), int(data.clean_ids.shape[1]), n_eval,
                       int(templates.clean_ids.shape[1]) if templates is not None else 0, n_templates)


def pairs_lengths(attr_lengths: list[int], width: int, n_eval: int = 0, templates_width: int = 0,
                  n_templates: int = 0) -> TaskLengths:
    """The lengths of pairs already built (the stages themselves, once the data exists); n_eval
    is needed for `pruning_at` only."""
    return TaskLengths(True, "the data stage's pairs", tuple(attr_lengths), width, n_eval, templates_width,
                       n_templates)


# --------------------------------------------------------------------------- the estimates

def attribution_batches(cfg: Any, lengths: TaskLengths, batch_size: int | None = None) -> list[tuple[int, int]]:
    """The distinct (pairs, tokens) shapes of the attribution batches, as the stage will run them."""
    d = cfg.discovery
    b = batch_size or d.batch_size
    attr = list(lengths.attr)
    if d.num_shards > 1:
        start, stop = shard_range(len(attr), d.num_shards, d.shard_index)
        attr = attr[start:stop] or attr[:1]
    if d.algorithm in LENGTH_BATCHED and lengths.tokenized:  # configured: every pair alike, full batches
        return list(_length_batch_shapes(tuple(attr), b))
    return [(min(b, len(attr)), lengths.width)]


@lru_cache(maxsize=64)
def _length_batch_shapes(attr: tuple[int, ...], batch_size: int) -> tuple[tuple[int, int], ...]:
    """The distinct (pairs, tokens) of `TaskData.length_batches(batch_size)` over pairs of these lengths."""
    return tuple(sorted({(len(idx), max(attr[i] for i in idx)) for idx in plan_batches(attr, batch_size)}))


def _with_lengths(estimate: MemoryEstimate, lengths: TaskLengths, rows: int, tokens: int, what: str) -> MemoryEstimate:
    source = "tokenized" if lengths.tokenized else "configured"
    estimate.lengths = {"tokens": tokens, "rows": rows, "source": source, "reason": lengths.reason,
                        "line": f"estimated at {what}: {lengths.reason}"}
    return estimate


def attribution_at(cfg: Any, lengths: TaskLengths, batch_size: int | None = None) -> MemoryEstimate:
    """The attribution estimate at its largest batch over `lengths` (its `lengths` say which)."""
    best = None
    for rows, tokens in attribution_batches(cfg, lengths, batch_size):
        est = attribution_estimate(cfg, batch_size=rows, seq_len=tokens)
        if best is None or est.total_bytes > best[0].total_bytes:
            best = (est, rows, tokens)
    est, rows, tokens = best
    return _with_lengths(est, lengths, rows, tokens, f"{rows} pairs x {tokens} tokens (its largest batch)")


def device_attribution_batch(cfg: Any, lengths: TaskLengths, device, free_bytes: int | None = None) -> tuple[int, str]:
    """(the attribution batch size, why): discovery.batch_size on the CPU or with device_batch=off; on an
    accelerator with device_batch=auto the largest batch whose estimate (less the weights, already
    loaded) fits DEVICE_FREE_SHARE of the free memory at these lengths, never below batch_size.
    A CPU-sized batch leaves an accelerator waiting for the host; scores do not depend on the batch."""
    from circuitkit.core.device import free_memory_bytes

    d = cfg.discovery
    if d.device_batch == "off" or getattr(device, "type", device) == "cpu":
        return d.batch_size, f"{d.batch_size} pairs per batch (discovery.batch_size)"
    free = free_memory_bytes(device) if free_bytes is None else free_bytes

    def fits(batch_size: int) -> bool:
        est = attribution_at(cfg, lengths, batch_size)
        return est.total_bytes - est.terms.get("weights", 0) <= DEVICE_FREE_SHARE * free

    best = largest_fitting(fits, max(len(lengths.attr), 1))
    if best <= d.batch_size:
        return d.batch_size, f"{d.batch_size} pairs per batch (discovery.batch_size; no larger batch fits)"
    return best, (f"{best} pairs per batch, the largest whose estimate fits {DEVICE_FREE_SHARE:.0%} of the"
                  f" {free / 2**30:.1f} GiB free (discovery.device_batch=auto; batch_size {d.batch_size})")


def pruning_at(cfg: Any, lengths: TaskLengths, batch_size: int | None = None,
               free_bytes: int | None = None) -> MemoryEstimate:
    """The pruning estimate for the held-out pairs (and held-out templates) of `lengths`, edge
    records bounded by the memory free once the weights are loaded (`pruning_estimate`)."""
    b = min(batch_size or cfg.discovery.batch_size, lengths.n_eval)
    est = pruning_estimate(cfg, **_pruning_args(lengths), batch_size=b, free_bytes=free_bytes)
    templates = f", the held-out templates' at {lengths.templates_width}" if lengths.n_templates else ""
    return _with_lengths(est, lengths, b, max(lengths.width, lengths.templates_width),
                         f"{b} held-out pairs x {lengths.width} tokens per batch{templates}")


def _pruning_args(lengths: TaskLengths) -> dict:
    return {"seq_len": lengths.width, "n_eval": lengths.n_eval, "n_attr": len(lengths.attr),
            "n_templates": lengths.n_templates, "templates_seq_len": lengths.templates_width or None}


def _attribution_estimate(cfg: Any) -> MemoryEstimate:
    return attribution_at(cfg, task_lengths(cfg))


def _attribution_advice(cfg: Any, budget_bytes: int) -> list[str]:
    """The largest batch that fits at the tokenized lengths; else the configured-length levers."""
    lengths = task_lengths(cfg)
    d = cfg.discovery
    if not lengths.tokenized:
        return configured_attribution_advice(cfg, budget_bytes)
    best = largest_fitting(lambda b: attribution_at(cfg, lengths, b).total_bytes <= budget_bytes, d.batch_size)
    if 0 < best < d.batch_size:
        return [f"discovery.batch_size={best} (largest that fits at these prompt lengths; scores do not depend on"
                " the batch size)"]
    if d.task == "induction":  # its prompts are seq_len long: the configured advice's lever is the real one
        return configured_attribution_advice(cfg, budget_bytes)
    rest = [t for t in configured_attribution_advice(cfg, budget_bytes) if not t.startswith("discovery.batch_size=")]
    return [f"discovery.batch_size=1 and shorter prompts (the longest attribution pair is {max(lengths.attr)}"
            " tokens)", *rest]


def _pruning_estimate(cfg: Any) -> MemoryEstimate:
    return pruning_at(cfg, task_lengths(cfg))


def _pruning_advice(cfg: Any, budget_bytes: int) -> list[str]:
    lengths = task_lengths(cfg)
    return pruning_advice(cfg, budget_bytes, **_pruning_args(lengths)) if lengths.tokenized else \
        pruning_advice(cfg, budget_bytes)


ATTRIBUTION_AT_DATA = StageMemory(estimate=_attribution_estimate, advice=_attribution_advice, note=ig_advice)
PRUNING_AT_DATA = StageMemory(estimate=_pruning_estimate, advice=_pruning_advice)
