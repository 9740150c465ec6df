"""CausalLMLoss: whole or in token chunks, the same loss and gradients; chunks use less memory."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import optremat
from optremat.core.schedule import keep_all, simulate
from optremat.core.solution import OPTIMAL
from optremat.models import HiddenGPT
from optremat.planners.regions import Region
from optremat.planning import chunking
from optremat.planning import model as model_planning
from optremat.runtime.measure import measure_step
from optremat.tracing import lm_loss
from optremat.tracing.extract import extract
from optremat.tracing.lm_loss import CausalLMLoss

torch.set_num_threads(1)

B, T, H, V = 2, 12, 16, 40


def labels(ignored: int = -100) -> torch.Tensor:
    """Token ids with a few positions marked `ignored`."""
    found = torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(1))
    found[0, :3] = ignored
    found[1, 7] = ignored
    return found


def grads(loss_fn: CausalLMLoss, hidden: torch.Tensor, params: list[torch.Tensor]) -> list[torch.Tensor]:
    loss = loss_fn(hidden)
    return [loss.detach(), *torch.autograd.grad(loss, [hidden, *params])]


@pytest.fixture(params=["ours", "torch"])
def kernel(request, monkeypatch) -> str:
    """Which implementation runs the plain loss's chunks: on a CPU ours; PyTorch's (as on
    an accelerator) made to run here too, so that its pricing is checked on a CPU."""
    if request.param == "torch":
        monkeypatch.setattr(lm_loss, "_torch_kernel_runs", lambda hidden: True)
    return request.param


OPTIONS = [dict(), dict(shift=False), dict(label_smoothing=0.1), dict(num_items_in_batch=7), dict(softcap=3.0),
           dict(label_smoothing=0.2, softcap=2.0, num_items_in_batch=9), dict(ignore_index=5)]


@pytest.mark.parametrize("options", OPTIONS, ids=lambda o: ",".join(o) or "plain")
@pytest.mark.parametrize("chunks", [1, 2, 3, 8, 100])
@pytest.mark.parametrize("bias", [False, True])
def test_chunks_give_the_whole_loss_and_gradients(options: dict, chunks: int, bias: bool, kernel: str) -> None:
    torch.manual_seed(0)
    head = nn.Linear(H, V, bias=bias)
    hidden = torch.randn(B, T, H, requires_grad=True)
    ids = labels(options.get("ignore_index", -100))
    whole = CausalLMLoss(head, ids, chunks=None, **options)
    chunked = CausalLMLoss(head, ids, chunks=chunks, **options)
    params = list(head.parameters())
    for got, want in zip(grads(chunked, hidden, params), grads(whole, hidden, params)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("chunks", [2, 8])
def test_a_sum_over_no_label_divided_by_a_count_of_0_after_it_takes_no_gradient(chunks: int, kernel: str) -> None:
    """The loss summed (`num_items_in_batch=1`) and divided by a count of 0 after it, as
    a compiled graph's own loss is run after its chunks: nan, and every gradient 0 as
    the whole loss's (the chunks' were scaled by the division's infinite gradient)."""
    torch.manual_seed(0)
    head = nn.Linear(H, V)
    hidden = torch.randn(B, T, H, requires_grad=True)
    ignored = torch.full((B, T), -100)
    params = [hidden, *head.parameters()]
    got, want = (torch.autograd.grad(CausalLMLoss(head, ignored, chunks=c, num_items_in_batch=1)(hidden)
                                     / torch.tensor(0), params) for c in (chunks, None))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


@pytest.mark.parametrize("options", [dict(), dict(label_smoothing=0.1), dict(num_items_in_batch=7)],
                         ids=lambda o: ",".join(o) or "plain")
def test_a_batch_whose_every_label_is_ignored_trains_as_the_whole_loss(options: dict, kernel: str) -> None:
    """A prompt-only batch: the mean over no label is nan (a sum over `num_items_in_batch`
    is 0) and every gradient 0, as `F.cross_entropy` has them; no nan reaches a weight."""
    torch.manual_seed(0)
    head = nn.Linear(H, V)
    hidden = torch.randn(B, T, H, requires_grad=True)
    ignored = torch.full((B, T), -100)
    params = list(head.parameters())
    for chunks in (2, 8):
        got = grads(CausalLMLoss(head, ignored, chunks=chunks, **options), hidden, params)
        want = grads(CausalLMLoss(head, ignored, chunks=None, **options), hidden, params)
        torch.testing.assert_close(got[0], want[0], equal_nan=True)
        for g, w in zip(got[1:], want[1:]):
            assert not g.isnan().any()
            torch.testing.assert_close(g, w)


@pytest.mark.parametrize("label", [V, -1])
def test_a_label_outside_the_vocabulary_is_refused_as_the_whole_loss_refuses_it(label: int, kernel: str) -> None:
    """The chunks' gather failed naming neither the label nor the vocabulary."""
    head = nn.Linear(H, V)
    hidden = torch.randn(B, T, H, requires_grad=True)
    ids = labels()
    ids[1, 5] = label
    with pytest.raises(IndexError, match=f"Target {label} is out of bounds"):
        CausalLMLoss(head, ids, chunks=None)(hidden)
    with pytest.raises(IndexError, match=f"Target {label} is out of bounds"):
        CausalLMLoss(head, ids, chunks=2)(hidden)


def test_logits_spread_wider_than_exp_reaches_give_the_whole_loss_and_gradients() -> None:
    """Logits hundreds apart, whose softmax underflows float32: the chunks' cut-off
    before `exp` leaves the loss and gradients those of the whole head."""
    torch.manual_seed(0)
    head = nn.Linear(H, V, bias=False)
    hidden = (200 * torch.randn(B, T, H)).requires_grad_()
    whole, chunked = CausalLMLoss(head, labels(), chunks=None), CausalLMLoss(head, labels(), chunks=3)
    with torch.no_grad():
        logits = head(hidden)
    assert (logits.amax(-1) - logits.amin(-1)).min() > 200
    params = list(head.parameters())
    for got, want in zip(grads(chunked, hidden, params), grads(whole, hidden, params)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("chunks", [2, 3])
def test_bfloat16_chunks_on_a_cpu_give_the_whole_loss_and_are_priced_as_measured(chunks: int) -> None:
    """In bfloat16 on a CPU the chunks run in optremat's own function (PyTorch's kernel
    casts the weight once per chunk, unlike the implementation a trace records): the
    loss and gradients match the whole head's to bfloat16's precision, and the measured
    peak is within 2% of the priced one, oneDNN's bfloat16 matrix-product scratch
    included (`onednn.size_matmul_scratch`; 10.4% of this step, unpriced before)."""
    torch.manual_seed(0)
    model = HiddenGPT(vocab=512, seq=64, dim=64, layers=1, heads=2).to(torch.bfloat16)
    idx, ids = torch.randint(0, 512, (2, 64)), torch.randint(0, 512, (2, 64))
    whole, chunked = CausalLMLoss(model.head, ids, chunks=None), CausalLMLoss(model.head, ids, chunks=chunks)
    hidden = model(idx).detach().requires_grad_()
    head = list(model.head.parameters())
    for got, want in zip(grads(chunked, hidden, head), grads(whole, hidden, head)):
        torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
    g = extract(model, (idx,), chunked)
    measured = measure_step(model, (idx,), chunked).peak_bytes
    predicted = simulate(g, keep_all(g)).peak_bytes
    assert abs(measured - predicted) <= 0.02 * predicted, (measured, predicted)


@pytest.mark.parametrize("chunks", [None, 4])
def test_bfloat16_logits_are_capped_as_gemma_2_caps_them_and_priced_as_measured(chunks: int | None) -> None:
    """Gemma 2 caps its bfloat16 logits (divide, tanh, multiply, each rounded to
    bfloat16) before its loss casts them to float32; `softcap` caps them so, forward
    and backward, whole or in chunks: the whole head gives Gemma 2's loss and gradients
    to the bit, the chunks its hidden states' gradient to the bit and the rest within a
    float32 sum's order (capped in float32 before, both were 2 bfloat16 steps off).
    The chunks' float32 logits die once the cap's backward casts their gradient, as
    priced (they lived on, 13.7% over the price of this step)."""
    torch.manual_seed(0)
    model = HiddenGPT(vocab=512, seq=64, dim=64, layers=1, heads=2).to(torch.bfloat16)
    with torch.no_grad():
        model.head.weight.mul_(40)  # logits of tens, where the cap bites
    idx, ids = torch.randint(0, 512, (2, 64)), torch.randint(0, 512, (2, 64))
    ids[0, :10] = -100
    hidden = model(idx).detach().requires_grad_()
    head = list(model.head.parameters())

    def gemma2(h: torch.Tensor) -> torch.Tensor:
        logits = torch.tanh(model.head(h) / 30.0) * 30.0
        shifted = nn.functional.pad(ids[..., 1:], (0, 1), value=-100)
        return nn.functional.cross_entropy(logits.float().reshape(-1, 512), shifted.reshape(-1), ignore_index=-100)

    capped = CausalLMLoss(model.head, ids, chunks=chunks, softcap=30.0)
    (loss, grad_hidden, grad_weight), (want_loss, want_hidden, want_weight) = (
        grads(f, hidden, head) for f in (capped, gemma2))
    assert torch.equal(grad_hidden, want_hidden)
    if chunks is None:
        assert torch.equal(loss, want_loss) and torch.equal(grad_weight, want_weight)
    torch.testing.assert_close(loss, want_loss, rtol=1e-6, atol=0)
    torch.testing.assert_close(grad_weight.float(), want_weight.float(), rtol=0, atol=1e-6)
    g = extract(model, (idx,), capped)
    measured = measure_step(model, (idx,), capped).peak_bytes
    predicted = simulate(g, keep_all(g)).peak_bytes
    assert abs(measured - predicted) <= 0.02 * predicted, (measured, predicted)


@pytest.mark.parametrize("options", [dict(), dict(softcap=3.0)], ids=["plain", "softcap"])
def test_a_tied_embedding_or_a_weight_tensor_is_a_head(options: dict) -> None:
    """The head's weight shared with the input embedding takes the gradient of both uses."""
    torch.manual_seed(0)
    embedding = nn.Embedding(V, H)
    ids = torch.randint(0, V, (B, T))

    def step(head: nn.Module | torch.Tensor, chunks: int | None) -> torch.Tensor:
        hidden = torch.tanh(embedding(ids))
        loss = CausalLMLoss(head, labels(), chunks=chunks, **options)(hidden)
        return torch.autograd.grad(loss, embedding.weight)[0]

    want = step(embedding, None)
    torch.testing.assert_close(step(embedding, 4), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(step(embedding.weight, 4), want, rtol=1e-5, atol=1e-5)


def test_the_output_may_be_a_tuple_or_carry_last_hidden_state() -> None:
    torch.manual_seed(0)
    head = nn.Linear(H, V)
    hidden = torch.randn(B, T, H)
    loss = CausalLMLoss(head, labels(), chunks=3)
    out = type("Out", (), {"last_hidden_state": hidden})()
    assert torch.equal(loss(out), loss(hidden)) and torch.equal(loss((hidden, None)), loss(hidden))


@pytest.mark.parametrize("bad, message", [
    (dict(chunks=0), "chunks must be"), (dict(chunks=2.5), "chunks must be"), (dict(chunks=True), "chunks must be"),
    (dict(chunks="many"), "chunks must be"), (dict(label_smoothing=1.5), "label_smoothing"),
    (dict(softcap=0), "softcap"), (dict(num_items_in_batch=0), "num_items_in_batch"),
])
def test_bad_options_are_refused(bad: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        CausalLMLoss(nn.Linear(H, V), labels(), **bad)


def test_bad_heads_labels_and_outputs_are_refused() -> None:
    with pytest.raises(TypeError, match="head must"):
        CausalLMLoss(nn.ReLU(), labels())
    with pytest.raises(TypeError, match="labels must"):
        CausalLMLoss(nn.Linear(H, V), labels().float())
    with pytest.raises(ValueError, match="bias goes with a weight tensor"):
        CausalLMLoss(nn.Linear(H, V), labels(), bias=torch.zeros(V))
    with pytest.raises(ValueError, match="do not match the hidden states"):
        CausalLMLoss(nn.Linear(H, V), labels())(torch.randn(B, T + 1, H))
    with pytest.raises(TypeError, match="final hidden states"):
        CausalLMLoss(nn.Linear(H, V), labels())(torch.zeros(B, T, dtype=torch.long))


def test_it_is_exported_on_first_use() -> None:
    assert optremat.CausalLMLoss is CausalLMLoss


class Body(nn.Module):
    """A layer before the head, so that the step has a parameter and an output to hold."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.layer = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x)


@pytest.mark.parametrize("options", [dict(), dict(softcap=5.0)], ids=["torch", "softcap"])
def test_chunks_use_less_memory(options: dict, kernel: str) -> None:
    """Measured on the CPU: 8 chunks hold an eighth of the logits (the head weight's
    gradient and the hidden states' stay)."""
    torch.manual_seed(0)
    model, vocab = Body(64), 4096
    head = nn.Linear(64, vocab, bias=False)
    ids = torch.randint(0, vocab, (4, 128))
    x = torch.randn(4, 128, 64)
    peaks = {chunks: measure_step(model, (x,), CausalLMLoss(head, ids, chunks=chunks, **options)).step_peak_bytes
             for chunks in (None, 8)}
    logits = 4 * 128 * vocab * 4
    assert peaks[8] < peaks[None] - 2 * logits


@pytest.mark.parametrize("chunks, options", [(None, {}), (4, {}), (16, {}), (4, dict(softcap=5.0, label_smoothing=0.1))],
                         ids=["whole", "plain-4", "plain-16", "softcap-smoothing-4"])
def test_the_unplanned_step_is_priced_as_measured(chunks: int | None, options: dict, kernel: str) -> None:
    """Traced on fake tensors, PyTorch's chunked op recorded op by op and ours as it runs:
    the simulated peak of the unplanned step is the measured one within 0.2% (whole or
    ours: the labels the loss holds count in both; Python holds the shifted labels and
    their mask through our chunk loop, about 5 KiB the trace frees after their last read)
    or 5% (PyTorch's op: it holds one more hidden-states-sized buffer in eager than its
    traced implementation shows, 3.6% of this small step, 1% of gpt-mini's)."""
    torch.manual_seed(0)
    model, vocab = Body(64), 4096
    model.head = nn.Linear(64, vocab, bias=False)
    x, ids = torch.randn(4, 128, 64), torch.randint(0, vocab, (4, 128))
    loss = CausalLMLoss(model.head, ids, chunks=chunks, **options)
    graph = extract(model, (x,), loss)
    predicted = simulate(graph, keep_all(graph)).peak_bytes
    measured = measure_step(model, (x,), loss).peak_bytes
    torch_op = kernel == "torch" and chunks is not None and not options
    assert abs(measured / predicted - 1) < (0.05 if torch_op else 0.002)


@pytest.fixture(scope="module")
def lm() -> tuple[HiddenGPT, torch.Tensor, torch.Tensor, optremat.Plan]:
    """A small GPT whose logits set its least peak, and the plan of per-block checkpointing."""
    torch.manual_seed(0)
    model = HiddenGPT(vocab=2048, seq=64, dim=32, layers=2, heads=2)
    idx, ids = torch.randint(0, 2048, (2, 64)), torch.randint(0, 2048, (2, 64))
    per_block = optremat.price_regions(model, (idx,), [Region(f"blocks.{i}", 0, ()) for i in range(2)],
                                       loss_fn=CausalLMLoss(model.head, ids, chunks=None))
    return model, idx, ids, per_block


def test_below_per_block_checkpointing_only_chunks_fit(lm) -> None:
    """Under per-block checkpointing's peak no region plan of the whole head fits; the
    joint plan chunks the head, and runs as priced: the same loss and gradients, its
    measured peak within the budget and the prediction."""
    model, idx, ids, per_block = lm
    budget = int(per_block.predicted_peak_bytes * 0.9)
    with pytest.raises(optremat.InfeasibleBudget):
        optremat.plan(model, (idx,), budget, loss_fn=CausalLMLoss(model.head, ids, chunks=None), time_limit=5)
    loss = CausalLMLoss(model.head, ids)
    found = optremat.plan(model, (idx,), budget, loss_fn=loss, time_limit=5)
    assert found.chunking is not None and found.chunking.chunks is not None and found.chunking.head == "tok.weight"
    assert found.predicted_peak_bytes <= budget and f"in {found.chunking.chunks} token chunks" in found.summary()
    assert "the step never holds the whole logits" in found.explain()
    params = list(model.parameters())
    want = grads(CausalLMLoss(model.head, ids, chunks=None), model(idx), params)[:1] + list(
        torch.autograd.grad(CausalLMLoss(model.head, ids, chunks=None)(model(idx)), params))
    optremat.apply(model, found)
    try:
        assert loss.running_chunks() == CausalLMLoss(model.tok, ids).running_chunks() == found.chunking.chunks
        got = [loss(model(idx)).detach(), *torch.autograd.grad(loss(model(idx)), params)]
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
        measured = measure_step(model, (idx,), loss).peak_bytes
    finally:
        optremat.remove(model)
    assert measured <= budget * 1.02 and abs(measured / found.predicted_peak_bytes - 1) < 0.05
    assert loss.running_chunks() is None


@pytest.fixture
def few_choices(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two chunk counts priced besides the whole head, to keep a test short."""
    monkeypatch.setattr(chunking, "CHOICES", (None, 2, 8))


def test_the_chunking_is_saved_cached_and_installed_from_a_file(lm, few_choices, tmp_path) -> None:
    model, idx, ids, per_block = lm
    loss = CausalLMLoss(model.head, ids)
    found = optremat.plan(model, (idx,), int(per_block.predicted_peak_bytes * 0.9), loss_fn=loss, time_limit=5,
                          cache=tmp_path)
    again = optremat.plan(model, (idx,), int(per_block.predicted_peak_bytes * 0.9), loss_fn=loss, time_limit=5,
                          cache=tmp_path)
    assert again.cached and again.chunking == found.chunking
    found.save(tmp_path / "plan.json")
    optremat.apply(model, optremat.Plan.load(tmp_path / "plan.json"))
    try:
        assert loss.running_chunks() == found.chunking.chunks
    finally:
        optremat.remove(model)


def test_at_the_unplanned_peak_the_cheapest_head_is_chosen(lm, few_choices) -> None:
    """Nothing needs saving: the head runs whole or chunked, whichever is cheaper, and no
    plan is cheaper than the unplanned step with the whole head."""
    model, idx, ids, _ = lm
    found = optremat.plan(model, (idx,), 1.0, loss_fn=CausalLMLoss(model.head, ids), time_limit=5, deterministic=True)
    assert found.chunking.tried == (None, 2, 8) and found.status == OPTIMAL
    assert found.predicted_overhead <= 0 and found.lower_bound <= found.predicted_overhead


@pytest.mark.parametrize("fraction", [0.9, 1.2])
def test_the_count_chosen_is_the_cheapest_of_every_count_planned_alone(lm, few_choices, fraction: float) -> None:
    """Counts whose step alone costs more than a plan found are not solved; what is
    chosen is still the cheapest plan of any count, each planned on its own (in the
    whole head's step cost), and the bound holds for all of them."""
    model, idx, ids, per_block = lm
    budget = int(per_block.predicted_peak_bytes * fraction)
    found = optremat.plan(model, (idx,), budget, loss_fn=CausalLMLoss(model.head, ids), time_limit=5,
                          deterministic=True)  # the proofs must not depend on machine load
    alone = {}
    for k in chunking.CHOICES:
        try:
            plan = optremat.plan(model, (idx,), budget, loss_fn=CausalLMLoss(model.head, ids, chunks=k), time_limit=5,
                                 deterministic=True)
        except optremat.InfeasibleBudget:
            continue
        assert plan.status == OPTIMAL
        alone[k] = plan.graph.total_cost * (1 + plan.predicted_overhead)
    whole_cost = per_block.graph.total_cost * (1 + found.predicted_overhead)  # its overhead is of the whole head
    assert whole_cost == pytest.approx(min(alone.values()), rel=1e-6)
    assert found.status == OPTIMAL and found.chunking.chunks in alone


class Clock:
    """A clock that moves only when told: each solve of a count takes `taken(limit)`."""

    def __init__(self, taken) -> None:
        self.now, self.taken, self.limits = 0.0, taken, []

    def perf_counter(self) -> float:
        return self.now

    def solving(self, solve):
        def timed(*args, **kwargs):
            self.limits.append(kwargs["time_limit"])
            self.now += self.taken(kwargs["time_limit"])
            return solve(*args, **kwargs)
        return timed


@pytest.mark.parametrize("taken, shares", [(lambda limit: 0.0, [2.0, 3.0]), (lambda limit: 2 * limit, [2.0, 1.0])],
                         ids=["searches ending at once", "searches running over"])
def test_the_counts_share_the_seconds_left(lm, few_choices, monkeypatch, taken, shares) -> None:
    """Each count was given a third of the time limit whatever the others took: a
    4-layer Llama's plan at time_limit=6 took 11 s of searching. A search ending early
    now leaves its time to the next counts, one running over takes it from them, and
    once none is left the counts not solved (here the last, whose step alone costs more
    than the plan found, either way) are bounded by their steps' costs."""
    model, idx, ids, per_block = lm
    clock = Clock(taken)
    monkeypatch.setattr(chunking, "time", clock)
    monkeypatch.setattr(model_planning, "solve_native", clock.solving(model_planning.solve_native))
    found = optremat.plan(model, (idx,), int(per_block.predicted_peak_bytes * 0.9), loss_fn=CausalLMLoss(model.head, ids),
                          time_limit=6)
    assert clock.limits == pytest.approx(shares)
    assert found.chunking.tried == (None, 2, 8) and found.lower_bound <= found.predicted_overhead


def test_a_count_no_time_is_left_for_is_bounded_by_its_composition(monkeypatch) -> None:
    """A count no time is left for was bounded by its step's own cost (a 13B Llama at half
    its peak: +0.03% under a plan at +7.66%); where its step has a chain of blocks, the
    bound the composition puts on it, from the frontiers already solved, is stronger (the
    13B: +6.86%) and still no more than the plan."""
    torch.manual_seed(0)
    monkeypatch.setattr(chunking, "CHOICES", (None, 2))
    model = HiddenGPT(vocab=1024, seq=64, dim=64, layers=8, heads=2)
    idx, ids = torch.randint(0, 1024, (8, 64)), torch.randint(0, 1024, (8, 64))

    def planned() -> optremat.Plan:
        clock = Clock(lambda limit: 100.0)  # the first count's search takes all the time there is
        monkeypatch.setattr(chunking, "time", clock)
        monkeypatch.setattr(model_planning, "solve_native", clock.solving(model_planning.solve_native))
        # the searches in deterministic time, the counts sharing the clock's seconds
        monkeypatch.setattr(model_planning, "solve_chunked", lambda *args: chunking.solve_chunked(
            *args[:8], False, *args[9:]))
        found = optremat.plan(model, (idx,), 0.5, loss_fn=CausalLMLoss(model.head, ids), time_limit=2,
                              deterministic=True)
        assert len(clock.limits) < len(found.chunking.tried)  # a count no time was left for
        return found

    composed = planned()
    monkeypatch.setattr(model_planning, "composed_bound", lambda *args, **kwargs: None)
    by_cost = planned()
    assert by_cost.predicted_overhead == composed.predicted_overhead
    assert by_cost.lower_bound < composed.lower_bound <= composed.predicted_overhead


def test_a_count_its_composition_bounds_above_the_plan_found_is_not_solved(monkeypatch) -> None:
    """Every count was searched, though the bound the blocks' composition puts on a
    count's plans (one simulation, once the frontiers are solved) can already show it
    costs more than the plan found (a Llama-7B at half its peak: four of seven counts,
    10 s of its 32 s). Those counts are bounded so and not searched: the same plan and
    bound as searching every count."""
    torch.manual_seed(0)
    monkeypatch.setattr(chunking, "CHOICES", (None, 2, 4, 8))
    model = HiddenGPT(vocab=1024, seq=64, dim=64, layers=8, heads=2)
    idx, ids = torch.randint(0, 1024, (8, 64)), torch.randint(0, 1024, (8, 64))
    solve = model_planning.solve_native

    def planned() -> tuple[optremat.Plan, int]:
        searched = []
        monkeypatch.setattr(model_planning, "solve_native", lambda *a, **k: searched.append(1) or solve(*a, **k))
        found = optremat.plan(model, (idx,), 0.5, loss_fn=CausalLMLoss(model.head, ids), time_limit=4,
                              deterministic=True)
        return found, len(searched)

    skipping, searched = planned()
    monkeypatch.setattr(model_planning, "composed_bound", lambda *args, **kwargs: None)
    every, all_searched = planned()
    assert searched < all_searched == len(every.chunking.tried)
    assert skipping.chunking == every.chunking and skipping.status == every.status == OPTIMAL
    assert skipping.predicted_overhead == every.predicted_overhead
    assert skipping.lower_bound == pytest.approx(every.lower_bound, abs=1e-9)


def test_progress_reports_the_cheapest_plan_so_far_and_a_bound_over_every_count(lm, few_choices) -> None:
    """Each report is of the whole head's step: the plan never gets dearer, the bound
    (counts not solved yet bounded by their steps' own cost) never falls or passes it,
    and the last report is the plan."""
    model, idx, ids, per_block = lm
    reports = []
    found = optremat.plan(model, (idx,), per_block.predicted_peak_bytes, loss_fn=CausalLMLoss(model.head, ids),
                          time_limit=5, progress=lambda *report: reports.append(report))
    assert reports
    for (_, cost, bound), (_, later_cost, later_bound) in zip(reports, reports[1:]):
        assert later_cost <= cost and later_bound >= bound
    assert all(bound <= cost for _, cost, bound in reports)
    assert reports[-1][1:] == pytest.approx((found.predicted_overhead, found.lower_bound), abs=1e-6)  # ties


def test_replanning_with_the_loss_of_one_batch_plans_a_batch_of_another_size(lm, few_choices) -> None:
    """A `CausalLMLoss` holds the labels of the batch it was made for; at a batch of
    another size its labels are shaped as that batch's for planning, and the step trains
    as unplanned."""
    model, idx, ids, _ = lm
    loss = CausalLMLoss(model.head, ids)
    replan = optremat.Replanning(1.0, loss_fn=loss, time_limit=5)
    optremat.apply(model, optremat.plan(model, (idx,), 1.0, loss_fn=loss, time_limit=5), replan=replan)
    torch.manual_seed(1)
    bigger, bigger_ids = torch.randint(0, 2048, (3, 64)), torch.randint(0, 2048, (3, 64))
    params = list(model.parameters())
    try:
        got = torch.autograd.grad(CausalLMLoss(model.head, bigger_ids)(model(bigger)), params)
    finally:
        optremat.remove(model)
    want = torch.autograd.grad(CausalLMLoss(model.head, bigger_ids, chunks=None)(model(bigger)), params)
    assert list(replan.plans) == [("int64[3, 64]",)]
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


def test_a_head_outside_the_model_is_refused(lm) -> None:
    model, idx, ids, _ = lm
    with pytest.raises(ValueError, match="not a parameter of HiddenGPT"):
        optremat.plan(model, (idx,), 1.0, loss_fn=CausalLMLoss(nn.Linear(32, 2048), ids))


def test_the_hidden_states_are_found_among_flat_outputs_by_the_labels_shape() -> None:
    """A compiled mixture of experts returns its router logits beside its hidden states,
    in an order of the graph's own; several tensors shaped as hidden states, none first,
    cannot be told apart and are refused."""
    torch.manual_seed(0)
    head, labels = nn.Linear(16, 32), torch.randint(0, 32, (2, 8))
    hidden, router = torch.randn(2, 8, 16), torch.randn(16, 4)
    loss = CausalLMLoss(head, labels)
    torch.testing.assert_close(loss((router, hidden)), loss(hidden))
    torch.testing.assert_close(loss((hidden, torch.randn(2, 8, 16))), loss(hidden))
    with pytest.raises(ValueError, match="cannot tell which are the final hidden states"):
        loss((router, hidden, torch.randn(2, 8, 16)))
