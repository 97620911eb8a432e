"""Code figures of the repository: what a reader of the source meets, counted the same way on any
checkout (stdlib only, from the syntax tree; nothing is imported or run).

Prints, for the packages ``canzona``, ``validation``, ``profiling``, ``tests``, ``examples`` and
``notebooks`` (those present):

- lines per package (physical lines of its ``.py`` files) and per top-level subpackage of ``canzona``;
- the ten longest functions and methods (``file:qualified.name:lines``, decorators excluded);
- how many modules are named ``fsdp.py`` and ``tp.py``;
- module-docstring lines in total and per package, and the five longest module docstrings.

Usage (the before/after figures of a refactor)::

    python profiling/code_stats.py                  # this checkout
    python profiling/code_stats.py /path/to/other   # another checkout (e.g. a git worktree of the base)
    python profiling/code_stats.py --json           # the same figures as one JSON object
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

__all__ = ["PACKAGES", "Function", "code_stats", "format_stats", "functions", "main"]

PACKAGES: tuple[str, ...] = ("canzona", "validation", "profiling", "tests", "examples", "notebooks")


@dataclass(frozen=True, slots=True)
class Function:
    """One function or method: its file (relative to the root), qualified name and length in lines."""

    path: str
    name: str
    lines: int

    def __str__(self) -> str:
        return f"{self.path}:{self.name}:{self.lines}"


def _py_files(root: Path, package: str) -> list[Path]:
    base = root / package
    return sorted(p for p in base.rglob("*.py") if "__pycache__" not in p.parts and ".ipynb_checkpoints" not in p.parts)


def functions(tree: ast.AST, path: str) -> Iterator[Function]:
    """Every function and method of ``tree`` with its qualified name (``Class.method``,
    ``outer.<locals>.inner`` as ``outer.inner``); its length runs from the ``def`` line to its
    last line."""

    def walk(node: ast.AST, prefix: str) -> Iterator[Function]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = f"{prefix}{child.name}"
                yield Function(path, name, child.end_lineno - child.lineno + 1)
                yield from walk(child, f"{name}.")
            elif isinstance(child, ast.ClassDef):
                yield from walk(child, f"{prefix}{child.name}.")
            else:
                yield from walk(child, prefix)

    yield from walk(tree, "")


def _docstring_lines(tree: ast.Module) -> int:
    doc = ast.get_docstring(tree, clean=False)
    if doc is None:
        return 0
    node = tree.body[0]
    return node.end_lineno - node.lineno + 1


def code_stats(root: Path) -> dict:
    """The figures of the checkout at ``root`` (see the module docstring), as plain data."""
    lines: dict[str, int] = {}
    subpackages: dict[str, int] = {}
    funcs: list[Function] = []
    docs: list[tuple[str, int]] = []
    doc_lines: dict[str, int] = {}
    named = {"fsdp.py": [], "tp.py": []}
    for package in PACKAGES:
        files = _py_files(root, package)
        if not files:
            continue
        lines[package] = 0
        for f in files:
            rel = f.relative_to(root).as_posix()
            text = f.read_text(encoding="utf-8")
            n = len(text.splitlines())
            lines[package] += n
            if package == "canzona":
                parts = f.relative_to(root / package).parts
                key = f"canzona/{parts[0]}" if len(parts) > 1 else "canzona/*.py"
                subpackages[key] = subpackages.get(key, 0) + n
            if f.name in named:
                named[f.name].append(rel)
            try:
                tree = ast.parse(text, filename=rel)
            except SyntaxError:
                continue
            funcs.extend(functions(tree, rel))
            docs.append((rel, _docstring_lines(tree)))
            doc_lines[package] = doc_lines.get(package, 0) + docs[-1][1]
    funcs.sort(key=lambda fn: (-fn.lines, fn.path, fn.name))
    docs.sort(key=lambda d: (-d[1], d[0]))
    return {
        "lines": lines,
        "canzona_subpackages": dict(sorted(subpackages.items())),
        "longest_functions": [str(f) for f in funcs[:10]],
        "functions_over_60_lines": sum(f.lines > 60 for f in funcs),
        "modules_named": {k: sorted(v) for k, v in named.items()},
        "module_docstring_lines": sum(n for _, n in docs),
        "module_docstring_lines_by_package": doc_lines,
        "longest_module_docstrings": [f"{p}:{n}" for p, n in docs[:5]],
    }


def format_stats(stats: dict) -> str:
    """The figures as a short text report."""
    out = ["lines per package:"]
    out += [f"  {k:<12}{v:>7}" for k, v in stats["lines"].items()]
    out.append("canzona by subpackage:")
    out += [f"  {k:<22}{v:>7}" for k, v in stats["canzona_subpackages"].items()]
    out.append(f"ten longest functions (file:function:lines); {stats['functions_over_60_lines']} functions over 60 lines:")
    out += [f"  {f}" for f in stats["longest_functions"]]
    for name, paths in stats["modules_named"].items():
        out.append(f"modules named {name}: {len(paths)} ({', '.join(paths)})")
    by_package = ", ".join(f"{k} {v}" for k, v in stats["module_docstring_lines_by_package"].items())
    out.append(f"module-docstring lines: {stats['module_docstring_lines']} ({by_package}); longest:")
    out += [f"  {d}" for d in stats["longest_module_docstrings"]]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Code figures of a canzona checkout (lines, longest functions, module names, docstrings).")
    parser.add_argument("root", nargs="?", default=str(Path(__file__).resolve().parents[1]), help="the checkout (default: this one)")
    parser.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    args = parser.parse_args(argv)
    root = Path(args.root)
    if not (root / "canzona").is_dir():
        print(f"code_stats: {root} has no canzona/ package: not a checkout of this repository", file=sys.stderr)
        return 2
    stats = code_stats(root)
    print(json.dumps(stats, indent=2) if args.json else format_stats(stats))
    return 0


if __name__ == "__main__":
    sys.exit(main())
