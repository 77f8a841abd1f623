"""The package's imports go one way: the run layer (train, trainer, run, evaluate, grpo, plot, bench) uses
rollout/, which uses es/, model/ and envs/; nothing lower reaches back up, and no import cycle exists. Imports
made inside functions count: they run too, and a cycle through them is a cycle."""

import ast
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "asyncres_jax"
RUN_LAYER = ("train", "trainer", "run", "evaluate", "grpo", "plot", "bench")
LOWER = ("rollout", "es", "envs", "model")


def modules() -> dict[str, pathlib.Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def import_graph() -> dict[str, set[str]]:
    """module -> the package's modules it imports anywhere in its source (`from pkg import sub` names sub)."""
    mods = modules()

    def resolve(name: str) -> str:
        while name not in mods:
            name = name.rpartition(".")[0]
        return name

    graph = {}
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets |= {resolve(a.name) for a in node.names if a.name.split(".")[0] == "asyncres_jax"}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(parts + ([base] if base else []))
                if base.split(".")[0] != "asyncres_jax":
                    continue
                targets |= {f"{base}.{a.name}" if f"{base}.{a.name}" in mods else resolve(base) for a in node.names}
        graph[name] = targets - {name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
                on_stack.discard(component[-1])
            if len(component) > 1:
                out.append(sorted(component))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def layer(module: str) -> str:
    return module.split(".")[1] if "." in module else ""


def test_the_graph_sees_imports_made_inside_functions():
    graph = import_graph()
    assert "asyncres_jax.grpo.trainer" in graph["asyncres_jax.trainer"]  # only imported inside train()
    assert "asyncres_jax.rollout.cohort" in graph["asyncres_jax.rollout.jobs"]  # only inside cohort_job_fn
    found = cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}})
    assert found == [["a", "b", "c"]]


def test_the_package_has_no_import_cycle():
    assert cycles(import_graph()) == []


def test_rollout_es_envs_and_model_never_import_the_run_layer():
    up = sorted(f"{m} -> {t}" for m, targets in import_graph().items() if layer(m) in LOWER
                for t in targets if layer(t) in RUN_LAYER)
    assert up == []
