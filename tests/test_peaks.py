"""What eager PyTorch allocates beyond the traced tensors is priced: kernel scratch
buffers, what checkpoint and the runtime stash per checkpointed call, what a rerun
that stops early still computes, and what Python holds past its last read. Each plan's
predicted peak is the measured one (CPU, float64, batches small enough that a few
hundred bytes matter)."""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch
import torch.nn as nn

import optremat
from optremat.models import GPT
from optremat.planners.regions import Region
from optremat.runtime.measure import measure_step
from optremat.tracing.costs import DEVICES
from tests.blocks import Twice

WIDTH, BATCH = 32, 96


def loss_fn(out: torch.Tensor) -> torch.Tensor:
    return out.square().mean()


class Scale(nn.Module):
    """A product with a number: its autograd node saves nothing."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 0.5


class Tuple(nn.Module):
    """Returns a tuple of two tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.tanh(self.lin(x)), torch.tanh(x)


class Unpacking(nn.Module):
    """Unpacks the tuple a child returns: Python holds both halves until it returns."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = Tuple()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = self.inner(x)
        return a * 0.5 + b


class Tied(nn.Module):
    """One weight read twice: its two gradients reach autograd's engine as views (of the
    products' transposes), which it sums into a new tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, 4 * WIDTH, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(torch.tanh(self.lin(x)), self.lin.weight.t())


class Gated(nn.Module):
    """A gated MLP: the product's autograd node saves the gate's SiLU output, which nothing
    else keeps, and holds it until its formula has made both gradients."""

    def __init__(self) -> None:
        super().__init__()
        self.gate, self.up = nn.Linear(WIDTH, 16 * WIDTH), nn.Linear(WIDTH, 16 * WIDTH)
        self.down = nn.Linear(16 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(nn.functional.silu(self.gate(x)) * self.up(x))


class Attention(nn.Module):
    """Self-attention run by PyTorch's CPU flash kernel, whose forward and backward
    allocate scratch blocks per thread, of 32 queries in 4 sequences of 24 tokens, or of
    64 in one of `tokens` (from 192); `heads_first` returns the output in (batch, head,
    query) order, so its gradient reaches the backward laid out otherwise than the output,
    which the backward copies."""

    def __init__(self, heads_first: bool = False, tokens: int = BATCH) -> None:
        super().__init__()
        self.qkv, self.heads_first, self.tokens = nn.Linear(WIDTH, 3 * WIDTH), heads_first, tokens

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        sequences = 4 if self.tokens == BATCH else 1
        rows = x.repeat(self.tokens // BATCH, 1)
        qkv = self.qkv(rows).view(sequences, self.tokens // sequences, 3, 4, WIDTH // 4)
        out = nn.functional.scaled_dot_product_attention(*(t.transpose(1, 2) for t in qkv.unbind(2)))
        return (out if self.heads_first else out.transpose(1, 2)).reshape(self.tokens, WIDTH)[:BATCH]


class TanhGelu(torch.autograd.Function):
    """A GELU with its own Python backward, as BLOOM writes it: one named temporary, the
    rest of each expression's temporaries dropped as the expression reads them."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return x * 0.5 * (1.0 + torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x)))

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        tanh_out = torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x))
        return (0.5 * x * ((1 - tanh_out * tanh_out) * (0.79788456 + 0.1070322243 * x * x)) + 0.5 * (1 + tanh_out)) * g


class PythonBackward(nn.Module):
    def __init__(self, function: type[torch.autograd.Function] = TanhGelu) -> None:
        super().__init__()
        self.function = function
        self.up, self.down = nn.Linear(WIDTH, 4 * WIDTH), nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.function.apply(self.up(x)))


class GeluAgain(torch.autograd.Function):
    """A GELU whose Python backward differentiates the op again, as memory-saving custom
    activations do: the recomputed result is held by `torch.autograd.grad`'s argument
    until that call returns, though no op reads it."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return nn.functional.gelu(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        with torch.enable_grad():
            again = x.detach().requires_grad_()
            return torch.autograd.grad(nn.functional.gelu(again), again, g)[0]


class Heads(nn.Module):
    """A projection's result reshaped into heads and kept in a variable, as attention
    keeps its queries: the variable holds it until the forward returns, in a rerun too,
    though the scaled copy is all the rest reads."""

    def __init__(self) -> None:
        super().__init__()
        self.proj, self.out = nn.Linear(WIDTH, 4 * WIDTH), nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        heads = self.proj(x).view(BATCH, 4, WIDTH)
        return self.out(torch.tanh(heads * 0.5).view(BATCH, 4 * WIDTH))


class Gathered(nn.Module):
    """A few columns gathered from a wide product: gather's autograd node saves the whole
    product, though its formula reads only its shape."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, 8 * WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.gather(self.lin(x), 1, torch.arange(WIDTH).expand(x.shape[0], WIDTH))


def spread(x: torch.Tensor) -> torch.Tensor:
    """A plain function, no module call, whose variables hold its wide temporaries until it
    returns, past the ops that last read them."""
    wide = x.repeat(1, 8)
    scaled = wide * 0.5
    shifted = scaled + 1.0
    return torch.tanh(shifted).view(-1, 8, WIDTH).sum(1)


class Spread(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return spread(x)


def framed(*blocks: nn.Module) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, WIDTH), *blocks, nn.Linear(WIDTH, 4)).double()


CASES: dict[str, tuple[Callable[[], nn.Module], tuple[Region, ...]]] = {
    "a batch norm's backward scratch buffer": (lambda: framed(nn.BatchNorm1d(WIDTH)), ()),
    "the RNG state and buffer copies of a checkpointed batch norm": (
        lambda: framed(nn.BatchNorm1d(WIDTH)), (Region("[0:2]", 0),)),
    "a rerun stopping at a tanh that saves its output": (
        lambda: framed(nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH), nn.Tanh()),
                       Scale()), (Region("1", 0),)),
    "a saved output dropped when the rerun is over": (
        lambda: framed(nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH))),
        (Region("1[0:2]", 0),)),
    "a block's output held through its second call": (
        lambda: framed(Twice(nn.Sequential(nn.Linear(WIDTH, WIDTH), Unpacking(), nn.BatchNorm1d(WIDTH)))), ()),
    "a weight read twice, its gradients summed through views": (lambda: framed(Tied()), ()),
    "a product's inputs held until its backward formula returns": (lambda: framed(Gated()), ()),
    "a product's recomputed inputs held until its backward formula returns": (
        lambda: framed(Gated()), (Region("1", 0),)),
    "the flash attention kernel's scratch, its call checkpointed": (lambda: framed(Attention()), (Region("1", 0),)),
    "the flash attention kernel's scratch in blocks of 64 queries": (
        lambda: framed(Attention(tokens=3 * BATCH)), (Region("1", 0),)),
    "the flash attention kernel's copy of a gradient laid out otherwise": (
        lambda: framed(Attention(heads_first=True)), (Region("1", 0),)),
    "a Python backward's temporaries dropped as its expressions read them": (lambda: framed(PythonBackward()), ()),
    "gather's whole input held until its backward formula runs": (lambda: framed(Gathered()), ()),
    "a Python backward's result handed to autograd.grad held until it returns": (lambda: framed(PythonBackward(GeluAgain)), ()),
    "a Python backward's result handed to autograd.grad, its call checkpointed": (
        lambda: framed(PythonBackward(GeluAgain)), (Region("1", 0),)),
    "a call's result held by the caller's variable through its views, in its rerun too": (
        lambda: framed(Heads()), (Region("1", 0),)),
    "a plain function's variables held until it returns": (lambda: framed(Spread()), ()),
    "a tuple's halves held while the caller runs, in its rerun too": (
        lambda: framed(nn.Sequential(Unpacking(), nn.Tanh())), (Region("1", 0),)),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_predicted_peak_is_what_eager_allocates(case: str) -> None:
    make, regions = CASES[case]
    model = make()
    x = torch.randn(BATCH, 16, dtype=torch.float64)
    plan = optremat.price_regions(model, (x,), regions, loss_fn=loss_fn)
    assert {(r.path, r.call) for r in plan.regions} == {(r.path, r.call) for r in regions}
    optremat.apply(model, plan)
    measured = measure_step(model, (x,), loss_fn).peak_bytes
    assert abs(measured - plan.predicted_peak_bytes) <= 64, (measured, plan.predicted_peak_bytes)


@pytest.mark.parametrize("norm", [nn.utils.weight_norm, nn.utils.spectral_norm], ids=["weight_norm", "spectral_norm"])
def test_a_weight_a_hook_computes_is_priced_as_held_by_its_layer(norm: Callable[[nn.Module], nn.Module]) -> None:
    """`torch.nn.utils.weight_norm`'s and `spectral_norm`'s hooks compute a layer's weight
    before each call and leave it on the layer until its next call: plans checkpointing
    such layers were priced as if that freed their weights, and measured up to 1.3 times
    their prediction."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(norm(nn.Linear(32, 128)), nn.GELU(), norm(nn.Linear(128, 32)), nn.Tanh(),
                                          norm(nn.Linear(32, 32))) for _ in range(5)])
    x, y = torch.randn(64, 32), torch.randn(64, 32)

    def squared_error(out: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(out, y)

    try:
        plan = optremat.plan(model, (x,), 0.72, loss_fn=squared_error, time_limit=2, deterministic=True)
    except optremat.InfeasibleBudget as refused:
        plan = optremat.plan(model, (x,), refused.smallest, loss_fn=squared_error, time_limit=2, deterministic=True)
    assert plan.regions
    optremat.apply(model, plan)
    measured = measure_step(model, (x,), squared_error).peak_bytes
    assert abs(measured / plan.predicted_peak_bytes - 1) <= 0.05, (measured, plan.predicted_peak_bytes)


def test_a_checkpointed_call_holds_the_rng_state_until_its_backward_is_done() -> None:
    model = framed(nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH), nn.Tanh()), Scale())
    x = torch.randn(BATCH, 16, dtype=torch.float64)
    plan = optremat.price_regions(model, (x,), (Region("1", 0),), loss_fn=loss_fn)
    graph, schedule = plan.graph, plan.schedule
    rng = DEVICES["cpu"].rng_state_bytes
    assert rng == torch.get_rng_state().nbytes > 0
    reruns = schedule.stage != schedule.node
    assert set(schedule.held[reruns].tolist()) == {2 * rng}, "one stash from the forward, one while it reruns"
    first_op = min(v for v in range(graph.n) if graph.module[v].startswith("1.") and graph.kind[v] == "op")
    assert schedule.held[schedule.node == first_op].tolist() == [rng]
    assert schedule.held[-1] == 0, "the stash is dropped once the call's autograd nodes are done"
    assert optremat.simulate(graph, schedule).peak_bytes == plan.predicted_peak_bytes


def test_python_holds_a_call_argument_until_the_call_returns() -> None:
    model = framed(Unpacking())
    x = torch.randn(BATCH, 16, dtype=torch.float64)
    graph = optremat.extract(model, (x,), loss_fn)
    index = {name: k for k, name in enumerate(graph.names)}
    first_linear = index["addmm"]
    last_of_call = max(k for k in range(graph.n) if graph.module[k].startswith("1") and not graph.backward[k]
                       and graph.kind[k] == "op")
    assert graph.lives_to[first_linear] == last_of_call, "Unpacking's argument lives until Unpacking returns"
    halves = [index["tanh"], index["tanh_1"]]
    assert graph.lives_to[halves].tolist() == [last_of_call] * 2, "the unpacked tuple lives until the caller returns"
    again = optremat.Graph.from_json(graph.to_json())
    assert again.lives_to.tolist() == graph.lives_to.tolist() and again.fingerprint == graph.fingerprint


@pytest.mark.parametrize("chunks", [None, 4])
def test_a_tied_heads_gradient_is_summed_into_the_one_that_came_first(chunks: int | None) -> None:
    """A GPT whose head shares the embedding's weight: the head's gradient, made first, is a
    tensor nothing else holds, and autograd's engine adds the embedding's into it. With the
    head in chunks and every block checkpointed the step peaks there, so a new tensor for
    the sum would be priced a weight's bytes (1 MiB) over what eager allocates."""
    torch.manual_seed(0)
    model = GPT(4096, 64, 32, 6, 4).double()
    model.forward = model.hidden_states
    ids = torch.randint(0, 4096, (2, 64))
    loss = optremat.CausalLMLoss(model.head, ids, chunks=chunks)
    plan = optremat.price_regions(model, ids, [Region(f"blocks.{i}", 0) for i in range(6)], loss_fn=loss)
    optremat.apply(model, plan)
    measured = measure_step(model, ids, loss).peak_bytes
    assert abs(measured - plan.predicted_peak_bytes) <= 2048, (measured, plan.predicted_peak_bytes)



FLOAT64_CONVOLUTIONS = {
    "3x3": lambda: nn.Conv2d(8, 8, 3, padding=1),
    "3x3, stride 2": lambda: nn.Conv2d(8, 8, 3, stride=2, padding=1),
    "1x1": lambda: nn.Conv2d(8, 8, 1),
    "dilated": lambda: nn.Conv2d(8, 8, 3, padding=2, dilation=2),
    "transposed": lambda: nn.ConvTranspose2d(8, 8, 3, padding=1),
    "1-d": lambda: nn.Sequential(nn.Flatten(2), nn.Conv1d(8, 8, 5, padding=2), nn.Unflatten(2, (16, 16))),
    "3-d": lambda: nn.Sequential(nn.Unflatten(2, (4, 4)), nn.Conv3d(8, 8, 3, padding=1), nn.Flatten(2, 3)),
}


@pytest.mark.parametrize("conv", list(FLOAT64_CONVOLUTIONS))
def test_a_float64_convolution_is_priced_with_the_columns_it_unfolds(conv: str) -> None:
    """A CPU runs float64 convolutions in ATen's own kernels, which unfold the input into
    im2col columns (nine inputs' sizes for a 3x3 kernel) in the forward and again in the
    backward: a float64 convnet's step measured 1.8 times its prediction."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(), FLOAT64_CONVOLUTIONS[conv](), nn.ReLU(),
                          nn.Conv2d(8, 8, 3, padding=1)).double()
    x = torch.randn(8, 8, 16, 16, dtype=torch.float64)
    loss_fn = lambda out: out.square().mean()  # noqa: E731
    plan = optremat.price_regions(model, (x,), (), loss_fn=loss_fn)
    measured = measure_step(model, (x,), loss_fn).peak_bytes
    assert abs(measured - plan.predicted_peak_bytes) <= 1024, (measured, plan.predicted_peak_bytes)


def test_a_grouped_float64_convolution_is_priced_at_least_as_it_runs() -> None:
    """Grouped float64 convolutions run group by group and join the groups' outputs,
    priced as an upper bound: one group's columns and a copy of the output."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 16, 3, padding=1, groups=16),
                          nn.ReLU(), nn.Conv2d(16, 16, 3, padding=1, groups=4)).double()
    x = torch.randn(8, 8, 16, 16, dtype=torch.float64)
    loss_fn = lambda out: out.square().mean()  # noqa: E731
    plan = optremat.price_regions(model, (x,), (), loss_fn=loss_fn)
    measured = measure_step(model, (x,), loss_fn).peak_bytes
    assert measured <= plan.predicted_peak_bytes <= 1.15 * measured, (measured, plan.predicted_peak_bytes)


class Residual(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.a, self.b = (nn.Conv2d(channels, channels, 3, padding=1) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.b(torch.relu(self.a(x)))


@pytest.mark.parametrize("channels", [4, 8, 12, 24])
def test_a_convolution_whose_channels_are_not_a_multiple_of_16_is_priced_with_their_padding(channels: int) -> None:
    """oneDNN's float32 convolution backward reorders its input and output gradient
    into copies whose channels it pads to a multiple of 16 (measured: a 3x3 from 32
    channels to 1 holds 1.54 inputs' sizes of scratch, not 1.03). Residual blocks of 4
    to 24 channels measured 1.05-1.34 times their predicted peak; now 0.95-1.02 (24
    channels on 2 threads hold a little more than the padding)."""
    assert 0.94 <= measured_over_predicted(*residual_net(channels, blocks=4, side=16)) <= 1.025


def residual_net(channels: int, blocks: int, side: int) -> tuple[nn.Module, torch.Tensor, Callable]:
    """Residual blocks of `channels` on `side` x `side` maps after a stem, a linear head
    and a cross-entropy over a batch of 8."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, channels, 3, padding=1), *[Residual(channels) for _ in range(blocks)],
                          nn.Flatten(), nn.Linear(channels * side * side, 10))
    x, y = torch.randn(8, 3, side, side), torch.randint(0, 10, (8,))
    return model, x, lambda out: nn.functional.cross_entropy(out, y)


def measured_over_predicted(model: nn.Module, x: torch.Tensor, loss_fn: Callable) -> float:
    """The unplanned step's measured peak over its predicted one."""
    plan = optremat.price_regions(model, (x,), (), loss_fn=loss_fn)
    return measure_step(model, (x,), loss_fn).peak_bytes / plan.predicted_peak_bytes


class SiluOnCtx(torch.autograd.Function):
    """A SiLU keeping its input on `ctx` rather than `save_for_backward`, and its scale, a
    parameter, there too."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        ctx.x, ctx.scale = x, scale
        return x * torch.sigmoid(scale * x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        return SiluOnCtx.gradient(ctx.x, ctx.scale, g), None

    @staticmethod
    def gradient(x: torch.Tensor, scale: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        s = torch.sigmoid(scale * x)
        return g * (s + scale * x * s * (1 - s))


class SiluSaved(SiluOnCtx):
    """The same SiLU saving its input for the backward, its scale on `ctx`."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        ctx.scale = scale
        return x * torch.sigmoid(scale * x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        return SiluOnCtx.gradient(ctx.saved_tensors[0], ctx.scale, g), None


class CtxBlock(nn.Module):
    def __init__(self, keep_input: bool) -> None:
        super().__init__()
        self.function = SiluOnCtx if keep_input else SiluSaved
        self.a, self.b = nn.Linear(64, 256), nn.Linear(256, 64)
        self.scale = nn.Parameter(torch.tensor(1.702), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.function.apply(self.a(x), self.scale))


@pytest.mark.parametrize("keep_input", [True, False], ids=["input on ctx", "weight on ctx"])
def test_a_call_whose_function_keeps_what_it_computes_on_ctx_is_not_checkpointed(keep_input: bool) -> None:
    """checkpoint cannot drop what an autograd.Function keeps on its ctx rather than
    `save_for_backward`: six such blocks on 2048 rows planned at half their peak measured
    1.44x the budget. The calls running one are not checkpointed (a budget only checkpointing could
    meet is refused, naming why); a parameter kept there costs nothing and rules nothing out."""
    torch.manual_seed(0)
    model = nn.Sequential(*[CtxBlock(keep_input) for _ in range(6)])
    x, y = torch.randn(512, 64), torch.randn(512, 64)
    loss_fn = lambda out: nn.functional.mse_loss(out, y)  # noqa: E731
    if keep_input:
        with pytest.raises(optremat.InfeasibleBudget, match="keeping tensors on its ctx"):
            optremat.plan(model, (x,), 0.5, loss_fn=loss_fn, time_limit=5, deterministic=True)
        return
    plan = optremat.plan(model, (x,), 0.5, loss_fn=loss_fn, time_limit=5, deterministic=True)
    assert plan.regions
    optremat.apply(model, plan)
    assert measure_step(model, (x,), loss_fn).peak_bytes <= plan.budget_bytes


class Skipped(nn.Module):
    """A U-Net level: the upsampled map, convolved, is concatenated with the skip."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.enc = nn.Conv2d(3, channels, 3, padding=1)
        self.down = nn.Conv2d(channels, 2 * channels, 3, stride=2, padding=1)
        self.up = nn.Sequential(nn.Upsample(scale_factor=2), nn.Conv2d(2 * channels, channels, 3, padding=1))
        self.head = nn.Conv2d(2 * channels, 3, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skip = self.enc(x)
        return self.head(torch.cat([self.up(self.down(skip)), skip], 1))


@pytest.mark.parametrize("channels", [16, 32])
def test_a_convolution_whose_output_gradient_is_a_slice_is_priced_with_its_copy(channels: int) -> None:
    """A convolution whose output a `torch.cat` reads gets its output gradient as a slice
    of the cat's, and copies it contiguous before its kernel runs: U-Net levels measured
    1.08 and 1.10 times their predicted peak; now 1.002."""
    torch.manual_seed(0)
    model, x = Skipped(channels), torch.randn(8, 3, 64, 64)
    assert 0.99 <= measured_over_predicted(model, x, lambda out: out.square().mean()) <= 1.01


@pytest.mark.parametrize("channels", [128, 256])
def test_a_convolution_of_many_channels_on_a_small_map_is_priced_with_its_weight_gradient(channels: int) -> None:
    """oneDNN's float32 convolution backward holds its weight gradient in a blocked layout
    while it runs; with many channels on a small map that is more than the reordered
    activations it was priced with."""
    assert 0.97 <= measured_over_predicted(*residual_net(channels, blocks=2, side=4)) <= 1.01


class Attending(nn.Module):
    """A pre-norm attention block returning its attention weights, as `need_weights`
    does: the dropout's output feeds the values' product and the weights a loss reads."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(64)
        self.attn = nn.MultiheadAttention(64, 4, dropout=0.1, batch_first=True)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.norm(x)
        a, weights = self.attn(h, h, h, need_weights=True, average_attn_weights=False)
        return x + a, weights


class AttendingStack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Attending() for _ in range(2))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        for block in self.blocks:
            x, weights = block(x)
        return x, weights


def test_a_gradient_sum_whose_first_term_is_a_view_is_priced_as_a_new_tensor() -> None:
    """Autograd's engine adds a second gradient into the first where nothing else holds
    the first, and otherwise makes a new tensor, never adding into the second. The
    attention weights' gradient arrives first through their view, then the values'
    product's: priced as added into the second, a plan saving the dropout's output
    measured one weights tensor (400 KiB) over its prediction and its budget."""
    torch.manual_seed(0)
    model = AttendingStack()
    x = torch.randn(16, 40, 64)
    loss_fn = lambda out: out[0].square().mean() + out[1].square().mean()  # noqa: E731
    plan = optremat.price_regions(model, (x,), [Region("blocks.1.attn", 0, frozenset({("mul.Tensor", 1)}))],
                                  loss_fn=loss_fn)
    optremat.apply(model, plan)
    measured = measure_step(model, (x,), loss_fn).peak_bytes
    assert abs(measured - plan.predicted_peak_bytes) <= 64, (measured, plan.predicted_peak_bytes)


LOSSES: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "mse": lambda out: nn.functional.mse_loss(out, torch.zeros_like(out)),
    "smooth l1, summed": lambda out: nn.functional.smooth_l1_loss(out, torch.ones_like(out), reduction="sum"),
    "huber": lambda out: nn.functional.huber_loss(out, torch.zeros_like(out)),
    "a square's mean, its backward formula the step's last": lambda out: out.square().mean(),
    "soft margin": lambda out: nn.functional.soft_margin_loss(out, torch.ones_like(out)),
    "binary cross-entropy with logits": lambda out: nn.functional.binary_cross_entropy_with_logits(
        out, torch.full_like(out, 0.5)),
    "binary cross-entropy": lambda out: nn.functional.binary_cross_entropy(torch.sigmoid(out), torch.zeros_like(out)),
}
MISPRICED_LOSSES = ("binary cross-entropy with logits",)
"""Losses priced one output's size off (docs/known-gaps.md): a test passing on one fails."""


class OwnLoss(nn.Module):
    """A model computing its loss in its forward from a target it is handed."""

    def __init__(self, loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.layers = nn.Sequential(*[nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))
                                      for _ in range(6)])
        self.loss = loss

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.loss(self.layers(x), y)


@pytest.mark.parametrize("loss", [nn.functional.mse_loss, nn.functional.smooth_l1_loss, nn.functional.l1_loss],
                         ids=lambda f: f.__name__)
@pytest.mark.parametrize("budget", [1.0, 0.8])
def test_a_loss_the_model_computes_in_its_forward_is_priced_with_the_storage_it_keeps(loss, budget: float) -> None:
    """`F.mse_loss`'s scalar keeps its elementwise losses' storage: with the loss in the
    model's forward, held through the backward, plans measured an input's size over
    their prediction and over their budget."""
    torch.manual_seed(0)
    model = OwnLoss(loss)
    inputs = (torch.randn(256, 64), torch.randn(256, 64))
    plan = optremat.plan(model, inputs, budget, loss_fn=lambda out: out, time_limit=5, deterministic=True)
    optremat.apply(model, plan)
    measured = measure_step(model, inputs, lambda out: out).peak_bytes
    assert measured <= plan.budget_bytes
    assert abs(measured - plan.predicted_peak_bytes) <= 64, (measured, plan.predicted_peak_bytes)


def test_a_target_the_loss_reads_in_its_forward_and_backward_is_priced_once() -> None:
    """The trace records a tensor the loss holds from outside as a constant for each op
    reading it: `F.huber_loss`'s target, read again by its backward, was priced twice."""
    torch.manual_seed(0)
    model = OwnLoss(nn.functional.huber_loss).layers
    x, y = torch.randn(256, 64), torch.randn(256, 64)
    loss_fn = lambda out: nn.functional.huber_loss(out, y)  # noqa: E731
    plan = optremat.price_regions(model, (x,), (), loss_fn=loss_fn)
    measured = measure_step(model, (x,), loss_fn).peak_bytes
    assert abs(measured - plan.predicted_peak_bytes) <= 64, (measured, plan.predicted_peak_bytes)


@pytest.mark.parametrize("loss", [pytest.param(name, marks=pytest.mark.xfail(strict=True, reason="known gap"))
                                  if name in MISPRICED_LOSSES else name for name in sorted(LOSSES)])
def test_a_loss_kernels_elementwise_losses_are_priced(loss: str) -> None:
    """A loss kernel computes its elementwise losses into tensors of its input's size
    before reducing them (`costs.LOSS_SCRATCH`), and some keep them as the reduced loss's
    storage (`costs.REDUCED_INTO_ELEMENTWISE`): on a wide output they set the peak."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, WIDTH), nn.Linear(WIDTH, 16 * WIDTH)).double()
    x = torch.randn(BATCH, 16, dtype=torch.float64)
    plan = optremat.price_regions(model, (x,), (), loss_fn=LOSSES[loss])
    measured = measure_step(model, (x,), LOSSES[loss]).peak_bytes
    assert abs(measured - plan.predicted_peak_bytes) <= 64, (measured, plan.predicted_peak_bytes)
