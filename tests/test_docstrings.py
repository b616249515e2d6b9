"""Public entry points carry Google-style ``Args:``/``Returns:``/``Raises:`` sections (issue #33).

The names walked are the ``__all__`` of each public module below. For each public function (a
``contextlib.contextmanager`` is read through ``__wrapped__``), and for each public method a public class defines
itself, the docstring must have:

- ``Args:`` when the callable takes a parameter (``self``/``cls`` aside), and name every parameter there;
- ``Returns:`` when its own body returns a value (a ``return`` with something other than ``None``), or
  ``Yields:`` when it is a generator that yields a value (a context manager's ``as`` target);
- ``Raises:`` naming each exception class its own body raises by name (``raise SomeError(...)``); a bare
  re-raise and exceptions raised by helpers it calls are not read.

A public class with a hand-written ``__init__`` that takes parameters names them under ``Args:`` (or
``Attributes:``); a dataclass names its public fields under ``Attributes:`` (or ``Args:``). Exception classes are
skipped: users catch them, they do not call them. Everything is read with :mod:`inspect` and :mod:`ast`; nothing
is run. ``ALLOWED`` lists, with reasons, the few names a section cannot apply to; ``PENDING`` what is left to do.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import re
import textwrap

import pytest

MODULES = (
    "hf_tpu",
    "hf_tpu.compile_cache",
    "hf_tpu.device_map",
    "hf_tpu.diffusers",
    "hf_tpu.distributed",
    "hf_tpu.distributed.launch",
    "hf_tpu.distributed.sim_backend",
    "hf_tpu.distributed.tp_plan",
    "hf_tpu.encoders",
    "hf_tpu.kernels",
    "hf_tpu.launch",
    "hf_tpu.quantization",
    "hf_tpu.ray",
    "hf_tpu.ray.batch",
    "hf_tpu.ray.local",
    "hf_tpu.runtime",
    "hf_tpu.serving",
    "hf_tpu.sim",
    "hf_tpu.sim.execution_mode",
    "hf_tpu.testing",
    "hf_tpu.tpu_compile",
    "hf_tpu.training",
    "hf_tpu.transformers",
)

# (module, qualified name) -> why a section cannot apply. Keep it short and give each entry its reason. An entry
# naming a class covers its constructor and methods.
ALLOWED: dict[tuple[str, str], str] = {
    ("hf_tpu.distributed.sim_backend", "SimulatedTPUProcessGroup"): (
        "a torch.distributed c10d backend: torch constructs it through register()'s creator and calls its methods "
        "(allreduce, broadcast, ...) with the signatures of torch's ProcessGroup, documented there; users call "
        "torch.distributed, never these"
    ),
}

# Entries still to do, each with why it is not done yet. test_pending_entries_still_fail makes sure an entry leaves
# this list once its docstring is fixed.
PENDING: dict[tuple[str, str], str] = {}

SECTION = re.compile(r"^(\w[\w ]*):\s*$")


def sections(doc: str) -> dict[str, str]:
    """The docstring's Google-style sections, by title (``Args``, ``Returns``, ...), each with its body."""
    found: dict[str, list[str]] = {}
    current = None
    for line in inspect.cleandoc(doc).splitlines():
        match = SECTION.match(line)
        if match and not line.startswith(" "):
            current = match.group(1)
            found[current] = []
        elif current is not None:
            if line and not line.startswith(" "):
                current = None
            else:
                found[current].append(line)
    return {title: "\n".join(lines) for title, lines in found.items()}


def documented_names(section: str) -> set[str]:
    """The names a section documents: each entry line starts with them (``x: ...``, ``*names: ...``, ``backend,
    fullgraph: ...`` for several at once, ``x (int): ...``)."""
    names = set()
    for line in section.splitlines():
        match = re.match(r"^\s+([\w*][\w*,\s]*?)\s*(\([^)]*\))?:", line)
        if match:
            names.update(part.strip().lstrip("*") for part in match.group(1).split(","))
    return names


def own_body(tree: ast.AST) -> list[tuple[ast.AST, frozenset[str]]]:
    """The nodes of the function's own body (not those of functions, lambdas or classes nested in it), each with
    the exception names caught around it in that body (``try: ... except (OSError, ValueError):``)."""
    nodes: list[tuple[ast.AST, frozenset[str]]] = []
    stack = [(child, frozenset()) for child in ast.iter_child_nodes(tree)]
    while stack:
        node, caught = stack.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            continue
        nodes.append((node, caught))
        if isinstance(node, ast.Try):
            names = set()
            for handler in node.handlers:
                types = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
                names.update(t.id if isinstance(t, ast.Name) else getattr(t, "attr", "BaseException") for t in types)
            stack.extend((child, caught | names) for child in node.body)
            for part in (node.handlers, node.orelse, node.finalbody):
                stack.extend((child, caught) for child in part)
        else:
            stack.extend((child, caught) for child in ast.iter_child_nodes(node))
    return nodes


def function_tree(func) -> ast.FunctionDef | ast.AsyncFunctionDef:
    source = textwrap.dedent(inspect.getsource(func))
    node = ast.parse(source).body[0]
    assert isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)), func
    return node


def is_none(node: ast.AST | None) -> bool:
    return node is None or (isinstance(node, ast.Constant) and node.value is None)


def raised_names(nodes: list[tuple[ast.AST, frozenset[str]]]) -> set[str]:
    """The exception classes raised by name and not caught again in the same body."""
    names = set()
    for node, caught in nodes:
        if isinstance(node, ast.Raise) and node.exc is not None:
            exc = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
            name = exc.id if isinstance(exc, ast.Name) else getattr(exc, "attr", "")
            if name[:1].isupper() and not caught & {name, "Exception", "BaseException"}:
                names.add(name)
    return names


def function_problems(func, *, method: bool = False) -> list[str]:
    """What the docstring of ``func`` lacks, by the rules of this module's docstring."""
    func = inspect.unwrap(func)
    doc = inspect.getdoc(func) or ""
    found = sections(doc)
    problems = []
    params = [
        name
        for index, (name, param) in enumerate(inspect.signature(func).parameters.items())
        if not (method and index == 0 and name in ("self", "cls"))
    ]
    if params:
        args = found.get("Args", "")
        if not args:
            problems.append("no Args: section")
        else:
            named = documented_names(args)
            missing = [name for name in params if name not in named]
            if missing:
                problems.append(f"Args: does not name {missing}")
    body = own_body(function_tree(func))
    returns_value = any(isinstance(n, ast.Return) and not is_none(n.value) for n, _ in body)
    yields_value = any(isinstance(n, (ast.Yield, ast.YieldFrom)) and not is_none(n.value) for n, _ in body)
    if returns_value and "Returns" not in found:
        problems.append("returns a value but has no Returns: section")
    if yields_value and "Yields" not in found and "Returns" not in found:
        problems.append("yields a value but has no Yields: section")
    raised = raised_names(body)
    if raised:
        text = found.get("Raises", "")
        missing = sorted(name for name in raised if not re.search(rf"\b{name}\b", text))
        if missing:
            problems.append(f"Raises: does not name {missing}")
    return problems


def class_problems(cls) -> dict[str, list[str]]:
    """What the docstrings of class ``cls`` and of its own public methods lack."""
    out: dict[str, list[str]] = {}
    found = sections(inspect.getdoc(cls) or "")
    init = cls.__dict__.get("__init__")
    if dataclasses.is_dataclass(cls):
        params = [f.name for f in dataclasses.fields(cls)]
    elif init is not None and inspect.isfunction(init):
        params = list(inspect.signature(init).parameters)[1:]
    else:
        params = []
    params = [name for name in params if not name.startswith("_")]
    if params:
        text = found.get("Args", "") + "\n" + found.get("Attributes", "")
        named = documented_names(text)
        missing = [name for name in params if name not in named]
        if missing:
            out[cls.__qualname__] = [f"Args:/Attributes: do not name {missing}"]
    for name, attr in vars(cls).items():
        if name.startswith("_"):
            continue
        if isinstance(attr, (staticmethod, classmethod)):
            func, method = attr.__func__, isinstance(attr, classmethod)
        elif inspect.isfunction(attr):
            func, method = attr, True
        else:
            continue  # properties and plain attributes are described in the class docstring
        problems = function_problems(func, method=method)
        if problems:
            out[f"{cls.__qualname__}.{name}"] = problems
    return out


def public_objects():
    for module_name in MODULES:
        module = importlib.import_module(module_name)
        for name in module.__all__:
            obj = getattr(module, name)
            if inspect.isclass(obj) or callable(obj) and inspect.isfunction(inspect.unwrap(obj)):
                yield module_name, name, obj


def problems_of(module_name: str, obj, *, skip: tuple[dict, ...] | None = None) -> dict[str, list[str]]:
    skip = (ALLOWED, PENDING) if skip is None else skip
    if inspect.isclass(obj):
        if issubclass(obj, BaseException):
            return {}
        found = class_problems(obj)
    else:
        found = {obj.__name__: function_problems(obj)}
    return {
        qualname: problems
        for qualname, problems in found.items()
        if problems
        and not any((module_name, name) in listed for listed in skip for name in (qualname, qualname.split(".")[0]))
    }


@pytest.mark.parametrize("module_name", MODULES)
def test_public_entry_points_document_args_returns_raises(module_name):
    failures = []
    for mod, name, obj in public_objects():
        if mod != module_name:
            continue
        for qualname, problems in problems_of(mod, obj).items():
            failures.append(f"{mod}.{name} ({qualname}): {'; '.join(problems)}")
    assert not failures, "public docstrings lack sections:\n" + "\n".join(failures)


def test_every_public_submodule_is_walked():
    """A module named in a walked ``__all__`` (``hf_tpu.distributed.launch``) is public too: walk its ``__all__``."""
    missing = []
    for module_name in MODULES:
        module = importlib.import_module(module_name)
        for name in module.__all__:
            obj = getattr(module, name)
            if inspect.ismodule(obj) and obj.__name__.startswith("hf_tpu") and obj.__name__ not in MODULES:
                missing.append(f"{module_name}.{name} ({obj.__name__})")
    assert not missing, f"add to MODULES: {missing}"


def test_the_allow_list_names_only_existing_public_names():
    names = {(mod, name) for mod, name, _ in public_objects()}
    for (mod, qualname), reason in {**ALLOWED, **PENDING}.items():
        assert (mod, qualname.split(".")[0]) in names, (mod, qualname)
        assert reason.strip(), (mod, qualname)


def test_pending_entries_still_fail():
    objects = {(mod, name): obj for mod, name, obj in public_objects()}
    for mod, qualname in PENDING:
        found = problems_of(mod, objects[(mod, qualname.split(".")[0])], skip=(ALLOWED,))
        assert qualname in found, f"{mod}.{qualname} is documented now: remove it from PENDING"


def _sample(doc: str):
    def func(a, b=1):
        return a + b

    func.__doc__ = doc
    return func


@pytest.mark.parametrize(
    "doc, expected",
    [
        ("Add.", ["no Args: section", "returns a value but has no Returns: section"]),
        ("Add.\n\nArgs:\n    a: one.\n\nReturns:\n    The sum.", ["Args: does not name ['b']"]),
        ("Add.\n\nArgs:\n    a: one.\n    b: two.\n\nReturns:\n    The sum.", []),
    ],
)
def test_the_check_catches_each_missing_section(doc, expected):
    assert function_problems(_sample(doc)) == expected


def test_the_check_reads_raises_and_yields():
    def raiser(x):
        """Check.

        Args:
            x: the value.
        """
        if x:
            raise ValueError("x")
        try:
            raise KeyError(x)  # caught below: not a Raises: entry
        except (KeyError, OSError):
            pass
        yield x

    assert function_problems(raiser) == [
        "yields a value but has no Yields: section",
        "Raises: does not name ['ValueError']",
    ]
