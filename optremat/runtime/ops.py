"""What the runtimes need to know about a traced op, and how to run one eagerly."""

from __future__ import annotations

import functools
import operator
from typing import Any, Callable

import torch
import torch.fx

def signature_of(leaves: list[Any]) -> list[Any]:
    """Shape, dtype and device of each tensor (other values as they are): what a plan is for."""
    return [(tuple(t.shape), t.dtype, t.device.type) if isinstance(t, torch.Tensor) else t for t in leaves]


def autocast_state() -> tuple:
    """Which autocast regions are active: a plan traced under autocast holds its casts."""
    return tuple((device, torch.get_autocast_dtype(device)) for device in ("cpu", "cuda")
                 if torch.is_autocast_enabled(device))


def returns_alias(node: torch.fx.Node) -> bool:
    """Views and in-place ops: their output is another tensor's storage. Rather than stored,
    a saved one is rerun on its (saved) base when the segment is recomputed."""
    schema = getattr(node.target, "_schema", None)
    return schema is not None and any(r.alias_info is not None for r in schema.returns)


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


def rng_state(device: torch.device) -> torch.Tensor:
    return torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()


def set_rng_state(device: torch.device, state: torch.Tensor) -> None:
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)


def call(node: torch.fx.Node, value: Callable[[torch.fx.Node], Any], into: torch.Tensor | None = None) -> Any:
    """Run the node's op on the values of its inputs; with `into`, write the result over
    that tensor (an input the op is the last to read) through the op's out= overload,
    when it has one and `into` has the result's shape, dtype and strides."""
    args = torch.fx.node.map_arg(node.args, value)
    kwargs = torch.fx.node.map_arg(node.kwargs, value)
    if node.target is operator.getitem:
        return args[0][args[1]]
    if into is not None:
        variant = out_variant(node.target)
        expected = node.meta.get("val")
        if (variant is not None and isinstance(expected, torch.Tensor) and into.shape == expected.shape
                and into.dtype == expected.dtype and into.stride() == expected.stride()):
            overload, out = variant
            return overload(*args, **kwargs, **{out: into})
    return node.target(*args, **kwargs)


@functools.lru_cache(maxsize=None)
def out_variant(op: Any) -> tuple[Any, str] | None:
    """The out= overload of an aten op taking the same arguments (names and types) plus
    one output argument, with that argument's name; or None."""
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
            return candidate, outs[0].name
    return None
