"""Regenerate ``src/zeroshard/deepspeed/engine_api/deepspeed_engine_api.json`` from DeepSpeed's source.

Reads ``deepspeed/runtime/engine.py`` of the installed DeepSpeed with :mod:`ast` (nothing of
DeepSpeed is imported or run), lists every public method and property that ``DeepSpeedEngine``
defines, and records for each zeroshard's status: ``works`` (the engine has it),
``not-yet-supported`` (a row of ``zeroshard.deepspeed.engine_api.unsupported.NOT_YET_SUPPORTED``, with its
reason) or ``missing`` (neither; ``tests/unit/test_engine_api.py`` fails on it).

    python scripts/gen_deepspeed_engine_api.py            # rewrite the JSON
    python scripts/gen_deepspeed_engine_api.py --check    # exit 1 if the JSON is out of date
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

import torch

from zeroshard.deepspeed.engine import ZeroEngine
from zeroshard.deepspeed.engine_api import API_DATA, NOT_YET_SUPPORTED


def deepspeed_engine_source() -> tuple[str, str]:
    """``(version, source of deepspeed/runtime/engine.py)`` of the installed DeepSpeed."""
    spec = importlib.util.find_spec("deepspeed")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("DeepSpeed is not installed: pip install deepspeed==0.19.8")
    root = Path(spec.submodule_search_locations[0])
    version = "unknown"
    for line in (root / "git_version_info_installed.py").read_text().splitlines() if (
            root / "git_version_info_installed.py").exists() else []:
        if line.startswith("version="):
            version = line.split("=", 1)[1].strip().strip("'\"")
    return version, (root / "runtime" / "engine.py").read_text()


def _kind(node: ast.FunctionDef) -> str:
    decorators = {ast.unparse(d) for d in node.decorator_list}
    if "property" in decorators:
        return "property"
    if "staticmethod" in decorators:
        return "staticmethod"
    if "contextmanager" in decorators:
        return "contextmanager"
    return "method"


def public_api(source: str) -> list[dict[str, Any]]:
    """Public methods and properties defined in ``DeepSpeedEngine``'s class body, in source order."""
    tree = ast.parse(source)
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "DeepSpeedEngine")
    seen: dict[str, dict[str, Any]] = {}
    for node in cls.body:
        if not isinstance(node, ast.FunctionDef) or node.name.startswith("_") or node.name in seen:
            continue  # a property's setter repeats its name
        args = ast.unparse(node.args)
        seen[node.name] = {"name": node.name, "kind": _kind(node), "signature": f"({args})"}
    return list(seen.values())


def status(name: str) -> dict[str, Any]:
    """zeroshard's status for one DeepSpeed engine name."""
    if name in NOT_YET_SUPPORTED:
        return {"status": "not-yet-supported", "reason": NOT_YET_SUPPORTED[name]}
    if hasattr(ZeroEngine, name):
        return {"status": "works"}
    return {"status": "missing"}


def build() -> dict[str, Any]:
    """The whole data file."""
    version, source = deepspeed_engine_source()
    entries = []
    for item in public_api(source):
        item.update(status(item["name"]))
        item["in_nn_module"] = hasattr(torch.nn.Module, item["name"])
        entries.append(item)
    counts: dict[str, int] = {}
    for e in entries:
        counts[e["status"]] = counts.get(e["status"], 0) + 1
    return {"deepspeed_version": version, "source": "deepspeed/runtime/engine.py: class DeepSpeedEngine",
            "generator": "scripts/gen_deepspeed_engine_api.py", "counts": counts, "methods": entries}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="only check that the JSON is up to date")
    args = parser.parse_args(argv)
    text = json.dumps(build(), indent=1) + "\n"
    if args.check:
        current = API_DATA.read_text() if API_DATA.exists() else ""
        if current != text:
            print(f"{API_DATA} is out of date: run python scripts/gen_deepspeed_engine_api.py", file=sys.stderr)
            return 1
        return 0
    API_DATA.write_text(text)
    print(f"wrote {API_DATA}: {json.loads(text)['counts']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
