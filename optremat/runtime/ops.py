"""What planning and compiled graphs need to know about a traced op and its inputs."""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.fx


def signature_of(leaves: list[Any]) -> list[Any]:
    """Shape, dtype and device of each tensor (other values as they are): what a plan is for."""
    return [(tuple(t.shape), t.dtype, t.device.type) if isinstance(t, torch.Tensor) else t for t in leaves]


def is_random(node: torch.fx.Node) -> bool:
    """Whether the op draws random numbers: a seeded op, unless its dropout probability
    is zero (attention and dropout ops called with p=0 are deterministic)."""
    if torch.Tag.nondeterministic_seeded not in getattr(node.target, "tags", ()):
        return False
    schema = node.target._schema
    for position, argument in enumerate(schema.arguments):
        if argument.name in ("p", "dropout_p"):
            value = node.kwargs.get(argument.name, node.args[position] if position < len(node.args)
                                    else argument.default_value)
            return value != 0
    return True


@functools.lru_cache(maxsize=None)
def out_variant(op: Any) -> tuple[Any, str] | None:
    """The out= overload of an aten op taking the same arguments (names and types) plus
    one output argument, with that argument's name, where a device kernel writes into it;
    or None. An out= overload PyTorch only composes (`native_dropout_backward.out`,
    `clone.out`) computes its result into a new tensor and copies it over: written over a
    dying input, it held both, and a plan with dropout measured 6% over its price."""
    schema = getattr(op, "_schema", None)
    if schema is None:
        return None
    signature = [(a.name, str(a.type)) for a in schema.arguments]
    packet = op.overloadpacket
    for name in packet.overloads():
        candidate = getattr(packet, name)
        arguments = candidate._schema.arguments
        outs = [a for a in arguments if a.is_out]
        if len(outs) == 1 and [(a.name, str(a.type)) for a in arguments if not a.is_out] == signature:
            qualified = f"{candidate._schema.name}.{candidate._schema.overload_name}"
            native = any(torch._C._dispatch_has_kernel_for_dispatch_key(qualified, key) for key in ("CPU", "CUDA"))
            return (candidate, outs[0].name) if native else None
    return None
