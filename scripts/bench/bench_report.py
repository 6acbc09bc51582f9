"""report.html's size and open time in headless Chromium, and its screenshots for the docs.

    python scripts/bench/bench_report.py outputs/demo/report.html outputs/demo-real/report.html [--repeats 5]
        [--images docs/images]

For each page: its size, the share that is plotly.js (gzip + base64), and the time from navigation
to every chart drawn (`window.circuitReport.readyMs`), min and median over fresh browser contexts,
with the split (HTML parsed, plotly.js unpacked and run, charts drawn). With --images, a
screenshot of the top of the page and of the circuit graph per page (named after the run dir).
Needs Chromium (scripts/tools/ensure_chromium.sh) and playwright (`pip install -e '.[browser]'`).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.helpers.report_browser import chromium_path, open_report  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("reports", nargs="+", type=Path)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--images", type=Path, default=None, help="write screenshots here")
    args = parser.parse_args()
    from playwright.sync_api import sync_playwright

    table = Table(title="report.html in headless Chromium (fresh context per open)")
    for col in ("report", "MiB", "plotly.js share", "open s (min / median)", "parsed / plotly / drawn s", "errors"):
        table.add_column(col)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium_path(), args=["--no-sandbox"])
        for path in args.reports:
            html = path.read_text()
            start = html.index('<script id="plotly-gz"')
            plotly_bytes = html.index("</script>", start) - start
            times, splits, errors = [], [], 0
            for i in range(args.repeats):
                opened = open_report(browser, path)
                t = opened.state()["timings"]
                times.append(opened.open_s)
                splits.append((t["start"] / 1000, (t["plotly"] - t["start"]) / 1000, (t["curves"] - t["plotly"]) / 1000))
                errors += len(opened.errors())
                if i == 0 and args.images is not None:
                    name = path.parent.name
                    args.images.mkdir(parents=True, exist_ok=True)
                    opened.page.screenshot(path=str(args.images / f"report_{name}.png"))
                    if opened.page.locator("#circuit-graph").count():
                        opened.page.evaluate("document.querySelector('nav').style.position = 'static'")
                        opened.page.locator("#circuit").screenshot(path=str(args.images / f"report_{name}_circuit.png"))
                opened.page.context.close()
            mid = [statistics.median(s[k] for s in splits) for k in range(3)]
            table.add_row(str(path), f"{path.stat().st_size / 2**20:.2f}",
                          f"{plotly_bytes / path.stat().st_size:.0%}",
                          f"{min(times):.2f} / {statistics.median(times):.2f}",
                          " / ".join(f"{x:.2f}" for x in mid), str(errors))
        browser.close()
    Console().print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
