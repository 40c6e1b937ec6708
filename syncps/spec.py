"""The PS optimizer spec of a ``torch.optim`` optimizer: its hyper-parameters, run by the PS with torch's formulas
(``"flavor": "torch"``, docs/torch.md, "Optimizers on the PS").

Supported: ``SGD``, ``Adam``, ``AdamW`` (or Adam with ``decoupled_weight_decay``), ``Adagrad``, with the options of
:data:`SUPPORTED`. Every parameter group must have the same hyper-parameters (the PS runs one optimizer), and an
option the PS does not run (:data:`MUST_BE`: ``maximize``, ``amsgrad``...) is refused with a ValueError naming it.
"""
from __future__ import annotations

from typing import Any

import torch

#: torch class name -> (PS name, {group key: PS key})
SUPPORTED = {
    "SGD": ("sgd", {"momentum": "momentum", "dampening": "dampening", "nesterov": "nesterov",
                    "weight_decay": "weight_decay"}),
    "Adam": ("adam", {"weight_decay": "weight_decay", "eps": "epsilon"}),
    "AdamW": ("adamw", {"weight_decay": "weight_decay", "eps": "epsilon"}),
    "Adagrad": ("adagrad", {"lr_decay": "lr_decay", "weight_decay": "weight_decay", "eps": "epsilon",
                            "initial_accumulator_value": "initial_accumulator_value"}),
}
#: group options that must be off, with the value that means off
MUST_BE = {"maximize": False, "amsgrad": False, "differentiable": False, "capturable": False}


def _float(value: Any) -> float:
    return float(value.item()) if isinstance(value, torch.Tensor) else float(value)


def optimizer_spec(opt: torch.optim.Optimizer) -> dict[str, Any]:
    """``{"name", "flavor": "torch", "learning_rate", ...}`` for ``opt``; ValueError if the PS cannot run it."""
    kind = next((c.__name__ for c in type(opt).__mro__ if c.__name__ in SUPPORTED), None)
    if kind is None or not isinstance(opt, torch.optim.Optimizer):
        raise ValueError(f"the PS runs torch.optim's {sorted(SUPPORTED)}, not {type(opt).__name__}")
    name, keys = SUPPORTED[kind]
    specs = []
    for group in opt.param_groups:
        for key, off in MUST_BE.items():
            if group.get(key, off) != off:
                raise ValueError(f"{type(opt).__name__}({key}={group[key]!r}) is not supported by the PS")
        spec: dict[str, Any] = {"name": name, "flavor": "torch", "learning_rate": _float(group["lr"])}
        if kind == "Adam" and group.get("decoupled_weight_decay"):
            spec["name"] = "adamw"
        if "betas" in group:
            spec["beta1"], spec["beta2"] = (_float(b) for b in group["betas"])
        for key, ps_key in keys.items():
            value = group[key]
            spec[ps_key] = value if isinstance(value, bool) else _float(value)
        specs.append(spec)
    if any(s != specs[0] for s in specs[1:]):
        raise ValueError("the PS runs one optimizer: every parameter group needs the same hyper-parameters")
    return specs[0]
