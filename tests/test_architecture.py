"""The package structure, checked from the source: no import cycle between the project's packages, kernel
bodies only in MaxText/kernels/, which imports nothing else of the project.

A package is a directory under MaxText/ (moe, gmm, quant, kernels, layers, data, convert), a module at the
top (config, train, ...) counts as its own. Every import counts, including those inside functions: a
lazy import is still a dependency."""

import ast
from pathlib import Path

from conftest import REPO

ROOT = REPO / "MaxText"


def _unit(module: str) -> str:
  """MaxText.moe.layer -> MaxText.moe; MaxText.train -> MaxText.train."""
  parts = module.split(".")
  if len(parts) >= 2 and (ROOT / parts[1]).is_dir():
    return ".".join(parts[:2])
  return ".".join(parts[:2]) if len(parts) >= 2 else module


def _module_name(path: Path) -> str:
  rel = path.relative_to(REPO).with_suffix("")
  parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
  return ".".join(parts)


def _imports(path: Path) -> set[str]:
  """The project modules `path` imports (absolute names)."""
  found = set()
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.Import):
      found |= {a.name for a in node.names if a.name.startswith("MaxText")}
    elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("MaxText") and not node.level:
      # `from MaxText import gmm` imports the module MaxText.gmm; `from MaxText.gmm import build` MaxText.gmm
      for a in node.names:
        candidate = f"{node.module}.{a.name}"
        is_module = (REPO / Path(*candidate.split("."))).is_dir() or (
          REPO / f"{Path(*candidate.split('.'))}.py"
        ).exists()
        found.add(candidate if is_module else node.module)
  return found


def import_graph() -> dict[str, set[str]]:
  graph: dict[str, set[str]] = {}
  for path in ROOT.rglob("*.py"):
    unit = _unit(_module_name(path))
    graph.setdefault(unit, set()).update(_unit(m) for m in _imports(path) if _unit(m) not in (unit, "MaxText"))
  return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
  """Each strongly connected component of more than one node (Tarjan)."""
  index, low, stack, on_stack, found, counter = {}, {}, [], set(), [], [0]

  def visit(v):
    index[v] = low[v] = counter[0]
    counter[0] += 1
    stack.append(v)
    on_stack.add(v)
    for w in graph.get(v, ()):
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on_stack:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      component = []
      while True:
        w = stack.pop()
        on_stack.discard(w)
        component.append(w)
        if w == v:
          break
      if len(component) > 1:
        found.append(sorted(component))

  for v in sorted(graph):
    if v not in index:
      visit(v)
  return found


def test_the_cycle_finder_finds_a_cycle():
  assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
  assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_between_packages():
  graph = import_graph()
  assert {"MaxText.moe", "MaxText.gmm", "MaxText.quant", "MaxText.kernels"} <= set(graph)
  found = cycles(graph)
  assert not found, "import cycles between packages: " + "; ".join(" <-> ".join(c) for c in found)


def test_kernels_import_nothing_else_of_the_project():
  for path in (ROOT / "kernels").rglob("*.py"):
    outside = {m for m in _imports(path) if not m.startswith("MaxText.kernels")}
    assert not outside, f"{path.relative_to(REPO)} imports {sorted(outside)}"


def test_kernel_bodies_live_in_kernels():
  """Pallas (Mosaic GPU, Triton) is written only under MaxText/kernels/."""
  for path in ROOT.rglob("*.py"):
    if (ROOT / "kernels") in path.parents:
      continue
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, (ast.Import, ast.ImportFrom)):
        names = (
          [node.module or ""] + [a.name for a in node.names]
          if isinstance(node, ast.ImportFrom)
          else [a.name for a in node.names]
        )
        assert not any("pallas" in n for n in names), f"{path.relative_to(REPO)} imports Pallas: kernels go in kernels/"
