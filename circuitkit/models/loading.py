"""Loading a causal LM and its tokenizer by hub name, local directory, GGUF file, or built-in fixture.

`model.name` is passed to `from_pretrained` exactly as users run it (a hub name such as
`google/gemma-3-4b-it`, or a local directory). `builtin:NAME` names a tiny fixture that is
built locally (seconds, cached) and then loaded from its directory the same way;
`fetched:NAME` a real model installed by `circuitkit fetch NAME` (`circuitkit.models.fetch`).
A GGUF file (`model.name=FILE.gguf`, or `model.gguf_file` inside `model.name`) goes to
`from_pretrained(directory, gguf_file=FILE)`, which dequantizes it (`circuitkit.models.gguf`).
`model.adapter` (a PEFT LoRA adapter directory) is applied on top of the loaded model
(`circuitkit.models.lora`): merged into its weights, or, for Gradian (`keep_adapter=True`), with
its LoRA linears kept. `model.base_name` names the model a full fine-tune was tuned from
(`load_base_model`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from circuitkit.core.device import PRECISION_AUTO, get_device, resolve_precision
from circuitkit.core.errors import UserError
from circuitkit.core.fingerprint import hub_revision
from circuitkit.core.syncs import all_finite
from circuitkit.fixtures.models import FIXTURE_NAMES, ensure_fixture
from circuitkit.models.adapters import ModelAdapter, get_adapter
from circuitkit.models.config import ModelConfig
from circuitkit.models.families import IMAGE_TEXT_MODEL_TYPES
from circuitkit.models.fetch import FETCHED_PREFIX, resolve_fetched
from circuitkit.models.gguf import GGUFError, check_gguf, gguf_reference, provenance, read_source
from circuitkit.models.lora import (
    attach_adapter,
    check_adapter_fits,
    lora_tensor_shapes,
    read_adapter,
    require_peft,
)

log = logging.getLogger(__name__)

BUILTIN_PREFIX = "builtin:"


@dataclass
class LoadedModel:
    """A frozen model on its device, its tokenizer and its architecture adapter."""

    model: nn.Module
    tokenizer: object
    adapter: ModelAdapter
    name: str
    revision: str | None
    path: str  # what from_pretrained was given
    lora: dict | None = None  # model.adapter's record (`AdapterSpec.record`), when one is applied
    adapter_kept: bool = False  # True: its LoRA linears are modules of `model` (Gradian's view), else merged

    @property
    def device(self) -> torch.device:
        """Where inputs go (the first layer's device when `model.device_map` splits the model)."""
        from circuitkit.models.placement import input_device

        return input_device(self.model)


class ModelReferenceError(UserError, ValueError):
    """`model.name` names no usable model (a missing directory, a file, an unknown fixture)."""

    exit_code = 2


# A hub id is `name` or `owner/name` of letters, digits and -_. (what the hub accepts).
_HUB_ID = re.compile(r"^(?:[A-Za-z0-9][A-Za-z0-9_.-]*/)?[A-Za-z0-9][A-Za-z0-9_.-]*$")


def is_local_path(name: str) -> bool:
    """True when `model.name` means a directory on this machine rather than a hub id."""
    return (Path(name).expanduser().exists() or name.startswith(("/", "./", "../", "~", "."))
            or "\\" in name or not _HUB_ID.match(name))


def resolve_model_path(name: str) -> str:
    """The argument for `from_pretrained`: builtin fixtures become their cached directory,
    local directories are checked (UserError naming what is missing), hub ids pass through."""
    if name.startswith(BUILTIN_PREFIX):
        fixture = name[len(BUILTIN_PREFIX):]
        if fixture not in FIXTURE_NAMES:
            raise ModelReferenceError(f"model.name '{name}' names no built-in fixture; available:"
                            f" {', '.join(BUILTIN_PREFIX + n for n in FIXTURE_NAMES)}.")
        return str(ensure_fixture(fixture))
    if name.startswith(FETCHED_PREFIX):
        return str(resolve_fetched(name))
    if is_local_path(name):
        path = Path(name).expanduser()
        if not path.exists():
            raise ModelReferenceError(f"model.name={name!r} is a local path that does not exist (resolved to"
                            f" {path.resolve()}); give an existing model directory (with config.json) or a"
                            " hub id such as gpt2 or google/gemma-3-4b-it.")
        if not path.is_dir():
            raise ModelReferenceError(f"model.name={name!r} is a file; give the model's directory (the one holding"
                            " config.json, the weights and the tokenizer files).")
        if not (path / "config.json").is_file():
            raise ModelReferenceError(f"model.name={name!r} has no config.json; give the directory a model was saved to"
                            " (save_pretrained writes config.json, the weights and the tokenizer).")
        return str(path)
    return name


def pretrained_args(cfg: ModelConfig) -> tuple[str, dict]:
    """(what `from_pretrained` is given, extra keyword arguments): `gguf_file=` for a GGUF source,
    whose header is checked first (a missing file, not GGUF, an unsupported architecture: one line)."""
    ref = gguf_reference(cfg.name, cfg.gguf_file)
    if ref is None:
        return resolve_model_path(cfg.name), {}
    directory = ref.directory
    if directory.startswith((BUILTIN_PREFIX, FETCHED_PREFIX)):
        directory = resolve_model_path(directory)
    if is_local_path(directory):
        path = Path(directory).expanduser() / ref.file
        if not path.is_file():
            raise ModelReferenceError(f"model.name={cfg.name!r}: the GGUF file {path} does not exist; give an existing"
                                      " .gguf file (model.name=FILE.gguf, or model.gguf_file inside model.name).")
        check_gguf(path)
        directory = str(path.parent)
    return directory, {"gguf_file": ref.file}


def model_source(cfg: ModelConfig, sha256_of=None) -> dict:
    """Where the analysed model comes from, for the run's manifest: its kind (builtin, fetched, local,
    hub, gguf) and, for a GGUF or a converted directory, the file, quantization, sha256 and that the
    analysed weights are its float32 dequantization; `adapter` (model.adapter's record: directory,
    weights sha256, r, lora_alpha, target modules, base model) and `base_name` when set.
    `sha256_of(path)` hashes a file (cached)."""
    out = _base_source(cfg, sha256_of)
    if getattr(cfg, "adapter", None):
        out["adapter"] = read_adapter(cfg.adapter).record()
    if getattr(cfg, "base_name", None):
        out["base_name"] = cfg.base_name
    return out


def _base_source(cfg: ModelConfig, sha256_of=None) -> dict:
    name = cfg.name
    if gguf_reference(name, cfg.gguf_file) is not None:
        directory, kwargs = pretrained_args(cfg)
        path = Path(directory) / kwargs["gguf_file"]
        if not path.is_file():
            return {"kind": "gguf", "name": name, "gguf_file": kwargs["gguf_file"]}
        return {"kind": "gguf", "name": name,
                **provenance(check_gguf(path), sha256_of(path) if sha256_of else None)}
    kind = ("builtin" if name.startswith(BUILTIN_PREFIX) else "fetched" if name.startswith(FETCHED_PREFIX)
            else "local" if is_local_path(name) else "hub")
    out = {"kind": kind, "name": name, "revision": cfg.revision}
    if kind in ("fetched", "local"):
        source = read_source(resolve_model_path(name))
        if source:
            out["converted_from"] = source
    return out


def load_hf_config(cfg: ModelConfig):
    """The model's config.json as attributes (no weights, no transformers import); None for a
    hub id that is not in the local Hugging Face cache. A local one that cannot be read raises
    UserError. Enough for `context_length` and other pre-run checks."""
    import json
    from types import SimpleNamespace

    path, kwargs = pretrained_args(cfg)
    if kwargs.get("gguf_file"):
        return _gguf_config(path, kwargs["gguf_file"], cfg.revision)
    if Path(path).is_dir():
        config_file: str | Path | None = Path(path) / "config.json"
    else:
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(path, "config.json", revision=cfg.revision)
        config_file = found if isinstance(found, str) else None
    if config_file is None:
        return None
    try:
        data = json.loads(Path(config_file).read_text())
    except (OSError, ValueError) as err:
        raise UserError(f"model.name={cfg.name!r}: {config_file} cannot be read ({_first_line(err)}).") from None
    if not isinstance(data, dict):
        raise UserError(f"model.name={cfg.name!r}: {config_file} is not a JSON object.")
    text = data.get("text_config")
    return SimpleNamespace(**{**data, "text_config": SimpleNamespace(**text) if isinstance(text, dict) else None})


def _gguf_config(directory: str, gguf_file: str, revision: str | None):
    """A GGUF's config as transformers reads it (metadata only, no tensors); None if not local."""
    from types import SimpleNamespace

    if not (Path(directory) / gguf_file).is_file():
        return None
    return SimpleNamespace(**auto_config(directory, {"gguf_file": gguf_file}, revision, False).to_dict(),
                           text_config=None)


def auto_config(path: str, kwargs: dict, revision: str | None, trust_remote_code: bool):
    """transformers' AutoConfig for a from_pretrained source (`pretrained_args`)."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(path, revision=revision, trust_remote_code=trust_remote_code, **kwargs)


def load_tokenizer(cfg: ModelConfig):
    """The model's tokenizer, from the same source as its weights (a GGUF carries its own)."""
    from transformers import AutoTokenizer

    path, kwargs = pretrained_args(cfg)
    return AutoTokenizer.from_pretrained(path, revision=cfg.revision, trust_remote_code=cfg.trust_remote_code,
                                         **kwargs)


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def _broken_weight_file(path: str) -> str | None:
    """The first weight file of a local directory that safetensors cannot open, if any."""
    from safetensors import safe_open

    for f in sorted(Path(path).glob("*.safetensors")):
        try:
            with safe_open(str(f), framework="pt") as fh:
                for key in fh.keys():
                    fh.get_slice(key)
        except Exception as err:  # noqa: BLE001 - any failure to open is what we are looking for
            return f"{f} ({_first_line(err)})"
    return None


def _auto_class(path: str, kwargs: dict, revision: str | None, trust_remote_code: bool):
    """AutoModelForCausalLM, or AutoModelForImageTextToText for the multimodal checkpoints a family
    names (Gemma 3's: its text path is used)."""
    from transformers import AutoModelForCausalLM

    config = auto_config(path, kwargs, revision, trust_remote_code)
    if getattr(config, "model_type", None) in IMAGE_TEXT_MODEL_TYPES:
        from transformers import AutoModelForImageTextToText

        return AutoModelForImageTextToText
    return AutoModelForCausalLM


def _quiet_transformers() -> None:
    """Our own progress and tables replace transformers' per-file bars; its warnings still show."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    logging.getLogger("matplotlib").setLevel(logging.WARNING)


def placement_kwargs(cfg: ModelConfig) -> dict:
    """`device_map`, `max_memory` and `offload_folder` for from_pretrained, when a device map is
    set (accelerate places the layers); UserError if accelerate is missing."""
    if cfg.device_map is None:
        return {}
    try:
        import accelerate  # noqa: F401
    except ImportError:
        raise UserError("model.device_map needs Hugging Face accelerate: pip install 'circuitkit-gradian[accelerate]'"
                        " (or set model.device_map=null).", 2) from None
    from omegaconf import OmegaConf

    def plain(value):
        return OmegaConf.to_container(value) if OmegaConf.is_config(value) else value
    out = {"device_map": plain(cfg.device_map)}
    if cfg.max_memory is not None:
        out["max_memory"] = {(int(k) if str(k).isdigit() else k): v for k, v in plain(cfg.max_memory).items()}
    if cfg.offload_folder is not None:
        out["offload_folder"] = str(Path(cfg.offload_folder).expanduser())
    return out


def load_model(cfg: ModelConfig, device: torch.device | None = None, keep_adapter: bool = False) -> LoadedModel:
    """Load `cfg.name` at `cfg.revision`, frozen, in eval mode, on `device`, in the dtype
    `resolve_precision(cfg.precision, device)` gives (auto: bfloat16 where `device` computes it
    natively, else float32).

    With `cfg.adapter` (a PEFT LoRA adapter directory) the adapter is applied after the model
    loads, checked against it first (`circuitkit.models.lora`): merged into the weights, or with
    its LoRA linears kept as modules when `keep_adapter` (Gradian, whose module filter can select
    them). The same function either way; an adapter made for another model is one line, exit 2.

    Parameters never require grad: CircuitKit only takes activation gradients.
    """
    device = device or get_device()
    dtype = resolve_precision(cfg.precision, device).dtype
    if cfg.precision not in ("bfloat16", PRECISION_AUTO):
        log.warning("model.precision=%s: auto (bfloat16 where native) is the default; %s uses more memory per weight"
                    " and is meant for reference/accuracy checks.", cfg.precision, cfg.precision)
    if cfg.trust_remote_code:
        log.warning("model.trust_remote_code=true: code from '%s' will run on this machine.", cfg.name)
    _quiet_transformers()
    path, source_kwargs = pretrained_args(cfg)
    if not source_kwargs and not Path(path).exists():  # a hub name: offline (decided once), not cached is one line now
        from circuitkit.core.hub import check_hub_name

        check_hub_name(cfg.name, cfg.revision, "model.name")
    try:
        auto = _auto_class(path, source_kwargs, cfg.revision, cfg.trust_remote_code)
        model = auto.from_pretrained(path, revision=cfg.revision, dtype=dtype,
                                     trust_remote_code=cfg.trust_remote_code,
                                     attn_implementation=cfg.attn_implementation, **source_kwargs,
                                     **placement_kwargs(cfg))
    except Exception as err:
        if isinstance(err, UserError):
            raise
        if source_kwargs:
            raise GGUFError(f"model.name={cfg.name!r}: transformers could not load the GGUF file"
                            f" {source_kwargs['gguf_file']} ({_first_line(err)}).") from None
        if Path(path).is_dir() and type(err).__name__ == "UnpicklingError":  # pickle.UnpicklingError
            pickles = sorted(p.name for p in Path(path).glob("*.bin")) or ["its weight file"]
            raise UserError(f"model.name={cfg.name!r}: {Path(path) / pickles[0]} is refused as unsafe: it is a"
                            " pickle that holds objects other than tensors, and loading it could run code; use"
                            " the model saved as safetensors (or convert a copy you trust).") from None
        if Path(path).is_dir():
            broken = _broken_weight_file(path)
            if broken:
                raise UserError(f"model.name={cfg.name!r}: cannot read the weight file {broken}; it is truncated"
                                " or corrupted: save or download the model again.") from None
            if isinstance(err, OSError | ValueError):
                raise UserError(f"model.name={cfg.name!r}: loading {path} failed ({_first_line(err)}).") from None
        elif isinstance(err, OSError):
            raise UserError(f"model.name={cfg.name!r} could not be loaded from the hub or the local Hugging Face"
                            f" cache ({_first_line(err)}). Offline, download it first (huggingface-cli download"
                            f" {cfg.name}) or give a local model directory.") from None
        raise
    model.requires_grad_(False)
    model.eval()
    if cfg.device_map is None:  # with a device map, accelerate has placed every layer already
        model.to(device)
    lora = None
    if getattr(cfg, "adapter", None):
        spec = read_adapter(cfg.adapter)
        model = attach_adapter(model, spec, cfg.name, keep_adapter, path)
        lora = spec.record()
    check_finite_weights(model, cfg)
    tokenizer = load_tokenizer(cfg)
    return LoadedModel(model, tokenizer, get_adapter(model), cfg.name, cfg.revision, path, lora,
                       bool(lora) and keep_adapter)


def check_finite_weights(model: nn.Module, cfg: ModelConfig) -> None:
    """UserError (exit 1) naming the first parameter that holds NaN or infinity (with an adapter:
    after it is applied); one host wait for every parameter's flag, offloaded (meta) ones skipped."""
    params = [(name, p) for name, p in model.named_parameters() if p.device.type != "meta"]
    if not params:
        return
    bad = [name for (name, _), ok in zip(params, all_finite([p for _, p in params]), strict=True) if not ok]
    if bad:
        more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
        with_adapter = f" with model.adapter={cfg.adapter!r}" if getattr(cfg, "adapter", None) else ""
        raise UserError(f"model.name={cfg.name!r}{with_adapter}: weight {bad[0]}{more} holds NaN or infinity; the"
                        " checkpoint is damaged (or was saved after training diverged): use an earlier or"
                        " re-downloaded copy.")


def base_model_config(cfg: ModelConfig) -> ModelConfig:
    """The config of `cfg.base_name` (the model a full fine-tune in `cfg.name` was tuned from): the
    same precision, attention and placement, its default revision, no adapter. UserError when
    `model.base_name` is not set."""
    if not getattr(cfg, "base_name", None):
        raise UserError(f"model.base_name is not set: give the model {cfg.name!r} was fine-tuned from (hub name,"
                        " local directory or builtin:NAME).", 2)
    return dataclasses.replace(cfg, name=cfg.base_name, base_name=None, adapter=None, gguf_file=None, revision=None)


def load_base_model(cfg: ModelConfig, device: torch.device | None = None) -> LoadedModel:
    """The base model of a full fine-tune (`model.base_name`), loaded as `load_model` loads
    `model.name`, after `check_base_model` (the two must share an architecture and shape)."""
    check_base_model(cfg)
    return load_model(base_model_config(cfg), device)


def check_base_model(cfg: ModelConfig) -> None:
    """`model.base_name` resolves and, where both configs are on this machine, has the tuned model's
    architecture and shape (ModelReferenceError naming both otherwise)."""
    if not getattr(cfg, "base_name", None):
        return
    base_cfg = base_model_config(cfg)
    try:
        pretrained_args(base_cfg)
    except ModelReferenceError as err:
        raise ModelReferenceError(str(err).replace("model.name", "model.base_name", 1)) from None
    tuned, base = load_hf_config(cfg), load_hf_config(base_cfg)
    if tuned is None or base is None:
        return  # a hub model not cached yet: loading it says so
    from circuitkit.models.families import family_of_config

    def describe(hf) -> tuple[str | None, dict | None]:
        text = getattr(hf, "text_config", None) or hf
        try:
            return getattr(text, "model_type", None), family_of_config(hf).read_dims(text)
        except (ValueError, AttributeError, TypeError):
            return getattr(text, "model_type", None), None
    (tuned_type, tuned_dims), (base_type, base_dims) = describe(tuned), describe(base)
    if tuned_type != base_type or tuned_dims != base_dims:
        raise ModelReferenceError(f"model.base_name={cfg.base_name!r} ({base_type}, {base_dims}) is not the"
                                  f" architecture of model.name={cfg.name!r} ({tuned_type}, {tuned_dims}): a full"
                                  " fine-tune keeps its base model's shape; give the model it was tuned from.")


# Config attributes that hold a model's context length, by family (GPT-2: n_positions).
_CONTEXT_ATTRS = ("max_position_embeddings", "n_positions", "n_ctx", "seq_length")


def context_length(hf_config) -> int | None:
    """The longest sequence (tokens) the model takes, from its Hugging Face config; None if unknown.

    Multimodal configs (Gemma 3) are read through their text config.
    """
    config = getattr(hf_config, "text_config", None) or hf_config
    for attr in _CONTEXT_ATTRS:
        value = getattr(config, attr, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def weights_hash(model: nn.Module) -> str:
    """sha256 over parameter names, shapes, dtypes and bytes: identifies the exact weights."""
    from circuitkit.models.placement import resident, state_entries

    h = hashlib.sha256()
    # = sorted(model.state_dict().items()), with offloaded weights read one module at a time
    for name, (module, attr) in sorted(state_entries(model).items()):
        with resident(module):
            p = getattr(module, attr)
            h.update(f"{name}:{tuple(p.shape)}:{p.dtype}".encode())
            h.update(p.detach().cpu().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


# ----------------------------------------------------------------------------- what stages ask

def check_model(cfg: ModelConfig) -> None:
    """The pre-run check every stage that loads the model shares: the reference resolves (and a
    GGUF file exists and has a supported architecture); `model.adapter` is a LoRA adapter directory
    and peft is installed; `model.base_name` resolves and has the model's shape."""
    pretrained_args(cfg)
    if getattr(cfg, "adapter", None):
        check_adapter_before_loading(cfg)
    check_base_model(cfg)


def check_adapter_before_loading(cfg: ModelConfig) -> None:
    """`model.adapter` checked before anything runs: adapter_config.json's values, the weights file's
    header, peft installed, and every LoRA tensor and target module against the model's modules, built
    empty on the meta device from its config (no weights read). A model whose config is not on this
    machine (a hub id not cached) or needs remote code is checked when it loads instead."""
    spec = read_adapter(cfg.adapter)
    lora_tensor_shapes(spec)
    require_peft()
    if cfg.trust_remote_code:
        return
    path, kwargs = pretrained_args(cfg)
    key = (path, cfg.revision, tuple(sorted(kwargs.items())), str(spec.weights_file),
           spec.weights_file.stat().st_mtime_ns, json.dumps(spec.config, sort_keys=True, default=str))
    if key in _ADAPTER_FITS:
        return
    try:
        auto = _auto_class(path, kwargs, cfg.revision, False)
        config = auto_config(path, kwargs, cfg.revision, False)
    except Exception:  # noqa: BLE001 - not available offline: load_model says so in its own words
        return
    with torch.device("meta"):
        skeleton = auto.from_config(config)
    check_adapter_fits(skeleton, spec, cfg.name, path)
    _ADAPTER_FITS.add(key)


# Adapters found to fit their model in this process (every stage's pre-run check asks again).
_ADAPTER_FITS: set[tuple] = set()


def model_inputs(cfg: ModelConfig) -> dict[str, Path | str]:
    """The model as a stage input: a local or builtin directory (every file: weights, config,
    tokenizer), a local GGUF file, or a hub id at its resolved revision."""
    adapter = {"model.adapter": read_adapter(cfg.adapter).directory} if getattr(cfg, "adapter", None) else {}
    path, kwargs = pretrained_args(cfg)
    if kwargs.get("gguf_file"):
        local = Path(path) / kwargs["gguf_file"]
        return {"model": local if local.is_file() else f"{hub_revision(path, cfg.revision)}/{local.name}", **adapter}
    if cfg.name.startswith((BUILTIN_PREFIX, FETCHED_PREFIX)) or is_local_path(cfg.name):
        return {"model": Path(resolve_model_path(cfg.name)), **adapter}
    return {"model": hub_revision(cfg.name, cfg.revision), **adapter}


def model_context(cfg: ModelConfig) -> int | None:
    """The model's context length from its config (no weights); None when not known offline."""
    hf = load_hf_config(cfg)
    return context_length(hf) if hf is not None else None
