"""The house rules of hf_tpu's import graph (issue #33): no cycle, and nothing imports up the house.

The graph is read from the source with :mod:`ast`, nothing is imported: a node per module of ``hf_tpu``, an edge
per import statement, at module level or inside a function (``TYPE_CHECKING`` blocks too), reaching the module the
name lives in (``from hf_tpu.sim import host_view`` reaches ``hf_tpu.sim``, ``from hf_tpu import runtime`` reaches
``hf_tpu.runtime``). ``importlib.import_module`` calls are not import statements and are not read.

The floors, top to bottom: the top floor (``hf_tpu.cli``, ``hf_tpu.benchmarks``, ``hf_tpu.__main__``) is where the
``hf_tpu`` facade (``enable``, ``warmup``, ...) may be used; the rooms (``hf_tpu.transformers``, ``hf_tpu.serving``,
``hf_tpu.distributed``, ...) and the top-level modules they share (``hf_tpu.runtime``, ``hf_tpu._patch``, ...) import
the module that defines a name; ``hf_tpu.sim`` is the bottom room. The rules:

1. no cycle: no two modules import each other, directly or through others;
2. nothing imports upward:
   - only the top floor imports the ``hf_tpu`` package itself (``import hf_tpu``, ``from hf_tpu import enable``,
     and ``import hf_tpu.sim``, which binds the name ``hf_tpu`` and reads ``hf_tpu.sim`` through it);
   - no module imports its own package's ``__init__`` (or an enclosing one's): it imports the submodule that
     defines the name;
   - only ``hf_tpu.cli`` and ``hf_tpu.benchmarks`` import ``hf_tpu.cli``;
   - ``hf_tpu.sim`` imports nothing from ``hf_tpu.distributed``, and ``hf_tpu.distributed`` nothing from ``hf_tpu.sim``
     (the simulator is the bottom room: distributed code reaches its ``tpu_dist`` side through
     ``hf_tpu.runtime.simulated_distributed``);
   - ``hf_tpu._shared``, the layer under the integrations, and ``hf_tpu.sim`` import no integration;
3. the integrations (``hf_tpu.transformers``, ``hf_tpu.encoders``, ``hf_tpu.diffusers``, ``hf_tpu.serving``,
   ``hf_tpu.training``) are siblings: none imports another's private module or name, and ``hf_tpu.transformers``
   and ``hf_tpu.encoders`` do not import each other at all (what both need is in ``hf_tpu._shared``; the facade
   ``hf_tpu._warmup`` picks one warm-up or the other);
4. the benchmarks measure hf_tpu through its public seams: a module of ``hf_tpu.benchmarks`` imports no private
   module (a dotted component starting with ``_``) and no underscore name of another room, ``hf_tpu._env`` aside
   (:data:`BENCHMARK_SEAMS`: the environment table, through which a benchmark reads a variable of its own);
5. every attribute hf_tpu sets on another library's object goes through ``hf_tpu._patch`` (``patch``, or ``assign``
   with its reason): outside it, no ``setattr(x, ...)`` and no ``x.attr = ...`` where ``x`` is a name imported from
   a third-party package (``torch``, ``transformers``, ...). An object reached through a variable is not seen;
6. a graph kind is a value (``hf_tpu.transformers._graph_key.GraphKind``), never text joined or split on ``"+"``
   (issue #49): outside ``_graph_key`` (whose ``parse`` reads the text that comes from outside, a compile-cache
   manifest), no ``.split("+")`` / ``.rsplit`` / ``.partition`` / ``.rpartition`` on ``"+"``, no ``"+".join``, no
   ``... + "+" + ...`` and no string that starts a kind's suffix (``"+token_type_ids"``, an f-string's
   ``f"+beams{n}..."``; docstrings aside). A function that parses other text on ``"+"`` is named in
   :data:`NOT_GRAPH_KEYS` with what it reads;
7. an ``HF_TPU_*`` environment variable is read only through its entry in ``hf_tpu._env`` (issue #66), whose
   ``graph_key`` puts the graph-changing ones in the compile cache's key: outside ``hf_tpu/_env.py`` no
   ``os.environ.get(K)``, ``os.environ[K]`` (read), ``K in os.environ`` or ``os.getenv(K)`` where ``K`` is an
   ``HF_TPU_...`` string or f-string, a variable's ``_env.X.name``, or a name bound anywhere in hf_tpu to one of
   those (``KV_WRITE_ENV = _env.KV_WRITE.name``, read as ``writes.KV_WRITE_ENV``). Writing one for a child process
   (``os.environ[K] = ...``, ``setdefault``) is allowed. A read through another alias of ``os.environ`` is not seen;
8. no function of ``hf_tpu.transformers`` is over :data:`LONGEST_FUNCTION` lines, from its ``def`` to its last line,
   docstring included (issue #66: a long one is split into named steps).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

PACKAGE = "hf_tpu"
PACKAGE_DIR = Path(__file__).resolve().parents[1] / PACKAGE

TOP_FLOOR = ("hf_tpu.cli", "hf_tpu.benchmarks", "hf_tpu.__main__")
CLI = "hf_tpu.cli"
CLI_IMPORTERS = ("hf_tpu.cli", "hf_tpu.benchmarks")
SIM = "hf_tpu.sim"
DISTRIBUTED = "hf_tpu.distributed"
BENCHMARKS = "hf_tpu.benchmarks"
SHARED = "hf_tpu._shared"
INTEGRATIONS = ("hf_tpu.transformers", "hf_tpu.encoders", "hf_tpu.diffusers", "hf_tpu.serving", "hf_tpu.training")
STRANGERS = {"hf_tpu.transformers", "hf_tpu.encoders"}  # integrations that import nothing of each other

@dataclass(frozen=True)
class Import:
    """One name an import statement brings into ``importer``."""

    importer: str
    imported: str  # the absolute dotted name, e.g. "hf_tpu.transformers._settings" or "hf_tpu.sim.host_view"
    target: str  # the hf_tpu module that name lives in (its longest prefix that is a module)
    line: int
    binds_package: bool = False  # `import hf_tpu.x`: the code reads hf_tpu.x through the name `hf_tpu`

    def __str__(self) -> str:
        return f"{self.importer} (line {self.line}) -> {self.target} (imports {self.imported})"


def find_modules() -> dict[str, Path]:
    """Every importable module of hf_tpu, by dotted name (a package by its own name, not ``.__init__``)."""
    found: dict[str, Path] = {}
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        parts = path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts
        if not all(part.isidentifier() for part in parts):
            continue  # not importable as part of hf_tpu (e.g. the kernel repository under kernels/hub)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


MODULES = find_modules()


def is_within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def module_of(name: str) -> str | None:
    """The module of hf_tpu that ``name`` lives in: its longest dotted prefix that is a module."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def imports_of(module: str) -> Iterator[Import]:
    """The hf_tpu names every import statement of ``module`` brings in, wherever the statement is."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                target = module_of(alias.name)
                if target is not None:
                    binds = alias.asname is None and "." in alias.name
                    yield Import(module, alias.name, target, node.lineno, binds_package=binds)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: `from . import x`, `from ..y import z`
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            if not is_within(base, PACKAGE):
                continue
            for alias in node.names:
                name = f"{base}.{alias.name}"
                target = name if name in MODULES else module_of(base)
                if target is not None:
                    yield Import(module, name, target, node.lineno)


ALL_IMPORTS: list[Import] = [imp for module in MODULES for imp in imports_of(module)]


def import_graph() -> dict[str, set[str]]:
    """Module -> the modules it imports (an import of itself, e.g. a package's own submodule name, is left out)."""
    graph: dict[str, set[str]] = {module: set() for module in MODULES}
    for imp in ALL_IMPORTS:
        if imp.target != imp.importer:
            graph[imp.importer].add(imp.target)
        if imp.binds_package and imp.importer != PACKAGE:
            graph[imp.importer].add(PACKAGE)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm), each sorted."""
    index: dict[str, int] = {}  # order of discovery
    lowest: dict[str, int] = {}  # lowest index reachable from the module through modules still on the stack
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = lowest[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for other in sorted(graph[module]):
            if other not in index:
                visit(other)
                lowest[module] = min(lowest[module], lowest[other])
            elif other in on_stack:
                lowest[module] = min(lowest[module], index[other])
        if lowest[module] == index[module]:  # `module` is the root of a component: pop it
            component = []
            while True:
                other = stack.pop()
                on_stack.discard(other)
                component.append(other)
                if other == module:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return found


def upward_reasons(imp: Import) -> list[str]:
    """Why ``imp`` runs up the house (empty when it does not)."""
    importer, target = imp.importer, imp.target
    if importer == PACKAGE:
        return []  # the facade itself
    reasons = []
    if (target == PACKAGE or imp.binds_package) and not any(is_within(importer, floor) for floor in TOP_FLOOR):
        reasons.append("only the top floor (hf_tpu.cli, hf_tpu.benchmarks) imports the hf_tpu facade")
    if target != PACKAGE and target != importer and is_within(importer, target):
        reasons.append(f"imports its own package's __init__ ({target}): import the submodule that defines the name")
    if is_within(target, CLI) and not any(is_within(importer, room) for room in CLI_IMPORTERS):
        reasons.append("only hf_tpu.cli and hf_tpu.benchmarks import hf_tpu.cli")
    if is_within(importer, SIM) and is_within(target, DISTRIBUTED):
        reasons.append("hf_tpu.sim is the bottom room: it imports nothing from hf_tpu.distributed")
    if is_within(importer, DISTRIBUTED) and is_within(target, SIM):
        reasons.append(
            "hf_tpu.distributed imports nothing from hf_tpu.sim: ask hf_tpu.runtime.simulated_distributed() for the "
            "simulator's side of torch.distributed"
        )
    for below in (SHARED, SIM):
        if is_within(importer, below) and integration_of(target) is not None:
            reasons.append(f"{below} is below the integrations: it imports nothing of {integration_of(target)}")
    return reasons


def integration_of(module: str) -> str | None:
    return next((room for room in INTEGRATIONS if is_within(module, room)), None)


def sibling_reasons(imp: Import) -> list[str]:
    """Why ``imp`` reaches into another integration (empty when it does not)."""
    mine, theirs = integration_of(imp.importer), integration_of(imp.target)
    if mine is None or theirs is None or mine == theirs:
        return []
    if {mine, theirs} == STRANGERS:
        return [
            f"{mine} imports nothing of {theirs}: put what both need in hf_tpu._shared (the facade hf_tpu._warmup "
            "picks between them)"
        ]
    private = private_part(imp.imported)
    if private is not None and is_within(private, theirs):
        return [f"imports {private}, private to {theirs}: give it a public seam, or move it under hf_tpu._shared"]
    return []


def private_part(imported: str) -> str | None:
    """``imported`` up to its first component that starts with ``_`` (dunders such as __version__ aside)."""
    parts = imported.split(".")
    for i, part in enumerate(parts):
        if part.startswith("_") and not (part.startswith("__") and part.endswith("__")):
            return ".".join(parts[: i + 1])
    return None


#: private modules a benchmark may import, and why
BENCHMARK_SEAMS = {
    "hf_tpu._env": "the one reader of HF_TPU_* variables (rule 7): a benchmark's own switch is read through it too",
}


def benchmark_seams() -> set[tuple[str, str]]:
    """(benchmark module, private module or name of another room) for every such import in hf_tpu.benchmarks."""
    found = set()
    for imp in ALL_IMPORTS:
        if is_within(imp.importer, BENCHMARKS) and not is_within(imp.imported, BENCHMARKS):
            private = private_part(imp.imported)
            if private is not None and private not in BENCHMARK_SEAMS:
                found.add((imp.importer, private))
    return found


THIRD_PARTY = {
    "accelerate", "diffusers", "huggingface_hub", "jax", "numpy", "peft", "safetensors", "sentence_transformers",
    "tokenizers", "torch", "torch_tpu", "torchao", "transformers",
}  # fmt: skip
PATCH_MODULE = "hf_tpu._patch"


def third_party_sets(source: str) -> list[tuple[int, str]]:
    """(line, code) of every ``setattr(x, ...)`` and ``x.attr = ...`` in ``source`` whose ``x`` (the root name) an
    import of the same source binds to a third-party package or one of its names."""
    tree = ast.parse(source)
    bound: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            bound |= {a.asname or a.name.split(".")[0] for a in node.names if a.name.split(".")[0] in THIRD_PARTY}
        elif isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] in THIRD_PARTY:
            bound |= {a.asname or a.name for a in node.names}

    def root(node: ast.AST) -> str | None:
        while isinstance(node, ast.Attribute):
            node = node.value
        return node.id if isinstance(node, ast.Name) else None

    found = []
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else (
            [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
        )  # fmt: skip
        found += [(node.lineno, ast.unparse(t)) for t in targets if isinstance(t, ast.Attribute) and root(t) in bound]
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr":
            if node.args and root(node.args[0]) in bound:
                found.append((node.lineno, ast.unparse(node)))
    return found


GRAPH_KEY_MODULE = "hf_tpu/transformers/_graph_key.py"
# (file, function) that split other text on "+": what each reads
NOT_GRAPH_KEYS = {
    ("hf_tpu/benchmarks/arch_sweep.py", "_copies_per_step"): 'the docs table\'s copies cell, "h2d + d2h"',
}


def graph_text_uses(source: str) -> list[tuple[int, str | None, str]]:
    """(line, enclosing function, code) of every place in ``source`` that joins or splits text on ``"+"`` the way
    graph kinds were built and read before they were typed (rule 6)."""
    tree = ast.parse(source)
    docstrings: set[int] = set()
    where: dict[int, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                docstrings.add(id(first.value))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for inner in ast.walk(node):
                where.setdefault(id(inner), node.name)  # (ast.walk is breadth first: the outermost function wins)

    def plus(node: ast.AST) -> bool:
        return isinstance(node, ast.Constant) and node.value == "+"

    found = []
    for node in ast.walk(tree):
        hit = False
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            splits = node.func.attr in ("split", "rsplit", "partition", "rpartition")
            joins = node.func.attr == "join" and plus(node.func.value)
            hit = bool(splits and node.args and plus(node.args[0])) or joins
        elif isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
            hit = plus(node.left) or plus(node.right)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            hit = len(node.value) > 1 and node.value[0] == "+" and (node.value[1].isalpha() or node.value[1] == "_")
        if hit:
            found.append((node.lineno, where.get(id(node)), ast.unparse(node)))
    return found


def test_the_graph_sees_the_whole_package():
    assert "hf_tpu" in MODULES and "hf_tpu.sim._ops" in MODULES and "hf_tpu.cli.main" in MODULES
    assert not any("hub" in module.split(".") for module in MODULES)  # a kernel repository, not hf_tpu's code
    assert ALL_IMPORTS and all(imp.target in MODULES for imp in ALL_IMPORTS)


def test_no_import_cycle():
    wrong = cycles(import_graph())
    assert not wrong, "import cycles (each line: the modules that import each other):\n" + "\n".join(
        f"  {c}" for c in wrong
    )


def test_no_upward_import():
    wrong = [f"  {imp}: {reason}" for imp in ALL_IMPORTS for reason in upward_reasons(imp)]
    assert not wrong, "imports up the house:\n" + "\n".join(sorted(set(wrong)))


def test_integrations_import_no_private_part_of_each_other_and_transformers_and_encoders_nothing():
    wrong = [f"  {imp}: {reason}" for imp in ALL_IMPORTS for reason in sibling_reasons(imp)]
    assert not wrong, "integrations reaching into each other:\n" + "\n".join(sorted(set(wrong)))


def test_benchmarks_import_no_private_module_or_name_of_another_room():
    wrong = benchmark_seams()
    assert not wrong, (
        "hf_tpu.benchmarks imports private modules or names of another room; give the room a public seam "
        "instead:\n" + "\n".join(f"  {module} imports {private}" for module, private in sorted(wrong))
    )


def test_third_party_attributes_are_set_only_through_the_patch_module():
    wrong = [
        f"  {module} (line {line}): {code}"
        for module, path in MODULES.items()
        if module != PATCH_MODULE
        for line, code in third_party_sets(path.read_text())
    ]
    assert not wrong, (
        "attributes of third-party objects set outside hf_tpu._patch (use _patch.patch, or _patch.assign with the "
        "reason it is not a patch):\n" + "\n".join(wrong)
    )


def test_the_rules_catch_what_they_name():
    """The checks themselves: a cycle, each kind of upward import, and a private import by a benchmark."""
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []

    def reasons(importer: str, target: str, binds: bool = False) -> list[str]:
        return upward_reasons(Import(importer, target, target, 1, binds_package=binds))

    assert reasons("hf_tpu.compile_cache", "hf_tpu")
    assert reasons("hf_tpu.selftest", "hf_tpu.sim", binds=True)
    assert reasons("hf_tpu.serving._selftest", "hf_tpu.serving")
    assert reasons("hf_tpu.benchmarks.__main__", "hf_tpu.benchmarks")
    assert reasons("hf_tpu.serving.tensor_parallel", "hf_tpu.cli.main")
    assert reasons("hf_tpu.sim._public_api", "hf_tpu.distributed.launch")
    assert len(reasons("hf_tpu.sim._counters", "hf_tpu.distributed.launch", binds=True)) == 2
    assert reasons("hf_tpu.cli.warmup", "hf_tpu") == []
    assert reasons("hf_tpu.benchmarks.generate", "hf_tpu", binds=True) == []
    assert reasons("hf_tpu.benchmarks.generate", "hf_tpu.cli.main") == []
    assert reasons("hf_tpu.distributed._bootstrap", "hf_tpu.sim")
    assert reasons("hf_tpu._shared.buckets", "hf_tpu.transformers.generation")
    assert reasons("hf_tpu._shared.notes", "hf_tpu.errors") == []
    assert reasons("hf_tpu.sim._ops", "hf_tpu.transformers._settings")
    assert reasons("hf_tpu.distributed.tp_plan", "hf_tpu.runtime") == []

    def siblings(importer: str, imported: str) -> list[str]:
        return sibling_reasons(Import(importer, imported, module_of(imported) or imported, 1))

    assert siblings("hf_tpu.transformers.warmup", "hf_tpu.encoders.warmup")  # public, but strangers
    assert siblings("hf_tpu.encoders.route", "hf_tpu.transformers.buckets.BucketLadder")
    assert siblings("hf_tpu.serving._step_graphs", "hf_tpu.transformers._graphs.model_identity")
    assert siblings("hf_tpu.serving.server", "hf_tpu.transformers.generation._helper")
    assert siblings("hf_tpu.serving.server", "hf_tpu.transformers.generation") == []  # a public seam
    assert siblings("hf_tpu._warmup", "hf_tpu.encoders.warmup") == []  # the facade, above both
    assert siblings("hf_tpu.encoders.route", "hf_tpu._shared.buckets.BucketLadder") == []
    assert reasons("hf_tpu.sim", "hf_tpu.sim._counters") == []
    assert private_part("hf_tpu.transformers._settings.SETTINGS") == "hf_tpu.transformers._settings"
    assert private_part("hf_tpu.transformers.generation._helper") == "hf_tpu.transformers.generation._helper"
    assert third_party_sets("import torch\ntorch._functorch.config.enable_autograd_cache = False") == [
        (2, "torch._functorch.config.enable_autograd_cache")
    ]
    assert third_party_sets("from torch._functorch import config as c\ndef f():\n    setattr(c, 'x', 1)")
    assert third_party_sets("import torch.backends\ntorch.backends.tpu = None")
    assert third_party_sets("import os\nos.sep = '/'\nclass A: pass\nA.x = 1") == []
    assert private_part("hf_tpu.__version__") is None and private_part("hf_tpu.runtime") is None


def test_no_graph_kind_is_joined_or_split_as_text():
    wrong, allowed = [], set()
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        name = path.relative_to(PACKAGE_DIR.parent).as_posix()
        if name == GRAPH_KEY_MODULE:
            continue
        for line, function, code in graph_text_uses(path.read_text()):
            if (name, function) in NOT_GRAPH_KEYS:
                allowed.add((name, function))
            else:
                wrong.append(f"  {name}:{line} (in {function}): {code}")
    assert not wrong, (
        "graph kinds joined or split on '+' (build a GraphKind: hf_tpu.transformers._graph_key; text from outside "
        "goes through GraphKind.parse):\n" + "\n".join(wrong)
    )
    assert allowed == set(NOT_GRAPH_KEYS), f"NOT_GRAPH_KEYS names what no longer splits on '+': {NOT_GRAPH_KEYS}"


def test_the_graph_kind_rule_catches_what_it_names():
    def caught(source: str) -> list[str]:
        return [code for _, _, code in graph_text_uses(source)]

    assert caught('base = kind.split("+", 1)[0]')  # (how _graphs.py read kinds)
    assert caught('features = frozenset(kind.split("+")[1:])')  # (how _graphs.py read the outputs asked)
    assert caught('base, plus, rest = kind.partition("+")')  # (how warm-up read its manifest)
    assert caught('variant = "+" + "+".join(labels)')  # (how the sampling plan named itself)
    assert caught('variant += "+token_type_ids" if types is not None else ""')
    assert caught('def f(n):\n    return f"+beams{n}x2e1" + "+beam_sample"')
    assert caught('key = ("decode" + variant, 1, 32)') == []  # (not seen: concatenating a variable)
    assert caught('def f():\n    """``"+mrope"`` graphs."""\n    return 1') == []  # a docstring names the text
    assert caught('text = f"copies/step={a}+{b} "') == []  # (a "+" between numbers)
    assert caught('x = "a,+b".split(",")') == []
    (found,) = graph_text_uses('def _copies_per_step(cell):\n    return cell.partition("+")')
    assert found[1] == "_copies_per_step"


ENV_MODULE = "hf_tpu/_env.py"
ENV_PREFIX = "HF_TPU_"


def _names_an_env_var(node: ast.AST, bound: set[str]) -> bool:
    """Whether ``node`` names an HF_TPU_* variable: such a string or f-string, an ``_env.X.name``, or a name (or an
    attribute) that :func:`env_name_bindings` found bound to one."""
    if isinstance(node, ast.Constant):
        return isinstance(node.value, str) and node.value.startswith(ENV_PREFIX)
    if isinstance(node, ast.JoinedStr):
        first = node.values[0] if node.values else None
        return isinstance(first, ast.Constant) and str(first.value).startswith(ENV_PREFIX)
    if isinstance(node, ast.Attribute):
        if node.attr == "name" and isinstance(node.value, ast.Attribute):
            root = node.value.value
            if isinstance(root, ast.Name) and root.id == "_env":
                return True
            if isinstance(root, ast.Attribute) and root.attr == "_env":
                return True
        return node.attr in bound
    return isinstance(node, ast.Name) and node.id in bound


def env_name_bindings(sources: list[str]) -> set[str]:
    """The identifiers some assignment in ``sources`` binds to an HF_TPU_* variable's name (``X = "HF_TPU_..."``,
    ``X = _env.Y.name``, ``X = module.X`` of such an ``X``), to a fixed point."""
    assigns = []
    for source in sources:
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Assign):
                names = [t.id if isinstance(t, ast.Name) else t.attr for t in node.targets
                         if isinstance(t, (ast.Name, ast.Attribute))]  # fmt: skip
                assigns.append((names, node.value))
            elif isinstance(node, ast.AnnAssign) and node.value is not None and isinstance(node.target, ast.Name):
                assigns.append(([node.target.id], node.value))
    bound: set[str] = set()
    while True:
        more = {n for names, value in assigns if _names_an_env_var(value, bound) for n in names} - bound
        if not more:
            return bound
        bound |= more


def _is_environ(node: ast.AST) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == "environ") or (
        isinstance(node, ast.Name) and node.id == "environ"
    )


def env_reads(source: str, bound: set[str]) -> list[tuple[int, str]]:
    """(line, code) of every read of an HF_TPU_* variable from ``os.environ`` / ``os.getenv`` in ``source``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        key = None
        if isinstance(node, ast.Call) and node.args:
            func = node.func
            if isinstance(func, ast.Attribute) and func.attr == "get" and _is_environ(func.value):
                key = node.args[0]
            elif (isinstance(func, ast.Attribute) and func.attr == "getenv") or (
                isinstance(func, ast.Name) and func.id == "getenv"
            ):
                key = node.args[0]
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) and _is_environ(node.value):
            key = node.slice
        elif isinstance(node, ast.Compare) and any(isinstance(op, (ast.In, ast.NotIn)) for op in node.ops):
            if any(_is_environ(c) for c in node.comparators):
                key = node.left
        if key is not None and _names_an_env_var(key, bound):
            found.append((node.lineno, ast.unparse(node)))
    return found


def test_hf_tpu_variables_are_read_only_through_the_environment_table():
    sources = {path.relative_to(PACKAGE_DIR.parent).as_posix(): path.read_text() for path in MODULES.values()}
    bound = env_name_bindings(list(sources.values()))
    assert {"KV_WRITE_ENV", "TP_ENV", "DEBUG_ENV"} <= bound  # the names the modules keep for their variables
    wrong = [
        f"  {name}:{line}: {code}"
        for name, source in sorted(sources.items())
        if name != ENV_MODULE
        for line, code in env_reads(source, bound)
    ]
    assert not wrong, (
        "HF_TPU_* variables read outside hf_tpu._env (read them as _env.X.get(); a new variable gets its entry in "
        "the table, with its parser, default, doc and whether it changes a graph):\n" + "\n".join(wrong)
    )


def test_the_environment_rule_catches_what_it_names():
    def caught(source: str, *more: str) -> list[str]:
        return [code for _, code in env_reads(source, env_name_bindings([source, *more]))]

    assert caught('import os\nx = os.environ.get("HF_TPU_KV_WRITE", "auto")')
    assert caught('import os\nx = os.environ["HF_TPU_DEBUG"]')
    assert caught('import os\nx = os.getenv("HF_TPU_DEBUG")')
    assert caught('from os import environ\nx = "HF_TPU_DEBUG" in environ')
    assert caught('import os\ndef f(k):\n    return os.environ.get(f"HF_TPU_{k}")')
    assert caught('import os\nx = os.environ.get(_env.DEBUG.name)')
    assert caught('import os\nENV = "HF_TPU_COMPILE_CACHE"\nx = os.environ.get(ENV, "").strip()')
    # a constant named through the table in one module, read through another module's attribute
    assert caught("import os\nx = os.environ.get(static.KV_WRITE_ENV)", "KV_WRITE_ENV = _env.KV_WRITE.name")
    assert caught('import os\nx = os.environ.get("TORCH_DEVICE_BACKEND_AUTOLOAD")') == []
    assert caught('import os\nos.environ["HF_TPU_SIM_GENERATION"] = "v5p"') == []  # a write for child processes
    assert caught('import os\nos.environ.setdefault("HF_TPU_SIM_HBM", "1")') == []
    assert caught('import os\nx = _env.DEBUG.get()') == []


# Rule 8: the most lines a function of hf_tpu.transformers may take (issue #66).
LONGEST_FUNCTION = 100


def long_functions(source: str, limit: int = LONGEST_FUNCTION) -> list[tuple[int, str, int]]:
    """``(line, name, lines)`` of each function (nested ones too) of ``source`` over ``limit`` lines."""
    return [
        (node.lineno, node.name, node.end_lineno - node.lineno + 1)
        for node in ast.walk(ast.parse(source))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno + 1 > limit
    ]


def test_no_function_of_the_transformers_room_is_over_the_longest():
    room = PACKAGE_DIR / "transformers"
    paths = sorted(room.rglob("*.py"))
    assert len(paths) > 20  # (the room is read)
    wrong = [
        f"  {path.relative_to(PACKAGE_DIR.parent).as_posix()}:{line} {name}: {lines} lines"
        for path in paths
        for line, name, lines in long_functions(path.read_text())
    ]
    assert not wrong, (
        f"functions of hf_tpu.transformers over {LONGEST_FUNCTION} lines (split each into named steps):\n"
        + "\n".join(wrong)
    )


def test_the_function_length_rule_catches_what_it_names():
    body = "".join(f"    x{i} = {i}\n" for i in range(LONGEST_FUNCTION))
    assert long_functions(f"def f():\n{body}") == [(1, "f", LONGEST_FUNCTION + 1)]
    nested = "".join(f"        x{i} = {i}\n" for i in range(LONGEST_FUNCTION))
    assert long_functions(f"class C:\n    async def g(self):\n{nested}") == [(2, "g", LONGEST_FUNCTION + 1)]
    assert long_functions("def f():\n" + "".join(f"    x{i} = {i}\n" for i in range(LONGEST_FUNCTION - 1))) == []
