"""How a row is stored: one file per format behind one interface (`base.RowFormat`), and their registry.

    dense      each module's projected block itself, in grads.storage_dtype          (`dense`)
    factored   rank-c factors U, V of each module's block                           (`factored`)
    signs      one bit per projected coordinate, scored by n - 2 x Hamming distance  (`signs`)

The writer, the reader, `gradian inspect --verify`, the scores and the curvature ask `format_of(manifest)`
once and call the format; the indexer and the memory estimate ask `format_for(grads)`. A new format is
a file here with a `RowFormat` subclass, a line in `FORMATS`, a choice of `grads.row_format` in the
config schema, and its tests.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from circuitkit.core.recorded import IndexIntegrityError
from gradian.index.formats.base import RowFormat
from gradian.index.formats.dense import DenseFormat
from gradian.index.formats.factored import FactoredFormat
from gradian.index.formats.signs import SignsFormat

FORMATS: dict[str, type[RowFormat]] = {
    "dense": DenseFormat,
    "factored": FactoredFormat,
    "signs": SignsFormat,
}


def row_format_problems(manifest: Mapping[str, Any], where: str) -> list[str]:
    """What a reader cannot take in a manifest's row format, each a sentence ending with its fix (an
    unknown format: upgrade; a damaged record: rebuild)."""
    name = manifest.get("row_format", "dense")
    if name not in FORMATS:
        return [f"{where}: row_format {name!r} is not one this Gradian reads ({', '.join(FORMATS)}); upgrade"
                " circuitkit"]
    return FORMATS[name].manifest_problems(manifest, where)


def format_of(manifest: Mapping[str, Any]) -> RowFormat:
    """The row format of the index whose manifest (or the indexer's header) this is. A manifest of a
    format this Gradian does not know is refused (IndexIntegrityError), as `read_manifest` refuses it."""
    problems = row_format_problems(manifest, "the index manifest")
    if problems:
        raise IndexIntegrityError(f"{problems[0]}.")
    return FORMATS[manifest.get("row_format", "dense")].from_manifest(manifest)


def format_for(grads) -> type[RowFormat]:
    """The row format grads.row_format asks for (its class: what the config alone decides)."""
    return FORMATS[grads.row_format]
