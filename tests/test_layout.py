"""The package layout (issue 15): the mitmproxy process imports no Django and no Django app, and
the top-level packages import each other only downwards: wire <- proxy; wire <- governance <-
trainer <- evolution (config may import anything). Read from the source with `ast`, module-level
and function-level imports alike."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("wire", "proxy", "governance", "trainer", "evolution", "config")
# Which packages each may import (besides itself).
ALLOWED = {
    "wire": set(),
    "proxy": {"wire"},
    "governance": {"wire"},
    "trainer": {"wire", "governance"},
    "evolution": {"wire", "governance", "trainer"},
    "config": set(PACKAGES),
}


def import_edges() -> dict[tuple[str, str], list[str]]:
    edges: dict[tuple[str, str], list[str]] = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")) if (ROOT / pkg).is_dir() else []:
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                else:
                    continue
                for name in names:
                    top = name.split(".")[0]
                    if top in PACKAGES and top != pkg:
                        where = f"{path.relative_to(ROOT)}:{node.lineno} {name}"
                        edges.setdefault((pkg, top), []).append(where)
    return edges


def test_package_imports_follow_the_layers() -> None:
    bad = {edge: where for edge, where in import_edges().items()
           if edge[1] not in ALLOWED[edge[0]]}
    assert not bad, bad


def test_no_cycle_between_packages() -> None:
    graph: dict[str, set[str]] = {}
    for src, dst in import_edges():
        graph.setdefault(src, set()).add(dst)
    state: dict[str, int] = {}

    def visit(node: str, trail: list[str]) -> None:
        state[node] = 1
        for nxt in graph.get(node, ()):
            assert state.get(nxt) != 1, f"import cycle: {' -> '.join([*trail, node, nxt])}"
            if nxt not in state:
                visit(nxt, [*trail, node])
        state[node] = 2

    for node in list(graph):
        if node not in state:
            visit(node, [])


def test_the_proxy_process_imports_no_django_app() -> None:
    code = ("import sys, time, json; t = time.perf_counter(); import proxy.addon; "
            "print(json.dumps({'seconds': time.perf_counter() - t, "
            "'modules': sorted(sys.modules)}))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, timeout=120, check=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    modules = result["modules"]
    forbidden = [m for m in modules
                 if m.split(".")[0] in ("django", "governance", "trainer", "evolution",
                                        "config", "rest_framework", "celery")]
    assert not forbidden, forbidden
    ours = [m for m in modules if m.split(".")[0] in ("proxy", "wire")]
    print(f"\nproxy.addon import: {len(modules)} modules ({len(ours)} of ours: "
          f"{', '.join(ours)}) in {result['seconds'] * 1000:.0f} ms")
