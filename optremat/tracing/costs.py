"""Per-op cost models: a FLOP/byte roofline over a device profile, or timing on a device.

The roofline is what planning uses by default: it needs only shapes, so it works on fake
tensors for models that do not fit in memory. Timing (`profile_costs`) runs the traced
step on real tensors and measures each op.
"""

from __future__ import annotations

import math
import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable

import sympy
import torch
import torch.fx
from torch._prims_common import suggest_memory_format
from torch.utils._sympy.numbers import int_oo
from torch.utils.flop_counter import flop_registry

from optremat.tracing.onednn import (MATMUL_SCRATCH, RNN_SCRATCH, channels_last_convolution_backward_workspace,
                                     plain_convolution_backward_weight_bytes)
from optremat.tracing.slow_convolution import slow_convolution_workspace

aten = torch.ops.aten


@dataclass(frozen=True)
class DeviceProfile:
    """Peak rates of a device; an op costs max(FLOPs / flops, bytes / bandwidth) + launch.
    The rest is what `torch.utils.checkpoint` costs on the host that drives the device:
    `dispatch_seconds` a Python dispatch mode (selective checkpointing's) adds to each op
    it sees, `rerun_seconds` each checkpointed call (its bookkeeping and its rerun), and
    `pack_seconds` each tensor its autograd nodes save (packed in the forward and the
    rerun, unpacked in the backward). The last two were measured on a 2-core x86 CPU with
    torch 2.13: chains of tiny ops saving one or two tensors each, checkpointed and plain.
    `rng_state_bytes` is what one stash of the RNG state takes in the device's memory:
    checkpoint keeps one per checkpointed call from its forward until its autograd nodes
    are done, and another while the call reruns. The CPU's is `torch.get_rng_state()`; a
    GPU's stash is a host tensor, nothing in the GPU's memory.

    `mapped_bytes`: on a CPU, glibc's malloc maps every allocation of at least 32 MiB
    fresh from the kernel and unmaps it when freed (its threshold rises to the largest
    freed block up to that), so each op writing a new output that large faults in every
    page of it, at `mapped_bytes_per_second` (measured on a 2-core x86 CPU with torch
    2.13: a 64 MiB multiply took 26.6 ms into a new tensor and 5.0 ms into a reused one).
    Caching allocators (a GPU's) keep their blocks: None there.

    `cache_bytes_per_second`: the rate an op moves its bytes at where no tensor it reads
    or writes (of a tensor it indexes into, what it selects) is over `cache_bytes`
    (None: `bytes_per_second` for every op). On a CPU those come from the heap's pages
    the step touched just before, still in its cache, and larger ones are fresh
    (`mapped_bytes`) or stream from memory: measured on a 2-core x86 CPU with torch 2.13
    on one thread, copies ran at 2.1-2.3e10 B/s up to 16 MiB and 1.2e10 at 128 MiB, and
    in the step of a causal LM whose head ran in 16 MiB token chunks each pass over a
    chunk took 1.0 ms, where 1e10 B/s prices 3.4 ms.

    `float32_flops_per_second`: the product rate of ops on float32 (and float64) tensors,
    where it differs from the 16-bit rate `flops_per_second` (a GPU's tensor cores; None:
    the same). `overlaps_launch`: the device works on one op while the host launches the
    next (a GPU), so an op takes the longer of its launch and its work, not their sum."""

    name: str
    flops_per_second: float
    bytes_per_second: float
    launch_seconds: float
    dispatch_seconds: float = 1.6e-5
    rerun_seconds: float = 6.5e-5
    pack_seconds: float = 7e-6
    rng_state_bytes: int = 0
    mapped_bytes: int | None = None
    mapped_bytes_per_second: float = 3.0e9
    float32_flops_per_second: float | None = None
    overlaps_launch: bool = False
    cache_bytes: int | None = None
    cache_bytes_per_second: float | None = None

    def __post_init__(self) -> None:
        rates = ("flops_per_second", "bytes_per_second", "mapped_bytes_per_second", "float32_flops_per_second",
                 "cache_bytes_per_second")
        seconds = ("launch_seconds", "dispatch_seconds", "rerun_seconds", "pack_seconds")
        for name in rates + seconds:
            value, least = getattr(self, name), "> 0" if name in rates else ">= 0"
            if value is None and name in ("float32_flops_per_second", "cache_bytes_per_second"):
                continue
            if not (isinstance(value, (int, float)) and (value > 0 if name in rates else value >= 0)
                    and value < math.inf):
                raise ValueError(f"DeviceProfile {self.name!r}: {name} must be a finite number {least}, not {value!r}")

    def byte_rate(self, largest: int) -> float:
        """The rate an op moves its bytes at, the largest tensor it reads or writes
        `largest` bytes: the cache's where that fits `cache_bytes`."""
        if self.cache_bytes_per_second is None or self.cache_bytes is None or largest >= self.cache_bytes:
            return self.bytes_per_second
        return self.cache_bytes_per_second

    def flop_rate(self, args: Any) -> float:
        """The product rate of an op on `args`: the float32 one where a floating tensor
        among them is float32 or float64."""
        if self.float32_flops_per_second is not None and any(
                isinstance(t, torch.Tensor) and t.dtype in (torch.float32, torch.float64)
                for t in torch.utils._pytree.tree_leaves(args)):
            return self.float32_flops_per_second
        return self.flops_per_second


def runs_on_cpu(profile: DeviceProfile) -> bool:
    """Whether `profile` prices a CPU's kernels, whose own scratch `workspace_bytes` then
    prices: a CPU's is the profile whose allocator maps large allocations fresh
    (`mapped_bytes`), the built-in "cpu" and any measured from it, whatever its name."""
    return profile.mapped_bytes is not None


COST_MODELS = ("roofline", "profile")
"""How ops are priced: from FLOPs and bytes over a device profile, or timed on this machine."""

_CUDA_HOST = dict(launch_seconds=8e-6, dispatch_seconds=1.1e-5, rerun_seconds=7e-4, pack_seconds=1.8e-5,
                  overlaps_launch=True)
"""What PyTorch's host side costs driving a GPU, measured by `measure_profile` on an H200
host (torch 2.11, CUDA 13): a tiny op's launch, a selective policy's look, a checkpointed
call (its RNG state stashed and restored on the GPU), a tensor packed under checkpoint."""

DEVICES: dict[str, DeviceProfile] = {
    "cpu": DeviceProfile("cpu", flops_per_second=1.0e11, bytes_per_second=1.0e10, launch_seconds=5e-6,
                         rng_state_bytes=torch.get_rng_state().nbytes, mapped_bytes=32 * 2**20,
                         cache_bytes=32 * 2**20, cache_bytes_per_second=2.2e10),
    "a100": DeviceProfile("a100", flops_per_second=2.4e14, float32_flops_per_second=1.45e13, bytes_per_second=1.7e12,
                          **_CUDA_HOST),
    "h100": DeviceProfile("h100", flops_per_second=7.5e14, float32_flops_per_second=5.0e13, bytes_per_second=2.85e12,
                          **_CUDA_HOST),
    "h200": DeviceProfile("h200", flops_per_second=7.5e14, float32_flops_per_second=5.0e13, bytes_per_second=4.0e12,
                          **_CUDA_HOST),
}
"""The GPUs' rates as `measure_profile` measured them on an H200 with torch 2.11 (its
products at 4096: 7.4-7.8e14 FLOP/s in bfloat16, 5.05e13 in float32, TF32 off; copies at
4.0-4.1e12 B/s); the H100 has the same products, the A100's are scaled by its peak rates
(312 and 19.5 TFLOP/s against 989 and 67); their bandwidths are the same share (85%) of
their spec sheets' (3.35 and 2.0 TB/s) as the H200's of its 4.8."""

_SAME_FLOPS_AS = {
    aten._scaled_dot_product_flash_attention_for_cpu: aten._scaled_dot_product_flash_attention,
    aten._scaled_dot_product_flash_attention_for_cpu_backward: aten._scaled_dot_product_flash_attention_backward,
}


def device_profile(name: str | DeviceProfile | torch.device) -> DeviceProfile:
    """Look up a device profile by name (cpu, a100, h100, h200), or the one pricing ops
    on a `torch.device`, or pass one through."""
    if isinstance(name, DeviceProfile):
        return name
    if isinstance(name, torch.device):
        return DEVICES[profile_for(name)]
    if name not in DEVICES:
        raise ValueError(f"unknown device profile {name!r}; choose one of {', '.join(DEVICES)}, or pass a "
                         "DeviceProfile (optremat.measure_profile() measures this machine's)")
    return DEVICES[name]


def model_device(model: torch.nn.Module) -> str:
    """The profile that prices ops where `model`'s parameters are (the CPU's for none)."""
    first = next(iter(model.parameters()), None)
    return "cpu" if first is None else profile_for(first.device)


def profile_for(device: torch.device) -> str:
    """The profile that prices ops on `device`: the CPU's, or the GPU's whose name the
    device's name contains (the H100's, with a warning, for a GPU with no profile)."""
    if device.type != "cuda":
        return "cpu"
    name = torch.cuda.get_device_name(device).lower()
    known = [profile for profile in DEVICES if profile != "cpu" and profile in name]
    if known:
        return known[0]
    warnings.warn(f"no cost profile for {name!r}: ops are priced as on an H100; pass "
                  "device=optremat.measure_profile() or cost_model='profile' to price them on this GPU", stacklevel=3)
    return "h100"


def concrete(value: Any) -> Any:
    """`value` as a number where it is a symbolic size: the traced size, or for a size the
    data decides (the rows a boolean mask selects) the most it can be, so that memory is
    never priced under what a batch can take."""
    if not isinstance(value, (torch.SymInt, torch.SymFloat)):
        return value
    node = value.node
    if node.has_hint():
        return node.hint
    most = node.shape_env.bound_sympy(node.expr).upper
    if most in (int_oo, sympy.oo) or not most.is_finite:
        raise UnboundedSize(f"a size the data decides ({node.expr}) has no upper bound to price it at")
    return int(most) if isinstance(value, torch.SymInt) else float(most)


class UnboundedSize(ValueError):
    """A size the data decides with no upper bound: no memory price holds for every batch."""


def tensor_bytes(value: Any) -> int:
    """Bytes of every tensor in a (possibly nested) value, each counted by its own size."""
    return sum(each_tensor_bytes(value))


def each_tensor_bytes(value: Any) -> list[int]:
    """Bytes of each tensor in a (possibly nested) value, in its pytree order."""
    leaves = torch.utils._pytree.tree_leaves(value)
    return [concrete(t.numel()) * t.element_size() for t in leaves if isinstance(t, torch.Tensor)]


def op_flops(target: Any, args: tuple, kwargs: dict, out: Any) -> int:
    """FLOPs of one aten op from PyTorch's flop formulas and ours (`FORMULAS`); 0 for ops
    neither has."""
    packet = getattr(target, "overloadpacket", None)
    packet = _SAME_FLOPS_AS.get(packet, packet)
    name = getattr(packet, "__name__", "")
    if packet not in flop_registry and name.endswith("_"):  # in place: `addmm_` multiplies as `addmm` does
        packet = getattr(aten, name[:-1], packet)
    formula = flop_registry.get(packet, FORMULAS.get(packet))
    if formula is None:
        return 0
    return int(concrete(formula(*args, **kwargs, out_val=out)))


def _grouped_mm_flops(mat_a: torch.Tensor, mat_b: torch.Tensor, *args: Any, out_val: torch.Tensor,
                      **kwargs: Any) -> int:
    """`aten._grouped_mm`'s: each output element sums over its group's share of the
    contraction (a's last dimension), all of it unless both operands are 2-D, where the
    groups split it (the output is [groups, M, N]: the weight gradient of experts)."""
    groups = out_val.shape[0] if mat_a.dim() == 2 and mat_b.dim() == 2 else 1
    return 2 * out_val.numel() * mat_a.shape[-1] // groups


FORMULAS: dict[Any, Callable[..., int]] = {aten._grouped_mm: _grouped_mm_flops}
"""FLOP formulas of ops PyTorch's flop counter has none for: transformers' mixture-of-experts
kernels run their experts' products as `_grouped_mm`, which without one was priced by its
bytes alone, a Mixtral's experts at a sixth of the 21 ms they took on a CPU."""


def node_flops(node: torch.fx.Node) -> int:
    """FLOPs of one fx node, from the fake tensors of its inputs and output."""
    args, kwargs = _fake_arguments(node)
    return op_flops(node.target, args, kwargs, node.meta.get("val"))


def roofline_cost(node: torch.fx.Node, profile: DeviceProfile) -> float:
    """Seconds one fx node takes on `profile` by the roofline model."""
    args, kwargs = _fake_arguments(node)
    out = node.meta.get("val")
    flops = op_flops(node.target, args, kwargs, out)
    moved = moved_bytes(node.target, args, kwargs, out)
    work = max(flops / profile.flop_rate(args), sum(moved) / profile.byte_rate(max(moved, default=0)))
    launched = max(work, profile.launch_seconds) if profile.overlaps_launch else work + profile.launch_seconds
    return launched + mapped_seconds(node.target, out, profile)


_GATHERS = {aten.embedding, aten.gather, aten.index_select, aten.index}
"""Ops reading their first argument only where their indices point: one element per
element of their output."""
_SCATTERS = {aten.scatter_add_: 3, aten.index_put_: 2, aten._index_put_impl_: 2}
"""Ops writing over their first argument in place only where their indices point, by
the position of their values: each element of the values read, and its target read
and written."""


def moved_bytes(target: Any, args: tuple, kwargs: dict, out: Any) -> list[int]:
    """Bytes an op reads and writes, tensor by tensor: every argument and output whole,
    except the first argument of ops indexing into it (`_GATHERS`, `_SCATTERS`, the
    negative log likelihood's forward), which moves only the elements the indices select."""
    packet = getattr(target, "overloadpacket", None)
    first = args[0] if args else None
    if not isinstance(first, torch.Tensor):
        return each_tensor_bytes((args, kwargs, out))
    rest = each_tensor_bytes((args[1:], kwargs))
    if packet in _GATHERS:
        return rest + each_tensor_bytes((out, out))
    if packet in _SCATTERS and len(args) > _SCATTERS[packet]:
        return rest + each_tensor_bytes((args[_SCATTERS[packet]],) * 2)
    if packet is aten.nll_loss_forward and len(args) > 1:
        return rest + each_tensor_bytes(out) + [concrete(args[1].numel()) * first.element_size()]
    return each_tensor_bytes((args, kwargs, out))


def mapped_seconds(target: Any, out: Any, profile: DeviceProfile) -> float:
    """Seconds faulting in the pages of the new outputs `out` of the op `target` that the
    allocator maps fresh (each of at least `profile.mapped_bytes`); outputs that view or
    write over an input (by the op's schema) allocate nothing."""
    returns = getattr(getattr(target, "_schema", None), "returns", None)
    if profile.mapped_bytes is None or not returns:
        return 0.0
    outs = out if isinstance(out, (tuple, list)) else (out,)
    aliases = [r.alias_info for r in returns] if len(returns) == len(outs) else [returns[0].alias_info] * len(outs)
    sizes = [tensor_bytes(t) for t, alias in zip(outs, aliases) if alias is None and isinstance(t, torch.Tensor)]
    return sum(b for b in sizes if b >= profile.mapped_bytes) / profile.mapped_bytes_per_second


def fused_cost(node: torch.fx.Node, profile: DeviceProfile) -> float:
    """Seconds a pointwise op adds where a compiler computes it inside the kernel that
    reads its result: its arithmetic (one operation per output element at least); its
    inputs are read instead of its output."""
    args, kwargs = _fake_arguments(node)
    out = node.meta.get("val")
    elements = concrete(out.numel()) if isinstance(out, torch.Tensor) else 0
    return max(op_flops(node.target, args, kwargs, out), elements) / profile.flop_rate(args)


def _fake_arguments(node: torch.fx.Node) -> tuple[Any, Any]:
    value = lambda a: a.meta.get("val") if isinstance(a, torch.fx.Node) else a  # noqa: E731
    return torch.fx.node.map_aggregate(node.args, value), torch.fx.node.map_aggregate(node.kwargs, value)


def workspace_bytes(node: torch.fx.Node, cpu: bool = True) -> int:
    """Temporaries a kernel allocates beyond its outputs, for the kernels known to; the
    CPU's own kernels (flash attention's) only where the step is priced for a CPU (`cpu`).

    Measured on PyTorch's CPU kernels: a convolution ATen runs itself (float64) its
    im2col columns, forward and backward (`slow_convolution`); one oneDNN runs, in its
    backward, reordered copies of its output gradient and its input while it runs
    (transposed ones too), in float32 their channels padded to a multiple of 16
    (`_blocked`); a strided one builds its input gradient in a scratch buffer instead of
    the first; or, where that is more, what it holds for the weight
    (`onednn.plain_convolution_backward_weight_bytes`: many channels on a small map).
    Any convolution, forward or backward, first copies the tensors it reads that are not
    dense in its kernel's memory format (`_contiguous_copies`). On
    channels-last data it runs oneDNN's channels-last kernels instead, priced by
    `onednn.channels_last_convolution_backward_workspace`. A batch norm's backward that
    computes the input gradient allocates a scratch buffer of the input's size, its
    forward two per-channel vectors (three in training on a 2-D input); a layer norm's
    backward that computes the weight or bias gradient two vectors of the normalized
    shape (any dtype; torch 2.13). A oneDNN RNN layer's backward, what it was measured to
    take (`onednn.size_rnn_workspaces`), a bfloat16 or float16 matrix product its
    packed operands (`onednn.size_matmul_scratch`). A loss kernel's elementwise losses before it
    reduces them (`LOSS_SCRATCH`), a soft margin loss's backward two of its input's
    size (any device: ATen builds it of other ops). On a CPU, a dropout's backward the
    masked gradient before it scales it (a tensor of its output's size).
    """
    packet = getattr(node.target, "overloadpacket", None)
    value = lambda k: node.args[k].meta.get("val")  # noqa: E731
    if RNN_SCRATCH in node.meta:
        return node.meta[RNN_SCRATCH]
    if cpu and MATMUL_SCRATCH in node.meta:
        return node.meta[MATMUL_SCRATCH]
    if cpu and packet in (aten.convolution, aten.convolution_backward):
        slow = slow_convolution_workspace(node)
        if slow is not None:
            return slow
    if packet is aten.convolution:
        return _contiguous_copies(node, (0, 1))
    if packet is aten.convolution_backward:
        channels_last = channels_last_convolution_backward_workspace(node)
        if channels_last is not None:
            return channels_last
        stride, transposed = node.args[4], node.args[7]
        grad_output, inputs = tensor_bytes(value(0)), tensor_bytes(value(1))
        onednn = cpu and value(1).dtype == torch.float32
        if not transposed and any(s != 1 for s in stride):
            activations = 2 * inputs
        elif onednn:
            activations = _blocked(grad_output, value(0).shape[1]) + _blocked(inputs, value(1).shape[1])
        else:
            activations = grad_output + inputs
        weight = plain_convolution_backward_weight_bytes(node) if onednn else 0
        return _contiguous_copies(node, (0, 1, 2)) + max(activations, weight)
    if packet is aten.native_batch_norm_backward:
        return tensor_bytes(value(1)) if node.args[9][0] else 0
    if packet is aten.native_batch_norm:
        x = value(0)
        return (3 if node.args[5] and x.dim() == 2 else 2) * x.shape[1] * x.element_size()
    if packet is aten.native_layer_norm_backward and node.args[5] is not None:
        return 2 * tensor_bytes(value(5)) if any(node.args[7][1:]) else 0
    if packet in LOSS_SCRATCH:
        return loss_scratch(node)
    if packet is aten.soft_margin_loss_backward:
        return 2 * tensor_bytes(value(1))  # the exponential and a quotient, before the product
    if cpu and packet in (aten._scaled_dot_product_flash_attention_for_cpu,
                          aten._scaled_dot_product_flash_attention_for_cpu_backward):
        return flash_attention_cpu_workspace(node)
    if cpu and packet is aten.native_dropout_backward:
        return tensor_bytes(node.meta.get("val"))  # the masked gradient, before it is scaled
    return 0


def _contiguous_copies(node: torch.fx.Node, positions: tuple[int, ...]) -> int:
    """Bytes of the copies a convolution (or its backward) makes of the tensors at
    `positions` of its arguments that are not dense in the memory format its kernel runs
    in: channels-last where the input or the weight suggests it, else contiguous. A
    convolution whose output feeds a `torch.cat` gets its output gradient as a slice of
    the cat's, and copies it before its kernel runs."""
    tensors = [node.args[k].meta.get("val") for k in positions if isinstance(node.args[k], torch.fx.Node)]
    tensors = [t for t in tensors if isinstance(t, torch.Tensor)]
    if len(tensors) < len(positions):
        return 0
    inputs, weight = tensors[-2:]
    layouts = {suggest_memory_format(inputs), suggest_memory_format(weight)}
    layout = next((f for f in (torch.channels_last, torch.channels_last_3d) if f in layouts), torch.contiguous_format)
    return sum(tensor_bytes(t) for t in tensors if not t.is_contiguous(memory_format=layout))


def _blocked(nbytes: int, channels: int) -> int:
    """The bytes of a tensor of `nbytes` whose `channels` oneDNN pads to a multiple of 16
    in its reordered copy."""
    return nbytes * -(-channels // 16) * 16 // channels


LOSS_SCRATCH = {aten.mse_loss: 1, aten.smooth_l1_loss: 1, aten.huber_loss: 1}
"""How many tensors of its input's size a loss kernel allocates beyond its output's
storage when it reduces (reduction "mean" or "sum"): the elementwise losses are computed
first (for a squared error, the difference too). Measured on PyTorch 2.13's CPU kernels,
in ATen's code shared by every device."""

REDUCED_INTO_ELEMENTWISE = {aten.mse_loss, aten.smooth_l1_loss, aten.soft_margin_loss, aten.binary_cross_entropy}
"""Loss kernels whose reduced loss, a scalar, lives in the storage of their elementwise
losses, resized, and keeps it alive as long as it lives (`F.mse_loss(a, b)
.untyped_storage()` holds `a`'s bytes; torch 2.13). A fake tensor reports 0-d storage."""

_REDUCTION_ARGUMENT = {aten.binary_cross_entropy: 3}
"""Where a loss kernel takes its reduction, where not third (after input and target)."""


def _reduces(node: torch.fx.Node) -> bool:
    """Whether the loss kernel `node` reduces its elementwise losses ("mean", "sum")."""
    at = _REDUCTION_ARGUMENT.get(node.target.overloadpacket, 2)
    return bool(node.args[at] if len(node.args) > at else node.kwargs.get("reduction", 1))


def loss_scratch(node: torch.fx.Node) -> int:
    """The bytes of temporaries the loss kernel `node` allocates (`LOSS_SCRATCH`)."""
    return LOSS_SCRATCH[node.target.overloadpacket] * tensor_bytes(node.args[0].meta["val"]) if _reduces(node) else 0


def storage_bytes(node: torch.fx.Node, reported: int) -> int:
    """The bytes of the storage `node`'s output holds, where a trace `reported` them: more
    for a loss reduced into its elementwise losses (`REDUCED_INTO_ELEMENTWISE`)."""
    if getattr(node.target, "overloadpacket", None) in REDUCED_INTO_ELEMENTWISE and _reduces(node):
        return max(reported, tensor_bytes(node.args[0].meta["val"]))
    return reported


def flash_attention_cpu_workspace(node: torch.fx.Node) -> int:
    """Scratch of PyTorch's CPU flash attention (torch 2.13), measured: per thread
    (`torch.get_num_threads()` as the step is traced: a plan made with fewer threads than
    the training runs with under-prices it), query blocks of 32 rows (64 from
    192 queries, 256 from 768) against key blocks of up to 512, in the accumulation dtype
    (float32 for half types): the forward holds a block of scores, two row statistics and
    a block of output; the backward two blocks of scores, one row vector, and a copy of
    the output gradient unless it is laid out as the output is (batch, query, head). Half
    types hold more (converted copies) that is not priced."""
    query, grad = node.args[0].meta["val"], None
    backward = node.target.overloadpacket is aten._scaled_dot_product_flash_attention_for_cpu_backward
    if backward:
        grad, query = query, node.args[1].meta["val"]
    keys = node.args[2 if backward else 1].meta["val"]
    rows, width = concrete(query.shape[-2]), concrete(query.shape[-1])
    q_block = 256 if rows >= 768 else 64 if rows >= 192 else 32
    q_block, kv_block = min(q_block, rows), min(512, concrete(keys.shape[-2]))
    item = max(query.element_size(), 4)
    threads = torch.get_num_threads()
    if not backward:
        return threads * (q_block * kv_block + 2 * q_block + q_block * width) * item
    copied = 0 if grad.transpose(1, 2).is_contiguous() else tensor_bytes(grad)
    return threads * 2 * q_block * kv_block * item + q_block * item + copied


class _OpTimer(torch.fx.Interpreter):
    """Runs a traced step on real tensors, timing each op (best of `repeats`, those that
    write into their arguments tried on copies)."""

    def __init__(self, module: torch.fx.GraphModule, repeats: int, once: Callable[[torch.fx.Node], bool]) -> None:
        super().__init__(module)
        self.repeats, self.once = repeats, once
        self.writes = False
        self.seconds: dict[str, float] = {}

    def call_function(self, target: Any, args: tuple, kwargs: dict) -> Any:
        best = float("inf")
        result = None
        for repeat in range(self.repeats):
            given = (args, kwargs)
            if self.writes and repeat < self.repeats - 1:  # a trial run writes into copies
                given = torch.utils._pytree.tree_map_only(torch.Tensor, torch.clone, given)
            _synchronize(given)
            start = time.perf_counter()
            result = super().call_function(target, *given)
            _synchronize(result)
            best = min(best, time.perf_counter() - start)
        self.seconds[self.current_node] = best
        return result

    def run_node(self, n: torch.fx.Node) -> Any:
        self.current_node, self.writes = n.name, self.once(n)
        return super().run_node(n)


def _synchronize(value: Any) -> None:
    for t in torch.utils._pytree.tree_leaves(value):
        if isinstance(t, torch.Tensor) and t.is_cuda:
            torch.cuda.synchronize(t.device)
            return


def profile_costs(module: torch.fx.GraphModule, real_args: list[Any], repeats: int = 3,
                  once: Callable[[torch.fx.Node], bool] = lambda node: False) -> dict[str, float]:
    """Measured seconds per op node name (the best of `repeats` runs), from running
    `module` on `real_args`; the ops `once` names (those writing into what they are
    given) run their trials on copies of their arguments and once on them: run again on
    them, they would work on what their last run wrote (an `exp_` three times
    overflows)."""
    timer = _OpTimer(module, repeats, once)
    with torch.no_grad():
        timer.run(*real_args)
    return timer.seconds
