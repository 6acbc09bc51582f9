"""The `report` group's schema: whether report.html is written, and how much of the graph it embeds."""

from __future__ import annotations

from dataclasses import dataclass

from circuitkit.core.config import _f


@dataclass
class ReportConfig:
    enabled: bool = _f(True, "write report.html (the run as one self-contained page: circuitkit_app.report) in the"
                       " run dir at the end of every run, and one comparing the jobs in a multirun's sweep dir")
    top_edges: int = _f(2000, "the strongest edges of the circuit embedded in the report's graph (its edge"
                        " control ranges over them); every other edge is counted in per-layer totals", ge=1,
                        le=20000)
