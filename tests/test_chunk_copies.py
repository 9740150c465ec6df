"""An LM head's chunk loop traced through five chunks: the step it builds is the trace of
every chunk's, node for node; chunks that differ, or a shortened loop that fails, are
traced whole; eager loops, and other threads', still run every chunk."""

from __future__ import annotations

import threading
from typing import Any, Callable

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

from optremat.models import GPT
from optremat.tracing import chunked
from optremat.tracing.causal_lm import running
from optremat.tracing.chunked import loops_shortened
from optremat.tracing.extract import DefaultLoss, Traced, trace
from optremat.tracing.lm_loss import CausalLMLoss
from tests.test_repeat import assert_same_step

torch.set_num_threads(1)

V, T, B = 96, 40, 2


def _meta_llama(layers: int) -> tuple[nn.Module, Any, Callable]:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=T,
                                      use_cache=False)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    ids = torch.zeros(B, T, dtype=torch.long, device="meta")
    return model.train(), {"input_ids": ids, "labels": ids}, DefaultLoss()


def _gpt(**options: Any) -> tuple[nn.Module, Any, Callable]:
    model = GPT(V, T, 32, 2, 4)
    model.forward = model.hidden_states
    ids = torch.randint(0, V, (B, T))
    return model, ids, CausalLMLoss(model.head, ids, chunks="auto", **options)


class _Biased(nn.Module):
    """Hidden states for a head given as a weight tensor with a bias (float32, meta)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(16, 16)
        self.head = nn.Parameter(torch.empty(V, 16))
        self.bias = nn.Parameter(torch.empty(V))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.body(x))


def _meta_biased() -> tuple[nn.Module, Any, Callable]:
    with torch.device("meta"):
        model = _Biased()
    labels = torch.zeros(B, T, dtype=torch.long, device="meta")
    return model, torch.empty(B, T, 16, device="meta"), CausalLMLoss(model.head, labels, bias=model.bias)


STEPS = {
    "llama, PyTorch's kernel": lambda: _meta_llama(2),
    "llama of copied layers, PyTorch's kernel": lambda: _meta_llama(7),
    "float32 head with a bias, PyTorch's kernel": _meta_biased,
    "gpt on a cpu": lambda: _gpt(),
    "gpt, label smoothing and softcap": lambda: _gpt(label_smoothing=0.1, softcap=30.0),
}
"""Steps whose head's loop is PyTorch's (`F.linear_cross_entropy`: a meta-device model
is priced as on an accelerator, in bfloat16 and in float32 with a bias) or ours
(`ChunkedCrossEntropy`, on a CPU), alone or with a model's layers copied too."""


def _traced(model: nn.Module, inputs: Any, loss_fn: Callable, chunks: int) -> Traced:
    if isinstance(loss_fn, CausalLMLoss):
        return trace(model, inputs, loss_fn.with_chunks(chunks))
    with running(model, chunks):
        return trace(model, inputs, loss_fn)


def _ops_traced(traced: Traced) -> int:
    return sum(node.op == "call_function" for node in traced.module.graph.nodes)


@pytest.mark.parametrize("chunks", [8, 11, 20])
@pytest.mark.parametrize("name", STEPS)
def test_a_chunk_loop_traced_through_five_chunks_is_its_whole_trace(name: str, chunks: int,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(0)
    model, inputs, loss_fn = STEPS[name]()
    copied = _traced(model, inputs, loss_fn, chunks)
    with monkeypatch.context() as patch:
        patch.setattr(chunked, "MIN_CHUNKS", 10 ** 9)
        whole = _traced(model, inputs, loss_fn, chunks)
    assert _ops_traced(copied) < _ops_traced(whole)
    assert_same_step(copied, whole)


def test_fewer_chunks_than_copying_pays_for_are_traced_whole() -> None:
    model, inputs, loss_fn = _gpt()
    traced = _traced(model, inputs, loss_fn, chunked.MIN_CHUNKS - 1)
    assert _ops_traced(traced) == int(np.sum(np.array(traced.graph.kind) == "op"))


def _traced_whole(traced: Traced) -> bool:
    return _ops_traced(traced) == int(np.sum(np.array(traced.graph.kind) == "op"))


def test_chunks_that_differ_or_a_shortened_loop_that_fails_are_traced_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    model, inputs, loss_fn = _gpt()
    with monkeypatch.context() as patch:
        patch.setattr(chunked, "MIN_CHUNKS", 10 ** 9)
        whole = _traced(model, inputs, loss_fn, 12)
    chunk = chunked._chunk
    calls = []

    def fourth_differs(hidden: torch.Tensor, *args: Any) -> torch.Tensor:
        calls.append(1)
        return chunk(hidden.exp().log() if len(calls) % 12 == 4 else hidden, *args)  # the fourth of every loop

    with monkeypatch.context() as patch:
        patch.setattr(chunked, "_chunk", fourth_differs)
        differing = _traced(model, inputs, loss_fn, 12)
        patch.setattr(chunked, "MIN_CHUNKS", 10 ** 9)
        want = _traced(model, inputs, loss_fn, 12)
    assert _traced_whole(differing)
    assert_same_step(differing, want)
    def failing(count: int, tensor: torch.Tensor) -> Any:
        if chunked._shortening(tensor):
            raise RuntimeError("a loop that another PyTorch changed")
        return iter(range(count))

    with monkeypatch.context() as patch:
        patch.setattr(chunked, "chunk_indices", failing)
        failing_trace = _traced(model, inputs, loss_fn, 12)
    assert _traced_whole(failing_trace)
    assert_same_step(failing_trace, whole)


@pytest.mark.parametrize("kernel", ["torch", "ours"])
def test_loops_run_every_chunk_outside_a_trace_while_one_shortens_them(kernel: str) -> None:
    """Eager loops on the tracing thread, and loops on fake tensors on another thread,
    run every chunk and mark none."""
    torch.manual_seed(0)
    hidden = torch.randn(60, 16, requires_grad=True)
    weight = torch.randn(V, 16, requires_grad=True)
    labels = torch.randint(0, V, (60,))
    expected = F.cross_entropy(hidden @ weight.t(), labels, reduction="sum")
    want = torch.autograd.grad(expected, [hidden, weight])

    def chunked_loss(h: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if kernel == "torch":
            options = nn.LinearCrossEntropyOptions(batch_chunk_size=4, chunking_method=None)
            return F.linear_cross_entropy(h, w, y, reduction="sum", options=options)
        return chunked.ChunkedCrossEntropy.apply(h, w, None, y, 4, -100, 0.0, None, torch.tensor(1.0))

    def on_fake_tensors() -> None:
        mode = FakeTensorMode()
        fakes = [mode.from_tensor(t) for t in (hidden.detach(), weight.detach(), labels)]
        with mode:
            elsewhere.append(chunked_loss(fakes[0].requires_grad_(), fakes[1].requires_grad_(), fakes[2]))

    marks: list[int | None] = []
    elsewhere: list[torch.Tensor] = []
    other = threading.Thread(target=on_fake_tensors)
    with loops_shortened(marks.append):
        loss = chunked_loss(hidden, weight, labels)
        other.start()
        other.join()
    assert marks == [] and elsewhere[0].shape == ()
    torch.testing.assert_close(loss, expected)
    for got, wanted in zip(torch.autograd.grad(loss, [hidden, weight]), want):
        torch.testing.assert_close(got, wanted)
