"""Write one run's results: JSON, the markdown report and the PNG chart.

:func:`main` re-renders the markdown and the chart from a results JSON without running anything
(``python benchmarks/report.py``, the entry point beside ``run.py``).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from benchmarks.harness.derive import derive
from benchmarks.harness.tables import markdown, rel_path

REPO = Path(__file__).resolve().parents[2]


def kept_notes(path: Path, heading: str) -> str:
    """The hand-written analysis of an earlier results file at ``path`` (from its ``heading`` line
    on, e.g. ``"\n## Notes"``), kept under the new tables with the date of the run it was written for."""
    if not path.exists():
        return ""
    old = path.read_text()
    at = old.find(heading)
    if at < 0:
        return ""
    date = next((line.split(";")[0] for line in old.splitlines() if line.startswith("- Date:")), "")
    return (f"\n_The notes below were written for an earlier run ({date.removeprefix('- Date: ')}); "
            "check them against the figures above._\n" + old[at:])


def default_markdown(device: str, out: Path) -> Path:
    """``benchmarks/RESULTS.md`` for CPU runs, ``<out>/RESULTS-<device>.md`` otherwise."""
    return REPO / "benchmarks" / "RESULTS.md" if device == "cpu" else out / f"RESULTS-{device}.md"


def write_reports(results: list[dict[str, Any]], meta: dict[str, Any], out: Path,
                  markdown_path: Path | None = None) -> list[Path]:
    """Write ``<out>/<device>.json``, the markdown report and the chart; return the paths written."""
    from benchmarks.harness.chart import draw

    device = meta["device"]
    rows = derive(results)
    out.mkdir(parents=True, exist_ok=True)
    js = out / f"{device}.json"
    js.write_text(json.dumps({"meta": meta, "results": rows}, indent=1, default=str))
    md_path = markdown_path or default_markdown(device, out)
    chart = out / ("chart.png" if device == "cpu" else f"chart-{device}.png")
    machine = f"{meta['cpu']}, {meta['cpu_cores']} cores" if device == "cpu" else ", ".join(meta["gpus"])
    chart_note = draw(rows, chart, machine)
    md_path.write_text(markdown(rows, meta, rel_path(chart, md_path.parent), chart_note))
    return [js, md_path] + ([chart] if chart_note is None else [])


def main(argv: list[str] | None = None) -> int:
    """Re-render the markdown and chart of an earlier run from its JSON."""
    p = argparse.ArgumentParser(description="Re-render RESULTS.md and the chart from a results JSON.")
    p.add_argument("json", nargs="?", type=Path, default=REPO / "benchmarks" / "results" / "cpu.json")
    p.add_argument("--markdown", type=Path, help="where to write the markdown (default as run.py)")
    args = p.parse_args(argv)
    data = json.loads(args.json.read_text())
    for path in write_reports(data["results"], data["meta"], args.json.parent, args.markdown):
        print(f"wrote {path}")
    return 0
