"""What oneDNN's CPU kernels hold while a convolution's backward runs on channels-last
data, as measured with oneDNN 3.12 (torch 2.13) on AVX512: the blocked layouts its kernels
compute weight gradients in pad channels to the register width, which for a depthwise
convolution its depthwise kernel cannot take costs 256 times the weight (ConvNeXt's 7x7).
`costs.workspace_bytes` prices a convolution backward with it where it applies. And what
its RNN layers hold, and its low-precision matrix products, which only running them tells
(`size_rnn_workspaces`, `size_matmul_scratch`)."""

from __future__ import annotations

from typing import Any, Iterable

import torch
from torch._prims_common import suggest_memory_format
from torch.multiprocessing.reductions import StorageWeakRef

from optremat.tracing.host_memory import host_peak
from optremat.tracing.slow_convolution import convolution_backend


def channels_last_convolution_backward_workspace(node: torch.fx.Node) -> int | None:
    """Temporaries of a float32 2-d convolution's backward that PyTorch runs through oneDNN
    on channels-last data (the input or the weight suggests channels-last, as eager
    decides) on an AVX512 CPU; None for any other convolution backward, and where
    `_onednn_weight_gradient_bytes` has no measured price for the weight gradient.

    Measured with oneDNN 3.12 (torch 2.13), to a few hundred bytes and alike on 1, 2 and 4
    threads: PyTorch copies the output gradient and the weight to channels-last where they
    are not already; the input gradient's kernel reorders the weight (its bytes); the
    weight gradient is computed in oneDNN's blocked layout (`_onednn_weight_gradient_bytes`)
    and reordered into a plain buffer (the weight's bytes again) that is copied out; the
    bias gradient is copied out the same way.
    """
    args = node.args
    grad_output, inputs, weight = (args[k].meta.get("val") if isinstance(args[k], torch.fx.Node) else None
                                   for k in range(3))
    if not all(isinstance(t, torch.Tensor) for t in (grad_output, inputs, weight)):
        return None
    stride, padding, dilation, transposed, output_padding, groups, mask = args[4:11]
    if (transposed or inputs.device.type != "cpu" or inputs.dim() != 4
            or torch.backends.cpu.get_cpu_capability() != "AVX512"
            or any(t.dtype != torch.float32 for t in (grad_output, inputs, weight))):
        return None
    if torch.channels_last not in (suggest_memory_format(inputs), suggest_memory_format(weight)):
        return None
    if convolution_backend(node) != torch._C._ConvBackend.Mkldnn:
        return None
    item = weight.element_size()
    weight_bytes = weight.numel() * item
    total = 0
    if not grad_output.is_contiguous(memory_format=torch.channels_last):
        total += grad_output.numel() * grad_output.element_size()
    if not weight.is_contiguous(memory_format=torch.channels_last):
        total += weight_bytes
    if mask[1]:
        blocked = _onednn_weight_gradient_bytes(weight, groups, list(inputs.shape[2:]), list(grad_output.shape[2:]),
                                                list(stride), list(padding), list(dilation))
        if blocked is None:
            return None
        total += blocked + weight_bytes
    elif mask[0]:
        total += weight_bytes
    if mask[2]:
        total += weight.shape[0] * item
    return total


_AVX512_BLOCK = 16
"""Channels per AVX512 register: oneDNN's blocked weight layouts pad channels to it."""


def plain_convolution_backward_weight_bytes(node: torch.fx.Node) -> int:
    """What a float32 convolution's backward that oneDNN runs on contiguous data holds for
    its weight at once: the weight gradient in oneDNN's blocked layout and the bias
    gradient, or without a weight gradient the weight reordered for the input gradient's
    kernel; 0 where oneDNN does not run it, for the first-layer kernel and for grouped
    ones (not measured). The kernel holds this or its reordered activations, whichever
    is more (measured on one thread, to the byte on 18 shapes of 16 to 512 channels on
    4x4 to 64x64 maps; on two threads some shapes also hold a copy of the weight gradient
    per thread)."""
    grad_output, inputs, weight = (node.args[k].meta.get("val") if isinstance(node.args[k], torch.fx.Node)
                                   else None for k in range(3))
    if not all(isinstance(t, torch.Tensor) for t in (grad_output, inputs, weight)):
        return 0
    stride, padding, dilation, transposed, output_padding, groups, mask = node.args[4:11]
    if transposed or groups != 1 or weight.dim() != 4 or convolution_backend(node) != torch._C._ConvBackend.Mkldnn:
        return 0
    item, weight_bytes = weight.element_size(), weight.numel() * weight.element_size()
    if not mask[1]:
        return weight_bytes if mask[0] else 0
    blocked = _onednn_weight_gradient_bytes(weight, groups, list(inputs.shape[2:]), list(grad_output.shape[2:]),
                                            list(stride), list(padding), list(dilation))
    return 0 if blocked is None else blocked + (weight.shape[0] * item if mask[2] else 0)


def _onednn_weight_gradient_bytes(weight: torch.Tensor, groups: int, size_in: list[int], size_out: list[int],
                                  stride: list[int], padding: list[int], dilation: list[int]) -> int | None:
    """Bytes of the blocked weight gradient oneDNN's AVX512 kernels compute on
    channels-last data; None for the first-layer kernel (one group of fewer than 16 input
    channels) and a strided 1x1 convolution's, whose temporaries differ (the older
    formula bounds them).

    oneDNN's depthwise kernel pads only the number of groups to the block, where its
    conditions hold; the general and 1x1 kernels pad each group's input and output
    channels to the block, so a depthwise convolution the depthwise kernel cannot take (a
    kernel wider than 3, dilation, an input smaller than the kernel...) holds its weight
    gradient at 16 x 16 = 256 times its size: a 7x7 depthwise convolution's, as in
    ConvNeXt. The gemm kernel oneDNN falls back to for some dilated or very wide kernels
    was measured at or below this.
    """
    out_channels, per_group_in, kh, kw = weight.shape
    per_group_out, item, block = out_channels // groups, weight.element_size(), _AVX512_BLOCK
    if per_group_in == per_group_out == 1 and _onednn_depthwise_kernel(size_in, size_out, [kh, kw], stride, padding,
                                                                      dilation):
        return _round_up(groups, block) * kh * kw * item
    if groups == 1 and per_group_in < block:
        return None
    if groups == 1 and kh == kw == 1 and any(s != 1 for s in stride):
        return None
    return groups * _round_up(per_group_out, block) * _round_up(per_group_in, block) * kh * kw * item


def _round_up(n: int, block: int) -> int:
    return -(-n // block) * block


def _end_padding(size_in: int, size_out: int, extent: int, stride: int, begin: int) -> int:
    return max(0, (size_out - 1) * stride + extent - size_in - begin)


def _onednn_depthwise_kernel(size_in: list[int], size_out: list[int], kernel: list[int], stride: list[int],
                             padding: list[int], dilation: list[int]) -> bool:
    """Whether oneDNN's depthwise kernel takes a depthwise convolution's weight gradient
    (`jit_uni_dw_conv_bwd_weights` init_conf): no dilation, a kernel at most 3 wide, no
    gaps between windows, padding at most half the kernel (beyond 1, a multiple of the
    stride in height) and an input as tall as the kernel."""
    if any(d != 1 for d in dilation) or kernel[1] > 3 or stride[1] > kernel[1]:
        return False
    ends = [_end_padding(size_in[a], size_out[a], kernel[a], stride[a], padding[a]) for a in (0, 1)]
    for a in (0, 1):
        if max(padding[a], ends[a]) > kernel[a] // 2:
            return False
        if size_out[a] != (size_in[a] + padding[a] + ends[a] - kernel[a]) // stride[a] + 1:
            return False
    return (size_in[0] >= kernel[0] + (-padding[0]) % stride[0]
            and (padding[0] <= 1 or padding[0] % stride[0] == 0) and (ends[0] <= 1 or ends[0] % stride[0] == 0))


def size_rnn_workspaces(gm: torch.fx.GraphModule) -> None:
    """Size what each oneDNN RNN layer (`mkldnn_rnn_layer`, an LSTM's or GRU's on a CPU)
    holds as the kernels do: a trace on fake tensors returns the workspace the forward
    keeps for the backward empty (3.0 MB for a 64-wide LSTM layer over 48x16 tokens, more
    than the layer's outputs), and the backward's scratch (1.0 MB there) is no output.
    oneDNN sizes both from every shape and option of the layer with padding of its own, so
    each distinct layer runs once on zeros of its shapes, forward then backward (its
    allocations measured): the workspace and the tensors reading it out of the forward's
    tuple are resized to match, and each backward's scratch is recorded as its node's
    `RNN_SCRATCH` for `costs.workspace_bytes`."""
    workspaces: dict[str, torch.Tensor] = {}
    scratch: dict[str, int] = {}
    forward_of: dict[torch.fx.Node, str] = {}
    for node in gm.graph.nodes:
        if node.target is torch.ops.aten.mkldnn_rnn_layer.default:
            key = repr([_described(a) for a in node.args])
            if key not in workspaces:
                workspaces[key] = node.target(*_zeros(node.args))[3]  # under no_grad the kernel keeps none
            readers = [user for user in node.users if user.args[1:] == (3,)]
            forward_of.update(dict.fromkeys(readers, key))
            for value in (node.meta["val"][3], *(reader.meta["val"] for reader in readers)):
                with value.fake_mode:
                    value.resize_(workspaces[key].numel())
        elif node.target is torch.ops.aten.mkldnn_rnn_layer_backward.default and node.args[-1] in forward_of:
            key = forward_of[node.args[-1]]
            if key not in scratch:
                scratch[key] = _backward_scratch(node, workspaces[key])
            node.meta[RNN_SCRATCH] = scratch[key]


RNN_SCRATCH = "optremat_rnn_scratch"
"""The node meta key of a oneDNN RNN backward's measured scratch bytes."""


def _described(arg: object) -> object:
    value = arg.meta["val"] if isinstance(arg, torch.fx.Node) else arg
    return (tuple(value.shape), value.dtype) if isinstance(value, torch.Tensor) else value


def _zeros(args: tuple) -> list:
    return [torch.zeros(a.meta["val"].shape, dtype=a.meta["val"].dtype)
            if isinstance(a, torch.fx.Node) and isinstance(a.meta["val"], torch.Tensor) else a for a in args]


def _backward_scratch(node: torch.fx.Node, workspace: torch.Tensor) -> int:
    """Bytes a oneDNN RNN layer's backward allocates beyond its outputs, run once on zeros
    and `workspace`."""
    args = _zeros(node.args[:-1]) + [workspace]
    outputs: list = []
    peak = host_peak(lambda: outputs.extend(node.target(*args)))
    distinct = {id(t): t for t in outputs if isinstance(t, torch.Tensor)}
    return max(peak - sum(t.numel() * t.element_size() for t in distinct.values()), 0)


MATMUL_SCRATCH = "optremat_matmul_scratch"
"""The node meta key of a low-precision CPU matrix product's measured scratch bytes."""

_MATMULS = (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm, torch.ops.aten.baddbmm)
_LOW_PRECISION = (torch.bfloat16, torch.float16)


def size_matmul_scratch(nodes: Iterable[torch.fx.Node]) -> None:
    """Record as its node's `MATMUL_SCRATCH`, for `costs.workspace_bytes`, what each
    bfloat16 or float16 matrix product on the CPU allocates beyond its output. oneDNN
    packs its operands into blocked buffers sized from the shapes, the strides and the
    threads (torch 2.13: 206,592 bytes for a 128x1024 by 1024x64 bfloat16 product on two
    threads, 136,192 on one, 542,464 with both operands transposed; none in float32), so
    each distinct product runs once on zeros of its operands' shapes and strides, its
    allocations measured. A chunked LM loss in bfloat16, where one chunk's gradient
    product is the peak's last allocation, measured 8-9% over a price without it."""
    measured: dict[str, int] = {}
    for node in nodes:
        if getattr(node.target, "overloadpacket", None) not in _MATMULS:
            continue
        values = [n.meta.get("val") for n in node.all_input_nodes]
        if not values or not all(isinstance(v, torch.Tensor) and v.device.type == "cpu" and v.dtype in _LOW_PRECISION
                                 and all(type(d) is int for d in (*v.shape, *v.stride())) for v in values):
            continue  # a size the data decides (a mixture's experts) cannot be run: left unpriced
        key = repr((str(node.target), torch.fx.node.map_aggregate((node.args, node.kwargs), _strided),
                    torch.get_num_threads()))
        if key not in measured:
            measured[key] = _matmul_scratch(node)
        node.meta[MATMUL_SCRATCH] = measured[key]


def _strided(arg: object) -> object:
    value = arg.meta.get("val") if isinstance(arg, torch.fx.Node) else arg
    return (tuple(value.shape), value.stride(), value.dtype) if isinstance(value, torch.Tensor) else value


def _matmul_scratch(node: torch.fx.Node) -> int:
    """Bytes a matrix product allocates beyond the output it returns, run once on zeros
    laid out as its operands are."""
    made: list[torch.Tensor] = []

    def real(arg: object) -> object:
        value = arg.meta.get("val") if isinstance(arg, torch.fx.Node) else arg
        if not isinstance(value, torch.Tensor):
            return value
        span = 1 + sum((n - 1) * step for n, step in zip(value.shape, value.stride())) if value.numel() else 0
        made.append(torch.zeros(span, dtype=value.dtype).as_strided(value.shape, value.stride()))
        return made[-1]

    args, kwargs = torch.fx.node.map_aggregate((node.args, node.kwargs), real)
    outputs: list[Any] = []
    peak = host_peak(lambda: outputs.append(node.target(*args, **kwargs)))
    given = {StorageWeakRef(t.untyped_storage()) for t in made}
    fresh = {StorageWeakRef(t.untyped_storage()): t.untyped_storage().nbytes()
             for t in outputs if isinstance(t, torch.Tensor)}
    return max(peak - sum(nbytes for ref, nbytes in fresh.items() if ref not in given), 0)
