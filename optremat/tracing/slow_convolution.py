"""The scratch of the convolutions a CPU runs in ATen's own kernels (`slow_conv2d`,
`slow_conv3d`, their dilated and transposed forms): float64 ones, which oneDNN does not
take. Each unfolds its input into columns (im2col), one row per input channel and kernel
element, one column per output position, and multiplies them by the weight; the
backward unfolds again for the weight's gradient and folds the input gradient's columns
back (col2im). The columns, many times the input, set the peak of a float64 convnet's
step: priced without them it measured 1.8 times its prediction.

Measured on PyTorch 2.13's CPU kernels (bytes, float64, 3x3 kernels unless named):
- `Slow2d`, `Slow3d`: the whole batch's columns, in the forward and again in the
  backward, none for a 1x1 kernel at stride 1 without padding (a plain product);
- `SlowDilated2d`, `SlowDilated3d`, and the transposed forms' backward: one sample's;
- `SlowTranspose2d`, `SlowTranspose3d` forward: the whole batch's, of the output
  channels, one column per input position;
- grouped convolutions run group by group, then join the groups' outputs: one group's
  columns and a copy of the output (of the input gradient in the backward), priced so
  as an upper bound (a depthwise 3x3: one input's size measured, 1.56 priced).
"""

from __future__ import annotations

import math

import torch
import torch.fx

_Backend = torch._C._ConvBackend
_WHOLE_BATCH = {_Backend.Slow2d, _Backend.Slow3d}
_ONE_SAMPLE = {_Backend.SlowDilated2d, _Backend.SlowDilated3d}
_TRANSPOSED = {_Backend.SlowTranspose2d, _Backend.SlowTranspose3d}


def convolution_backend(node: torch.fx.Node) -> torch._C._ConvBackend | None:
    """The kernel PyTorch runs the convolution or convolution backward `node` with, as
    `torch._C._select_conv_backend` chooses it on the traced (fake) tensors; None where it
    cannot tell."""
    first = 1 if node.target.overloadpacket is torch.ops.aten.convolution_backward else 0
    inputs, weight = (node.args[first + k].meta.get("val") for k in range(2))
    stride, padding, dilation, transposed, output_padding, groups = node.args[first + 3:first + 9]
    try:
        return torch._C._select_conv_backend(inputs, weight, None, list(stride), list(padding), list(dilation),
                                             transposed, list(output_padding), groups, None)
    except (RuntimeError, TypeError):
        return None


def slow_convolution_workspace(node: torch.fx.Node) -> int | None:
    """The bytes of columns the convolution or convolution backward `node` allocates
    beyond its outputs where ATen's own CPU kernels run it; None where another backend
    (oneDNN) does."""
    backward = node.target.overloadpacket is torch.ops.aten.convolution_backward
    first = 1 if backward else 0
    inputs, weight = (node.args[first + k].meta.get("val") for k in range(2))
    stride, padding, dilation, transposed, output_padding, groups = node.args[first + 3:first + 9]
    if inputs.device.type != "cpu":
        return None
    backend = convolution_backend(node)
    if backend not in _WHOLE_BATCH | _ONE_SAMPLE | _TRANSPOSED:
        return None
    kernel = math.prod(weight.shape[2:])
    if backend in _WHOLE_BATCH and kernel == 1 and all(s == 1 for s in stride) and not any(padding):
        return 0
    result = node.args[0].meta.get("val") if backward else node.meta.get("val")
    if transposed:
        channels, positions = weight.shape[1], math.prod(inputs.shape[2:])
    else:
        channels, positions = weight.shape[1], math.prod(result.shape[2:])
    samples = inputs.shape[0] if backend in _WHOLE_BATCH or (backend in _TRANSPOSED and not backward) else 1
    columns = int(kernel * channels * positions * samples) * inputs.element_size()
    if groups == 1:
        return columns
    joined = inputs if backward else result
    return columns + int(joined.numel()) * joined.element_size()
