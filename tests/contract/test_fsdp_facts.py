"""What hf_tpu's FSDP2 path (hf_tpu/training/fsdp.py, the simulated ``tpu_dist``) assumes of torch-tpu 0.2.0, read
from the wheel itself (torch_tpu autoloaded, no chip).

- No PrivateUse1 kernel for ``aten::_has_compatible_shallow_copy_type``: torch's composite answer knows only the
  built-in dense backends, so ``cpu_param.data = tpu_tensor`` (what ``fully_shard`` does to move a host model) is
  refused on a chip too, and hf_tpu swaps the tensors instead. When a wheel registers one, this test says the swap
  may go.
- ``ProcessGroupTpu`` (the C++ ``tpu_dist``) has the collectives FSDP2 uses (``_allgather_base``,
  ``_reduce_scatter_base``, their coalesced forms, ``allreduce``), AVG as a sum, and no PREMUL_SUM.
- ``torch.tpu.distributed.topology_aware_mesh`` exists for a topology-aware ``DeviceMesh``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch


def _glue() -> bytes:
    import torch_tpu

    version = torch.__version__.split("+")[0].replace(".", "_")
    (glue,) = (Path(torch_tpu.__file__).parent / "csrc" / "common" / f"glue_{version}").glob("*common.so")
    return glue.read_bytes()


def test_no_privateuse1_kernel_for_shallow_copy_compatibility():
    assert "torch_tpu" in sys.modules and hasattr(torch, "tpu"), "run with TORCH_DEVICE_BACKEND_AUTOLOAD=1"
    table = torch._C._dispatch_dump_table("aten::_has_compatible_shallow_copy_type")
    private_use1 = [line for line in table.splitlines() if line.startswith("PrivateUse1:")]
    assert private_use1 == [] or "math kernel" in private_use1[0], private_use1


def test_process_group_tpu_collectives_and_reductions():
    data = _glue()
    for method in (
        b"_allgather_base",
        b"_reduce_scatter_base",
        b"allgather_into_tensor_coalesced",
        b"reduce_scatter_tensor_coalesced",
        b"allreduce",
    ):
        assert b"ProcessGroupTpu" + str(len(method)).encode() + method in data, method
    assert b"BuildReduceBody: 'premul_sum' reduction is not supported" in data
    assert b"BuildReduceBody: 'avg' reduction should be handled using 'sum'" in data


def test_topology_aware_mesh_is_public():
    import torch_tpu._internal.distributed._distributed_module as module

    assert callable(module.topology_aware_mesh)
    assert "topology_aware_mesh" in dir(torch.tpu.distributed)
