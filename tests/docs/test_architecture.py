"""docs/architecture.md names only what exists: every ``hf_tpu.x.y`` it writes is a module of the package, or a name
defined at the top level of one (read with :mod:`ast`, nothing imported)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "architecture.md"
DOTTED = re.compile(r"\bhf_tpu(?:\.[A-Za-z_]\w*)*")


def module_file(dotted: str) -> Path | None:
    path = ROOT.joinpath(*dotted.split("."))
    for candidate in (path.with_suffix(".py"), path / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def top_level_names(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.parse(path.read_text(), filename=str(path)).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(alias.asname or alias.name).split(".")[0] for alias in node.names}
    return names


def missing(dotted: str) -> str | None:
    """Why ``dotted`` names nothing (None when it names a module, or a top-level name of one)."""
    if module_file(dotted) is not None:
        return None
    module, _, name = dotted.rpartition(".")
    path = module_file(module) if module else None
    if path is None:
        return f"{dotted}: no such module (nor {module})"
    if name not in top_level_names(path):
        return f"{dotted}: {module} ({path.relative_to(ROOT)}) defines no {name!r}"
    return None


def test_every_module_the_architecture_page_names_exists():
    named = sorted(set(DOTTED.findall(PAGE.read_text())))
    assert len(named) > 20, named  # the page names the engine's modules; a regex that finds none checks nothing
    wrong = [why for why in map(missing, named) if why]
    assert not wrong, "docs/architecture.md names what does not exist:\n" + "\n".join(f"  {w}" for w in wrong)


def test_the_check_refuses_a_module_or_name_that_does_not_exist():
    assert missing("hf_tpu.transformers.route") is None
    assert missing("hf_tpu._patch.patch") is None
    assert missing("hf_tpu.transformers.no_such_module")
    assert missing("hf_tpu.transformers.route.no_such_name")
    assert missing("hf_tpu.no_such.thing")
