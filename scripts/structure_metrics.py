"""Measures of the source tree's structure, for before/after comparisons of a redesign.

    python scripts/structure_metrics.py [ROOT]          # ROOT: a checkout (default: this one)

Prints, for ``ROOT/src/zeroshard``: packages, lines of the ZeRO core (``core/`` when it exists,
else the packages that held it before: ``stages partition offload comm precision``), places that
compare the ZeRO stage to a number, attributes of other objects assigned in the core (torch's
``.data``/``.grad``/``.requires_grad`` excluded: that is how torch is used, not wiring), ``Any`` in
the core's signatures, and import cycles (strongly connected components of the module graph,
function-level imports included, and of the graph between packages); then #49's measures of how the
parts connect (core modules imported from outside it, stage-class checks, ``Any`` at the seam's edges,
the coordinator's boolean flags, environment reads in the core, DeepSpeed classes in the engine's and
the stages' MROs).
"""

from __future__ import annotations

import ast
import re
import sys
from collections import defaultdict
from pathlib import Path

OLD_CORE = ("stages", "partition", "offload", "comm", "precision")
TORCH_ATTRS = {"data", "grad", "requires_grad"}
STAGE_COMPARE = re.compile(r"\b(stage|zero_stage|zero_optimization_stage\(\))\s*(==|!=|>=|<=|<|>)\s*[0-3]\b"
                           r"|\b[0-3]\s*(==|!=|>=|<=|<|>)\s*\w*stage\b|\bstage\s+in\s+[\(\[{]")


def _files(pkg: Path) -> list[Path]:
    return sorted(p for p in pkg.rglob("*.py") if "__pycache__" not in p.parts)


def _core_files(pkg: Path) -> list[Path]:
    if (pkg / "core").is_dir():
        return _files(pkg / "core")
    return [f for d in OLD_CORE if (pkg / d).is_dir() for f in _files(pkg / d)]


def _module_name(pkg: Path, f: Path) -> str:
    rel = f.relative_to(pkg.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def foreign_assignments(tree: ast.AST) -> list[int]:
    """Lines assigning an attribute of an object other than ``self`` (``x.a = ...``,
    ``self.x.a = ...``, ``setattr(x, ...)``), torch's tensor attributes excluded."""
    lines = []
    for node in ast.walk(tree):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        for t in targets:
            for el in (t.elts if isinstance(t, ast.Tuple) else [t]):
                if isinstance(el, ast.Attribute) and el.attr not in TORCH_ATTRS:
                    if not (isinstance(el.value, ast.Name) and el.value.id in ("self", "cls")):
                        lines.append(node.lineno)
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr"
                and node.args and not (isinstance(node.args[0], ast.Name) and node.args[0].id == "self")):
            lines.append(node.lineno)
    return lines


def any_in_signatures(tree: ast.AST) -> int:
    count = 0
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            anns = [a.annotation for a in (*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs)]
            anns += [node.returns]
            count += sum(1 for a in anns if a is not None and re.search(r"\bAny\b", ast.unparse(a)))
    return count


def _runtime_nodes(tree: ast.AST) -> list[ast.AST]:
    """Every node except those under ``if TYPE_CHECKING:`` (imports for annotations only, which
    run nothing: import-linter's ``exclude_type_checking_imports`` skips them too)."""
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return [n for n in ast.walk(tree) if id(n) not in skip]


def imports(pkg: Path, f: Path, tree: ast.AST) -> set[str]:
    me = _module_name(pkg, f)
    out: set[str] = set()
    for node in _runtime_nodes(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("zeroshard"))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = me.split(".")[: -node.level + (1 if f.name == "__init__.py" else 0) or None]
                base = ".".join([*anchor, base] if base else anchor)
            if base.startswith("zeroshard"):
                out.add(base)
                out.update(f"{base}.{a.name}" for a in node.names)
    return out


def sccs(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components of size > 1."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10_000)
    for v in list(graph):
        if v not in index:
            visit(v)
    return out


def main(root: Path) -> None:
    pkg = root / "src" / "zeroshard"
    files = _files(pkg)
    modules = {_module_name(pkg, f) for f in files}
    trees = {f: ast.parse(f.read_text()) for f in files}
    core = _core_files(pkg)
    graph: dict[str, set[str]] = defaultdict(set)
    for f, tree in trees.items():
        me = _module_name(pkg, f)
        for target in imports(pkg, f, tree):
            if target in modules and target != me and not me.startswith(target + "."):
                graph[me].add(target)

    packages = {_module_name(pkg, f) for f in files if f.name == "__init__.py"}

    def package_of(m: str) -> str:
        """The sub-package (folder) a module belongs to, at most two levels below ``zeroshard``
        (``zeroshard.core.zero3``); a module file directly in ``zeroshard`` or ``zeroshard.core``
        is a node of its own."""
        parts = m.split(".")
        for depth in (3, 2):
            head = ".".join(parts[:depth])
            if len(parts) >= depth and head in packages and head not in ("zeroshard", "zeroshard.core"):
                return head
        return m

    pgraph: dict[str, set[str]] = defaultdict(set)
    for a, bs in graph.items():
        for b in bs:
            if package_of(a) != package_of(b):
                pgraph[package_of(a)].add(package_of(b))
    stage_hits = [(f, i + 1) for f in files for i, line in enumerate(f.read_text().splitlines())
                  if STAGE_COMPARE.search(line.split("#")[0])]
    core_assign = {f: foreign_assignments(trees[f]) for f in core}
    all_assign = sum(len(foreign_assignments(t)) for t in trees.values())
    readme = root / "README.md"
    print(f"packages (folders with __init__.py): {sum(1 for p in pkg.rglob('__init__.py'))}")
    lines = sum(len(f.read_text().splitlines()) for f in files)
    print(f"python files / lines in src/zeroshard: {len(files)} / {lines}")
    print(f"core files / lines: {len(core)} / {sum(len(f.read_text().splitlines()) for f in core)}")
    print(f"places comparing the ZeRO stage: {len(stage_hits)} in {len({f for f, _ in stage_hits})} files")
    # where a stage is acted on at run time: not the plan (where the decision is made), the estimator's
    # per-stage formulas, config validation or the per-stage layouts of checkpoint formats
    formulas = ("estimate", "config", "checkpoint")
    acting = [(f, n) for f, n in stage_hits
              if f.relative_to(pkg).parts[0] not in formulas and f.relative_to(pkg) != Path("core/plan.py")]
    print(f"  of which at run time (outside the plan, estimate/, config/, checkpoint/): {len(acting)} in "
          f"{len({f for f, _ in acting})} files")
    print(f"foreign attribute assignments: core {sum(map(len, core_assign.values()))}, all of src {all_assign}")
    for f, lines in core_assign.items():
        if lines:
            print(f"    {f.relative_to(pkg)}: {lines}")
    print(f"Any in the core's signatures: {sum(any_in_signatures(trees[f]) for f in core)}")
    mod_cycles = sccs(graph)
    pkg_cycles = sccs(pgraph)
    print(f"import cycles: {len(mod_cycles)} between modules, {len(pkg_cycles)} between packages")
    for c in mod_cycles + pkg_cycles:
        print("    " + " <-> ".join(m.removeprefix("zeroshard.") for m in c))
    if readme.exists():
        print(f"README lines: {len(readme.read_text().splitlines())}")
    connection_metrics(pkg, files, trees, core, graph)


ZEROSHARD_ENV = re.compile(r"""(environ\b|getenv\()[^\n]*(["']ZEROSHARD_|\b[A-Z_]+_ENV\b)""")
STAGE_CLASS_CHECK = re.compile(r"isinstance\([^)]*\b(Stage3Optimizer|ZeroOptimizer)\b|\bcoordinator is (not )?None\b")


def bool_attributes_of(tree: ast.AST, cls: str) -> list[str]:
    """The attributes a class's methods set to ``True``/``False`` on ``self``: its boolean phase flags."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == cls:
            for sub in ast.walk(node):
                if isinstance(sub, (ast.Assign, ast.AnnAssign)) and isinstance(sub.value, ast.Constant) \
                        and isinstance(sub.value.value, bool):
                    for t in (sub.targets if isinstance(sub, ast.Assign) else [sub.target]):
                        if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                            names.add(t.attr)
    return sorted(names)


def deepspeed_in_mros() -> dict[str, list[str]]:
    """For the engine class ``initialize`` returns and each stage class it can build: the classes of
    ``zeroshard.deepspeed`` in its MRO (imports zeroshard; the measure of #49's "DeepSpeed by composition")."""
    out: dict[str, list[str]] = {}
    try:
        import importlib

        import zeroshard.core.zero_optimizer as zo
        engine = importlib.import_module("zeroshard.deepspeed.engine").ZeroEngine
        optimizer_mod = importlib.import_module("zeroshard.deepspeed.optimizer")
    except Exception as exc:  # an old tree: nothing to import by these names
        return {"(not measured)": [repr(exc)]}
    classes = [engine, zo.ZeroOptimizer]
    classes += [c for c in vars(optimizer_mod).values()
                if isinstance(c, type) and issubclass(c, zo.ZeroOptimizer) and c not in classes]
    for c in classes:
        out[f"{c.__module__}.{c.__qualname__}"] = [
            b.__qualname__ for b in c.__mro__ if b.__module__.startswith("zeroshard.deepspeed")]
    return out


def connection_metrics(pkg: Path, files: list[Path], trees: dict[Path, ast.AST], core: list[Path],
                       graph: dict[str, set[str]]) -> None:
    """#49's measures of how the parts connect."""
    core_modules = {_module_name(pkg, f) for f in core}
    imported_from_outside = {t for m, ts in graph.items() if m not in core_modules for t in ts if t in core_modules}
    print(f"core modules imported from outside the core: {len(imported_from_outside)} of {len(core_modules)}")
    checks = [(f, i + 1) for f in files for i, line in enumerate(f.read_text().splitlines())
              if STAGE_CLASS_CHECK.search(line.split("#")[0])]
    print(f"isinstance of a stage class / `coordinator is None`: {len(checks)} in {len({f for f, _ in checks})} files")
    edges = [pkg / "checkpoint", pkg / "engine.py", pkg / "core" / "seam.py"]
    edge_files = [f for f in files if any(f == e or e in f.parents for e in edges)]
    print(f"Any in the signatures of checkpoint/, engine.py and core/seam.py: "
          f"{sum(any_in_signatures(trees[f]) for f in edge_files)}")
    coordinator = pkg / "core" / "zero3" / "coordinator.py"
    if coordinator.exists():
        flags = bool_attributes_of(trees[coordinator], "ParamCoordinator")
        print(f"boolean attributes of ParamCoordinator: {len(flags)} ({', '.join(flags)})")
    env_reads = [(f, i + 1) for f in core for i, line in enumerate(f.read_text().splitlines())
                 if ZEROSHARD_ENV.search(line)]
    print(f"ZEROSHARD_* environment reads inside the core: {len(env_reads)} "
          f"({', '.join(f'{f.relative_to(pkg)}:{n}' for f, n in env_reads)})")
    for cls, bases in deepspeed_in_mros().items():
        print(f"DeepSpeed classes in the MRO of {cls}: {len(bases)} {bases}")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parents[1])
