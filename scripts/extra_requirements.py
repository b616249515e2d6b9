"""Print the requirements of one of pyproject.toml's optional extras, one per line (a requirements file for ``pip -r``).

``.ci/run`` adds the ``ray`` extra to a venv where hf_tpu is installed already: installing the extra's requirements
themselves leaves hf_tpu's editable install as it is (``pip install -e '.[...,ray]'`` would resolve every requirement
and build the editable wheel again).

    python scripts/extra_requirements.py ray > ray-requirements.txt && pip install -r ray-requirements.txt
"""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python scripts/extra_requirements.py EXTRA", file=sys.stderr)
        return 2
    extras = tomllib.loads(PYPROJECT.read_text())["project"]["optional-dependencies"]
    if argv[0] not in extras:
        print(f"pyproject.toml has no extra {argv[0]!r}; it has {', '.join(sorted(extras))}", file=sys.stderr)
        return 2
    print("\n".join(extras[argv[0]]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
