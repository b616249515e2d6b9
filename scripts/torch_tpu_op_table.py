"""Write hf_tpu/sim/_torch_tpu_ops.py: which aten ops torch-tpu sends to its missing-op fallback.

Run in a venv with torch-tpu installed, the wheel autoloaded at ``import torch`` (no chip is needed: the dispatcher
table is filled when the glue library loads):

    TORCH_DEVICE_BACKEND_AUTOLOAD=1 python scripts/torch_tpu_op_table.py            # rewrite the table
    TORCH_DEVICE_BACKEND_AUTOLOAD=1 python scripts/torch_tpu_op_table.py --check    # exit 1 if it differs
    TORCH_DEVICE_BACKEND_AUTOLOAD=1 python scripts/torch_tpu_op_table.py --list refused_ops.txt

For every ``aten::`` operator, ``torch._C._dispatch_dump_table`` names what serves its ``PrivateUse1`` key:

- ``[kernel]`` registered from torch_tpu's glue (``csrc/...``): torch_tpu's own kernel;
- ``[math kernel]`` / ``[default backend kernel]``: a composite from torch itself, which decomposes into other ops;
- ``[backend fallback]`` from torch_tpu's glue: ``TpuMissingOpFallback`` (``csrc/eager/tpu_aten_kernels.cc``), which
  raises "operator '<op>' is not implemented for TPU. Please file a feature request" unless the CPU fallback
  (``torch_tpu._internal.execution_mode.enable_cpu_fallback``) is on.

Op names are written as ``name`` (default overload) or ``name.overload``, without ``aten::``.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TABLE = REPO / "hf_tpu" / "sim" / "_torch_tpu_ops.py"
COMMAND = "TORCH_DEVICE_BACKEND_AUTOLOAD=1 python scripts/torch_tpu_op_table.py"

_ENTRY = re.compile(r"^(PrivateUse1|SparsePrivateUse1): (?:fallthrough )?registered at (\S+) \[([^\]]+)\]", re.M)


def _entry(table: str, key: str) -> tuple[str, str] | None:
    for found_key, where, kind in _ENTRY.findall(table):
        if found_key == key:
            return where, kind
    return None


def _from_glue(where: str) -> bool:
    # torch's own registrations carry the path of its build tree (/__w/pytorch/... or aten/src/...)
    return where.startswith("csrc/")


def classify() -> dict[str, list[str]]:
    """Reads the live dispatcher: ``{"kernel": [...], "composite": [...], "missing": [...], ...}``."""
    import torch

    if not hasattr(torch, "tpu") or "torch_tpu" not in sys.modules:
        raise SystemExit("torch_tpu is not loaded: run in the torch-tpu venv with TORCH_DEVICE_BACKEND_AUTOLOAD=1")
    groups: dict[str, list[str]] = {"kernel": [], "composite": [], "missing": [], "sparse_kernel": [], "via_out": []}
    delegates = _structured_delegates()
    structured: list[tuple[str, str]] = []
    for qualified in sorted(torch._C._dispatch_get_all_op_names()):
        if not qualified.startswith("aten::"):
            continue
        name = qualified.removeprefix("aten::")
        table = torch._C._dispatch_dump_table(qualified)
        dense = _entry(table, "PrivateUse1")
        if dense is None:
            raise SystemExit(f"{qualified}: no PrivateUse1 entry in its dispatch table:\n{table}")
        where, kind = dense
        if kind == "backend fallback" and _from_glue(where):
            groups["missing"].append(name)
        elif kind == "kernel" and _from_glue(where):
            groups["kernel"].append(name)
        elif kind in ("math kernel", "default backend kernel"):
            groups["composite"].append(name)
            if "NonFunctional" in where and name in delegates:
                structured.append((name, delegates[name]))
        else:
            raise SystemExit(f"{qualified}: unexpected PrivateUse1 entry {dense}")
        sparse = _entry(table, "SparsePrivateUse1")
        if sparse is not None and sparse[1] == "kernel" and _from_glue(sparse[0]):
            groups["sparse_kernel"].append(name)
    refused = set(groups["missing"])
    groups["via_out"] = [f"{name}:{out}" for name, out in structured if out in refused]
    return groups


def _structured_delegates() -> dict[str, str]:
    """``{"logaddexp": "logaddexp.out", ...}``: functional and in-place structured ops, and their out= op.

    A backend without a kernel for them runs torch's CompositeExplicitAutogradNonFunctional wrapper, which
    allocates the result and calls the out= op through the dispatcher: where that op is missing, the error names it.
    """
    import torchgen
    import yaml

    path = Path(torchgen.__file__).parent / "packaged" / "ATen" / "native" / "native_functions.yaml"
    delegates = {}
    for entry in yaml.load(path.read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader)):
        if "structured_delegate" in entry:
            name = entry["func"].partition("(")[0]
            out = entry["structured_delegate"]
            delegates[name.removesuffix(".default")] = out.removesuffix(".default")
    return delegates


# at::autocast::CastPolicy's values
_POLICIES = {"0": "lower_precision_fp", "1": "fp32", "2": "fp32_set_opt_dtype", "3": "fp32_append_dtype"}
_POLICIES["4"] = "promote"
# at::autocast::WrapFunction_<CastPolicy::N, c10::DeviceType::PrivateUse1 (20), ..., &at::_ops::<op>::call, ...>
_AUTOCAST = re.compile(rb"CastPolicyE(\d)ELN3c1010DeviceTypeE20E\w*?_ops(\d+)(\w+?)4call")


def autocast_policy() -> dict[str, list[str]]:
    """torch_tpu's AutocastPrivateUse1 kernels, read from the glue library's symbols: ``{policy: [op, ...]}``.

    Each ``KERNEL_PRIVATEUSEONE(op, policy)`` instantiates ``at::autocast::WrapFunction_`` with the cast policy, the
    device type (PrivateUse1 is 20) and ``at::_ops::<op>::call``; the op struct's name is ``name`` or
    ``name_overload``, mapped back to ``name.overload`` through torch's own op list.
    """
    import torch
    import torch_tpu

    version = torch.__version__.split("+")[0].replace(".", "_")
    (glue,) = (Path(torch_tpu.__file__).parent / "csrc" / "common" / f"glue_{version}").glob("*common.so")
    structs = {}
    for packet_name in dir(torch.ops.aten):
        packet = getattr(torch.ops.aten, packet_name)
        if not hasattr(packet, "overloads"):
            continue
        for overload in packet.overloads():
            qualified = packet_name if overload == "default" else f"{packet_name}.{overload}"
            structs[qualified.replace(".", "_")] = qualified
    policy: dict[str, set[str]] = {}
    for code, length, rest in _AUTOCAST.findall(glue.read_bytes()):
        struct = rest[: int(length)].decode()
        policy.setdefault(_POLICIES[code.decode()], set()).add(structs.get(struct, struct))
    return {name: sorted(ops) for name, ops in sorted(policy.items())}


def _mapping(name: str, pairs: list[str], comment: str) -> str:
    lines = [f"# {comment}", f"{name} = {{"]
    for pair in pairs:
        op, _, out = pair.partition(":")
        lines.append(f'    "{op}": "{out}",')
    lines += ["}", ""]
    return "\n".join(lines)


def _block(name: str, ops: list[str], comment: str) -> str:
    lines = [f"# {comment}", f"{name} = frozenset(", "    {"]
    lines += [f'        "{op}",' for op in ops]
    lines += ["    }", ")", ""]
    return "\n".join(lines)


def render(groups: dict[str, list[str]]) -> str:
    import torch

    torch_tpu_version = importlib.metadata.version("torch-tpu")
    torch_version = torch.__version__.split("+")[0]
    kernels, composites, missing = (len(groups[k]) for k in ("kernel", "composite", "missing"))
    header = f'''"""Generated by scripts/torch_tpu_op_table.py; do not edit. Regenerate in the torch-tpu venv with:

    {COMMAND}

torch {torch_version} + torch-tpu {torch_tpu_version}: of {kernels + composites + missing} aten operators, \
{kernels} have a torch_tpu kernel, {composites} are composites of
torch's that decompose into other ops, and {missing} reach torch_tpu's ``TpuMissingOpFallback`` (:data:`REFUSED`).
"""

TORCH_VERSION = "{torch_version}"
TORCH_TPU_VERSION = "{torch_tpu_version}"
COMPOSITE_COUNT = {len(groups["composite"])}

'''
    return (
        header
        + _block("REFUSED", groups["missing"], "PrivateUse1 served by TpuMissingOpFallback: refused on a chip.")
        + "\n"
        + _block("KERNELS", groups["kernel"], "PrivateUse1 served by a torch_tpu kernel.")
        + "\n"
        + _block(
            "SPARSE_KERNELS",
            groups["sparse_kernel"],
            "SparsePrivateUse1 served by a torch_tpu kernel; every other sparse op reaches TpuSparseOpFallback.",
        )
        + "\n"
        + _mapping(
            "VIA_OUT",
            groups["via_out"],
            "Structured ops whose torch wrapper calls a refused out= op (the error names that op).",
        )
        + "\n"
        + _policy_block(autocast_policy())
    )


def _policy_block(policy: dict[str, list[str]]) -> str:
    lines = [
        "# torch_tpu's autocast policy for PrivateUse1 (csrc/eager/amp_policies.cc), read from the glue library's",
        "# at::autocast::WrapFunction_ instantiations: {cast policy: ops}; every other op passes through unchanged.",
        "AUTOCAST = {",
    ]
    for name, ops in policy.items():
        lines.append(f'    "{name}": (')
        lines += [f'        "{op}",' for op in ops]
        lines.append("    ),")
    lines += ["}", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when the shipped table differs")
    parser.add_argument("--list", type=Path, help="also write the refused op names, one per line, to this file")
    args = parser.parse_args(argv)
    groups = classify()
    text = render(groups)
    if args.list:
        args.list.write_text("".join(op + "\n" for op in groups["missing"]))
    if args.check:
        if TABLE.read_text() != text:
            print(f"{TABLE} differs from torch-tpu's dispatcher: rerun {COMMAND}", file=sys.stderr)
            return 1
        print(f"{TABLE}: equal to the dispatcher ({len(groups['missing'])} refused ops)")
        return 0
    TABLE.write_text(text)
    print(f"wrote {TABLE}: {len(groups['missing'])} refused, {len(groups['kernel'])} kernels")
    return 0


if __name__ == "__main__":
    sys.exit(main())
