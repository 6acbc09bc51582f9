"""Open report.html in headless Chromium (the Debian package, driven by playwright) as a person
would: offline, from disk. Used by tests/app/test_report_browser.py and scripts/report_screenshots.py."""

from __future__ import annotations

import io
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome")
INSTALL = "`make test-slow` installs it (scripts/tools/ensure_chromium.sh: apt-get install chromium)"

# The position on the page of a node of the circuit graph (plotly's own axis maps).
_NODE_XY = """(name) => {
  const el = document.getElementById('circuit-graph');
  const trace = el.data.find((t) => t.customdata);
  const i = trace.customdata.indexOf(name);
  if (i < 0) return null;
  const fl = el._fullLayout, box = el.getBoundingClientRect();
  return [box.left + fl.xaxis._offset + fl.xaxis.l2p(trace.x[i]), box.top + fl.yaxis._offset + fl.yaxis.l2p(trace.y[i])];
}"""


def chromium_path() -> str | None:
    """The system Chromium, or None."""
    return next((p for p in map(shutil.which, CHROMIUM_NAMES) if p), None)


@dataclass
class OpenedReport:
    page: Any
    console: list[tuple[str, str]] = field(default_factory=list)
    open_s: float = 0.0  # from navigation to the charts drawn (window.circuitReport.readyMs)

    def state(self) -> dict[str, Any]:
        return self.page.evaluate("({ready: window.circuitReport.ready, error: window.circuitReport.error,"
                                  " drawnEdges: window.circuitReport.drawnEdges,"
                                  " drawnNodes: window.circuitReport.drawnNodes,"
                                  " readyMs: window.circuitReport.readyMs, timings: window.circuitReport.timings})")

    def errors(self) -> list[str]:
        return [text for kind, text in self.console if kind in ("error", "pageerror")]

    def node_xy(self, name: str) -> tuple[float, float] | None:
        self.page.locator("#circuit-graph").scroll_into_view_if_needed()
        xy = self.page.evaluate(_NODE_XY, name)
        return None if xy is None else (xy[0], xy[1])

    def hover_text(self, name: str) -> str:
        """Move the mouse onto node `name` and return the hover label's text."""
        label = self.page.locator("#circuit-graph .hoverlayer .hovertext")
        for attempt in range(3):  # plotly draws the label on its next frame; a slow frame is not a failure
            x, y = self.node_xy(name)
            self.page.mouse.move(x - 40, y - 40)
            self.page.mouse.move(x, y, steps=4)
            try:
                label.first.wait_for(timeout=3000 * (attempt + 1))
                break
            except Exception:  # noqa: BLE001 - playwright's TimeoutError; tried again, then the wait below raises
                continue
        label.first.wait_for(timeout=3000)
        return " ".join(t or "" for t in label.all_text_contents())


def open_report(browser: Any, path: Path, width: int = 1400, height: int = 1000) -> OpenedReport:
    """Open `path` from disk in a fresh offline context (every non-file request aborted and recorded)."""
    context = browser.new_context(viewport={"width": width, "height": height}, offline=True)
    page = context.new_page()
    opened = OpenedReport(page)
    page.on("console", lambda m: opened.console.append((m.type, m.text)))
    page.on("pageerror", lambda e: opened.console.append(("pageerror", str(e))))

    def refuse(route) -> None:
        opened.console.append(("error", f"network request: {route.request.url}"))
        route.abort()

    page.route(lambda url: not url.startswith(("file:", "data:", "blob:")), refuse)
    t0 = time.perf_counter()
    page.goto(Path(path).resolve().as_uri())
    page.wait_for_function("window.circuitReport && (window.circuitReport.ready || window.circuitReport.error)",
                           timeout=60_000)
    ready_ms = page.evaluate("window.circuitReport.readyMs")
    opened.open_s = ready_ms / 1000 if ready_ms else time.perf_counter() - t0
    return opened


def distinct_colours(png: bytes) -> int:
    """How many colours a screenshot has (a blank page has one or two)."""
    from PIL import Image

    image = Image.open(io.BytesIO(png)).convert("RGB")
    colours = image.getcolors(maxcolors=1 << 20)
    return len(colours) if colours is not None else 1 << 20
