"""Per-test durations of a CI run, kept next to the suite so that the next change sees what grew.

``.ci/run`` has pytest write a JUnit XML file per step (``--junitxml``) and calls this script twice:

    python scripts/test_durations.py record .ci-out/core.xml --tier core --wall 512 --out .ci-out/durations.json
    python scripts/test_durations.py compare .ci-out/durations.json tests/durations.json

    python scripts/test_durations.py failures .ci-out/*.xml

``record`` adds one tier's tests (node id -> seconds, the call with its set-up and tear-down, as JUnit counts them)
and the step's wall-clock seconds to a JSON file; ``compare`` prints, against the committed ``tests/durations.json``,
each tier's wall time then and now, the tests that grew by more than ``--grew`` seconds (and 50%), and new tests
slower than ``--new`` seconds. It never fails a run on a figure (these hosts are noisy); it exits non-zero only on a
file it cannot read. ``failures`` prints each failed or errored test of the given files with the first lines of its
message: ``.ci/run`` calls it last, so that the end of CI's output (often all a reader sees) names what failed. To
refresh the committed figures after a change, copy the run's file over
``tests/durations.json`` (CI prints where it wrote it).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import xml.etree.ElementTree as ET
from pathlib import Path


def read_junit(path: Path) -> dict[str, float]:
    """``{node id: seconds}`` of every test case in a JUnit XML file written by pytest (``--junitxml``)."""
    out: dict[str, float] = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        classname, name = case.get("classname", ""), case.get("name", "")
        name = re.sub(r"@[^\[\]@]*$", "", name)  # (under --dist loadgroup xdist appends "@<group>" to the name)
        module = classname.replace(".", "/")
        # pytest writes classname "tests.pkg.test_mod" (or "...test_mod.TestClass"); keep it readable and stable.
        out[f"{module}::{name}"] = out.get(f"{module}::{name}", 0.0) + float(case.get("time", 0.0) or 0.0)
    return out


def read_failures(path: Path) -> list[tuple[str, str, str]]:
    """``(node id, 'failed' or 'error', message)`` of every test case in a JUnit XML file that failed or errored."""
    out = []
    for case in ET.parse(path).getroot().iter("testcase"):
        for kind, tag in (("failed", "failure"), ("error", "error")):
            for bad in case.iter(tag):
                classname, name = case.get("classname", ""), re.sub(r"@[^\[\]@]*$", "", case.get("name", ""))
                message = (bad.get("message") or "").strip() or (bad.text or "").strip()
                out.append((f"{classname.replace('.', '/')}::{name}", kind, message))
    return out


def failures(args: argparse.Namespace) -> int:
    found = []
    for name in args.junit:
        path = Path(name)
        if not path.exists():
            print(f"  (no {path}: that step wrote no JUnit file)")
            continue
        found += [(path.stem, *row) for row in read_failures(path)]
    if not found:
        print("no test failed or errored in " + ", ".join(Path(n).name for n in args.junit))
        return 0
    print(f"{len(found)} {'test' if len(found) == 1 else 'tests'} failed or errored:")
    for tier, node, kind, message in found[: args.limit]:
        lines = [line for line in message.splitlines() if line.strip()][: args.lines]
        print(f"  {kind.upper()} {tier}:{node}")
        for line in lines:
            print(f"      {line[:300]}")
    if len(found) > args.limit:
        print(f"  ... and {len(found) - args.limit} more")
    return 0


def record(args: argparse.Namespace) -> int:
    target = Path(args.out)
    data = json.loads(target.read_text()) if target.exists() else {"tiers": {}, "tests": {}}
    tests = read_junit(Path(args.junit))
    data["tiers"][args.tier] = {"wall_s": args.wall, "tests": len(tests), "sum_s": round(sum(tests.values()), 1)}
    data["tests"].update({f"{args.tier}:{k}": round(v, 2) for k, v in tests.items()})
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    return 0


def compare(args: argparse.Namespace) -> int:
    now = json.loads(Path(args.now).read_text())
    then_path = Path(args.then)
    then = json.loads(then_path.read_text()) if then_path.exists() else {"tiers": {}, "tests": {}}
    print(f"tier wall times (s), this run vs {then_path}:")
    for tier, row in sorted(now["tiers"].items()):
        old = then["tiers"].get(tier, {})
        print(f"  {tier:<14} {row['wall_s']:>6}s  {row['tests']:>5} tests   "
              f"(then {old.get('wall_s', '-')}s, {old.get('tests', '-')} tests)")  # fmt: skip
    grew = [(k, then["tests"][k], v) for k, v in now["tests"].items()
            if k in then["tests"] and v - then["tests"][k] > args.grew and v > 1.5 * then["tests"][k]]  # fmt: skip
    new = [(k, v) for k, v in now["tests"].items() if k not in then["tests"] and v > args.new]
    if grew:
        print(f"tests that grew by more than {args.grew:g} s:")
        for k, old, v in sorted(grew, key=lambda r: r[1] - r[2]):
            print(f"  {v:8.1f}s (was {old:.1f}s)  {k}")
    if new:
        print(f"new tests slower than {args.new:g} s:")
        for k, v in sorted(new, key=lambda r: -r[1]):
            print(f"  {v:8.1f}s  {k}")
    if not grew and not new:
        print("no test grew or arrived slow")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("record", help="add one tier's JUnit durations to a durations JSON file")
    r.add_argument("junit")
    r.add_argument("--tier", required=True)
    r.add_argument("--wall", type=int, required=True, help="the step's wall-clock seconds")
    r.add_argument("--out", required=True)
    c = sub.add_parser("compare", help="print what grew against the committed durations")
    c.add_argument("now")
    c.add_argument("then")
    c.add_argument("--grew", type=float, default=10.0)
    c.add_argument("--new", type=float, default=20.0)
    f = sub.add_parser("failures", help="name each failed or errored test of JUnit files, with its message's start")
    f.add_argument("junit", nargs="+")
    f.add_argument("--limit", type=int, default=30, help="tests named at most")
    f.add_argument("--lines", type=int, default=4, help="lines of each message")
    args = parser.parse_args(argv)
    return {"record": record, "compare": compare, "failures": failures}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
