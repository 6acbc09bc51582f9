"""GGUF files (llama.cpp, Ollama) as a model source.

A GGUF file is loaded through transformers (`from_pretrained(directory, gguf_file=NAME)`), which
dequantizes every tensor to float32; the model CircuitKit and Gradian analyse is that dequantized
model, and the run's manifest says so (`model_source`). Two ways to name one:

* `model.name=/path/to/model.gguf` (a `.gguf` file), or
* `model.name=<directory or hub id>` with `model.gguf_file=<file name in it>` (transformers' form).

Before anything loads, the file's header is read here (a few milliseconds, no tensor data) to
refuse an architecture that transformers cannot dequantize or that no CircuitKit family handles,
in one line. `convert_gguf` turns a GGUF into an ordinary Hugging Face directory (safetensors) with
a `circuitkit_source.json` saying where it came from; `circuitkit fetch` uses it.
"""

from __future__ import annotations

import json
import shutil
import struct
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from circuitkit.core.errors import UserError

GGUF_SUFFIX = ".gguf"
SOURCE_FILE = "circuitkit_source.json"  # provenance of a converted directory (part of its fingerprint)


# ggml tensor types by number (ggml.h), for the quantization summary.
_GGML_TYPES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 9: "Q8_1",
               10: "Q2_K", 11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 15: "Q8_K", 16: "IQ2_XXS",
               17: "IQ2_XS", 18: "IQ3_XXS", 19: "IQ1_S", 20: "IQ4_NL", 21: "IQ3_S", 22: "IQ2_S", 23: "IQ4_XS",
               24: "I8", 25: "I16", 26: "I32", 27: "I64", 28: "F64", 29: "IQ1_M", 30: "BF16", 34: "TQ1_0",
               35: "TQ2_0", 39: "MXFP4"}

# GGUF metadata value types: struct format of the fixed-size ones; 8 = string, 9 = array.
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


class GGUFError(UserError, ValueError):
    """A GGUF file that cannot be used (not GGUF, truncated, an unsupported architecture).

    Exit 2 (the config names a model CircuitKit does not load: change model.name) by default;
    a file whose bytes are bad (not GGUF, cut short, unreadable) is `GGUFError(..., exit_code=1)`.
    """

    exit_code = 2


_ALIGNMENT = 32  # GGUF's default `general.alignment` of the tensor data


@dataclass(frozen=True)
class GGUFHeader:
    """What a GGUF file says about itself, without its tensor data."""

    path: Path
    version: int
    architecture: str
    name: str | None
    tensor_types: dict[str, int]  # ggml type name -> number of tensors
    n_tensors: int

    @property
    def quantization(self) -> str:
        """e.g. 'Q4_1 (210 tensors), F32 (61), Q8_0 (1)': the types, most used first."""
        parts = [f"{t} ({n}{' tensors' if i == 0 else ''})"
                 for i, (t, n) in enumerate(sorted(self.tensor_types.items(), key=lambda kv: -kv[1]))]
        return ", ".join(parts)


def _read(fh: BinaryIO, n: int) -> bytes:
    if n > _remaining(fh):  # a length from a cut or garbled header: refuse it before allocating it
        raise EOFError(f"unexpected end of file at byte {fh.tell()}, reading {n} more")
    data = fh.read(n)
    if len(data) != n:
        raise EOFError(f"unexpected end of file at byte {fh.tell()}")
    return data


def _remaining(fh: BinaryIO) -> int:
    import os

    return os.fstat(fh.fileno()).st_size - fh.tell()


def _tensor_bytes(dims: list[int], ggml_type: int) -> int | None:
    """Bytes of one tensor's data (ggml blocks of its type; the gguf package knows the sizes);
    None when the type or the package is unknown here (then transformers decides)."""
    try:
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

        block, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
    except (ImportError, ValueError, KeyError):
        return None
    n = 1
    for d in dims:
        n *= d
    return n // block * block_bytes


def _check_length(fh: BinaryIO, path: Path, meta: dict[str, Any], tensors: list[tuple[str, int, int | None]]) -> None:
    """GGUFError (exit 1) when the file ends before its last tensor's data does (a cut download)."""
    align = meta.get("general.alignment")
    align = align if isinstance(align, int) and align > 0 else _ALIGNMENT
    data_start = -(-fh.tell() // align) * align
    size = fh.tell() + _remaining(fh)
    ends = [(data_start + offset + n, name) for name, offset, n in tensors if n is not None]
    if ends and max(ends)[0] > size:
        end, name = max(ends)
        raise GGUFError(f"{path} is cut short: it has {size} bytes but its tensor data ends at byte {end}"
                        f" (tensor {name!r}); the download or write stopped early: download or write it again.",
                        exit_code=1)


def _unpack(fh: BinaryIO, fmt: str) -> Any:
    return struct.unpack(fmt, _read(fh, struct.calcsize(fmt)))[0]


def _string(fh: BinaryIO) -> str:
    return _read(fh, _unpack(fh, "<Q")).decode("utf-8", errors="replace")


def _value(fh: BinaryIO, kind: int, keep: bool) -> Any:
    """One metadata value; arrays are skipped (None) unless `keep`."""
    if kind in _SCALARS:
        return _unpack(fh, _SCALARS[kind])
    if kind == _STRING:
        return _string(fh)
    if kind == _ARRAY:
        item, count = _unpack(fh, "<I"), _unpack(fh, "<Q")
        if item in _SCALARS and not keep:
            fh.seek(count * struct.calcsize(_SCALARS[item]), 1)
            return None
        values = [_value(fh, item, keep) for _ in range(count)]
        return values if keep else None
    raise ValueError(f"unknown GGUF value type {kind}")


def read_gguf_header(path: str | Path) -> GGUFHeader:
    """The header of a GGUF file (metadata scalars and tensor types); GGUFError if it is not one."""
    path = Path(path)
    try:
        with path.open("rb") as fh:
            if _read(fh, 4) != b"GGUF":
                raise GGUFError(f"{path} is not a GGUF file (it does not start with the GGUF magic bytes);"
                                " give a .gguf file written by llama.cpp or the gguf package.", exit_code=1)
            version = _unpack(fh, "<I")
            if version < 2:
                raise GGUFError(f"{path} is GGUF version {version}; transformers reads versions 2 and 3.")
            n_tensors, n_kv = _unpack(fh, "<Q"), _unpack(fh, "<Q")
            meta: dict[str, Any] = {}
            for _ in range(n_kv):
                key = _string(fh)
                meta[key] = _value(fh, _unpack(fh, "<I"), keep=False)
            types: Counter[str] = Counter()
            tensors = []  # (name, data offset, bytes)
            for _ in range(n_tensors):
                name = _string(fh)
                dims = [_unpack(fh, "<Q") for _ in range(_unpack(fh, "<I"))]
                ggml_type = _unpack(fh, "<I")
                tensors.append((name, _unpack(fh, "<Q"), _tensor_bytes(dims, ggml_type)))
                types[_GGML_TYPES.get(ggml_type, f"type {ggml_type}")] += 1
            _check_length(fh, path, meta, tensors)
    except (EOFError, ValueError, struct.error, OverflowError, MemoryError) as err:
        if isinstance(err, GGUFError):
            raise
        reason = str(err).strip() or "unexpected end of file"
        raise GGUFError(f"{path} is truncated or not a valid GGUF file ({reason}); download or write it again.",
                        exit_code=1) from None
    except OSError as err:
        raise GGUFError(f"cannot read the GGUF file {path} ({err.strerror or err}).", exit_code=1) from None
    arch = meta.get("general.architecture")
    if not isinstance(arch, str):
        raise GGUFError(f"{path} has no general.architecture in its metadata; it is not a model file.")
    return GGUFHeader(path, version, arch, meta.get("general.name"), dict(types), n_tensors)


def check_gguf(path: str | Path) -> GGUFHeader:
    """The header, refusing (one line) an architecture no CircuitKit family or transformers handles."""
    # A GGUF `general.architecture` is the Hugging Face model_type; each family lists the ones it
    # loads (transformers also dequantizes others: bloom, falcon, mamba, t5, ...; refused here).
    from circuitkit.models.families import GGUF_MODEL_TYPES

    header = read_gguf_header(path)
    if header.architecture not in GGUF_MODEL_TYPES:
        raise GGUFError(f"{header.path}: GGUF architecture {header.architecture!r} is not supported; CircuitKit"
                        f" loads GGUF files of {', '.join(sorted(GGUF_MODEL_TYPES))} (dequantized by"
                        " transformers). Convert the model to a Hugging Face directory of a supported family.")
    return header


@dataclass(frozen=True)
class GGUFReference:
    """A GGUF model as from_pretrained takes it: a directory (or hub id) and a file name in it."""

    directory: str
    file: str

    @property
    def path(self) -> Path:
        return Path(self.directory) / self.file

    @property
    def is_local(self) -> bool:
        return self.path.is_file()


def gguf_reference(name: str, gguf_file: str | None) -> GGUFReference | None:
    """The GGUF that `model.name` / `model.gguf_file` name, or None when the model is not a GGUF."""
    if gguf_file:
        return GGUFReference(str(Path(name).expanduser()) if Path(name).expanduser().is_dir() else name, gguf_file)
    if name.lower().endswith(GGUF_SUFFIX):
        path = Path(name).expanduser()
        return GGUFReference(str(path.parent), path.name)
    return None


def provenance(header: GGUFHeader, sha256: str | None = None, **extra: Any) -> dict[str, Any]:
    """What a run records about a GGUF source: file, architecture, quantization, and that the
    analysed model is its float32 dequantization by transformers."""
    import transformers

    out = {"format": "gguf", "file": header.path.name, "architecture": header.architecture,
           "gguf_name": header.name, "quantization": header.quantization,
           "analysed_as": f"dequantized to float32 by transformers {transformers.__version__}"}
    if sha256:
        out["sha256"] = sha256
    out.update(extra)
    return out


def read_source(directory: str | Path) -> dict[str, Any] | None:
    """The provenance a converted directory carries (`circuitkit_source.json`), if any."""
    f = Path(directory) / SOURCE_FILE
    if not f.is_file():
        return None
    try:
        data = json.loads(f.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def convert_gguf(gguf_path: str | Path, out_dir: str | Path, source: dict[str, Any]) -> Path:
    """Dequantize a GGUF file into a Hugging Face directory (float32 safetensors + tokenizer) at
    `out_dir`, with `source` written to circuitkit_source.json. The directory appears atomically
    (built beside it, then renamed); the logits equal those of the GGUF loaded directly.

    transformers refuses to save a model loaded from GGUF ("not serializable"), so the weights are
    moved into a model built from the same config without its quantization_config.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # transformers' per-tensor bars; the caller says what runs
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    check_gguf(gguf_path)
    loaded = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name,
                                                  dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict(), strict=True)
    model.tie_weights()
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}-", dir=out_dir.parent))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / SOURCE_FILE).write_text(json.dumps(source, indent=2, sort_keys=True) + "\n")
        tmp.chmod(0o755)  # mkdtemp makes it private; a model directory is read by every user
        if out_dir.exists():
            shutil.rmtree(out_dir)
        tmp.rename(out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir
