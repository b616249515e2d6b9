"""Assemble transformers' own model tests into a folder that ``scripts/run_transformers_tests.py`` runs.

transformers' wheel holds no tests, and its sdist only the common mixins (``tests/*.py``): the generation tests
(``tests/generation/test_utils.py``), ``tests/causal_lm_tester.py`` and the model test files come from a checkout of
its repository. This script copies what the model tests of the families asked for import, from a git directory at a
revision or from a checkout folder, and optionally lays the sdist's ``tests/*.py`` of the installed version over
them. Where the source and the installed transformers differ (a source older than the installed release), it makes
the tree import, and says each thing it did:

* a name the source's tests import from ``transformers.testing_utils`` that the installed version no longer has, and
  that the source's own ``src/transformers/testing_utils.py`` defines as a plain top-level assignment (test settings
  such as ``_TEXT_MODEL_TESTER_DEFAULTS``), is defined in the test file itself, from the source's text;
* a helper module the mixins import that neither source has (``tests/distributed_testing_utils.py``: not in the sdist)
  gets a stand-in whose functions skip the test that calls them (distributed tests only);
* ``src/transformers`` links to the installed package (``tests/test_pipeline_mixin.py`` reads files there).

Nothing is downloaded; the tree lives outside hf_tpu's repository. Example (the tier of docs/generation.md)::

    python scripts/transformers_test_tree.py /tmp/tf-tests --git-dir /path/to/transformers.git --rev v5.24.0 \\
        --sdist transformers-5.24.0.tar.gz --models llama qwen3 gemma gpt2

``--source DIR`` takes a checkout folder instead of ``--git-dir``. Prints the source's and the installed version.
"""

from __future__ import annotations

import argparse
import ast
import io
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

# What the model tests import, besides tests/models/<family>/ (paths in transformers' repository).
COMMON = [
    "conftest.py", "pyproject.toml", "tests/__init__.py", "tests/causal_lm_tester.py", "tests/vlm_tester.py",
    "tests/generation", "tests/exporters", "tests/utils", "tests/models/__init__.py", "utils/test_module",
]  # fmt: skip
STAND_INS = {
    "tests/distributed_testing_utils.py": "transformers' distributed test helpers are not part of this test tree",
}


def _git(git_dir: Path, *args: str) -> bytes:
    return subprocess.run(["git", f"--git-dir={git_dir}", *args], check=True, capture_output=True).stdout


def copy_from_git(git_dir: Path, rev: str, paths: list[str], dest: Path) -> list[str]:
    """Extract ``paths`` (files or folders) at ``rev`` into ``dest``; returns the paths the revision lacks."""
    listed = _git(git_dir, "ls-tree", "-r", "--name-only", rev, "--", *paths).decode().splitlines()
    present = [p for p in paths if any(f == p or f.startswith(p.rstrip("/") + "/") for f in listed)]
    if present:
        archive = _git(git_dir, "archive", "--format=tar", rev, "--", *present)
        with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
            tar.extractall(dest, filter="data")
    return [p for p in paths if p not in present]


def copy_from_checkout(source: Path, paths: list[str], dest: Path) -> list[str]:
    """Copy ``paths`` from a checkout folder into ``dest``; returns the paths it lacks."""
    missing = []
    for path in paths:
        src = source / path
        if src.is_dir():
            shutil.copytree(src, dest / path, dirs_exist_ok=True, ignore=shutil.ignore_patterns("__pycache__"))
        elif src.is_file():
            (dest / path).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / path)
        else:
            missing.append(path)
    return missing


def top_level_tests(git_dir: Path | None, rev: str | None, source: Path | None) -> list[str]:
    """The source's ``tests/*.py`` (the common mixins and testers)."""
    if git_dir is not None:
        names = _git(git_dir, "ls-tree", "--name-only", rev, "tests/").decode().splitlines()
    else:
        names = [f"tests/{p.name}" for p in (source / "tests").iterdir()]
    return sorted(n for n in names if re.fullmatch(r"tests/[A-Za-z0-9_]+\.py", n))


def overlay_sdist(sdist: Path, dest: Path) -> list[str]:
    """Lay the sdist's ``tests/*.py`` and ``pyproject.toml`` over ``dest``; returns the files written."""
    written = []
    with tarfile.open(sdist) as tar:
        for member in tar.getmembers():
            parts = member.name.split("/")
            name = "/".join(parts[1:])
            if member.isfile() and (re.fullmatch(r"tests/[A-Za-z0-9_]+\.py", name) or name == "pyproject.toml"):
                (dest / name).parent.mkdir(parents=True, exist_ok=True)
                (dest / name).write_bytes(tar.extractfile(member).read())
                written.append(name)
    return sorted(written)


def source_text(git_dir: Path | None, rev: str | None, source: Path | None, path: str) -> str | None:
    try:
        if git_dir is not None:
            return _git(git_dir, "show", f"{rev}:{path}").decode()
        return (source / path).read_text()
    except (subprocess.CalledProcessError, OSError):
        return None


def source_version(text: str | None) -> str | None:
    found = re.search(r'^__version__ = "([^"]+)"', text or "", re.M)
    return found[1] if found else None


def _assignments(module_text: str) -> dict[str, str]:
    """Top-level ``NAME = <literal>`` assignments of a module, as source text."""
    tree = ast.parse(module_text)
    found = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            try:
                ast.literal_eval(node.value)
            except ValueError:
                continue
            found[node.targets[0].id] = ast.get_source_segment(module_text, node)
    return found


def inline_removed_names(dest: Path, testing_utils_text: str | None) -> list[str]:
    """Define in the test files the ``transformers.testing_utils`` constants the installed version lacks (see the
    module docstring); returns what was done, and what could not be (those files will not import)."""
    import transformers.testing_utils as installed

    defined = _assignments(testing_utils_text) if testing_utils_text else {}
    notes = []
    for path in sorted((dest / "tests").glob("*.py")) + sorted((dest / "tests" / "generation").glob("*.py")):
        text = path.read_text()
        tree = ast.parse(text)
        for node in tree.body:
            if not (isinstance(node, ast.ImportFrom) and node.module == "transformers.testing_utils"):
                continue
            missing = [a.name for a in node.names if not hasattr(installed, a.name)]
            if not missing:
                continue
            fixable = [n for n in missing if n in defined]
            for name in sorted(set(missing) - set(fixable)):
                notes.append(f"{path.relative_to(dest)}: imports {name}, which neither transformers has: left as is")
            if not fixable:
                continue
            kept = [a for a in node.names if a.name not in fixable]
            lines = text.splitlines(keepends=True)
            block = "".join(lines[node.lineno - 1 : node.end_lineno])
            if kept:
                names = ", ".join(a.name if a.asname is None else f"{a.name} as {a.asname}" for a in kept)
                new = f"from transformers.testing_utils import {names}\n"
            else:
                new = ""
            new += "".join(
                f"\n{defined[n]}  # (from the source's src/transformers/testing_utils.py)\n" for n in fixable
            )
            path.write_text(text.replace(block, new, 1))
            notes.append(
                f"{path.relative_to(dest)}: defined {', '.join(fixable)} (gone from the installed transformers)"
            )
            break  # (one such import per file; parse again if there are more)
    return notes


def write_stand_ins(dest: Path) -> list[str]:
    """Stand-ins for helper modules the mixins import and the tree lacks (see :data:`STAND_INS`)."""
    notes = []
    for rel, why in STAND_INS.items():
        target = dest / rel
        module = Path(rel).stem
        names: set[str] = set()
        for path in (dest / "tests").glob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom) and node.module == module and node.level == 1:
                    names.update(a.name for a in node.names)
        if target.exists() or not names:
            continue
        body = [
            f'"""Stand-in written by hf_tpu\'s scripts/transformers_test_tree.py: {why}."""',
            "import unittest",
            "",
        ]
        body += ["", "def _skip(*args, **kwargs):", f"    raise unittest.SkipTest({why!r})", ""]
        body += [f"{name} = _skip" for name in sorted(names)]
        target.write_text("\n".join(body) + "\n")
        notes.append(f"{rel}: stand-in ({why}; {', '.join(sorted(names))} skip)")
    return notes


def link_installed(dest: Path) -> str:
    import transformers

    link = dest / "src" / "transformers"
    link.parent.mkdir(parents=True, exist_ok=True)
    if link.is_symlink() or link.exists():
        link.unlink()
    link.symlink_to(Path(transformers.__file__).parent, target_is_directory=True)
    return f"src/transformers -> {link.resolve()}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("dest", type=Path, help="the folder to write (a transformers-like tree: conftest.py, tests/, ...)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--git-dir", type=Path, help="a transformers git directory (bare or .git)")
    src.add_argument("--source", type=Path, help="a transformers checkout folder")
    p.add_argument("--rev", default="HEAD", help="the revision of --git-dir (a tag such as v5.24.0, a commit)")
    p.add_argument("--sdist", type=Path, help="the installed version's sdist: its tests/*.py and pyproject.toml win")
    p.add_argument("--models", nargs="+", default=["llama", "qwen3", "gemma", "gpt2"], help="model families")
    a = p.parse_args(argv)
    import transformers

    a.dest.mkdir(parents=True, exist_ok=True)
    git_dir, rev, source = a.git_dir, a.rev if a.git_dir else None, a.source
    paths = COMMON + [f"tests/models/{m}" for m in a.models] + top_level_tests(git_dir, rev, source)
    missing = copy_from_git(git_dir, rev, paths, a.dest) if git_dir else copy_from_checkout(source, paths, a.dest)
    version = source_version(source_text(git_dir, rev, source, "src/transformers/__init__.py"))
    print(f"source: {git_dir or source}{f' at {rev}' if rev else ''} (transformers {version or 'unknown'})")
    print(f"installed: transformers {transformers.__version__}")
    for path in missing:
        print(f"  not in the source: {path}")
    if a.sdist is not None:
        print(f"  from {a.sdist.name}: {len(overlay_sdist(a.sdist, a.dest))} files (tests/*.py, pyproject.toml)")
    notes = inline_removed_names(a.dest, source_text(git_dir, rev, source, "src/transformers/testing_utils.py"))
    notes += write_stand_ins(a.dest)
    notes.append(link_installed(a.dest))
    for note in notes:
        print(f"  {note}")
    print(f"wrote {a.dest}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
