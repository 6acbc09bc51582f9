"""Is the Hugging Face hub reachable? Asked once per process, answered within about two seconds.

Offline, huggingface_hub retries every request five times with growing pauses: a hub model or
dataset name then takes 30-45 s and prints 5-10 "Retrying" lines before its error. So before the
first hub request CircuitKit decides once: offline when HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE,
HF_DATASETS_OFFLINE) says so, else when a TCP connection to the hub's host cannot be opened
within `PROBE_TIMEOUT_S`. Offline, the hub's own offline mode is switched on (environment and the
already-imported libraries' constants), so every later lookup reads the local cache only and
fails at once, and a name that is not in the cache is reported in one line before any work.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
from urllib.parse import urlparse

PROBE_TIMEOUT_S = 2.0
_OFFLINE_ENV = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE")
_state: dict[str, bool] = {}


def _truthy(value: str | None) -> bool:
    return (value or "").strip().upper() in ("1", "ON", "YES", "TRUE")


def _endpoint() -> tuple[str, int]:
    url = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    return url.hostname or "huggingface.co", url.port or (80 if url.scheme == "http" else 443)


def _reachable(host: str, port: int, timeout_s: float) -> bool:
    """A TCP connection to host:port within timeout_s (DNS included: run in a thread, since
    getaddrinfo itself has no timeout)."""
    result: list[bool] = []

    def probe() -> None:
        try:
            with socket.create_connection((host, port), timeout=timeout_s):
                result.append(True)
        except OSError:
            result.append(False)

    thread = threading.Thread(target=probe, daemon=True)
    thread.start()
    thread.join(timeout_s)
    return bool(result and result[0])


def go_offline() -> None:
    """Switch the hub libraries to offline mode: the environment for those not imported yet, the
    module constants for those already imported (they read the environment at import)."""
    for name in _OFFLINE_ENV:
        os.environ[name] = "1"
    constants = sys.modules.get("huggingface_hub.constants")
    if constants is not None:
        constants.HF_HUB_OFFLINE = True
    datasets_config = sys.modules.get("datasets.config")
    if datasets_config is not None:
        datasets_config.HF_HUB_OFFLINE = True
        datasets_config.HF_DATASETS_OFFLINE = True


def hub_offline(timeout_s: float = PROBE_TIMEOUT_S) -> bool:
    """True when the hub cannot be used (decided once per process; offline mode is then on)."""
    if "offline" not in _state:
        offline = any(_truthy(os.environ.get(name)) for name in _OFFLINE_ENV)
        _state["from_env"] = offline
        if not offline:
            offline = not _reachable(*_endpoint(), timeout_s)
        _state["offline"] = offline
        if offline:
            go_offline()
    return _state["offline"]


def forget() -> None:
    """Ask again at the next call (for tests)."""
    _state.clear()


def check_hub_name(name: str, revision: str | None, key: str, kind: str = "model") -> None:
    """Offline, a hub `name` must be in the local cache: else one line (UserError, exit 2) now,
    instead of retries and the same error half a minute later. Online, nothing is checked here."""
    if not hub_offline():
        return
    from huggingface_hub import try_to_load_from_cache
    from huggingface_hub.constants import HF_HUB_CACHE

    from circuitkit.core.errors import UserError

    if kind == "model":
        cached = isinstance(try_to_load_from_cache(name, "config.json", revision=revision), str)
    else:  # a dataset: any snapshot of it in the hub cache or the datasets cache
        from pathlib import Path

        folder = f"datasets--{name.replace('/', '--')}"
        datasets_cache = Path(os.environ.get("HF_DATASETS_CACHE") or Path(HF_HUB_CACHE).parent / "datasets")
        cached = (Path(HF_HUB_CACHE) / folder).is_dir() or any(datasets_cache.glob(f"{name.replace('/', '___')}*"))
    if not cached:
        why = "HF_HUB_OFFLINE is set" if _state.get("from_env") else "the hub cannot be reached"
        raise UserError(f"{key}={name!r} is a hub {kind} name, but the hub is offline ({why}) and the {kind} is not"
                        f" in the local Hugging Face cache: download it where there is a network"
                        f" (huggingface-cli download {'--repo-type dataset ' if kind == 'dataset' else ''}{name})"
                        f" or give a local {'model directory' if kind == 'model' else 'data file'}.", 2)
