"""`python -m harness.layout [CHECKOUT]`: the shape of a checkout, for comparing two of them side by side.

Prints the lines of each package and subpackage (Python, and other shipped sources such as C, .pxd and templates),
the largest functions and classes, and the import cycles inside each package (modules that import each other
through any chain: a change to one reloads and may break all of them). Reads the files only: nothing is imported,
so it reads an old checkout as well as this one (`git worktree add /tmp/old REV`).
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

PACKAGES = ("protocol", "modelserver", "epp", "harness")
OTHER_SOURCES = (".c", ".pxd", ".tmpl", ".j2")


@dataclass(frozen=True)
class Definition:
    kind: str  # "function" or "class"
    name: str  # module:qualified.name
    lines: int


def module_name(root: Path, path: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def python_files(root: Path) -> list[Path]:
    return sorted(p for package in PACKAGES if (root / package).is_dir() for p in (root / package).rglob("*.py"))


def line_counts(root: Path) -> tuple[Counter, Counter]:
    """Lines of Python and of other shipped sources per package and per subpackage (two levels)."""
    python, other = Counter(), Counter()
    for package in PACKAGES:
        for path in (root / package).rglob("*") if (root / package).is_dir() else ():
            if "__pycache__" in path.parts or not path.is_file():
                continue
            counter = python if path.suffix == ".py" else other if path.suffix in OTHER_SOURCES else None
            if counter is None:
                continue
            lines = len(path.read_text(errors="replace").splitlines())
            parts = path.relative_to(root).parts
            counter[parts[0]] += lines
            if len(parts) > 2:
                counter[f"{parts[0]}/{parts[1]}"] += lines
    return python, other


def definitions(root: Path) -> list[Definition]:
    found: list[Definition] = []
    for path in python_files(root):
        _collect(ast.parse(path.read_text()), f"{module_name(root, path)}:", found)
    return found


def _collect(node: ast.AST, prefix: str, found: list[Definition]) -> None:
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            kind = "class" if isinstance(child, ast.ClassDef) else "function"
            found.append(Definition(kind, prefix + child.name, child.end_lineno - child.lineno + 1))
            _collect(child, f"{prefix}{child.name}.", found)


def imports(root: Path) -> dict[str, set[str]]:
    """Each module's imports of modules of the same checkout (a `from package import name` of a submodule counts as
    importing that submodule)."""
    paths = python_files(root)
    modules = {module_name(root, p) for p in paths}
    graph: dict[str, set[str]] = {}
    for path in paths:
        module = module_name(root, path)
        is_package = path.name == "__init__.py"
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = module.split(".")[: len(module.split(".")) - node.level + (1 if is_package else 0)]
                    base = ".".join([*anchor, *([base] if base else [])])
                targets.add(base)
                targets.update(f"{base}.{alias.name}" for alias in node.names)
        graph[module] = {t for t in targets if t in modules and t != module}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, successors = work[-1]
            for successor in successors:
                if successor not in index:
                    index[successor] = low[successor] = len(index)
                    stack.append(successor)
                    on_stack.add(successor)
                    work.append((successor, iter(sorted(graph[successor]))))
                    break
                if successor in on_stack:
                    low[node] = min(low[node], index[successor])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        components.append(sorted(component))
    return sorted(components, key=len, reverse=True)


def report(root: Path, top: int) -> str:
    python, other = line_counts(root)
    lines = [f"# {root}", "", "lines (Python; other sources)"]
    for name in sorted(python.keys() | other.keys()):
        extra = f"; {other[name]}" if other[name] else ""
        lines.append(f"  {name:<34} {python[name]:>6}{extra}")
    found = definitions(root)
    for kind, plural in (("function", "functions"), ("class", "classes")):
        lines += ["", f"largest {plural}"]
        largest = sorted((d for d in found if d.kind == kind), key=lambda d: d.lines, reverse=True)[:top]
        lines += [f"  {d.lines:>5}  {d.name}" for d in largest]
    components = cycles(imports(root))
    lines += ["", f"import cycles: {len(components)}"]
    lines += [f"  {len(c)} modules: {', '.join(c)}" for c in components]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m harness.layout", description=__doc__.split("\n\n")[0])
    parser.add_argument("checkout", nargs="?", default=".", type=Path, help="the checkout's root (default: .)")
    parser.add_argument("--top", type=int, default=10, help="how many of the largest functions and classes")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if not any((args.checkout / package).is_dir() for package in PACKAGES):
        raise SystemExit(f"harness.layout: {args.checkout} holds none of {', '.join(PACKAGES)}")
    print(report(args.checkout, args.top))


if __name__ == "__main__":
    main()
