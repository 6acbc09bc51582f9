"""CircuitKit: circuit discovery (EAP, EAP-IG) and head pruning on Hugging Face causal LMs."""

__version__ = "0.1.0"
# Read (as text, not imported) by circuitkit_app when it starts: PyPI's `circuitkit` is another
# project (Lexsi Labs' CircuitKIT) that imports under the same name; ours is circuitkit-gradian.
DISTRIBUTION = "circuitkit-gradian"


def discover_circuit(cfg, run_dir=None):
    """Run the circuit stages from a plain dict; see circuitkit_app.api.discover_circuit."""
    # The entry layer stands above this package: imported when called, so that importing any
    # circuitkit module stays light and loads neither the entry layer nor gradian.
    from circuitkit_app.api import discover_circuit as _discover

    return _discover(cfg, run_dir)


__all__ = ["discover_circuit", "__version__"]
