"""PEFT LoRA adapters (`model.adapter: DIR`): the one module of the project that knows `peft`.

An adapter directory is what a PEFT model's `save_pretrained` writes: `adapter_config.json`
(`peft_type` LORA, `r`, `lora_alpha`, `target_modules`, `base_model_name_or_path`) and the LoRA
weights (`adapter_model.safetensors`, or `adapter_model.bin`). It is read from this machine only
(never the hub), and no code from it runs.

A LoRA target linear computes y = W x + (α/r)·B (A x), A (r, d_in), B (d_out, r). The model is
given in one of two views, the same function either way:

* merged (`keep=False`: circuit discovery, export, everything that reads weights): W + (α/r)·B·A
  folded into each target (peft's `merge_and_unload`), so the model is a plain Hugging Face model
  with the adapted weights and the families, hooks and weight readers see nothing new;
* kept (`keep=True`: Gradian): the LoRA linears stay next to their base layer, so that
  `grads.module_filter` can reach the adapter's own weights. PEFT names the base layer
  `<target>.base_layer` and the adapter's linears `<target>.lora_A.default`; `canonical_name` turns
  them into `<target>` and `<target>.lora_A` / `<target>.lora_B`, the names an index records.

`new_adapter` wraps a model in a fresh, trainable LoRA adapter of a given adapter_config.json
(`gradian attribute --verify` retrains the adapter without the accused rows).

Before peft touches the model, `check_adapter_fits` compares every LoRA tensor of the file with
the module it adapts: an adapter trained on another base model (a module it lacks, another
shape) is one line naming both, exit code 2.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import re
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

from circuitkit.core.errors import UserError
from circuitkit.models.families.base import is_linear, module_shape

log = logging.getLogger(__name__)

ADAPTER_CONFIG = "adapter_config.json"
WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")
LORA_KINDS = ("lora_A", "lora_B")
# grads.module_filter's name for every linear of a kept LoRA adapter (lora_A and lora_B).
ADAPTER_ALIAS = "adapter"
PEFT_INSTALL = "pip install 'circuitkit-gradian[peft]'"
# The keys of the file's LoRA tensors: `base_model.model.<module>.lora_A.weight`.
_TENSOR_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.(?P<kind>lora_A|lora_B)\.weight$")
# PEFT's names in the kept view -> the canonical ones (module docstring).
_BASE_LAYER = re.compile(r"\.base_layer(?=\.|$)")
_LORA_LINEAR = re.compile(r"\.(lora_A|lora_B)\.[^.]+$")


class AdapterError(UserError, ValueError):
    """`model.adapter` names no usable LoRA adapter, or one made for another model (exit code 2);
    an adapter directory whose files are damaged (a value of adapter_config.json, the weights
    file) is bad content (exit code 1, given where raised)."""

    exit_code = 2


# The largest LoRA rank taken from adapter_config.json: far above any trained adapter (ranks are
# at most the model's width), low enough that a damaged value is caught before peft allocates it.
MAX_RANK = 1 << 16


@dataclass(frozen=True)
class AdapterSpec:
    """An adapter directory, read and checked (no weights loaded)."""

    directory: Path
    weights_file: Path
    config: dict[str, Any]  # adapter_config.json

    @property
    def base_model(self) -> str | None:
        return self.config.get("base_model_name_or_path")

    def record(self) -> dict[str, Any]:
        """What an index or run manifest records of the adapter: its directory (name and path), the
        sha256 of its weights file and the fields of adapter_config.json that decide its weights."""
        targets = self.config.get("target_modules")
        return {"name": self.directory.name, "path": str(self.directory), "weights_file": self.weights_file.name,
                "weights_sha256": _sha256(self.weights_file), "peft_type": self.config.get("peft_type"),
                "r": self.config.get("r"), "lora_alpha": self.config.get("lora_alpha"),
                "target_modules": sorted(targets) if isinstance(targets, list) else targets,
                "base_model_name_or_path": self.base_model}


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def read_adapter(directory: str, what: str = "model.adapter") -> AdapterSpec:
    """The adapter at `directory` (a local directory; `~` expanded), its config parsed and checked:
    AdapterError naming what is missing or not LoRA. `what` names the setting in messages."""
    path = Path(directory).expanduser()
    if not path.exists():
        raise AdapterError(f"{what}={directory!r} does not exist (resolved to {path.resolve()}); give the local"
                           f" directory a PEFT model's save_pretrained wrote ({ADAPTER_CONFIG} and"
                           f" {WEIGHT_FILES[0]}). Adapters are not fetched from the hub.")
    if not path.is_dir() or not (path / ADAPTER_CONFIG).is_file():
        raise AdapterError(f"{what}={directory!r} is not a PEFT adapter directory: it has no {ADAPTER_CONFIG}"
                           " (give the directory save_pretrained wrote; a full model goes in model.name).")
    try:
        config = json.loads((path / ADAPTER_CONFIG).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise AdapterError(f"{what}={directory!r}: {ADAPTER_CONFIG} cannot be read ({_first_line(err)}).") from None
    if not isinstance(config, dict):
        raise AdapterError(f"{what}={directory!r}: {ADAPTER_CONFIG} is not a JSON object.")
    if config.get("peft_type") != "LORA":
        raise AdapterError(f"{what}={directory!r} is a {config.get('peft_type')!r} adapter; only LoRA adapters"
                           " (peft_type LORA) are supported.")
    _check_config_values(path / ADAPTER_CONFIG, config)
    weights = next((path / f for f in WEIGHT_FILES if (path / f).is_file()), None)
    if weights is None:
        raise AdapterError(f"{what}={directory!r} has no weights file ({' or '.join(WEIGHT_FILES)}); save the"
                           " adapter again with save_pretrained.")
    return AdapterSpec(path.resolve(), weights.resolve(), config)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_config_values(file: Path, config: dict[str, Any]) -> None:
    """adapter_config.json's values that shape the adapter, checked before any model loads: AdapterError
    (exit 1, the file's content) naming the file and the key."""
    def bad(key: str, value: Any, allowed: str) -> AdapterError:
        return AdapterError(f"{file}: {key} is {value!r:.80}; {allowed}. The file is damaged or was not written by"
                            " PEFT's save_pretrained: save the adapter again.", exit_code=1)

    ranks = [("r", config.get("r"))] + [(f"rank_pattern[{k!r}]", v) for k, v in
                                        (config.get("rank_pattern") or {}).items()]
    for key, r in ranks:
        if not _is_int(r) or not 1 <= r <= MAX_RANK:
            raise bad(key, r, f"a LoRA rank is a whole number from 1 to {MAX_RANK}")
    alphas = [("lora_alpha", config.get("lora_alpha"))] + [(f"alpha_pattern[{k!r}]", v) for k, v in
                                                          (config.get("alpha_pattern") or {}).items()]
    for key, alpha in alphas:
        if isinstance(alpha, bool) or not isinstance(alpha, int | float) or not math.isfinite(alpha):
            raise bad(key, alpha, "the LoRA scale lora_alpha is a finite number")
    targets = config.get("target_modules")
    if not (isinstance(targets, str) and targets) and not (
            isinstance(targets, list) and targets and all(isinstance(t, str) and t for t in targets)):
        raise bad("target_modules", targets, "it is a list of module names (or one regular expression)")


def target_modules_missing(config: dict[str, Any], names: list[str]) -> list[str]:
    """adapter_config.json's target_modules that name no module of `names` (peft's rule: a list entry
    matches a module named so or ending in `.<entry>`; a string is a regular expression matched in full)."""
    targets = config.get("target_modules")
    if isinstance(targets, str):
        try:
            return [] if any(re.fullmatch(targets, n) for n in names) else [targets]
        except re.error:
            return [targets]
    return [t for t in targets or [] if not any(n == t or n.endswith("." + t) for n in names)]


def require_peft(what: str = "model.adapter"):
    """The `peft` package, or one line saying how to install it (`what` names who needs it)."""
    try:
        import peft
    except ImportError:
        raise AdapterError(f"{what} needs peft, which is not installed: {PEFT_INSTALL}") from None
    return peft


# ----------------------------------------------------------------------------- the file's tensors


def lora_tensor_shapes(spec: AdapterSpec) -> dict[str, dict[str, tuple[int, ...]]]:
    """module name (as the base model names it) -> {"lora_A": shape, "lora_B": shape}, read from the
    weights file's header (safetensors) or its tensors (a .bin, loaded as plain tensors only)."""
    try:
        if spec.weights_file.suffix == ".safetensors":
            from safetensors import safe_open

            with safe_open(str(spec.weights_file), framework="pt") as fh:
                shapes = {k: tuple(fh.get_slice(k).get_shape()) for k in fh.keys()}
        else:
            import torch

            state = torch.load(spec.weights_file, map_location="cpu", weights_only=True, mmap=True)
            shapes = {k: tuple(v.shape) for k, v in state.items()}
    except Exception as err:  # noqa: BLE001 - a file that does not open is one line, whatever the reason
        raise AdapterError(f"model.adapter={str(spec.directory)!r}: cannot read {spec.weights_file}"
                           f" ({_first_line(err)}); it is truncated, corrupted or not a weights file: save the"
                           " adapter again.", exit_code=1) from None
    out: dict[str, dict[str, tuple[int, ...]]] = {}
    for key, shape in shapes.items():
        m = _TENSOR_KEY.match(key)
        if m:
            out.setdefault(m["module"], {})[m["kind"]] = shape
    if not out:
        raise AdapterError(f"model.adapter={str(spec.directory)!r}: {spec.weights_file} holds no LoRA"
                           " weights (no lora_A / lora_B tensors): save the adapter again.", exit_code=1)
    return out


def lora_linear_shapes(spec: AdapterSpec) -> dict[str, tuple[int, int]]:
    """The adapter's linears as Gradian names them, name -> (d_out, d_in): `<module>.lora_A` (r, d_in)
    and `<module>.lora_B` (d_out, r), from the file alone (the memory estimate's view)."""
    out = {}
    for module, kinds in lora_tensor_shapes(spec).items():
        for kind in LORA_KINDS:
            if kind in kinds and len(kinds[kind]) == 2:
                out[f"{module}.{kind}"] = (int(kinds[kind][0]), int(kinds[kind][1]))
    return out


def check_adapter_fits(model: nn.Module, spec: AdapterSpec, model_name: str, model_path: str | None = None) -> None:
    """Refuse an adapter made for another model, before peft touches it: every LoRA tensor pair
    must adapt a linear module the model has, with B·A of that module's (d_out, d_in) shape.
    `model_path`: where model.name was loaded from (base_model_name_or_path may name either)."""
    modules = dict(model.named_modules())
    made_for = f"made for {spec.base_model!r}" if spec.base_model else "base model not recorded"
    targets = spec.config.get("target_modules")
    where = (f"model.adapter={str(spec.directory)!r} ({made_for}, target_modules {targets!r:.80}) does not fit"
             f" model.name={model_name!r}")
    for name, kinds in lora_tensor_shapes(spec).items():
        module = modules.get(name)
        if module is None or not is_linear(module):
            like = [n for n, m in modules.items() if is_linear(m)][:3]
            what = "a module the model does not have" if module is None else f"a {type(module).__name__}, not a linear"
            raise AdapterError(f"{where}: the adapter has LoRA weights for {name!r}, {what} (the model's linear"
                               f" modules are named like {', '.join(like)}). Use the adapter with the model it was"
                               " trained on.")
        a, b = kinds.get("lora_A"), kinds.get("lora_B")
        if a is None or b is None or len(a) != 2 or len(b) != 2 or a[0] != b[1]:
            raise AdapterError(f"model.adapter={str(spec.directory)!r}: the LoRA weights of {name!r} are lora_A"
                               f" {a} and lora_B {b}, not a (r, d_in) and (d_out, r) pair: the file is damaged.",
                               exit_code=1)
        d_out, d_in = module_shape(module)
        if (b[0], a[1]) != (d_out, d_in):
            raise AdapterError(f"{where}: {name} is {d_out} x {d_in} (out x in) in the model, but the adapter's"
                               f" lora_B·lora_A is {b[0]} x {a[1]}. Use the adapter with the model it was trained on.")
    missing = target_modules_missing(spec.config, list(modules))
    if missing:
        like = [n for n, m in modules.items() if is_linear(m)][:3]
        raise AdapterError(f"{where}: target module(s) {', '.join(map(repr, missing))} of {ADAPTER_CONFIG} name no"
                           f" module of the model (its linear modules are named like {', '.join(like)}). Use the"
                           " adapter with the model it was trained on.")
    if spec.base_model and not _same_model(spec.base_model, model_name, model_path):
        log.warning("model.adapter %s was made for %s; model.name is %s (every LoRA weight fits its module, so it is"
                    " used).", spec.directory, spec.base_model, model_name)


def _same_model(recorded: str, name: str, path: str | None) -> bool:
    """Whether the adapter's base_model_name_or_path plausibly names model.name (the same name or
    directory, or a hub id and the local directory it was saved to, which end alike)."""
    names = [name] + ([path] if path else [])
    return recorded in names or Path(recorded).name in {Path(n).name for n in names}


# ----------------------------------------------------------------------------- attaching


def attach_adapter(model: nn.Module, spec: AdapterSpec, model_name: str, keep: bool,
                   model_path: str | None = None) -> nn.Module:
    """`model` with the adapter applied, frozen and in eval mode: merged into the weights (`keep`
    False) or with its LoRA linears kept (`keep` True; see the module docstring). AdapterError,
    one line, when peft is missing, the adapter does not fit or peft cannot apply it."""
    peft = require_peft()
    check_adapter_fits(model, spec, model_name, model_path)
    if keep and spec.config.get("modules_to_save"):
        raise AdapterError(f"model.adapter={str(spec.directory)!r} also saves whole modules"
                           f" ({spec.config['modules_to_save']}), which Gradian cannot index beside the LoRA weights:"
                           " merge it (peft's merge_and_unload, then save_pretrained) and give the merged model as"
                           " model.name.")
    try:
        with warnings.catch_warnings():  # peft asks transformers 5 a deprecated question; nothing for the user
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing", category=FutureWarning)
            wrapped = peft.PeftModel.from_pretrained(model, str(spec.directory), is_trainable=False,
                                                     autocast_adapter_dtype=False, torch_device="cpu")
            out = wrapped.get_base_model() if keep else wrapped.merge_and_unload()
    except Exception as err:  # noqa: BLE001 - peft's failures (target modules, keys) become one line
        raise AdapterError(f"model.adapter={str(spec.directory)!r}: peft could not apply it to model.name="
                           f"{model_name!r} ({_first_line(err)}).") from None
    out.requires_grad_(False)
    out.eval()
    return out


# ----------------------------------------------------------------------------- a new adapter, to train

# adapter_config.json's keys that say where and how an adapter was saved, not what it is.
_SAVED_ONLY = ("peft_type", "auto_mapping", "peft_version", "base_model_name_or_path", "revision", "inference_mode")


def lora_config(config: dict[str, Any], what: str = "--verify"):
    """peft's LoraConfig of `config` (adapter_config.json's keys: r, lora_alpha, target_modules, ...;
    the keys of where it was saved are ignored). AdapterError, one line, when peft is missing or
    refuses the values."""
    peft = require_peft(what)
    known = {f.name for f in dataclasses.fields(peft.LoraConfig) if f.init}
    kwargs = {k: v for k, v in config.items() if k in known and k not in _SAVED_ONLY}
    try:
        return peft.LoraConfig(**kwargs)
    except Exception as err:  # noqa: BLE001 - peft's refusals of a value become one line
        raise AdapterError(f"{what}: peft refuses a LoRA adapter with {_shown(kwargs)} ({_first_line(err)}); fix"
                           " the setting (--lora-r, --lora-alpha, --target-modules).") from None


def _shown(config: dict[str, Any]) -> str:
    return ", ".join(f"{k}={config.get(k)!r}" for k in ("r", "lora_alpha", "target_modules"))


def new_adapter(model: nn.Module, config: dict[str, Any], what: str = "--verify") -> nn.Module:
    """`model` wrapped in a new, trainable LoRA adapter shaped as `config` says (`lora_config`). Its
    lora_A is drawn from torch's global generator, as peft does (lora_B = 0): seed it first. Only
    the LoRA weights require grad; `model`'s target linears are replaced in place. Returns peft's
    model, whose `save_pretrained` writes an adapter directory. AdapterError (one line) when peft
    is missing or cannot build that adapter on this model (a target module it lacks)."""
    peft = require_peft(what)
    settings = lora_config(config, what)
    try:
        with warnings.catch_warnings():  # peft asks transformers 5 a deprecated question; nothing for the user
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing", category=FutureWarning)
            return peft.get_peft_model(model, settings)
    except Exception as err:  # noqa: BLE001 - peft's refusals (targets, shapes) become one line
        raise AdapterError(f"{what}: peft cannot build a LoRA adapter with {_shown(config)} on this model"
                           f" ({_first_line(err)}); fix the setting (--lora-r, --lora-alpha, --target-modules).") from None


# ----------------------------------------------------------------------------- names in the kept view


def canonical_name(name: str) -> str:
    """A module's name as an index records it: PEFT's `<target>.base_layer` -> `<target>`,
    `<target>.lora_A.<adapter name>` -> `<target>.lora_A` (and lora_B); any other name unchanged."""
    return _LORA_LINEAR.sub(r".\1", _BASE_LAYER.sub("", name))


def is_lora_name(name: str) -> bool:
    """True for the canonical name of a LoRA adapter's linear (`...lora_A`, `...lora_B`)."""
    return name.rsplit(".", 1)[-1] in LORA_KINDS


def strip_lora(name: str) -> str:
    """The adapted module's name of a LoRA linear (`x.lora_A` -> `x`); any other name unchanged."""
    return name.rsplit(".", 1)[0] if is_lora_name(name) else name


def unwrap_linear(module: nn.Module) -> nn.Module:
    """The base linear of a PEFT LoRA layer (a kept adapter's target); any other module itself."""
    inner = getattr(module, "base_layer", None)
    return inner if isinstance(inner, nn.Module) and hasattr(module, "lora_A") else module
