"""List the ``deepspeed`` surface that Hugging Face transformers and accelerate use (issue #13).

Scans the installed sources (or the directories given) with :mod:`ast`, without importing them:

* **import / attribute**: every ``import deepspeed...`` / ``from deepspeed... import ...`` and every
  attribute chain that starts at a name bound by such an import (``deepspeed.zero.Init``,
  ``dist.init_distributed`` after ``from deepspeed import comm as dist``), per function scope, so
  ``dist`` bound to ``torch.distributed`` elsewhere in the file is not counted;
* **gate**: calls with the literal ``"deepspeed"`` as first argument (``find_spec``,
  ``importlib.metadata.metadata``/``version``, ``compare_versions``, ``dep_version_check``), with
  whether the version :mod:`zeroshard.deepspeed.imports` reports takes each ``compare_versions``'s
  branch for a current DeepSpeed;
* **engine**: attribute reads of ``DeepSpeedEngine`` methods and properties (names taken from the
  installed DeepSpeed's ``runtime/engine.py``, parsed, not imported), in files that mention
  ``deepspeed``, on a receiver whose source text says ``engine``, ``deepspeed`` or ``model_wrapped``,
  or of a name only an engine has (``*checkpoint*``, ``*zero*``, ``*16bit*``...) on any receiver but
  ``self``. A heuristic: the engine rows are candidates to read, not a proof.

Each name is then resolved through the compatibility layer (``enable(shadow=True)`` in this
process) to give its status: ``yes`` (a real object), ``issue #10`` (a placeholder for a name that
issue #10's DeepSpeed surface adds to zeroshard), ``missing`` (a placeholder raising
``NotYetSupportedError``) or ``unresolved`` (the layer does not know the name: a gap to fix).

Usage::

    python scripts/hf_probe.py                       # installed transformers and accelerate
    python scripts/hf_probe.py --transformers /tmp/whl/tf/transformers --accelerate /tmp/whl/acc/accelerate
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import json
import re
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
DEFAULT_JSON = REPO / "docs" / "hf_surface.json"
DEFAULT_MD = REPO / "docs" / "hf_probe.md"
#: Test helpers of the libraries themselves are not a path users' code takes.
SKIP_PARTS = ("test_utils", "testing_utils.py")
GATE_FUNCS = {"find_spec", "metadata", "version", "compare_versions", "dep_version_check",
              "require_version", "_is_package_available"}
ENGINE_RECEIVER = re.compile(r"engine|deepspeed|model_wrapped", re.IGNORECASE)
#: Engine names no other object in these libraries has: counted on any receiver but ``self``.
ENGINE_DISTINCTIVE = re.compile(r"checkpoint|zero|16bit|grad_norm|accumulation_boundary")


#: What the scan cannot see, written by hand (kept in the generated file).
NOTES = [
    "## Notes (by hand)",
    "",
    "- Status says what resolves; what runs is tested in `tests/hf` (the Trainer at stages 0-3, ZeRO-3",
    "  `from_pretrained`, accelerate's loop at stages 2 and 3, export), with the versions pinned in the `hf` extra.",
    "- accelerate's multi-node DeepSpeed launch runs the `deepspeed` executable (`accelerate/utils/launch.py`);",
    "  the layer has none. Run `zeroshard launch --as-deepspeed train.py ...` (`--shadow-deepspeed` to hide an",
    "  installed DeepSpeed) instead.",
    "- transformers' `prevent_arange_dtype_change` reads `partition_parameters.zero_wrapper_for_fp_tensor_constructor`",
    "  and restores it around `zero.Init`; zeroshard's `zero.Init` wraps no tensor constructor, so the",
    "  placeholders are read and written back, never called.",
    "- Sequence parallelism (`ulysses_sp`, `utils.groups._get_sequence_parallel_*`) and `tp_model_init` are",
    "  used only when the config asks for them (`sp_size > 1`, `autotp_size > 1`); zeroshard has neither.",
]


@dataclass(frozen=True)
class Use:
    """One use of the DeepSpeed surface at ``path:line``."""

    name: str
    kind: str  # import | attribute | gate | engine
    path: str
    line: int
    detail: str = ""


class _ScopeVisitor(ast.NodeVisitor):
    """Collects imports of ``deepspeed`` and the attribute chains on the names they bind."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.scopes: list[dict[str, str | None]] = [{}]
        self.consts: list[dict[str, str]] = [{}]
        self.uses: list[Use] = []

    def _lookup(self, name: str) -> str | None:
        for scope in reversed(self.scopes):
            if name in scope:
                return scope[name]
        return None

    def _add(self, name: str, kind: str, node: ast.AST, detail: str = "") -> None:
        self.uses.append(Use(name, kind, self.path, getattr(node, "lineno", 0), detail))

    def _scoped(self, node: ast.AST) -> None:
        self.scopes.append({})
        self.consts.append({})
        self.generic_visit(node)
        self.scopes.pop()
        self.consts.pop()

    def visit_Assign(self, node: ast.Assign) -> None:
        # ``ver_min_required = "0.18.2"`` then ``compare_versions("deepspeed", ">=", ver_min_required)``
        if isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    self.consts[-1][target.id] = node.value.value
        self.generic_visit(node)

    def _const(self, node: ast.expr) -> str | None:
        if isinstance(node, ast.Constant):
            return str(node.value)
        if isinstance(node, ast.Name):
            return next((c[node.id] for c in reversed(self.consts) if node.id in c), None)
        return None

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = visit_ClassDef = _scoped

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            top = alias.name.split(".")[0]
            bound = alias.asname or top
            if top == "deepspeed":
                self.scopes[-1][bound] = alias.name if alias.asname else "deepspeed"
                self._add(alias.name, "import", node)
            else:
                self.scopes[-1][bound] = None  # shadows an outer ``deepspeed`` binding

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        module = node.module or ""
        is_ds = node.level == 0 and module.split(".")[0] == "deepspeed"
        for alias in node.names:
            bound = alias.asname or alias.name
            if is_ds:
                self.scopes[-1][bound] = f"{module}.{alias.name}"
                self._add(f"{module}.{alias.name}", "import", node)
            else:
                self.scopes[-1][bound] = None

    def visit_Name(self, node: ast.Name) -> None:
        if isinstance(node.ctx, ast.Store) and node.id in self.scopes[-1]:
            self.scopes[-1][node.id] = None

    def visit_Attribute(self, node: ast.Attribute) -> None:
        chain: list[str] = []
        base: ast.AST = node
        while isinstance(base, ast.Attribute):
            chain.append(base.attr)
            base = base.value
        if isinstance(base, ast.Name) and (root := self._lookup(base.id)) is not None:
            self._add(".".join([root, *reversed(chain)]), "attribute", node)
            return  # the inner attributes are prefixes of this chain
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        fname = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
        first = node.args[0] if node.args else None
        if (fname in GATE_FUNCS and isinstance(first, ast.Constant) and isinstance(first.value, str)
                and re.match(r"^deepspeed\b", first.value)):
            consts = [self._const(a) for a in node.args[1:]]
            self._add(f"{fname}({first.value!r})", "gate", node, " ".join(c or "?" for c in consts))
        self.generic_visit(node)


def _engine_names(deepspeed_root: Path | None) -> set[str]:
    """Public methods and properties of DeepSpeed's ``DeepSpeedEngine``, read from its source."""
    if deepspeed_root is None:
        return set()
    tree = ast.parse((deepspeed_root / "runtime" / "engine.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == "DeepSpeedEngine":
            return {f.name for f in node.body if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef)
                    and not (f.name.startswith("__") and f.name.endswith("__"))}
    return set()


def _engine_uses(tree: ast.AST, path: str, names: set[str]) -> list[Use]:
    """Reads of engine attributes: on a receiver that names an engine, or of a distinctive name."""
    import torch

    uses = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in names:
            receiver = ast.unparse(node.value)
            if not (ENGINE_RECEIVER.search(receiver)
                    or (ENGINE_DISTINCTIVE.search(node.attr) and receiver != "self"
                        and not hasattr(torch.nn.Module, node.attr))):
                continue
            if receiver.split(".")[0] == "deepspeed":
                continue  # module attributes, counted above
            uses.append(Use(f"DeepSpeedEngine.{node.attr}", "engine", path, node.lineno, receiver))
    return uses


def scan(root: Path, label: str, engine_names: set[str]) -> list[Use]:
    """All uses in the package directory ``root`` (paths reported as ``label/relative``)."""
    uses: list[Use] = []
    for file in sorted(root.rglob("*.py")):
        rel = file.relative_to(root).as_posix()
        if any(part in rel for part in SKIP_PARTS):
            continue
        text = file.read_text(encoding="utf-8")
        if "deepspeed" not in text:
            continue
        tree = ast.parse(text, filename=str(file))
        visitor = _ScopeVisitor(f"{label}/{rel}")
        visitor.visit(tree)
        uses += visitor.uses + _engine_uses(tree, f"{label}/{rel}", engine_names)
    return uses


def _package_dir(name: str, given: str | None) -> Path:
    if given:
        return Path(given)
    spec = importlib.util.find_spec(name)
    if spec is None or spec.origin is None:
        sys.exit(f"hf_probe: {name} is not installed; pass --{name} DIR (its package directory)")
    return Path(spec.origin).parent


def status_of(use: Use, version: str) -> str:
    """``yes`` / ``issue #10`` / ``missing`` / ``unresolved`` for one use (the layer is enabled)."""
    from zeroshard.deepspeed import surface
    from zeroshard.deepspeed.engine import ZeroEngine
    from zeroshard.errors import NotYetSupportedError

    if use.kind == "gate":
        return _gate_status(use, version)
    if use.kind == "engine":  # issue #10 covers the whole engine API
        attr = use.name.split(".", 1)[1]
        # nn.Module's own ``compile``/``zero_grad`` do not count: DeepSpeed's take other arguments
        ours = any(attr in vars(cls) for cls in ZeroEngine.__mro__ if cls.__module__.startswith("zeroshard"))
        return "yes" if ours else "issue #10"
    prefixes = {use.name.rsplit(".", n)[0] for n in range(use.name.count("."))}
    try:
        obj = surface.resolve(use.name)
    except NotYetSupportedError:  # an attribute of a placeholder
        return "issue #10" if prefixes & surface.ISSUE_10 else "missing"
    except (AttributeError, ImportError) as exc:
        return f"unresolved ({type(exc).__name__})"
    if surface.is_placeholder(obj):
        return "issue #10" if prefixes & surface.ISSUE_10 else "missing"
    return "yes"


def _gate_status(use: Use, version: str) -> str:
    from packaging.version import Version

    ops = {"<": "__lt__", "<=": "__le__", ">": "__gt__", ">=": "__ge__"}
    parts = use.detail.split()
    if not (use.name.startswith("compare_versions") and len(parts) == 2 and parts[0] in ops and parts[1] != "?"):
        return "yes"
    result = getattr(Version(version), ops[parts[0]])(Version(parts[1]))
    # ``>=``/``>`` gates a minimum: it must hold; ``<``/``<=`` picks a branch for old DeepSpeeds: it must not.
    newer = result if parts[0].startswith(">") else not result
    return f"{'ok' if newer else 'old-DeepSpeed branch'} ({result})"


def render_md(rows: list[dict[str, Any]], version: str, sources: dict[str, str]) -> str:
    """The table of docs/hf_probe.md: one line per name, its uses as ``file:line``."""
    counts: dict[str, int] = defaultdict(int)
    for row in rows:
        counts[row["status"].split(" (")[0]] += 1
    lines = [
        "# The `deepspeed` surface of Hugging Face transformers and accelerate",
        "",
        f"Generated by `python scripts/hf_probe.py` from {', '.join(f'{k} {v}' for k, v in sources.items())}"
        " (test helpers skipped). Each name is resolved through `zeroshard.deepspeed.imports`",
        f"(reported version `{version}`); status: **yes** (zeroshard provides it), **issue #10** (a",
        "name issue #10's DeepSpeed surface adds; until then a placeholder raising `NotYetSupportedError`),",
        "**missing** (a placeholder raising `NotYetSupportedError` when used; importing it works),",
        "**unresolved** (the layer does not know it: a gap). Engine rows are found by a heuristic (see",
        "the script's docstring). Gates are the availability and version checks; a version gate is **ok**",
        "when the reported version takes the branch meant for a current DeepSpeed (the comparison's value",
        "in brackets).",
        "",
        "Counts: " + ", ".join(f"{k}: {v}" for k, v in sorted(counts.items())),
        "",
        "| kind | name | status | used at |",
        "| --- | --- | --- | --- |",
    ]
    for row in rows:
        where = ", ".join(row["uses"][:6]) + (f" (+{len(row['uses']) - 6})" if len(row["uses"]) > 6 else "")
        lines.append(f"| {row['kind']} | `{row['name']}` | {row['status']} | {where} |")
    return "\n".join([*lines, "", *NOTES]) + "\n"


def collect(tf_dir: Path, acc_dir: Path, deepspeed_dir: Path | None, version: str) -> list[dict[str, Any]]:
    """One row per (kind, name), with every place it is used and its status."""
    engine = _engine_names(deepspeed_dir)
    uses = scan(tf_dir, "transformers", engine) + scan(acc_dir, "accelerate", engine)
    grouped: dict[tuple[str, str, str], list[str]] = defaultdict(list)
    for use in uses:
        grouped[(use.kind, use.name, use.detail if use.kind == "gate" else "")].append(f"{use.path}:{use.line}")
    rows = []
    for (kind, name, detail), where in sorted(grouped.items()):
        use = Use(name, kind, "", 0, detail)
        shown = f"{name} {detail}".strip() if kind == "gate" else name
        rows.append({"kind": kind, "name": shown, "status": status_of(use, version), "uses": where})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--transformers", help="transformers package directory (default: installed)")
    parser.add_argument("--accelerate", help="accelerate package directory (default: installed)")
    parser.add_argument("--json", default=str(DEFAULT_JSON), help="where to write the JSON list")
    parser.add_argument("--md", default=str(DEFAULT_MD), help="where to write the markdown table")
    args = parser.parse_args(argv)
    tf_dir, acc_dir = _package_dir("transformers", args.transformers), _package_dir("accelerate", args.accelerate)
    ds_spec = importlib.util.find_spec("deepspeed")  # before the layer is on: the real DeepSpeed
    ds_dir = Path(ds_spec.origin).parent if ds_spec and ds_spec.origin else None
    sources = {"transformers": _dist_version(tf_dir), "accelerate": _dist_version(acc_dir)}

    from zeroshard.deepspeed import imports as compat

    compat.enable(shadow=True)
    try:
        rows = collect(tf_dir, acc_dir, ds_dir, compat.DISTRIBUTION_VERSION)
    finally:
        compat.disable()
    Path(args.json).write_text(json.dumps({"sources": sources, "version": compat.DISTRIBUTION_VERSION,
                                           "uses": rows}, indent=1) + "\n")
    Path(args.md).parent.mkdir(parents=True, exist_ok=True)
    Path(args.md).write_text(render_md(rows, compat.DISTRIBUTION_VERSION, sources))
    bad = [r["name"] for r in rows if r["status"].startswith(("unresolved", "old-DeepSpeed"))]
    print(f"{len(rows)} names; written {args.json} and {args.md}")
    if bad:
        print("gaps: " + ", ".join(bad))
    return 1 if bad else 0


def _dist_version(package_dir: Path) -> str:
    """The version from the ``*.dist-info`` next to a package directory, else ``?``."""
    for info in package_dir.parent.glob(f"{package_dir.name}-*.dist-info"):
        return info.name[len(package_dir.name) + 1:-len(".dist-info")]
    return "?"


if __name__ == "__main__":
    sys.exit(main())
