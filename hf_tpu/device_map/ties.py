"""Keep tied weights tied when a module moves to the TPU.

``nn.Module.to`` keeps a shared parameter shared only when it can swap the tensor inside the existing
``Parameter`` (``param.data = new``). torch allows that swap only between "compatible" tensor types (the dense
CPU/CUDA/XPU/... backends); a PrivateUse1 tensor such as a ``tpu`` tensor is not one of them, so ``_apply`` builds
a new ``Parameter`` for every module that holds the shared one: the input embedding and the LM head come out as
two separate copies on the device (twice the HBM, and training updates only one). The same happens on any
device with ``torch.__future__.set_overwrite_module_params_on_conversion(True)``.

:func:`tied_groups` records which names share one parameter before a move, and :func:`retie` makes them share
the moved one again.

Example:
    >>> import torch
    >>> m = torch.nn.Module(); m.a = torch.nn.Linear(2, 2); m.b = torch.nn.Linear(2, 2); m.b.weight = m.a.weight
    >>> groups = tied_groups(m); groups
    [['a.weight', 'b.weight']]
    >>> m.b.weight = torch.nn.Parameter(m.a.weight.detach().clone()); retie(m, groups); m.b.weight is m.a.weight
    True
"""

from __future__ import annotations

import torch

__all__ = ["retie", "tied_groups"]


def tied_groups(module: torch.nn.Module) -> list[list[str]]:
    """Names of parameters that are one and the same ``Parameter`` object, one list per shared parameter.

    Args:
        module: the model (read before it is moved, so that :func:`retie` can restore the ties afterwards).

    Returns:
        One list of parameter names per parameter reachable under more than one name.
    """
    by_id: dict[int, list[str]] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(param), []).append(name)
    return [names for names in by_id.values() if len(names) > 1]


def retie(module: torch.nn.Module, groups: list[list[str]]) -> int:
    """Make every name of each group refer to the group's first parameter again.

    Args:
        module: the model whose ties a move may have broken.
        groups: the groups :func:`tied_groups` returned before the move.

    Returns:
        How many names were pointed back at their group's first parameter (0 when the ties held).
    """
    fixed = 0
    for names in groups:
        source = module.get_parameter(names[0])
        for name in names[1:]:
            owner_name, _, leaf = name.rpartition(".")
            owner = module.get_submodule(owner_name)
            if owner._parameters.get(leaf) is not source:
                owner._parameters[leaf] = source
                fixed += 1
    return fixed
