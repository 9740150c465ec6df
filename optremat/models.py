"""Built-in models for the CLI, tests and benchmarks.

Each comes in a tiny configuration (tests: seconds on a CPU) and a realistic one
(`gpt-small` is GPT-2 small's shape); `gpt-mini` and `resnet-mini` sit between, big
enough that compute rather than Python dominates a CPU step and small enough to time
in a fraction of a second. `build(name)` returns the model, example inputs
and a loss over the model's output, so a training step is `loss_fn(model(*inputs))`.
"""

from __future__ import annotations

import contextlib
import importlib.util
import sys
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Callable, Iterator

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._pytree import tree_leaves

from optremat.tracing.lm_loss import CausalLMLoss


@dataclass(frozen=True)
class Example:
    """A model, inputs for one step (positional, or a dict of keyword arguments), and the
    loss of its output (targets bound in)."""

    model: nn.Module
    inputs: tuple[torch.Tensor, ...] | dict[str, torch.Tensor]
    loss_fn: Callable[[torch.Tensor], torch.Tensor]

    def to(self, device: str | torch.device) -> "Example":
        """The same example with its model, inputs and targets on `device`."""
        moved = getattr(self.loss_fn, "to", None)
        inputs = ({k: x.to(device) for k, x in self.inputs.items()} if isinstance(self.inputs, dict)
                  else tuple(x.to(device) for x in self.inputs))
        return Example(self.model.to(device), inputs, self.loss_fn if moved is None else moved(device))


@dataclass(frozen=True)
class CrossEntropy:
    """Cross-entropy of a model's output against fixed targets; with `flatten`, the first
    two dimensions of output and target (batch, sequence) are merged first."""

    target: torch.Tensor
    flatten: bool = False

    def __call__(self, out: torch.Tensor) -> torch.Tensor:
        if self.flatten:
            return F.cross_entropy(out.flatten(0, 1), self.target.flatten())
        return F.cross_entropy(out, self.target)

    def to(self, device: str | torch.device) -> "CrossEntropy":
        return CrossEntropy(self.target.to(device), self.flatten)


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class GPTBlock(nn.Module):
    def __init__(self, dim: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, heads)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim), nn.Dropout(dropout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """A GPT-2 style decoder with tied input/output embeddings."""

    def __init__(self, vocab: int, seq: int, dim: int, layers: int, heads: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(seq, dim)
        self.blocks = nn.ModuleList(GPTBlock(dim, heads, dropout) for _ in range(layers))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.tok.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.hidden_states(idx))

    def hidden_states(self, idx: torch.Tensor) -> torch.Tensor:
        """The final hidden states, before the LM head."""
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok(idx) + self.pos(positions)
        for block in self.blocks:
            x = block(x)
        return self.ln(x)


class HiddenGPT(GPT):
    """`GPT` returning its final hidden states: the LM head runs in the loss
    (`optremat.CausalLMLoss(model.head, labels)`), as a chunked head and loss need."""

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.hidden_states(idx)


class LossGPT(GPT):
    """`GPT` taking its own loss in its forward from `targets`, as nanoGPT does:
    `logits, loss = model(idx, targets)`, positions targeted -1 left out."""

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.head(self.hidden_states(idx))
        return logits, F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.down = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        return F.relu(y + (x if self.down is None else self.down(x)))


class ResNet(nn.Module):
    """A ResNet-18 style CNN: skip connections and BatchNorm."""

    def __init__(self, width: int, blocks: tuple[int, ...], classes: int) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU())
        layers = []
        cin = width
        for stage, count in enumerate(blocks):
            cout = width * 2**stage
            for b in range(count):
                layers.append(BasicBlock(cin, cout, 2 if b == 0 and stage > 0 else 1))
                cin = cout
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(cin, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.layers(self.stem(x)).mean((2, 3)))


def _conv_block(cin: int, cout: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1), nn.ReLU(), nn.Conv2d(cout, cout, 3, padding=1), nn.ReLU())


class UNet(nn.Module):
    """A U-Net: long skip connections from each encoder level to its decoder level."""

    def __init__(self, width: int, depth: int, classes: int) -> None:
        super().__init__()
        widths = [width * 2**i for i in range(depth + 1)]
        self.down = nn.ModuleList(_conv_block(cin, cout) for cin, cout in zip([3] + widths[:-2], widths[:-1]))
        self.middle = _conv_block(widths[-2], widths[-1])
        self.up = nn.ModuleList(nn.ConvTranspose2d(widths[i + 1], widths[i], 2, stride=2) for i in reversed(range(depth)))
        self.dec = nn.ModuleList(_conv_block(2 * widths[i], widths[i]) for i in reversed(range(depth)))
        self.out = nn.Conv2d(width, classes, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skips = []
        for block in self.down:
            x = block(x)
            skips.append(x)
            x = F.max_pool2d(x, 2)
        x = self.middle(x)
        for up, dec, skip in zip(self.up, self.dec, reversed(skips)):
            x = dec(torch.cat([up(x), skip], dim=1))
        return self.out(x)


def mlp(width: int, depth: int, inputs: int, classes: int) -> nn.Sequential:
    """A plain chain of Linear+ReLU layers."""
    layers: list[nn.Module] = [nn.Linear(inputs, width), nn.ReLU()]
    for _ in range(depth - 1):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(width, classes))


def vgg(widths: tuple[int, ...], convs_per_stage: int, image: int, classes: int) -> nn.Sequential:
    """A VGG-style chain: conv+ReLU stages separated by max-pooling, then a classifier."""
    layers: list[nn.Module] = []
    cin = 3
    for cout in widths:
        for _ in range(convs_per_stage):
            layers += [nn.Conv2d(cin, cout, 3, padding=1), nn.ReLU()]
            cin = cout
        layers.append(nn.MaxPool2d(2))
    side = image // 2 ** len(widths)
    return nn.Sequential(*layers, nn.Flatten(), nn.Linear(cin * side * side, 4 * cin), nn.ReLU(), nn.Linear(4 * cin, classes))


class UnrolledLSTM(nn.Module):
    """An LSTM cell unrolled over time, with a classifier on the last state."""

    def __init__(self, inputs: int, hidden: int, classes: int) -> None:
        super().__init__()
        self.cell = nn.LSTMCell(inputs, hidden)
        self.fc = nn.Linear(hidden, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.new_zeros(x.shape[0], self.cell.hidden_size)
        c = torch.zeros_like(h)
        for t in range(x.shape[1]):
            h, c = self.cell(x[:, t], (h, c))
        return self.fc(h)


def _classification(model: nn.Module, x: torch.Tensor, classes: int) -> Example:
    target = torch.randint(0, classes, (x.shape[0],), generator=torch.Generator().manual_seed(1))
    return Example(model, (x,), CrossEntropy(target))


def _classification_map(model: nn.Module, x: torch.Tensor, classes: int) -> Example:
    """Per-pixel classification (segmentation) for the U-Net."""
    target = torch.randint(0, classes, (x.shape[0], x.shape[2], x.shape[3]), generator=torch.Generator().manual_seed(1))
    return Example(model, (x,), CrossEntropy(target))


def _gpt(batch: int, *, vocab: int, seq: int, dim: int, layers: int, heads: int, head_in_loss: bool = False
         ) -> Example:
    model = (HiddenGPT if head_in_loss else GPT)(vocab, seq, dim, layers, heads)
    gen = torch.Generator().manual_seed(0)
    idx = torch.randint(0, vocab, (batch, seq), generator=gen)
    target = torch.randint(0, vocab, (batch, seq), generator=gen)
    if head_in_loss:
        return Example(model, (idx,), CausalLMLoss(model.head, target))
    return Example(model, (idx,), CrossEntropy(target, flatten=True))


def _image(batch: int, side: int) -> torch.Tensor:
    return torch.randn(batch, 3, side, side, generator=torch.Generator().manual_seed(0))


BUILDERS: dict[str, Callable[..., Example]] = {
    "gpt-tiny": partial(_gpt, vocab=128, seq=32, dim=64, layers=2, heads=4),
    "gpt-mini": partial(_gpt, vocab=8192, seq=256, dim=256, layers=4, heads=4),
    "gpt-small": partial(_gpt, vocab=50257, seq=1024, dim=768, layers=12, heads=12),
    "resnet-tiny": lambda b: _classification(ResNet(16, (1, 1, 1), 10), _image(b, 64), 10),
    "resnet-mini": lambda b: _classification(ResNet(32, (1, 1, 1, 1), 100), _image(b, 96), 100),
    "resnet": lambda b: _classification(ResNet(64, (2, 2, 2, 2), 1000), _image(b, 224), 1000),
    "unet-tiny": lambda b: _classification_map(UNet(16, 3, 3), _image(b, 64), 3),
    "unet": lambda b: _classification_map(UNet(64, 4, 3), _image(b, 256), 3),
    "mlp-tiny": lambda b: _classification(mlp(64, 4, 32, 10), torch.randn(b, 32), 10),
    "mlp": lambda b: _classification(mlp(4096, 16, 1024, 1000), torch.randn(b, 1024), 1000),
    "vgg-tiny": lambda b: _classification(vgg((16, 32, 64), 2, 64, 10), _image(b, 64), 10),
    "vgg": lambda b: _classification(vgg((64, 128, 256, 512, 512), 2, 224, 1000), _image(b, 224), 1000),
    "rnn-tiny": lambda b: _classification(UnrolledLSTM(16, 32, 10), torch.randn(b, 8, 16), 10),
    "rnn": lambda b: _classification(UnrolledLSTM(512, 1024, 1000), torch.randn(b, 64, 512), 1000),
}
BATCH = {"gpt-tiny": 2, "gpt-mini": 4, "gpt-small": 4, "resnet-tiny": 8, "resnet-mini": 16, "resnet": 32, "unet-tiny": 4, "unet": 8, "mlp-tiny": 8,
         "mlp": 256, "vgg-tiny": 8, "vgg": 16, "rnn-tiny": 4, "rnn": 64}
"""Each built-in model's default batch size."""


def build(name: str, *, seed: int = 0, dtype: torch.dtype = torch.float32, batch: int | None = None,
          device: str | torch.device = "cpu", head_in_loss: bool = False) -> Example:
    """Build a built-in model by name (see `BUILDERS`), with deterministic weights and data
    (drawn on the CPU, so the same on every device), at its default batch size or `batch`,
    on `device`. With `head_in_loss` a GPT returns its final hidden states and its head
    runs in the loss, `optremat.CausalLMLoss(chunks="auto")`, so that a plan may run them in
    token chunks (the same weights and loss; the labels are shifted)."""
    if name not in BUILDERS:
        raise KeyError(f"unknown built-in model {name!r}; choose one of {', '.join(sorted(BUILDERS))}")
    if head_in_loss and not name.startswith("gpt"):
        raise ValueError(f"head_in_loss is for the built-in GPTs, not {name!r}")
    torch.manual_seed(seed)
    batch = BATCH[name] if batch is None else batch
    example = (BUILDERS[name](batch, head_in_loss=True) if head_in_loss else BUILDERS[name](batch)).to(device)
    if dtype != torch.float32:
        inputs = tuple(x.to(dtype) if x.is_floating_point() else x for x in example.inputs)
        return Example(example.model.to(dtype), inputs, example.loss_fn)
    return example


def load(spec: str) -> Example:
    """A built-in model by name, or `path/to/file.py:function` where the function returns
    `(model, example_inputs)` or `(model, example_inputs, loss_fn)`; inputs given as a
    dict are keyword arguments (`model(**batch)`). Without a loss the step's loss is the
    model's own where its output carries one (`outputs.loss`, as a transformers model
    given `labels` returns it), else the sum of the output's floating-point tensors. A file
    that fails to run, or a function that fails when called, raises ValueError naming it
    and the exception's type and message (the exception chained as its cause)."""
    if spec in BUILDERS:
        return build(spec)
    path, _, function = spec.rpartition(":")
    if not path.endswith(".py") or not function.isidentifier():
        raise KeyError(f"unknown model {spec!r}; choose one of {', '.join(sorted(BUILDERS))} "
                       "or give path/to/file.py:function")
    if not Path(path).is_file():
        raise FileNotFoundError(f"no such model file: {path}")
    module_spec = importlib.util.spec_from_file_location(Path(path).stem, path)
    module = importlib.util.module_from_spec(module_spec)

    def failed(what: str, error: Exception) -> ValueError:
        """`what` failed, with the exception's type and message on one line, as the
        command prints errors."""
        message = " ".join(str(error).split())
        return ValueError(f"{what}: {type(error).__name__}" + (f": {message}" if message else ""))

    with _importable(Path(path).resolve().parent, Path.cwd()):
        try:
            module_spec.loader.exec_module(module)
        except Exception as error:
            raise failed(f"model file {path} could not be loaded", error) from error
        if not callable(getattr(module, function, None)):
            raise KeyError(f"{path} defines no function {function!r}")
        try:
            made = getattr(module, function)()
        except Exception as error:
            raise failed(f"{function}() in model file {path} failed", error) from error
    if not isinstance(made, tuple) or len(made) not in (2, 3) or not isinstance(made[0], nn.Module):
        raise ValueError(f"{spec} must return (model, example_inputs) or (model, example_inputs, loss_fn)")
    loss_fn = made[2] if len(made) == 3 and made[2] is not None else own_loss_or_sum
    if not callable(loss_fn):
        raise ValueError(f"{spec} returned a loss_fn that is not a function: {loss_fn!r}")
    inputs = made[1] if isinstance(made[1], (tuple, dict)) else (made[1],)
    return Example(made[0], inputs, loss_fn)


@contextlib.contextmanager
def _importable(*folders: Path) -> Iterator[None]:
    """A model file imports what it would run as a script (its own folder) or with
    `python -m` from where the command runs (the working directory): the console
    script puts neither on the path."""
    added = [str(f) for f in folders if str(f) not in sys.path]
    sys.path[:0] = added
    try:
        yield
    finally:
        for folder in added:
            sys.path.remove(folder)


def own_loss_or_sum(output: object) -> torch.Tensor:
    """The loss of a model file's step that gives none: the output's own (`outputs.loss`),
    else the sum of its floating-point tensors."""
    own = output.get("loss") if isinstance(output, dict) else getattr(output, "loss", None)
    if isinstance(own, torch.Tensor):
        return own
    leaves = [t for t in tree_leaves(output) if isinstance(t, torch.Tensor) and t.is_floating_point()]
    return sum(t.sum() for t in leaves)
