"""The package's layers, along a request's path, each importing only from below (docs/structure.md).

Every import of a ``minillm`` module is read from the source, those inside functions included,
and checked against ``LAYERS``: a module may import its own folder, or a folder of a lower layer.
An import that points up (the engine importing a benchmark) fails, and so does any import cycle
between folders."""
from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "minillm"

# lowest first; one folder (or top-level module) per entry
LAYERS = [
    "core",        # the records the engine and server write; device and dtype helpers
    "hardware",    # what machine this is: spec sheets, measured ceilings, is it quiet enough to measure
    "assets",      # the shipped tokenizer and prompts (data only)
    "model",       # the transformer and its loader
    "metrics",     # metric definitions and the diagnosis: pure functions of records
    "engine",      # scheduler, runner, KV cache, sampling, LLMEngine
    "serving",     # the OpenAI-compatible server and its gateway
    "perf",        # the roofline's formulas and the calculator
    "plots",       # the chapter's figures, drawn from plain data: they import no benchmark
    "loadgen",     # workloads, arrivals, the streaming client that drives a server
    "bench",       # the benchmark commands: decode, peers, the sweep, the engine, the four deceptions
    "experiments", # what each notebook section measures (10.4's stall, 10.5's outside-the-forward)
    "doctor",      # the machine check
    "cli",         # every command
    "__main__",
]
ROOT_EXPORTS = "__init__"   # minillm/__init__.py re-exports the public API lazily: it sits above all


def unit_of(module: str) -> str:
    """``minillm.engine.runner`` → ``engine``; ``minillm.cli`` → ``cli``; ``minillm`` → ``__init__``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ROOT_EXPORTS


def module_name(path: Path, package: Path = PACKAGE) -> str:
    rel = path.relative_to(package.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def imports_of(path: Path, package: Path = PACKAGE) -> list[tuple[int, str]]:
    """(line, module) for every ``minillm`` import in ``path``, at any depth."""
    tree = ast.parse(path.read_text(), filename=str(path))
    here = module_name(path, package)
    package = here if path.name == "__init__.py" else here.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names if a.name.split(".")[0] == "minillm"]
        elif isinstance(node, ast.ImportFrom):
            if node.level:                                     # relative: resolve against the package
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if mod.split(".")[0] == "minillm":
                # `from minillm import engine` names a folder: count it as that folder
                names = [f"{mod}.{a.name}" for a in node.names] if mod == "minillm" else [mod]
                out += [(node.lineno, m) for m in names]
    return out


def layer_violations(package: Path = PACKAGE, layers: list[str] = LAYERS) -> list[str]:
    rank = {u: i for i, u in enumerate(layers)}
    problems = []
    for path in sorted(package.rglob("*.py")):
        src = unit_of(module_name(path, package))
        if src == ROOT_EXPORTS:
            continue
        for line, mod in imports_of(path, package):
            dst = unit_of(mod)
            if dst == src:
                continue
            where = f"{path.relative_to(package.parent)}:{line} imports {mod}"
            if src not in rank or dst not in rank:
                problems.append(f"{where}: {src if src not in rank else dst} is in no layer (add it to "
                                "LAYERS)")
            elif dst == ROOT_EXPORTS or rank[dst] >= rank[src]:
                problems.append(f"{where}: {dst} is not below {src}")
    return problems


def folder_cycles(package: Path = PACKAGE) -> list[list[str]]:
    """Cycles in the folder-level import graph (function-level imports included)."""
    graph: dict[str, set[str]] = {}
    for path in package.rglob("*.py"):
        src = unit_of(module_name(path, package))
        for _, mod in imports_of(path, package):
            if unit_of(mod) != src:
                graph.setdefault(src, set()).add(unit_of(mod))
    cycles, state = [], {}

    def visit(u: str, stack: list[str]) -> None:
        state[u] = 1
        for v in sorted(graph.get(u, ())):
            if state.get(v) == 1:
                cycles.append(stack[stack.index(v):] + [v])
            elif v not in state:
                visit(v, stack + [v])
        state[u] = 2

    for u in sorted(graph):
        if u not in state:
            visit(u, [u])
    return cycles


def test_every_import_points_down():
    assert layer_violations() == []


def test_no_import_cycle_between_folders():
    assert folder_cycles() == []


def test_the_check_catches_an_upward_import(tmp_path):
    pkg = tmp_path / "minillm"
    for folder, body in (("core", "from minillm.engine.runner import X\n"),
                         ("engine", "import minillm.core\n")):
        (pkg / folder).mkdir(parents=True)
        (pkg / folder / "__init__.py").write_text("")
        (pkg / folder / "m.py").write_text(body)
    problems = layer_violations(pkg)
    assert len(problems) == 1 and "core/m.py:1 imports minillm.engine.runner" in problems[0]
    assert folder_cycles(pkg) == [["core", "engine", "core"]]


def test_the_check_catches_a_function_level_import(tmp_path):
    pkg = tmp_path / "minillm"
    (pkg / "model").mkdir(parents=True)
    (pkg / "model" / "m.py").write_text("def f():\n    from minillm.serving import app\n")
    (pkg / "metrics").mkdir()
    (pkg / "metrics" / "m.py").write_text("from minillm.metrics.x import y\n")    # its own folder: fine
    problems = layer_violations(pkg, ["model", "metrics", "serving"])
    assert problems == ["minillm/model/m.py:2 imports minillm.serving: serving is not below model"]
    assert layer_violations(pkg, ["serving", "model", "metrics"]) == []          # serving below: allowed


def test_library_code_never_changes_matplotlibs_backend():
    """``matplotlib.use`` in a kernel where pyplot is loaded switches the backend, and every later
    ``plt.show()`` in the notebook draws nothing: saving a figure works under any backend."""
    calls = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr == "use" and isinstance(node.func.value, ast.Name)
                    and node.func.value.id in ("matplotlib", "mpl")):
                calls.append(f"{path.relative_to(PACKAGE)}:{node.lineno}")
    assert not calls, calls
