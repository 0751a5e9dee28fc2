"""The layer order of DESIGN.md, checked on the source: each layer imports only the layers below it, the
import-time graph has no cycle, and an import hidden inside a function is either hoisted or listed in
`FUNCTION_LEVEL` with its reason. The top-level folders are read too: the package imports none of them
(`configs/`, `tests/`, `launch/`: not at module level, not in a function, not through `importlib`), and
`configs/*.py` only re-export the package's presets. Reads the code with `ast` (nothing is imported), so it
takes milliseconds; the checks run once on planted sources, so each is seen to fail.
"""

from __future__ import annotations

import ast
import pathlib
from typing import Any

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "librarian_jax"

# Lowest first (DESIGN.md "Layers"; `LAYERS` below is that table). A module belongs to the layer of its
# longest matching prefix. `segment` (the rollout -> rl record), `data` (schema, loaders, the synthetic
# world, grain pipelines), `compile_cache` (JAX's persistent cache switch), `storage` (local or gs://
# paths) and `errors` (`ConfigError`, the CLI's one line) import nothing above them, so every layer may read
# them.
LAYERS: list[tuple[str, ...]] = [
    ("segment", "data", "errors", "compile_cache", "storage", "xla_flags", "host_memory", "text_memo",
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
    # checkpoints, multi-process start-up and the one training loop (SFT's and GRPO's: checkpoints, resume,
    # summaries, the clock) know nothing of configs
    ("distributed", "checkpoint", "train_loop"),
    # every key declared once: it imports the lower layers' choice lists, nothing above
    ("config_schema",),
    # the presets (values set on the schema; `configs/*.py` re-export them), the checks that need the devices
    # or several sections, a run's tasks and tokenizer from its config, the flag parser
    ("presets", "config_validation", "inputs", "cli_flags"),
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


REPO = PACKAGE.parent
# the repository's top-level folders of Python: above the package (they import it; it imports none of them)
TOP_LEVEL = ("configs", "tests", "launch")


def _module_name(path: pathlib.Path, root: pathlib.Path = PACKAGE) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


MODULES = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}
TOP_MODULES = {_module_name(p, REPO): p for folder in TOP_LEVEL
               for p in sorted((REPO / folder).rglob("*.py"))}


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


def _imported_names(tree: ast.AST, package: str) -> list[tuple[str, bool, int]]:
    """(dotted name, inside a function, line) of every import in `tree` (a module of `package`), typing-only
    ones left out; `importlib.import_module("x")` / `__import__("x")` with a constant name are imports."""
    typing_only = _type_checking_nodes(tree)
    in_function = {id(n) for f in ast.walk(tree) if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef)
                   for n in ast.walk(f)}
    out = []
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
        elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str)
              and ast.unparse(node.func) in ("importlib.import_module", "import_module", "__import__")):
            names = [node.args[0].value]
        out += [(n, id(node) in in_function, node.lineno) for n in names]
    return out


def imports_of(module: str, source: str, modules: dict[str, Any] | None = None
               ) -> list[tuple[str, str, bool, int]]:
    """(importer, imported, inside a function, line) for every import of a librarian_jax module (or of a
    top-level folder's, `top:configs.grpo`) in `module`'s `source`."""
    modules = MODULES if modules is None else modules
    path = modules.get(module)
    is_package = path is not None and pathlib.Path(path).name == "__init__.py"
    package = module if is_package else module.rpartition(".")[0]
    out = []
    for n, inside, line in _imported_names(ast.parse(source), package):
        if n.split(".")[0] in TOP_LEVEL:
            out.append((module, f"top:{n}", inside, line))
            continue
        target = _resolve(n)
        if target is not None and target != module:
            out.append((module, target, inside, line))
    return out


def imports() -> list[tuple[str, str, bool, int]]:
    """(importer, imported, inside a function, line) for every import of a librarian_jax module."""
    return [i for module, path in MODULES.items() for i in imports_of(module, path.read_text())]


IMPORTS = imports()


def upward_imports(imports: list[tuple[str, str, bool, int]]) -> list[str]:
    return [f"librarian_jax.{a}:{line} imports librarian_jax.{b} (layer {layer_of(b)} > {layer_of(a)})"
            for a, b, _, line in imports if not b.startswith("top:") and layer_of(b) > layer_of(a)]


def top_level_imports(imports: list[tuple[str, str, bool, int]]) -> list[str]:
    return [f"librarian_jax.{a}:{line} imports {b[4:]} (the top-level {b[4:].split('.')[0]}/ folder: "
            "resolve it inside the package, e.g. librarian_jax.presets, or take it as an argument)"
            for a, b, _, line in imports if b.startswith("top:")]


def test_every_layer_imports_only_layers_below():
    bad = upward_imports(IMPORTS)
    assert not bad, "\n".join(bad)


def test_the_package_imports_no_top_level_folder():
    """`configs/`, `tests/` and `launch/` sit above the package: a module that imports one of them (at
    module level, in a function or through `importlib`) breaks the package installed without them."""
    bad = top_level_imports(IMPORTS)
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("source,check", [
    ("from configs import grpo\n", top_level_imports),
    ("def f():\n    from configs import sft as s\n    return s\n", top_level_imports),
    ("import importlib\ng = importlib.import_module('configs.grpo')\n", top_level_imports),
    ("from tests import multiproc\n", top_level_imports),
    ("from librarian_jax import training\n", upward_imports),  # the schema importing a command
    ("from librarian_jax.warm_start import demos\n", upward_imports),
])
def test_a_planted_import_fails_the_checks(source, check):
    """The checks above on a planted `config_schema` source: each flags it (a check that cannot fail
    checks nothing)."""
    planted = imports_of("config_schema", source)
    assert planted and check(planted), (source, planted)


def test_checkpoint_and_config_schema_import_nothing_above_them():
    """Orbax checkpoints know no config (the CLI's error type is `errors.ConfigError`); the schema knows
    no module that reads it (the demonstration styles it checks are its own list)."""
    for module in ("checkpoint", "config_schema"):
        above = sorted({b for a, b, _, _ in IMPORTS if a == module and layer_of(b) >= layer_of(module)})
        assert above == (["distributed"] if module == "checkpoint" else []), (module, above)


def test_configs_only_re_export_the_package_presets():
    """`configs/<command>.py` (what `--config=configs/grpo.py:preset` loads) defines nothing: it re-exports
    `librarian_jax.presets.<command>`, where the package finds the same presets."""
    assert {m for m in TOP_MODULES if m.startswith("configs.")} == {
        "configs.grpo", "configs.sft", "configs.eval", "configs.build"}
    for module, path in TOP_MODULES.items():
        if not module.startswith("configs.") or path.name == "__init__.py":
            continue
        tree = ast.parse(path.read_text())
        body = [n for n in tree.body if not (isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant))]
        defined = [ast.unparse(n).splitlines()[0] for n in body
                   if not isinstance(n, ast.ImportFrom | ast.Assign)]
        assert not defined, f"{path} defines {defined}: presets live in librarian_jax/presets/"
        froms = [n.module for n in body if isinstance(n, ast.ImportFrom)]
        assert froms == [f"librarian_jax.presets.{module.split('.')[1]}"], (path, froms)


def test_top_level_modules_import_existing_package_modules():
    """Every module of `configs/`, `tests/` and `launch/` parses, and each `librarian_jax` name it imports
    resolves to a module of the package (a moved module is found here, not by a user)."""
    bad = []
    for path in TOP_MODULES.values():
        for n, _, line in _imported_names(ast.parse(path.read_text(), str(path)), ""):
            if n.startswith("librarian_jax.") and n.removeprefix("librarian_jax.").split(".")[0] not in {
                    m.split(".")[0] for m in MODULES}:
                bad.append(f"{path.relative_to(REPO)}:{line} imports {n}")
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
                                          ("checkpoint", 9), ("train_loop", 9), ("config_schema", 10),
                                          ("presets.grpo", 11),
                                          ("warm_start.demos", 13), ("warm_start.sft", 13),
                                          ("data.synthetic", 0), ("errors", 0), ("segment", 0),
                                          ("cluster", 12), ("training", 14), ("main", 15)])
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
