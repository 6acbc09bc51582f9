"""A multirun's report: one row per job (`circuitkit.core.sweep.summarize_sweep`), the swept keys
against wall time, peak memory and the headline result, and a link to each job's own report.

Each job's swept values are read from its `.hydra/overrides.yaml` (`job_overrides`: a list, one
override per entry), never re-split from the summary's joined text: a value may hold any character,
an unbalanced apostrophe too. A job link is a relative file link (`./` and the percent-encoded
folder name), never a URL scheme the browser would run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any
from urllib.parse import quote

from circuitkit.core.sweep import HEADLINE_KEYS, job_overrides, summarize_sweep

REPORT = "report.html"


def job_link(job: str) -> str:
    """The href of a job's page from the sweep's page: `./JOB/report.html`, JOB percent-encoded (a
    folder named `javascript:...` stays a file link)."""
    return f"./{quote(str(job), safe='')}/{REPORT}"


def _values(job_dir: Path) -> dict[str, str]:
    """{key: value as written} of a job's overrides (`+`/`~` dropped); {} for a job whose overrides
    cannot be read (its summary row is failed, with the error naming the file and the job)."""
    try:
        overrides = job_overrides(job_dir)
    except ValueError:
        return {}
    out = {}
    for item in overrides:
        if "=" in item:
            key, value = item.split("=", 1)
            out[key.lstrip("+~")] = value
    return out


def collect_sweep(sweep_dir: Path) -> dict[str, Any]:
    """{"sweep": {jobs, swept, failed, result_label}} for the page; UserError (exit 2) if `sweep_dir`
    has no job directories."""
    from circuitkit.core.errors import UserError

    rows = summarize_sweep(Path(sweep_dir))
    if not rows:
        raise UserError(f"{sweep_dir} holds no multirun jobs (no N/.hydra/overrides.yaml): give a run directory or"
                        " a multirun's sweep directory.", exit_code=2)
    values = [_values(Path(sweep_dir) / str(r["job"])) for r in rows]
    read = [v for v in values if v]  # a job whose overrides cannot be read varies nothing
    keys = [k for k in dict.fromkeys(k for v in read for k in v)]
    swept = [k for k in keys if len({v.get(k) for v in read}) > 1]
    result_key = next((k for k in HEADLINE_KEYS if any(r.get(k) is not None for r in rows)), None)
    jobs = []
    for row, vals in zip(rows, values, strict=True):
        report = Path(sweep_dir) / str(row["job"]) / REPORT
        result = row.get(result_key) if result_key else None
        jobs.append({"job": row["job"], "overrides": row.get("overrides", ""), "status": row.get("status"),
                     "wall_s": row.get("wall_s"), "peak_mib": row.get("peak_mib"),
                     "result": result if isinstance(result, (int, float)) and not isinstance(result, bool) else None,
                     "error": row.get("error"), "values": vals,
                     "report": job_link(row["job"]) if report.is_file() else None})
    return {"kind": "sweep", "sweep": {"jobs": jobs, "swept": swept, "result_label": result_key or "(no result)",
                                       "failed": sum(j["status"] == "failed" for j in jobs),
                                       "sweep_dir": str(sweep_dir)}}
