"""Write (or check) the sha256 digest in each shipped Hub kernel's ``metadata.json``.

``kernels`` 0.19 checks a kernel variant's files against ``metadata.json``'s ``digest`` on every load and refuses a
variant whose files were edited since: after editing a file under ``hf_tpu/kernels/hub/<repo>/build/<variant>/``,
run this script to record the new digest (tests/kernels/test_hub.py checks it). The digest is each file's sha256,
base64, by its path relative to the variant folder; ``metadata.json`` itself and ``__pycache__`` are left out.

Usage: ``python scripts/hub_kernel_digest.py`` (rewrite), ``python scripts/hub_kernel_digest.py --check`` (exit 1
naming each stale ``metadata.json``).
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import sys
from pathlib import Path

HUB = Path(__file__).resolve().parent.parent / "hf_tpu" / "kernels" / "hub"


def digest(variant: Path) -> dict:
    """``metadata.json``'s ``digest`` entry for the variant folder ``variant``."""
    files = {
        f.relative_to(variant).as_posix(): base64.b64encode(hashlib.sha256(f.read_bytes()).digest()).decode()
        for f in sorted(variant.rglob("*"))
        if f.is_file() and f.name != "metadata.json" and "__pycache__" not in f.parts
    }
    return {"algorithm": "sha256", "files": files}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only check; exit 1 when a digest is stale")
    args = parser.parse_args(argv)
    stale = []
    for metadata_path in sorted(HUB.glob("*/build/*/metadata.json")):
        metadata = json.loads(metadata_path.read_text())
        want = digest(metadata_path.parent)
        if metadata.get("digest") == want:
            continue
        stale.append(metadata_path)
        if not args.check:
            metadata["digest"] = want
            metadata_path.write_text(json.dumps(metadata, indent=2) + "\n")
    verb = "stale" if args.check else "rewritten"
    for path in stale:
        print(f"{verb}: {path.relative_to(HUB.parent.parent.parent)}")
    return 1 if args.check and stale else 0


if __name__ == "__main__":
    sys.exit(main())
