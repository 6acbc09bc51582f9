"""The pipeline: stages in order, the run directory, manifest.json and resume.

Each stage declares the config blocks it reads. Its config hash covers those blocks and the
hashes of the stages before it, so changing `discovery.ig_steps` reruns attribution and
everything after it, and nothing before. Each stage also declares the files it reads
(`inputs`: data files, the model, upstream artifacts), fingerprinted by content
(circuitkit.core.fingerprint) and recorded in its manifest entry. A rerun in the same run
directory skips a stage whose manifest entry is `ok` with the same config hash, the same
input fingerprints and artifacts that still have the recorded sha256; a stage that reruns
makes every stage after it rerun.

Before the run directory is touched, every selected stage's `check(cfg)` runs: cheap checks
that read configs only (never weights) and catch what would otherwise fail after hours of
work, such as a length beyond the model's context or an unwritable output path.

The pipeline knows no stage by name: each domain defines its stages, and the entry layer
(`circuitkit_app.stage_list`) assembles the one `Pipeline` of them with the model loader.
"""

from __future__ import annotations

import errno
import json
import logging
import platform
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from circuitkit.core.config import to_dict
from circuitkit.core.device import PRECISION_AUTO, get_device, measure_peak, module_bytes, resolve_precision
from circuitkit.core.errors import UserError, describe_os_error
from circuitkit.core.fingerprint import Fingerprinter, changed_inputs
from circuitkit.core.io import atomic_write_json, json_bytes, rewrite_in_place, sha256_file, sha256_json
from circuitkit.core.progress import duration

log = logging.getLogger(__name__)
MANIFEST = "manifest.json"
MANIFEST_FORMAT = 1
VERSIONED_PACKAGES = ("torch", "transformers", "tokenizers", "hydra-core", "omegaconf",
                      "safetensors", "rich", "numpy")


def make_console() -> Console:
    """Console on stderr; 120 columns when not a terminal so logged tables stay readable."""
    return Console(stderr=True, width=None if sys.stderr.isatty() else 120)


class PipelineError(UserError, RuntimeError):
    """A stage failed; the manifest records which and why, earlier artifacts are kept."""


@dataclass
class StageResult:
    """What a stage hands back: its artifact files and its headline numbers."""

    artifacts: list[Path] = field(default_factory=list)
    summary: dict[str, Any] = field(default_factory=dict)  # JSON-able headline results
    estimated_peak_bytes: int | None = None


InputsFn = Callable[[Any, Path], dict[str, "Path | str"]]


@dataclass(frozen=True)
class StageMemory:
    """How a stage's peak device memory is estimated before anything is loaded (the preflight).

    estimate(cfg): a MemoryEstimate (circuitkit.preflight.memory) from the model's shape, or None when
    the stage will not run under `cfg` (e.g. grads.enabled=false).
    advice(cfg, budget_bytes): the settings that bring the peak under the budget, in order.
    note(cfg): an optional line printed with the estimate (e.g. EAP-IG's time/accuracy).
    """

    estimate: Callable[[Any], Any]
    advice: Callable[[Any, int], list[str]]
    note: Callable[[Any], str | None] | None = None


@dataclass(frozen=True)
class Stage:
    """A pipeline stage: `run(ctx)` does the work, `blocks` are the config keys it reads.

    inputs(cfg, run_dir): the files it reads, `{label: Path}` (a directory stands for every
    file in it) or `{label: fingerprint string}`; a change in any reruns the stage.
    check(cfg): cheap pre-run check (configs only, no weights, no writes); raises UserError
    (or ConfigError) naming the problem. Runs for every selected stage before the first one.
    check_run_dir(cfg, run_dir): the same, for what needs the run directory (an output path that
    must not be the run directory itself); runs wherever the run directory is known beforehand.
    memory: its peak estimate, read by the preflight stage (None: nothing worth estimating).
    """

    name: str
    blocks: tuple[str, ...]
    run: Callable[[RunContext], StageResult]
    cached: bool = True  # False: runs every time and feeds no later stage (the preflight)
    inputs: InputsFn | None = None
    check: Callable[[Any], None] | None = None
    memory: StageMemory | None = None
    check_run_dir: Callable[[Any, Path], None] | None = None


class RunContext:
    """Shared state of one pipeline run: config, run dir, console, the lazily loaded model.

    Stages hand results to later stages through `ctx.state`; a skipped stage's results are
    reloaded from its artifacts by the stage that needs them.
    """

    def __init__(self, cfg: Any, run_dir: Path, console: Console | None = None,
                 load_model: Callable[[Any], Any] | None = None, stages: tuple[Stage, ...] = ()) -> None:
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        self.console = console or make_console()
        self.state: dict[str, Any] = {}
        self.changed_inputs: list[str] = []  # of the running stage, against its last recorded run
        self.stages = stages  # the selected stages of this run, in order (the preflight reads them)
        self._load_model = load_model
        self._loaded = None
        self._record: Callable[[dict[str, Any]], None] | None = None  # set by the pipeline per stage

    def record(self, **values: Any) -> None:
        """Add `values` to the running stage's manifest entry and write manifest.json now
        (before the stage ends): e.g. a shard's checksum, which other jobs read while this one
        still runs."""
        if self._record is None:
            raise PipelineError("record() is only available while a pipeline stage runs.")
        self._record(values)

    def model(self, keep_adapter: bool = False):
        """The LoadedModel for `cfg.model`, loaded on first use.

        `keep_adapter`: with `model.adapter`, the view whose LoRA linears are kept as modules
        (Gradian) rather than merged into the weights (`circuitkit.models.loading.load_model`); one
        view is held at a time, so asking for the other releases it and loads again.
        """
        kept = keep_adapter and bool(getattr(self.cfg.model, "adapter", None))
        if self._loaded is not None and bool(getattr(self._loaded, "adapter_kept", False)) != kept:
            self._loaded = None  # the other view: released before the next one loads
        if self._loaded is None:
            if self._load_model is None:
                raise PipelineError("this pipeline was assembled without a model loader.")
            used = resolve_precision(self.cfg.model.precision).used
            with self.console.status(f"Loading {self.cfg.model.name} ({used})"):
                self._loaded = (self._load_model(self.cfg.model, keep_adapter=True) if kept
                                else self._load_model(self.cfg.model))
        return self._loaded

    def release_model(self) -> None:
        """Drop the loaded model (a stage that loads its own models frees the run's first); the next
        `model()` loads it again."""
        self._loaded = None

    def resident_bytes(self) -> int:
        return module_bytes(self._loaded.model) if self._loaded is not None else 0


def package_versions() -> dict[str, str | None]:
    """Installed versions of the packages that decide results, plus Python's, and this project's
    own (`circuitkit.core.provenance.software`: the distribution's version and the git commit of a
    checkout, None from an installed wheel)."""
    from circuitkit.core.provenance import software

    out = {"python": platform.python_version(), **software()}
    for pkg in VERSIONED_PACKAGES:
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = "not installed"
    return out


def _block_value(cfg_dict: dict[str, Any], dotted: str) -> Any:
    node: Any = cfg_dict
    for part in dotted.split("."):
        node = node[part]
    return node


def stage_hashes(cfg: Any, stages: list[Stage]) -> dict[str, str]:
    """Config hash per stage: its own blocks plus the hash of the stage before it.

    `model.precision=auto` is hashed as the dtype it resolves to on this device, so a run dir
    resumed where bf16 is (not) native reruns what was computed in the other dtype.
    """
    cfg_dict = to_dict(cfg)
    if cfg_dict["model"]["precision"] == PRECISION_AUTO:
        cfg_dict["model"]["precision"] = resolve_precision(PRECISION_AUTO).used
    hashes, previous = {}, ""
    for stage in stages:
        own = {b: _block_value(cfg_dict, b) for b in stage.blocks}
        hashes[stage.name] = sha256_json({"blocks": own, "previous": previous})
        previous = hashes[stage.name]
    return hashes


def load_manifest(run_dir: Path) -> dict[str, Any]:
    path = Path(run_dir) / MANIFEST
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise PipelineError(f"{path} is not valid JSON ({err}); move it away to start this run dir afresh.") from err


def _artifacts_intact(run_dir: Path, recorded: dict[str, dict[str, Any]]) -> bool:
    for rel, info in recorded.items():
        path = run_dir / rel
        if not path.is_file() or sha256_file(path) != info.get("sha256"):
            return False
    return True


def _artifact_record(run_dir: Path, paths: list[Path]) -> dict[str, dict[str, Any]]:
    out = {}
    for p in paths:
        p = Path(p)
        rel = str(p.relative_to(run_dir)) if p.is_relative_to(run_dir) else str(p)
        out[rel] = {"sha256": sha256_file(p), "bytes": p.stat().st_size}
    return out


class InterruptWatch:
    """Remembers that Ctrl-C came, even when the KeyboardInterrupt it raised was swallowed.

    Python ignores (prints "Exception ignored in ...") an exception raised inside a finalizer
    or a __del__, so a Ctrl-C that lands in a cleanup callback would let the stage go on and be
    recorded `ok`. While the watch is active, SIGINT sets `fired` and then raises as usual; the
    pipeline checks `fired` after each stage and ends the run as interrupted (exit 130).
    Installed only in the main thread and over Python's own handler.
    """

    def __init__(self) -> None:
        self.fired = False
        self._previous = None

    def _handler(self, signum, frame) -> None:
        self.fired = True
        previous = self._previous
        if callable(previous):
            previous(signum, frame)
        raise KeyboardInterrupt

    def __enter__(self) -> InterruptWatch:
        if threading.current_thread() is threading.main_thread():
            current = signal.getsignal(signal.SIGINT)
            if current is signal.default_int_handler:
                self._previous = current
                signal.signal(signal.SIGINT, self._handler)
        return self

    def __exit__(self, *exc) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
            self._previous = None


MANIFEST_RESERVE_BYTES = 8192  # room kept in a running stage's manifest for its failure record


def write_final_status(manifest_path: Path, manifest: dict[str, Any]) -> None:
    """Write the manifest after a stage failed or was interrupted. On a full disk the atomic write
    fails too; the manifest is then rewritten in place, into the room the `running` write kept,
    so that it never stays `running` after the run has stopped."""
    try:
        atomic_write_json(manifest_path, manifest)
    except OSError as err:
        if err.errno not in (errno.ENOSPC, errno.EDQUOT) or not manifest_path.is_file():
            raise
        rewrite_in_place(manifest_path, json_bytes(manifest))


def _stage_error_message(err: BaseException) -> str:
    if isinstance(err, OSError) and not isinstance(err, FileNotFoundError | IsADirectoryError):
        return describe_os_error(err)
    if isinstance(err, UserError):
        return str(err)
    return f"{type(err).__name__}: {err}"


@dataclass
class Pipeline:
    """The stages a run can select, in pipeline order, and how their model is loaded.

    stages: name -> Stage (a run executes those `cfg.stages` names, in this order).
    load_model(model_cfg): the LoadedModel a stage gets from `ctx.model()`.
    describe_model(model_cfg, sha256_of): where the model comes from (the manifest's `model_source`:
    a hub id, a directory, a GGUF file and its quantization, a converted download); `sha256_of(path)`
    hashes a file through the run's fingerprint cache.
    """

    stages: dict[str, Stage]
    load_model: Callable[[Any], Any]
    describe_model: Callable[[Any, Callable[[Path], str]], dict[str, Any]] | None = None

    def selected(self, cfg: Any) -> list[Stage]:
        """The stages `cfg.stages` names, in order; PipelineError naming any this pipeline lacks."""
        missing = [name for name in cfg.stages if name not in self.stages]
        if missing:
            raise PipelineError(f"stage(s) {', '.join(missing)} are not part of this pipeline; it has:"
                                f" {', '.join(self.stages)}.")
        return [self.stages[name] for name in cfg.stages]

    def check(self, cfg: Any, run_dir: Path | None = None) -> None:
        """Run every selected stage's pre-run check (and, given the run directory, its
        `check_run_dir`); the first problem raises (nothing written)."""
        for stage in self.selected(cfg):
            if stage.check is not None:
                stage.check(cfg)
            if stage.check_run_dir is not None and run_dir is not None:
                stage.check_run_dir(cfg, Path(run_dir))

    def run(self, cfg: Any, run_dir: Path, console: Console | None = None,
            overrides: list[str] | None = None, checked: bool = False) -> dict[str, Any]:
        """Run `cfg.stages` in order in `run_dir`; returns the manifest (also written to disk).

        Before anything is written: PipelineError if a selected stage is not in this pipeline,
        and the stages' pre-run checks (skipped when `checked`, i.e. the caller ran `check`).
        Raises PipelineError when a stage fails and KeyboardInterrupt when interrupted, after
        recording the stage as `failed` / `interrupted` in the manifest.
        """
        return _run(self, cfg, run_dir, console, overrides, checked)


def _run(pipeline: Pipeline, cfg: Any, run_dir: Path, console: Console | None,
         overrides: list[str] | None, checked: bool) -> dict[str, Any]:
    run_dir = Path(run_dir)
    selected = pipeline.selected(cfg)
    if not checked:
        pipeline.check(cfg, run_dir)
    if run_dir.exists() and not run_dir.is_dir():
        raise UserError(f"run directory {run_dir} is a file; choose another hydra.run.dir.", exit_code=2)
    run_dir.mkdir(parents=True, exist_ok=True)

    ctx = RunContext(cfg, run_dir, console, pipeline.load_model, tuple(selected))
    hashes = stage_hashes(cfg, selected)
    manifest = load_manifest(run_dir)
    fingerprints = Fingerprinter(record for e in manifest.get("stages", {}).values()
                                 for record in (e.get("inputs") or {}).values())
    manifest.update({
        "format_version": MANIFEST_FORMAT,
        "run_dir": str(run_dir.resolve()),
        "config_hash": sha256_json(to_dict(cfg)),
        "config": to_dict(cfg),
        "overrides": list(overrides or []),
        "versions": package_versions(),
        "device": str(get_device()),
        "precision": resolve_precision(cfg.model.precision).record(),  # requested, used and why
        "command": " ".join(sys.argv),
    })
    if pipeline.describe_model is not None:
        manifest["model_source"] = pipeline.describe_model(cfg.model, lambda p: fingerprints.file(p)["sha256"])
    manifest.setdefault("stages", {})
    manifest_path = run_dir / MANIFEST
    atomic_write_json(manifest_path, manifest)

    with InterruptWatch() as watch:
        _run_stages(ctx, selected, hashes, manifest, manifest_path, fingerprints, watch)
    print_manifest_table(manifest, ctx.console)
    return manifest


def _run_stages(ctx: RunContext, selected: list[Stage], hashes: dict[str, str], manifest: dict[str, Any],
                manifest_path: Path, fingerprints: Fingerprinter, watch: InterruptWatch) -> None:
    cfg, run_dir = ctx.cfg, ctx.run_dir
    upstream_ran = False  # once a stage runs, the ones after it read fresh inputs and run too
    for stage in selected:
        prior = manifest["stages"].get(stage.name, {})
        inputs = fingerprints.inputs(stage.inputs(cfg, run_dir)) if stage.inputs is not None else {}
        changed = changed_inputs(prior.get("inputs") or {}, inputs) if prior else []
        if (cfg.skip_completed and stage.cached and not upstream_ran and prior.get("status") == "ok"
                and prior.get("config_hash") == hashes[stage.name] and not changed
                and _artifacts_intact(run_dir, prior.get("artifacts", {}))):
            ctx.console.print(f"[dim]stage {stage.name}: up to date (config, inputs and artifacts match), skipped[/dim]")
            prior["skipped_on_rerun"] = True
            prior["inputs"] = inputs  # fresh mtimes keep the fast path fast
            continue
        if changed and prior.get("status") == "ok" and stage.cached:
            shown = ", ".join(changed[:3]) + (f" and {len(changed) - 3} more" if len(changed) > 3 else "")
            ctx.console.print(f"stage {stage.name}: input changed since the last run ({escape(shown)}), rerunning")
        ctx.changed_inputs = changed
        upstream_ran = upstream_ran or stage.cached
        entry: dict[str, Any] = {"status": "running", "config_hash": hashes[stage.name], "inputs": inputs,
                                 "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        manifest["stages"][stage.name] = entry
        atomic_write_json(manifest_path, manifest, reserve_bytes=MANIFEST_RESERVE_BYTES)

        def record(values: dict[str, Any], entry: dict[str, Any] = entry) -> None:
            entry.update(values)
            atomic_write_json(manifest_path, manifest, reserve_bytes=MANIFEST_RESERVE_BYTES)
        ctx._record = record
        if ctx.console.is_terminal:
            ctx.console.rule(f"stage {stage.name}")
        else:  # a log: plain lines that say when each stage started and how long it took
            ctx.console.print(f"stage {stage.name}: started", markup=False, highlight=False)
        t0 = time.perf_counter()
        try:
            with measure_peak(resident_bytes=ctx.resident_bytes) as peak:
                result = stage.run(ctx)
            if watch.fired:  # Ctrl-C whose KeyboardInterrupt a finalizer swallowed: still an interrupt
                raise KeyboardInterrupt
        except KeyboardInterrupt:
            entry.update(status="interrupted", wall_s=round(time.perf_counter() - t0, 3),
                         error="interrupted (Ctrl-C)")
            write_final_status(manifest_path, manifest)
            raise
        except Exception as err:
            if watch.fired:  # an error that followed a swallowed Ctrl-C: the run was interrupted
                entry.update(status="interrupted", wall_s=round(time.perf_counter() - t0, 3),
                             error="interrupted (Ctrl-C)")
                write_final_status(manifest_path, manifest)
                raise KeyboardInterrupt from err
            message = _stage_error_message(err)
            entry.update(status="failed", wall_s=round(time.perf_counter() - t0, 3), error=message)
            ctx.console.print(f"stage {stage.name}: failed after {duration(entry['wall_s'])}", markup=False,
                              highlight=False)
            write_final_status(manifest_path, manifest)
            raise PipelineError(f"stage '{stage.name}' failed: {message} (manifest: {manifest_path})") from err
        entry.update(
            status="ok" if result.summary.get("status") != "skipped" else "skipped",
            wall_s=round(time.perf_counter() - t0, 3),
            estimated_peak_bytes=result.estimated_peak_bytes,
            measured_peak_bytes=peak.peak_bytes,
            peak_method=peak.method,
            artifacts=_artifact_record(run_dir, result.artifacts),
            summary=result.summary,
            finished=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        )
        atomic_write_json(manifest_path, manifest)
        ctx.console.print(f"stage {stage.name}: {entry['status']} in {duration(entry['wall_s'])}", markup=False,
                          highlight=False)
        ctx._record = None
    if watch.fired:
        raise KeyboardInterrupt


def print_manifest_table(manifest: dict[str, Any], console: Console) -> None:
    """One row per stage: status, wall time, peak memory, artifacts."""
    table = Table(title=escape(f"run {manifest.get('run_dir', '')}"))
    for col in ("stage", "status", "wall s", "est. peak MiB", "measured peak MiB", "artifacts"):
        table.add_column(col)

    def mib(b: int | None) -> str:
        return "-" if b is None else f"{b / 2**20:.1f}"

    for name, e in manifest.get("stages", {}).items():
        status = e.get("status", "?") + (" (cached)" if e.get("skipped_on_rerun") else "")
        table.add_row(escape(name), status, f"{e.get('wall_s', 0):.2f}", mib(e.get("estimated_peak_bytes")),
                      mib(e.get("measured_peak_bytes")), escape(", ".join(e.get("artifacts", {}))))
    console.print(table)


def headline(manifest: dict[str, Any]) -> dict[str, Any]:
    """Flat headline results of a run (stage summaries), for sweep summaries."""
    out: dict[str, Any] = {}
    for name, e in manifest.get("stages", {}).items():
        for key, value in (e.get("summary") or {}).items():
            if isinstance(value, (int, float, str, bool)) or value is None:
                out[f"{name}.{key}"] = value
    return out

