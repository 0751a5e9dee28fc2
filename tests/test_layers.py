"""The layer order of DESIGN.md, checked on the source: each layer imports only the layers below it, the
import-time graph has no cycle, and an import hidden inside a function is either hoisted or listed in
`FUNCTION_LEVEL` with its reason. Reads the code with `ast` (nothing is imported), so it takes milliseconds.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "librarian_jax"

# Lowest first (DESIGN.md "Layers"; `LAYER_ROWS` below is that table). A module belongs to the layer of its
# longest matching prefix. `segment` (the rollout -> rl record), `data` (schema, loaders, the synthetic
# world, grain pipelines), `compile_cache` (JAX's persistent cache switch) and `storage` (local or gs://
# paths) import nothing above them, so every layer may read them.
LAYERS: list[tuple[str, ...]] = [
    ("segment", "data", "compile_cache", "storage", "xla_flags", "host_memory", "text_memo",
     "planning.topology"),
    ("models",),
    ("tokenizers",),
    ("engine",),
    # the test doubles (a byte tokenizer under the real chat templates, the scripted engine over the engine's
    # session record), below everything that runs agents: the warm start's demonstrations replay through them
    ("testing",),
    ("workspace",),
    ("agents",),
    ("rollout",),
    ("rl",),
    # the config's schema names the demonstration styles (`warm_start.demos`, which runs scripted builders
    # through rollout), so they sit with it; `inputs`: a run's tasks and tokenizer from its config
    ("checkpoint", "distributed", "config_schema", "presets", "config_validation", "warm_start.demos", "inputs",
     "cli_flags"),
    ("cluster",),
    ("warm_start",),
    ("eval", "serve", "training", "bench", "planning"),
    ("main",),
    ("",),
]

# Imports inside functions that stay there, by (importing module, imported module), with the reason. Every
# entry is an optional dependency or a start-up cost, never an import cycle.
_CLI = "CLI start-up: config errors and --dry_run answer before the model/engine/rollout stack is imported"
FUNCTION_LEVEL: dict[tuple[str, str], str] = {
    ("main", "training"): _CLI,
    ("main", "warm_start.sft"): _CLI,
    ("main", "eval.cli"): _CLI,
    # `--dry_run --compile --config.topology`: the plan (it imports training and the warm start itself)
    ("training", "planning.plan"): "a plan's modules load only when a plan is asked for (--config.topology)",
    ("eval.cli", "planning.plan"): "a plan's modules load only when a plan is asked for (--config.topology)",
}


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


MODULES = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def layer_of(module: str) -> int:
    best, rank = -1, None
    for i, prefixes in enumerate(LAYERS):
        for p in prefixes:
            if (p == "" and module == "") or module == p or (p and module.startswith(p + ".")):
                if len(p) > best:
                    best, rank = len(p), i
    if rank is None:
        raise AssertionError(f"librarian_jax.{module} is in no layer: add it to LAYERS in {__file__}")
    return rank


def _resolve(name: str) -> str | None:
    """The package module an imported dotted name refers to (a module, or the package holding a name)."""
    if not name.startswith("librarian_jax"):
        return None
    name = name.removeprefix("librarian_jax").lstrip(".")
    while name not in MODULES:
        name = name.rpartition(".")[0]
    return name


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    out: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            out |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    return out


def imports() -> list[tuple[str, str, bool, int]]:
    """(importer, imported, inside a function, line) for every import of a librarian_jax module."""
    out = []
    for module, path in MODULES.items():
        tree = ast.parse(path.read_text(), str(path))
        typing_only = _type_checking_nodes(tree)
        in_function = {id(n) for f in ast.walk(tree) if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef)
                       for n in ast.walk(f)}
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        for node in ast.walk(tree):
            if id(node) in typing_only:
                continue
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".") if package else []
                    up = up[: len(up) - node.level + 1]
                    base = ".".join(["librarian_jax", *up, *([base] if base else [])])
                names = [f"{base}.{a.name}" for a in node.names]
            for n in names:
                target = _resolve(n)
                if target is not None and target != module:
                    out.append((module, target, id(node) in in_function, node.lineno))
    return out


IMPORTS = imports()


def test_every_layer_imports_only_layers_below():
    bad = [f"librarian_jax.{a}:{line} imports librarian_jax.{b} (layer {layer_of(b)} > {layer_of(a)})"
           for a, b, _, line in IMPORTS if layer_of(b) > layer_of(a)]
    assert not bad, "\n".join(bad)


def test_no_import_cycle_at_import_time():
    """Module-level imports between modules, a package's own `__init__` excluded (a submodule importing a
    name its package re-exports is how packages are written)."""
    graph: dict[str, set[str]] = {m: set() for m in MODULES}
    for a, b, local, _ in IMPORTS:
        if not local and not (a.startswith(b + ".") or b == ""):
            graph[a].add(b)
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                raise AssertionError("import cycle: " + " -> ".join(stack[stack.index(n):] + [n]))
            if n not in state:
                visit(n)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)


def test_function_level_imports_are_hoisted_or_have_a_reason():
    local = {(a, b) for a, b, inside, _ in IMPORTS if inside}
    unlisted = sorted(f"{a} -> {b}" for a, b in local if (a, b) not in FUNCTION_LEVEL)
    assert not unlisted, ("imports inside functions: hoist them, or list them in FUNCTION_LEVEL with the "
                          "reason:\n" + "\n".join(unlisted))
    stale = sorted(f"{a} -> {b}" for a, b in FUNCTION_LEVEL if (a, b) not in local)
    assert not stale, "no longer imported inside a function: remove from FUNCTION_LEVEL:\n" + "\n".join(stale)


@pytest.mark.parametrize("module,layer", [("models.moe", 1), ("engine.engine", 3), ("testing", 4),
                                          ("warm_start.demos", 9), ("warm_start.sft", 11),
                                          ("data.synthetic", 0), ("segment", 0), ("cluster", 10),
                                          ("training", 12), ("main", 13)])
def test_layer_table(module, layer):
    assert layer_of(module) == layer


def test_design_md_layer_table_is_this_order():
    """DESIGN.md's "Layers" table lists the packages in the order `LAYERS` checks (each row's first cell
    names the row's modules), so the map a newcomer reads is the one the code keeps."""
    design = (PACKAGE.parent / "DESIGN.md").read_text()
    section = design.split("## Layers", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    named = [tuple(n.strip("`").rstrip("/") for n in row.split("|")[1].replace(",", " ").split())
             for row in rows]
    want = [tuple(p for p in layer if p) for layer in LAYERS if any(layer)]
    assert named == want, f"DESIGN.md layers {named} != tests/test_layers.py LAYERS {want}"
