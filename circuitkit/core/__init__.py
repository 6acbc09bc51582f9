"""The runner core: config schema, pipeline and manifest, fingerprints, device, io, errors,
sweeps, batch plans and circuit.pt's format. Imports nothing of the layers above."""

# Our distribution's name on PyPI (its metadata: version, dependency windows). PyPI's
# `circuitkit` is another project (Lexsi Labs' CircuitKIT) that imports under the same name.
DISTRIBUTION = "circuitkit-gradian"
