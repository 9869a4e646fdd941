"""The package's modules import each other without a circle (a circle makes import order matter
and hides what depends on what). Read from the source, so lazy imports inside functions count."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("vllm_router_ext", "csrc_triton")


def _modules() -> dict[str, Path]:
    mods = {}
    for pkg in PACKAGES:
        for f in (ROOT / pkg).rglob("*.py"):
            name = ".".join(f.relative_to(ROOT).with_suffix("").parts)
            mods[name.removesuffix(".__init__")] = f
    return mods


def _imports(mods: dict[str, Path]) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {name: set() for name in mods}
    for name, path in mods.items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                continue
            graph[name] |= {t for t in targets if t in mods and t != name}
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_no_import_circle_in_the_package():
    mods = _modules()
    assert "csrc_triton.choice" in mods and "csrc_triton.launches" in mods
    cycle = _cycle(_imports(mods))
    assert cycle is None, " -> ".join(cycle)


def test_the_cycle_finder_finds_a_circle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_the_kernel_library_stands_alone():
    """``csrc_triton`` (problem, choice, tables, kernels, dispatch) imports nothing of the plugin:
    it runs without vLLM, and adding a kernel or a GPU touches nothing in ``vllm_router_ext``."""
    graph = _imports(_modules())
    upward = {
        (name, target)
        for name, targets in graph.items()
        if name.startswith("csrc_triton")
        for target in targets
        if target.startswith("vllm_router_ext")
    }
    assert not upward, sorted(upward)
    assert {"csrc_triton.problem", "csrc_triton.choice", "csrc_triton.dispatch"} <= graph.keys()


def test_the_kernel_library_imports_without_the_plugin_or_vllm():
    """In a fresh interpreter, the library's entry points load no module of the plugin or vLLM,
    and choose a launch for a problem (the import graph above is read from the source; this runs it)."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from csrc_triton import choice, dispatch\n"
        "from csrc_triton.problem import Precision, Problem\n"
        "launch = choice.choose(Problem(8, 7168, 256, Precision.FP32))\n"
        "loaded = sorted(m for m in sys.modules if m.split('.')[0] in ('vllm', 'vllm_router_ext'))\n"
        "print(launch.kernel, loaded)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    kernel, loaded = out.stdout.strip().split(" ", 1)
    assert kernel in ("gemv", "splitk") and loaded == "[]", out.stdout
