"""The runner core: config schema, pipeline and manifest, fingerprints, device, io, errors,
sweeps, batch plans and circuit.pt's format. Imports nothing of the layers above."""
