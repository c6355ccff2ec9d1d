"""Optimizer state between a rank's local layout and the single-device layout.

``torch.optim.Optimizer.state_dict()`` names parameters by their position across the param
groups of *that* optimizer. Under a plan each rank's optimizer holds only its own stage's
parameters, so positions differ from rank to rank and from plan to plan. A checkpoint stores
the layout the same ``configure_optimizers`` gives on one device; these pure functions
translate through parameter *names*, which every layout shares.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["GroupNames", "by_name", "to_local", "to_single_device"]

GroupNames = Sequence[Sequence[str]]
"""Parameter names of each param group, in the optimizer's order."""


def by_name(state_dict: Mapping[str, Any], names: GroupNames) -> dict[str, Any]:
    """Per-parameter state of a local optimizer ``state_dict`` keyed by parameter name."""
    flat = [n for group in names for n in group]
    return {flat[index]: value for index, value in state_dict["state"].items()}


def to_single_device(
    states: Mapping[str, Any], groups: Sequence[Mapping[str, Any]], full_names: GroupNames
) -> dict[str, Any]:
    """Assemble the single-device ``state_dict`` from name-keyed states of every stage.

    Args:
        states: per-parameter state of all parameters, by name.
        groups: hyperparameters of each param group (any rank's; ``params`` is ignored).
        full_names: parameter names of each group as on one device.
    """
    if len(groups) != len(full_names):
        raise ValueError(f"optimizer has {len(groups)} param groups here but {len(full_names)} on one device")
    return _numbered(states, groups, full_names)


def to_local(single: Mapping[str, Any], full_names: GroupNames, local_names: GroupNames) -> dict[str, Any]:
    """This rank's optimizer ``state_dict`` cut from a single-device one."""
    groups = single["param_groups"]
    if len(groups) != len(full_names) or len(local_names) != len(full_names):
        raise ValueError(
            f"the checkpoint's optimizer has {len(groups)} param groups, this model's {len(full_names)}; "
            "resume with the same configure_optimizers"
        )
    position: dict[str, int] = {}
    for group, names in zip(groups, full_names):
        if len(group["params"]) != len(names):
            raise ValueError(
                f"a param group of the checkpoint's optimizer holds {len(group['params'])} parameters, this "
                f"model's {len(names)}; resume with the same model and configure_optimizers"
            )
        position.update(zip(names, group["params"]))
    local = [name for group in local_names for name in group]
    states = {name: single["state"][position[name]] for name in local if position[name] in single["state"]}
    return _numbered(states, groups, local_names)


def _numbered(states: Mapping[str, Any], groups: Sequence[Mapping[str, Any]], names: GroupNames) -> dict[str, Any]:
    """An optimizer ``state_dict`` holding the parameters ``names`` (numbered across the groups in
    that order) with the hyperparameters of ``groups`` and each parameter's entry in ``states``."""
    flat = [name for group in names for name in group]
    starts = itertools.accumulate((len(group) for group in names), initial=0)
    return {
        "state": {index: states[name] for index, name in enumerate(flat) if name in states},
        "param_groups": [
            {
                **{k: v for k, v in group.items() if k != "params"},
                "params": list(range(start, start + len(group_names))),
            }
            for group, group_names, start in zip(groups, names, starts)
        ],
    }
