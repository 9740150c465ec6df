"""A model taking its own loss in its forward (nanoGPT's `logits, loss = model(idx,
targets)`) compiled by `compile_backend`: the graph before its head and cross-entropy
is compiled and planned with them run after it in the plan's token chunks; the loss and
gradients are the eager model's, the logits come back None, and the measured peak is
the predicted one."""

import copy

import pytest
import torch

import optremat
from optremat.compiler import backend as backend_module
from optremat.compiler.backend import Backend
from optremat.runtime.measure import measure_peak
from optremat.tracing.lm_loss import install
from tests.test_deferred_head import NanoGPT, _batch

COMPILED = Backend._compiled
SPLIT = backend_module.split_own_loss


@pytest.fixture(autouse=True)
def fresh_dynamo() -> None:
    torch._dynamo.reset()


def _step(model: torch.nn.Module, idx: torch.Tensor, targets: torch.Tensor) -> tuple:
    logits, loss = model(idx, targets)
    grads = torch.autograd.grad(loss, list(model.parameters()))
    return logits, loss.detach(), grads


def _same(expected: tuple, got: tuple) -> None:
    torch.testing.assert_close(got[1], expected[1], rtol=1e-5, atol=1e-6)
    for a, b in zip(expected[2], got[2]):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(("loss", "inner"), [("plain", "aot_eager"), ("sum", "aot_eager"),
                                             ("smoothing", "aot_eager"), ("bias", "aot_eager"), ("plain", "inductor")])
def test_a_loss_taken_in_the_forward_runs_after_the_compiled_graph_in_the_planned_chunks(loss: str, inner: str) -> None:
    model = NanoGPT(loss).train()
    idx, targets = _batch()
    expected = _step(copy.deepcopy(model), idx, targets)
    backend = optremat.compile_backend(0.5, inner=inner, solver="dtr", time_limit=10)
    compiled = torch.compile(model, backend=backend, dynamic=False)
    got = _step(compiled, idx, targets)
    _same(expected, got)
    assert got[0] is None and expected[0] is not None
    plan = backend.plans[-1]
    assert len(backend.plans) == 1 and plan.chunking.chunks is not None
    assert f"in {plan.chunking.chunks} token chunks, so the logits it returns are None" in plan.summary()
    measured = measure_peak(lambda: _step(compiled, idx, targets),
                            resident=[list(model.parameters()), idx, targets]).peak_bytes
    assert measured <= 1.02 * plan.budget_bytes, plan.summary()
    assert abs(measured - plan.predicted_peak_bytes) <= 0.02 * plan.predicted_peak_bytes, (measured, plan.summary())


def test_logits_read_again_or_no_gradient_compile_the_graph_as_it_is() -> None:
    """A z-loss reads the logits beside the cross-entropy, so the graph is compiled and
    planned whole and returns them; so does a step taking no gradient."""
    model = NanoGPT("z-loss").train()
    idx, targets = _batch()
    expected = _step(copy.deepcopy(model), idx, targets)
    backend = optremat.compile_backend(0.9, inner="aot_eager", solver="dtr", time_limit=5)
    compiled = torch.compile(model, backend=backend, dynamic=False)
    got = _step(compiled, idx, targets)
    _same(expected, got)
    torch.testing.assert_close(got[0], expected[0])
    assert [plan.chunking for plan in backend.plans] == [None]
    plain = NanoGPT().train()
    compiled = torch.compile(plain, backend=optremat.compile_backend(0.7, inner="aot_eager"), dynamic=False)
    with torch.no_grad():
        logits, loss = compiled(idx, targets)
        torch.testing.assert_close(loss, plain(idx, targets)[1])
    assert logits is not None


@pytest.mark.parametrize("head_chunks", ["auto", None])
def test_a_plan_keeping_the_head_whole_compiles_the_graph_as_it_is(head_chunks, monkeypatch) -> None:
    """Where the plan runs the head whole (on an H100's prices, chunks only add launches
    at a budget the whole head meets), the graph before the head is compiled, then the
    whole graph as it is, its logits returned, and one plan is listed; with
    `head_chunks=None` the whole graph alone. A chunk count installed for the head
    stays."""
    compiled = []
    monkeypatch.setattr(Backend, "_compiled",
                        lambda self, gm, inputs: compiled.append(gm) or COMPILED(self, gm, inputs))
    model = NanoGPT().train()
    idx, targets = _batch()
    expected = _step(copy.deepcopy(model), idx, targets)
    install(model.lm_head.weight, 8)
    backend = optremat.compile_backend(1.0, inner="aot_eager", solver="dtr", time_limit=5, device="h100",
                                       head_chunks=head_chunks)
    got = _step(torch.compile(model, backend=backend, dynamic=False), idx, targets)
    _same(expected, got)
    torch.testing.assert_close(got[0], expected[0])
    assert len(backend.plans) == 1 and backend.plans[0].chunking is None
    assert len(compiled) == (2 if head_chunks else 1)
    assert optremat.CausalLMLoss(model.lm_head, targets).running_chunks() == 8
    install(model.lm_head.weight, None)


def test_a_loss_taken_without_gradients_stays_in_the_graph() -> None:
    model = Head("no_grad").train()
    idx = torch.randint(0, 1024, (4, 64))
    backend = optremat.compile_backend(0.9, inner="aot_eager", time_limit=5)
    logits, loss = torch.compile(model, backend=backend, dynamic=False)(idx, idx)
    assert logits is not None and not loss.requires_grad
    torch.testing.assert_close(loss, model(idx, idx)[1])


class Outputs(torch.nn.Module):
    """NanoGPT returning a dict: its logits twice, its loss, and a tensor besides."""

    def __init__(self) -> None:
        super().__init__()
        self.gpt = NanoGPT()

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> dict[str, torch.Tensor]:
        logits, loss = self.gpt(idx, targets)
        return {"logits": logits, "loss": loss, "again": logits, "doubled": idx * 2}


def test_the_graphs_other_outputs_come_back_in_their_places() -> None:
    model = Outputs().train()
    idx, targets = _batch()
    expected = model(idx, targets)["loss"]
    got = torch.compile(model, backend=optremat.compile_backend(0.5, inner="aot_eager", solver="dtr", time_limit=5),
                        dynamic=False)(idx, targets)
    assert got["logits"] is None and got["again"] is None
    torch.testing.assert_close(got["loss"], expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got["doubled"], idx * 2)


def test_a_bfloat16_head_whose_logits_the_loss_casts_runs_in_chunks() -> None:
    """At its predicted peak: oneDNN's bfloat16 matrix products' scratch is priced (9%
    of this step, unpriced before)."""
    model = NanoGPT("bfloat16").train()
    idx, targets = _batch()
    expected = _step(copy.deepcopy(model), idx, targets)
    backend = optremat.compile_backend(0.5, inner="aot_eager", solver="dtr", time_limit=5)
    compiled = torch.compile(model, backend=backend, dynamic=False)
    got = _step(compiled, idx, targets)
    plan = backend.plans[0]
    assert got[0] is None and plan.chunking.chunks is not None
    torch.testing.assert_close(got[1], expected[1], rtol=1e-3, atol=1e-3)
    for a, b in zip(expected[2], got[2]):
        torch.testing.assert_close(b, a, rtol=2e-2, atol=2e-2)
    measured = measure_peak(lambda: _step(compiled, idx, targets),
                            resident=[list(model.parameters()), idx, targets]).peak_bytes
    assert abs(measured - plan.predicted_peak_bytes) <= 0.02 * plan.predicted_peak_bytes, (measured, plan.summary())


@pytest.mark.parametrize("form", ["llama", "counted", "gemma2", "gemma2_bfloat16", "gpt2"])
def test_a_transformers_causal_lm_compiled_whole_runs_its_own_loss_in_chunks(form: str) -> None:
    """transformers' loss casts the logits to float32 before flattening them: a Llama
    compiled as it is, called with labels, runs its head and loss after the graph in
    chunks, with the eager model's loss and gradients, at its predicted peak; also
    with `num_items_in_batch`, as `transformers.Trainer` passes it (the loss summed,
    then divided by it inside the graph), a Gemma 2, its logits capped (in bfloat16 too:
    to bfloat16's precision), and a GPT-2 told its loss type (without it, transformers
    warns that the type is unset, and dynamo breaks the graph there, between the head
    and the loss)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    sizes = dict(vocab_size=2048, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, use_cache=False)
    if form.startswith("gemma2"):
        model = transformers.Gemma2ForCausalLM(transformers.Gemma2Config(**sizes, head_dim=16))
        model.to(torch.bfloat16 if form.endswith("bfloat16") else torch.float32)
    elif form == "gpt2":
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=2048, n_embd=64, n_layer=2, n_head=4, n_positions=64, use_cache=False, resid_pdrop=0.0,
            embd_pdrop=0.0, attn_pdrop=0.0))
        model.loss_type = "ForCausalLM"
    else:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**sizes))
    model.train()
    ids = torch.randint(0, 2048, (4, 64))
    labels = ids.clone()
    labels[0, :10] = -100
    counts = {"num_items_in_batch": (labels[:, 1:] != -100).sum()} if form == "counted" else {}
    reference = copy.deepcopy(model)

    def step(m: torch.nn.Module) -> tuple:
        out = m(input_ids=ids, labels=labels, **counts)
        return out.logits, out.loss.detach(), torch.autograd.grad(out.loss, list(m.parameters()))

    expected = step(reference)
    backend = optremat.compile_backend(0.5, inner="aot_eager", solver="dtr", time_limit=5)
    compiled = torch.compile(model, backend=backend, dynamic=False)
    got = step(compiled)
    if form.endswith("bfloat16"):
        torch.testing.assert_close(got[1:], expected[1:])
    else:
        _same(expected, got)
    plan = backend.plans[0]
    assert got[0] is None and plan.chunking.chunks is not None
    measured = measure_peak(lambda: step(compiled), resident=[list(model.parameters()), ids, labels]).peak_bytes
    assert abs(measured - plan.predicted_peak_bytes) <= 0.02 * plan.predicted_peak_bytes, (measured, plan.summary())


class Head(torch.nn.Module):
    """A head and loss written more ways: "keywords" calls `F.linear` with its bias before
    its weight; "hidden" also returns the head's input; "shifted" reads all positions but
    the last, against the next tokens; "autocast" runs under bfloat16 autocast, the
    head's weight float32, the logits cast to float32 for the loss; "no_grad" takes the
    loss without gradients; "auxiliary" halves the loss and adds an auxiliary loss to it
    in place (as Mixtral adds its router's); "vector" scales it by a vector, then sums;
    "capped" caps the logits as Gemma 2 does, "capped_bfloat16" so in bfloat16; "logged"
    also returns the loss doubled without gradients; "baseline" subtracts a running
    baseline from the loss, then updates it with the loss; "accuracy" reads the logits
    again after a graph break."""

    def __init__(self, form: str) -> None:
        super().__init__()
        self.form = form
        self.emb, self.fc, self.head = (torch.nn.Embedding(1024, 64), torch.nn.Linear(64, 64),
                                        torch.nn.Linear(64, 1024))
        self.register_buffer("baseline", torch.tensor(5.0))
        if form == "capped_bfloat16":
            self.to(torch.bfloat16)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> tuple:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.form == "autocast"):
            x = torch.tanh(self.fc(self.emb(idx)))
            if self.form == "shifted":
                x, targets = x[:, :-1], targets[:, 1:]
            with torch.set_grad_enabled(self.form != "no_grad"):
                logits = torch.nn.functional.linear(x, bias=self.head.bias, weight=self.head.weight)
                if self.form.startswith("capped"):
                    logits = torch.tanh(logits / 30.0) * 30.0
                loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, 1024), targets.reshape(-1))
            if self.form == "auxiliary":
                loss = loss * 0.5
                loss += 1e-3 * x.square().mean()
            if self.form == "vector":
                loss = (loss * x.mean((0, 1))).sum()
            if self.form == "logged":
                with torch.no_grad():
                    return logits, loss, loss * 2
            if self.form == "baseline":
                advantage = loss - self.baseline
                self.baseline.mul_(0.9).add_(0.1 * loss.detach())
                return logits, advantage, self.baseline.clone()
            if self.form == "accuracy":
                torch._dynamo.graph_break()
                return logits, loss, (logits.argmax(-1) == targets).float().mean()
            return (logits, loss, x) if self.form == "hidden" else (logits, loss)


@pytest.mark.parametrize("form", ["keywords", "hidden", "shifted", "autocast", "auxiliary", "vector", "capped",
                                  "capped_bfloat16", "logged", "baseline", "accuracy"])
def test_a_head_and_loss_written_other_ways_compile_as_eager(form: str, monkeypatch) -> None:
    """The weight given by keyword after the bias is the weight (it was taken for the
    bias); the head's input returned too is handed to the loss priced (its view was not,
    and the head went unpriced); a strided head input is copied in the graph, where the
    plan prices the copy; under autocast the head's float32 weight meets bfloat16
    logits, so the graph compiles as it is (run after it with autocast off, the head
    multiplied bfloat16 by float32 and failed). A loss scaled and added to runs so
    after the chunks; scaled by more than a scalar, the graph compiles as it is. Logits
    capped in float32 or bfloat16 are capped so in the chunks, in their own dtype before
    the cast (bfloat16's weight gradient, summed over the chunks in float32, to
    bfloat16's precision). These compile as they are: a graph computing from the loss
    without gradients (run after the chunks, that took gradients), one updating a
    buffer with the loss that it also reads (run after the chunks, the read and the
    update were reordered), and one returning its logits to the rest of a forward cut by
    a graph break (which read None)."""
    torch.manual_seed(0)
    model = Head(form).train()
    idx = torch.randint(0, 1024, (4, 64))

    def step(m: torch.nn.Module) -> tuple:
        logits, loss, *hidden = m(idx, idx)
        total = loss + sum(h.sum() * 1e-3 for h in hidden)
        return logits, loss.detach(), torch.autograd.grad(total, list(m.parameters())), *hidden

    expected = step(copy.deepcopy(model))
    chunked = form not in ("autocast", "vector", "logged", "baseline", "accuracy")
    splits = []
    monkeypatch.setattr(backend_module, "split_own_loss",
                        lambda gm, inputs: splits.append(SPLIT(gm, inputs)) or splits[-1])
    backend = optremat.compile_backend(0.5 if chunked else 1.0, inner="aot_eager", time_limit=5)
    compiled = torch.compile(model, backend=backend, dynamic=False)
    got = step(compiled)
    if form == "capped_bfloat16":
        torch.testing.assert_close(got[1:3], expected[1:3])
    else:
        _same(expected, got)
    assert (got[0] is None) == chunked and (backend.plans[0].chunking is not None) == chunked
    assert any(split is not None for split in splits) == chunked
    if form in ("hidden", "logged", "baseline", "accuracy"):
        torch.testing.assert_close(got[3], expected[3])
        assert got[3].requires_grad == expected[3].requires_grad
    if chunked:
        plan = backend.plans[0]
        measured = measure_peak(lambda: step(compiled), resident=[list(model.parameters()), idx]).peak_bytes
        assert abs(measured - plan.predicted_peak_bytes) <= 0.02 * plan.predicted_peak_bytes, plan.summary()


def test_dynamic_shapes_are_refused_as_for_any_graph() -> None:
    model = NanoGPT().train()
    idx, targets = _batch()
    backend = optremat.compile_backend(0.5, inner="aot_eager", solver="dtr")
    compiled = torch.compile(model, backend=backend, dynamic=True)
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed, match="compile with dynamic=False"):
        compiled(idx, targets)


class Broken(torch.nn.Module):
    """A head and loss dynamo compiles in a graph of their own, after a graph break."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.fc, self.head = (torch.nn.Embedding(1024, 64), torch.nn.Linear(64, 64),
                                        torch.nn.Linear(64, 1024, bias=False))

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> tuple:
        x = torch.tanh(self.fc(self.emb(idx)))
        torch._dynamo.graph_break()
        logits = self.head(x)
        return logits, torch.nn.functional.cross_entropy(logits.view(-1, 1024), targets.view(-1))


def test_a_head_alone_in_its_graph_under_a_budget_it_cannot_meet_is_refused() -> None:
    """The graph before the head holds only its input and plans nothing; no plan of the
    whole graph fits, so the refusal stands (the plan of the graph before the break was
    taken for the head's and the head run whole)."""
    backend = optremat.compile_backend("3MiB", inner="aot_eager", solver="dtr", time_limit=5)
    idx = torch.randint(0, 1024, (4, 64))
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed, match="compiled graph 2"):
        torch.compile(Broken().train(), backend=backend, dynamic=False)(idx, idx)
    assert len(backend.plans) == 1 and "run after the compiled graph" not in backend.plans[0].loss


def test_a_graph_returning_its_own_loss_beside_its_logits_is_priced_with_that_loss() -> None:
    """With its head left in the graph, a bfloat16 model returning its logits and its own
    loss is priced with the loss it returns, differentiated as it is: a cross-entropy
    over its logits, which the step never runs, was priced instead (9% over the
    measured peak; in float32 the backward's peak hid it)."""
    model = NanoGPT("bfloat16").train()
    idx, targets = _batch()
    backend = optremat.compile_backend(1.0, inner="aot_eager", time_limit=5, head_chunks=None)
    compiled = torch.compile(model, backend=backend, dynamic=False)
    _step(compiled, idx, targets)
    plan = backend.plans[0]
    measured = measure_peak(lambda: _step(compiled, idx, targets),
                            resident=[list(model.parameters()), idx, targets]).peak_bytes
    assert abs(measured - plan.predicted_peak_bytes) <= 0.02 * plan.predicted_peak_bytes, (measured, plan.summary())


class Counted(torch.nn.Module):
    """A loss summed and divided by a count handed in, as transformers' loss divides by
    `num_items_in_batch`."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.fc, self.head = (torch.nn.Embedding(1024, 64), torch.nn.Linear(64, 64),
                                        torch.nn.Linear(64, 1024))

    def forward(self, idx: torch.Tensor, targets: torch.Tensor, count: torch.Tensor) -> tuple:
        logits = self.head(torch.tanh(self.fc(self.emb(idx))))
        summed = torch.nn.functional.cross_entropy(logits.view(-1, 1024), targets.view(-1), reduction="sum")
        return logits, summed / count


def test_a_summed_loss_over_no_label_divided_by_a_count_of_0_takes_no_gradient_as_eager() -> None:
    """Every label ignored and a count of 0: the loss is nan and every gradient 0, as
    eager's (the chunks' gradients were scaled by the division's infinite gradient, so
    were nan)."""
    torch.manual_seed(0)
    model = Counted().train()
    idx, ignored = torch.randint(0, 1024, (4, 64)), torch.full((4, 64), -100)
    reference = copy.deepcopy(model)
    expected = torch.autograd.grad(reference(idx, ignored, torch.tensor(0))[1], list(reference.parameters()))
    backend = optremat.compile_backend(0.5, inner="aot_eager", solver="dtr", time_limit=5)
    logits, loss = torch.compile(model, backend=backend, dynamic=False)(idx, ignored, torch.tensor(0))
    assert logits is None and backend.plans[0].chunking.chunks is not None and loss.isnan()
    for got, want in zip(torch.autograd.grad(loss, list(model.parameters())), expected):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
