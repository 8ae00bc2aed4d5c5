"""Re-render the comparison's markdown report and chart from a results JSON, running nothing (after
editing the report code, say):

    python benchmarks/report.py [benchmarks/results/cpu.json] [--markdown benchmarks/RESULTS.md]

The JSON's own folder gets the chart; the markdown goes where ``run.py`` would put it.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # `python benchmarks/report.py`: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.harness.report import main

if __name__ == "__main__":
    sys.exit(main())
