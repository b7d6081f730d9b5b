"""The house plan holds: one namespace, imports pointing one way, no loops.

Reads the source with ``ast`` (nothing is imported), so a violation names the
file and the import that breaks the plan.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import tomllib

from support.paths import ROOT

TOPS = ("collectors", "detectors", "pipeline", "dashboard")
# Which packages each package may import (beside itself). The contract,
# rankscope.collectors.schema, imports nothing of the project.
ALLOWED = {
    "rankscope.collectors.schema": (),
    "rankscope.collectors": ("rankscope.collectors",),
    "rankscope.detectors": ("rankscope.detectors", "rankscope.collectors.schema"),
    "rankscope.pipeline": ("rankscope.pipeline", "rankscope.collectors", "rankscope.detectors"),
    "rankscope.dashboard": (
        "rankscope.dashboard", "rankscope.pipeline", "rankscope.collectors.schema",
    ),
}


def _modules() -> dict[str, ast.Module]:
    out = {}
    for top in TOPS:
        for path in sorted((ROOT / top).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out["rankscope." + ".".join(parts)] = ast.parse(path.read_text(), str(path))
    return out


def _imports(name: str, tree: ast.Module, known: set[str]) -> set[str]:
    """Every rankscope module this module imports, at any depth of the file."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("rankscope"))
        elif isinstance(node, ast.ImportFrom) and node.module:
            base = node.module
            if node.level:
                pkg = name.split(".")[: -node.level] if not name.endswith("__init__") else name
                base = ".".join([*pkg, node.module])
            if not base.startswith("rankscope"):
                continue
            for a in node.names:
                sub = f"{base}.{a.name}"
                found.add(sub if sub in known else base)
    return found


def _home(mod: str) -> str:
    return max((k for k in ALLOWED if mod == k or mod.startswith(k + ".")), key=len)


def test_every_package_is_installed():
    setup = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(setup["packages"])
    on_disk = {
        "rankscope." + ".".join(p.parent.relative_to(ROOT).parts)
        for top in TOPS for p in (ROOT / top).rglob("__init__.py")
    }
    assert listed == on_disk


def test_imports_point_one_way():
    mods = _modules()
    bad = []
    for name, tree in mods.items():
        home = _home(name)
        for dep in _imports(name, tree, set(mods)):
            if not any(dep == a or dep.startswith(a + ".") for a in (home, *ALLOWED[home])):
                bad.append(f"{name} imports {dep}")
    assert not bad, "\n".join(bad)


def test_no_import_loops():
    mods = _modules()
    graph = {n: _imports(n, t, set(mods)) & set(mods) for n, t in mods.items()}
    index, low, stack, on, loops = {}, {}, [], set(), []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
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
                loops.append(sorted(comp))

    sys.setrecursionlimit(10_000)
    for v in graph:
        if v not in index:
            visit(v)
    assert not loops, loops


def test_no_generic_top_level_modules_installed():
    """Only rankscope.* is importable from outside the checkout."""
    code = (
        "import importlib.util, sys; sys.path = [p for p in sys.path if p not in ('', '.')];"
        "print([m for m in ('collectors', 'detectors', 'pipeline', 'dashboard')"
        " if importlib.util.find_spec(m)])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd="/", check=True)
    assert out.stdout.strip() == "[]"


TRAIN = """
import torch
from rankscope.collectors import RankCollector

model = torch.nn.Linear(4, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
rc = RankCollector.attach(model, opt, job="shadow", sink="file://out")
for _ in range(3):
    loss = model(torch.randn(8, 4)).pow(2).mean()
    rc.loss(loss)
    opt.zero_grad()
    loss.backward()
    opt.step()
rc.close()
"""


def test_users_own_collectors_and_pipeline_do_not_break_attach(tmp_path):
    (tmp_path / "collectors.py").write_text("raise ImportError('the user collectors.py')\n")
    (tmp_path / "pipeline").mkdir()
    (tmp_path / "pipeline" / "__init__.py").write_text("raise ImportError('the user pipeline')\n")
    (tmp_path / "detectors.py").write_text("raise ImportError('the user detectors.py')\n")
    (tmp_path / "train.py").write_text(TRAIN)
    done = subprocess.run([sys.executable, "train.py"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = [ln for f in (tmp_path / "out").rglob("*.jsonl") for ln in f.read_text().splitlines()]
    steps = [ln for ln in lines if '"type":"step"' in ln.replace(" ", "")]
    assert len(steps) == 3
