"""Executable documentation: README.md and every page under docs/, read with sybil's markdown lexers.

What a page's blocks mean to the suite (tests/docs/test_docs.py runs them):

* a ```python block runs, in order, in one namespace per page (sybil's ``PythonEvaluator``); what a page takes as
  given (a model ``path``) is set by a hidden ``<!-- invisible-code-block: python ... -->`` block before it;
* a ```bash block is commands a user runs on the simulator, one a line, in a fresh scratch directory (holding
  ``examples``, a link to the repository's, and what the block's commands write), with ``hf-tpu`` and ``python``
  from the suite's own environment and this checkout's ``hf_tpu``. The set-up steps of the README's install line
  (``python3 -m venv``, ``. .venv/bin/activate``, ``pip install ...``) are the environment the suite runs in and
  are not repeated. Each command must exit 0;
* a bare fenced block (no language) right after a ```bash block is the output of its last command (stdout and
  stderr as a terminal shows them), compared line by line (see :func:`match_output`);
* a ```console block is ``$ command`` lines each followed by what it prints (exit status not checked: the output
  says what happened);
* ``<!-- docs-test: heavy -->`` before a command block: it runs in the heavy group (``-m docs_heavy``, run by
  .ci/run, not by the README's test command);
* ``<!-- docs-test: not run: REASON -->`` before a block: not run; a python block must still compile, and an
  ``hf-tpu`` command's flags must still parse with the CLI's own parser, a ``python FILE`` must name a file that
  exists; a bare block right after it is not compared either;
* ``<!-- docs-test: not checked: REASON -->`` before a bare block that follows no command (an excerpt, a layout);
  a bare block with neither is a failure.

Output comparison: each line of the page's block matches one printed line, except ``...`` alone on a line, which
matches any number of lines (zero included), and ``...`` inside a line, which matches any text there (versions,
paths). Times vary: a number followed by ``s``, ``ms`` or ``us`` (``8.294s``, ``(5.7 s)``), a rate
(``1.30s/step``, ``19.92step/s``) and tqdm's ``[elapsed<remaining`` are replaced by placeholders on both sides
before comparing. A progress bar's line is its final state (the text after its last carriage return). Lines
that an optional extra's import prints in the suite's environment but not on the README's plain install
(:data:`ENVIRONMENT_NOISE`) are left out of what was printed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import io
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from _timeouts import SAFETY_TIMEOUT_S
from sybil import Document, Lexeme, Region
from sybil.evaluators.python import PythonEvaluator
from sybil.parsers.markdown.lexers import DirectiveInHTMLCommentLexer, FencedCodeBlockLexer

ROOT = Path(__file__).resolve().parents[2]
#: Pages not read yet, with the reason (each is a page another piece of work is rewriting at the time of writing).
PENDING: dict[str, str] = {}
#: The pages the suite reads, relative to the repository root.
PAGES = ["README.md", *sorted(f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md"))]
PAGES = [page for page in PAGES if page not in PENDING]

#: What the suite's environment prints that a plain ``pip install -e .`` does not (the quant extra's torchao,
#: imported by transformers): left out of a command's output before it is compared.
ENVIRONMENT_NOISE = [
    re.compile(r"^Failed to load .*/torchao/.*"),
    re.compile(r"^W\d{4} [\d:.]+ \d+ .*torch/utils/_pytree\.py:\d+\] <enum '\w+'> is an Enum subclass"),
    re.compile(r"^Unable to import `torchao` Tensor objects"),
]

#: Install steps of the README's command line: the suite already runs in the environment they make.
_SETUP_STEP = re.compile(r"^(python3? -m venv \S+|\. \S*/bin/activate|source \S*/bin/activate|pip install .*)$")

_FENCES = FencedCodeBlockLexer(language=r"[\w+-]*", mapping={"language": "language", "source": "source"})
_DIRECTIVES = DirectiveInHTMLCommentLexer(directive="docs-test", arguments=".+?")
_INVISIBLE = DirectiveInHTMLCommentLexer(directive="invisible-code-block", arguments="python")


@dataclasses.dataclass
class Commands:
    """A command block: its commands (one a line, set-up steps dropped), the output shown after it."""

    kind: str  # "bash" or "console"
    commands: list[str]
    outputs: list[str | None]  # the output shown after each command (None: not shown)
    heavy: bool = False


@dataclasses.dataclass
class NotRun:
    """A block the suite does not run, with the reason the page gives."""

    language: str
    source: str
    reason: str
    output: str | None = None  # the output block shown after it, for a test that runs the command elsewhere


@dataclasses.dataclass
class Problem:
    """Something on a page the suite cannot check, as a failure to report."""

    message: str


def _directive(args: str) -> tuple[str, str]:
    args = args.strip().rstrip("-").strip()
    for name in ("heavy", "not run", "not checked"):
        if args == name or args.startswith(name + ":"):
            return name, args[len(name) + 1 :].strip()
    raise ValueError(f"unknown docs-test directive {args!r} (heavy, not run: REASON, not checked: REASON)")


def _setup_free(line: str) -> str:
    """The command line without the README's install steps (``&&``-joined); empty when only those remain."""
    parts = [p.strip() for p in line.split(" && ")]
    return " && ".join(p for p in parts if not _SETUP_STEP.match(p))


def _console(source: str) -> tuple[list[str], list[str | None]]:
    commands: list[str] = []
    outputs: list[str | None] = []
    for line in source.splitlines():
        if line.startswith("$ "):
            commands.append(line[2:])
            outputs.append("")
        elif not commands:
            raise ValueError("a console block starts with a '$ command' line")
        else:
            outputs[-1] += line + "\n"
    return commands, outputs


class PageParser:
    """A sybil parser for a page's fenced blocks and docs-test directives, as described in the module docstring."""

    def __call__(self, document: Document):
        items = [("fence", r) for r in _FENCES(document)]
        items += [("directive", r) for r in _DIRECTIVES(document)]
        items += [("invisible", r) for r in _INVISIBLE(document)]
        items.sort(key=lambda item: item[1].start)
        directive: tuple[str, str] | None = None
        i = 0
        while i < len(items):
            kind, region = items[i]
            i += 1
            if kind == "directive":
                directive = _directive(region.lexemes["arguments"])
                continue
            if kind == "invisible":
                yield Region(region.start, region.end, region.lexemes["source"], PythonEvaluator())
                continue
            language = region.lexemes["language"]
            source: Lexeme = region.lexemes["source"]
            name, reason = directive or ("", "")
            directive = None
            output_region = None
            following = items[i] if i < len(items) else None
            if language == "bash" and following and following[0] == "fence" and not following[1].lexemes["language"]:
                output_region = items[i][1]
                i += 1
            end = output_region.end if output_region is not None else region.end
            if name == "not run":
                shown = str(output_region.lexemes["source"]) if output_region is not None else None
                yield Region(region.start, end, NotRun(language, str(source), reason, shown), check_not_run)
            elif name == "not checked" and not language:
                continue
            elif name in ("not checked", "heavy") and language not in ("bash", "console"):
                yield Region(region.start, end, Problem(f"'docs-test: {name}' does not apply to a ```{language} "
                                                        "block"), report_problem)
            elif language == "python":
                yield Region(region.start, region.end, source, PythonEvaluator())
            elif language == "bash":
                lines = [_setup_free(line) for line in str(source).replace("\\\n", " ").splitlines() if line.strip()]
                commands = [line for line in lines if line]
                outputs: list[str | None] = [None] * len(commands)
                if output_region is not None:
                    outputs[-1] = str(output_region.lexemes["source"])
                yield Region(region.start, end, Commands("bash", commands, outputs, heavy=name == "heavy"),
                             run_commands)
            elif language == "console":
                commands, outputs = _console(str(source))
                yield Region(region.start, end, Commands("console", commands, outputs, heavy=name == "heavy"),
                             run_commands)
            elif not language:
                yield Region(region.start, end, Problem(
                    "a block of output that follows no ```bash block and is not marked "
                    "'<!-- docs-test: not checked: REASON -->'"), report_problem)
            else:
                yield Region(region.start, end, Problem(
                    f"a ```{language} block: the suite runs python, bash and console blocks; mark it "
                    "'<!-- docs-test: not run: REASON -->'"), report_problem)


def shown_output(page: str, command: str) -> str:
    """The output a page shows after ``command`` in a block it does not run (a test that runs that command itself
    compares its output with the page's through :func:`match_output`)."""
    document = Document.parse(str(ROOT / page), PageParser())
    for example in document.examples():
        block = example.parsed
        if isinstance(block, NotRun) and block.output is not None and block.source.strip() == command:
            return block.output
    raise LookupError(f"{page} shows no output of `{command}` in a block marked 'not run'")


def report_problem(example) -> str:
    return example.parsed.message


# -- output comparison ----------------------------------------------------------------------------------------------

_TIME = re.compile(r"(?<![\w.])\d+(?:\.\d+)? ?(?:s|ms|us|µs)(?![\w])")
_UNITS = r"(?:step|shape|check|it|tok|token)"
_RATE = re.compile(rf"(?<![\w.])(?:\d+(?:\.\d+)?|\?){_UNITS}s?/s\b|<t>/{_UNITS}\b")
_TQDM_ELAPSED = re.compile(r"\[\d+:\d+(?::\d+)?<[\d:?]+")


def normalize(line: str) -> str:
    """One line with its times, rates and tqdm elapsed/remaining replaced by placeholders, trailing space cut."""
    line = _TIME.sub("<t>", line)
    line = _RATE.sub("<rate>", line)
    line = _TQDM_ELAPSED.sub("[<elapsed>", line)
    line = re.sub(r", +<rate>", ", <rate>", line)
    line = re.sub(r" +<t>", " <t>", line)  # a right-aligned time column: its padding follows the number's width
    return line.rstrip()


def printed_lines(text: str) -> list[str]:
    """What a terminal shows of ``text``: each line's last carriage-return segment, without environment noise."""
    lines = []
    for raw in text.split("\n"):
        segments = [s for s in raw.split("\r") if s.strip()]
        line = segments[-1] if segments else ""
        if any(p.search(line) for p in ENVIRONMENT_NOISE):
            continue
        lines.append(normalize(line))
    while lines and not lines[-1]:
        lines.pop()
    while lines and not lines[0]:
        lines.pop(0)
    return lines


def _pattern(expected: list[str]) -> re.Pattern:
    parts = []
    for line in expected:
        if line.strip() == "...":
            parts.append(r"(?:[^\n]*\n)*?")
        else:
            parts.append(".*?".join(re.escape(piece) for piece in line.split("...")) + r"\n")
    return re.compile("".join(parts))


def match_output(expected: str, actual: str) -> str | None:
    """None when ``actual`` (what a command printed) matches the page's ``expected``; else a diff to show."""
    shown = [normalize(line) for line in expected.strip("\n").split("\n")]
    printed = printed_lines(actual)
    if _pattern(shown).fullmatch("".join(line + "\n" for line in printed)):
        return None
    diff = difflib.unified_diff(shown, printed, "the page shows", "the command printed", lineterm="")
    return "\n".join(diff)


# -- running commands -----------------------------------------------------------------------------------------------


def command_env(scratch: Path) -> dict[str, str]:
    """The environment of a page's commands: the suite's Python first on PATH, this checkout's hf_tpu."""
    env = os.environ.copy()
    bindir = str(Path(sys.executable).parent)
    env["PATH"] = os.pathsep.join([bindir, env.get("PATH", "")])
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["PYTHONUNBUFFERED"] = "1"  # stdout and stderr interleave as on a terminal
    # a page's `~` is the scratch directory (a `--compile-cache ~/...` starts empty), the native core's build shared
    env["HF_TPU_CACHE"] = env.get("HF_TPU_CACHE") or str(Path.home() / ".cache" / "hf_tpu")
    env["HOME"] = str(scratch)
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")
    # a page's commands compute as a user's do: at torch_tpu's default float32 matmul precision, not the suite's
    for name in ("HF_TPU_SIMULATE", "HF_TPU_DEBUG", "PYTEST_CURRENT_TEST", "COLUMNS", "HF_TPU_SIM_MATMUL_PRECISION"):
        env.pop(name, None)
    return env


def scratch_dir() -> Path:
    scratch = Path(tempfile.mkdtemp(prefix="hf_tpu_docs_"))
    (scratch / "examples").symlink_to(ROOT / "examples")
    # the scratch directory is also $HOME: curl shows its progress meter only when its output is not a terminal
    (scratch / ".curlrc").write_text("--silent\n--show-error\n")
    return scratch


def run_commands(example) -> str | None:
    block: Commands = example.parsed
    scratch = scratch_dir()
    server: Server | None = None
    try:
        env = command_env(scratch)
        for command, shown in zip(block.commands, block.outputs):
            if Server.starts(command):
                if server is not None:
                    server.stop()
                server = Server(command, scratch, env)
                problem = server.wait_ready()
                if problem:
                    return problem
                if shown is not None:  # what it printed up to `ready`
                    diff = match_output(shown, "".join(server.lines))
                    if diff is not None:
                        return f"`{command}` printed other than the page shows:\n{diff}"
                continue
            proc = subprocess.run(
                ["bash", "-c", "set -o pipefail; " + command], cwd=scratch, env=env, stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT, timeout=SAFETY_TIMEOUT_S,
            )
            printed = proc.stdout.decode(errors="replace")  # bytes: text mode would turn a bar's \r into lines
            if block.kind == "bash" and proc.returncode != 0:
                tail = "\n".join(printed.splitlines()[-40:])
                return f"`{command}` exited with status {proc.returncode}:\n{tail}"
            if shown is not None:
                diff = match_output(shown, printed)
                if diff is not None:
                    return f"`{command}` printed other than the page shows:\n{diff}"
        return None
    finally:
        if server is not None:
            server.stop()
        shutil.rmtree(scratch, ignore_errors=True)


class Server:
    """An ``hf-tpu serve`` command of a page: started in the background, ready once it says so, stopped (SIGTERM to
    its process group) before the block's next server or at the block's end. The block's other commands (a
    ``curl``) run while it listens."""

    READY = re.compile(r"^hf-tpu serve: warm-up done .*; ready$")

    @staticmethod
    def starts(command: str) -> bool:
        words = shlex.split(command, comments=True)
        return words[:2] == ["hf-tpu", "serve"] or words[:3] == ["hf-tpu", "--simulate", "serve"]

    def __init__(self, command: str, cwd: Path, env: dict[str, str]):
        self.command = command
        self.lines: list[str] = []
        self.proc = subprocess.Popen(
            ["bash", "-c", "exec " + command], cwd=cwd, env=env, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True, start_new_session=True,
        )

    def wait_ready(self) -> str | None:
        for line in self.proc.stdout:
            self.lines.append(line)
            if self.READY.match(line.strip()):
                threading.Thread(target=self._drain, daemon=True).start()
                return None
        self.proc.wait()
        tail = "".join(self.lines[-40:])
        return f"`{self.command}` ended (status {self.proc.returncode}) before it was ready:\n{tail}"

    def _drain(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=SAFETY_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def check_not_run(example) -> str | None:
    """A block the suite does not run must still be true to the code: python compiles, flags parse, files exist."""
    block: NotRun = example.parsed
    if not block.reason:
        return "'docs-test: not run' needs a reason after a colon"
    if block.language == "python":
        try:
            compile(block.source, example.path, "exec")
        except SyntaxError as err:
            return f"the python block does not compile: {err}"
        return None
    if block.language not in ("bash", "console"):
        return None
    if block.language == "console":
        lines, _ = _console(block.source)
    else:
        lines = [_setup_free(line) for line in block.source.replace("\\\n", " ").splitlines()]
    for line in lines:
        for part in line.split(" && "):
            problem = check_command_words(part.strip())
            if problem:
                return problem
    return None


def check_command_words(command: str) -> str | None:
    """An ``hf-tpu`` command's flags parse with the CLI's parser; a ``python FILE`` names a file that exists."""
    if not command or command.startswith("#"):
        return None
    # a usage line's optional part `[--flag VALUE]` is checked as given; a shell variable ($NODE_RANK) as a number
    command = re.sub(r"\$\{?[A-Za-z_]\w*\}?", "1", command)
    words = [w.strip("[]") for w in shlex.split(command, comments=True)]
    words = [w for w in words if w]
    while words and re.match(r"^[A-Z_][A-Z0-9_]*=", words[0]):  # VAR=value before the command
        words.pop(0)
    if not words:
        return None
    if words[0] == "hf-tpu":
        from hf_tpu.cli.main import build_parser

        argv = words[1:]
        parser = build_parser(argv)
        said = io.StringIO()
        try:
            with contextlib.redirect_stderr(said), contextlib.redirect_stdout(io.StringIO()):
                parser.parse_args(argv)
        except SystemExit as exit_:
            if exit_.code:
                return f"`{command}`: hf-tpu's parser refuses it: {said.getvalue().strip().splitlines()[-1]}"
        return None
    if words[0] in ("python", "python3") and len(words) > 1 and words[1].endswith(".py"):
        if not (ROOT / words[1]).exists():
            return f"`{command}`: {words[1]} does not exist in the repository"
    return None
