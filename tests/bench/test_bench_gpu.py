"""scripts/bench/bench_gpu.py on a tiny setting: the hand-written floor computes the rows Gradian stores
(a real oracle: the same projected gradients from plain hooks), the counts are the design's, and the
table has its rows."""

from __future__ import annotations

import torch

from gradian.index.reader import IndexReader
from scripts.bench.bench_gpu import PROXY_SHAPE, Setting, machine_meta, markdown, run_bench


def test_the_floor_computes_the_rows_gradian_stores_and_the_table_shows_both(tmp_path) -> None:
    setting = Setting("tiny", {**PROXY_SHAPE, "n_layers": 2}, rows=6, device_tokens=512, rows_per_shard=2,
                      count_rows=6, lengths=(20, 60), eap=None, bergson=False, calibrate=False)
    cpu = torch.device("cpu")
    report = run_bench(setting, tmp_path / "work", cpu, keep_floor_rows=True, cache=tmp_path / "models",
                       log=lambda _: None)

    for variant in ("defaults", "device-sized"):
        ids, stored = zip(*((rows, grads) for rows, grads, _ in IndexReader(tmp_path / "work" / f"index-{variant}").shards()),
                          strict=True)
        stored = torch.cat(stored).float()[torch.cat(ids).argsort()]  # (6, 14 modules x 1024) in row order
        floor = report["floor_rows"][variant].float()
        assert stored.shape == floor.shape == (6, 14 * 1024)
        error = (stored - floor).norm(dim=1) / floor.norm(dim=1)
        assert floor.norm(dim=1).min() > 0 and error.max() < 2e-3, error

    # Per batch: no wait in Gradian's index loop; the floor's one copy of its rows.
    for counts in report["counts"].values():
        assert len(counts["blocking"]) >= 2 and max(counts["blocking"]) <= 1, counts
    assert all(c == {"Tensor.cpu": 1} for c in report["floor_blocking"]), report["floor_blocking"]

    text = markdown(report, machine_meta(cpu))
    rows = [line.split(" | ")[0] for line in text.splitlines() if line.startswith("| ")]
    assert rows[1:] == ["| floor (defaults batches)", "| gradian, defaults", "| floor (device-sized batches)",
                        "| gradian, device-sized"], rows
    gradian = next(line for line in text.splitlines() if line.startswith("| gradian, defaults")).split(" | ")
    assert gradian[1] == str(report["index"]["defaults"][0]["batches"]) and gradian[-1] == "n/a |"
