"""A language model taking its own loss in its forward (nanoGPT's `logits, loss =
model(idx, targets)`) planned with its head and loss in chunks: the head's logits are
deferred until the forward's cross-entropy reads them, which then runs in the plan's
chunks; every other read of them gets the logits the model computes."""

import io

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import optremat
from optremat.runtime.measure import measure_step

VOCAB, WIDTH, TOKENS = 1024, 64, 64


class Block(nn.Module):
    def __init__(self, dropout: float) -> None:
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.c_attn, self.c_proj = nn.Linear(WIDTH, 3 * WIDTH), nn.Linear(WIDTH, WIDTH)
        self.c_fc, self.c_out = nn.Linear(WIDTH, 4 * WIDTH), nn.Linear(4 * WIDTH, WIDTH)
        self.dropout = dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (z.view(b, t, 4, c // 4).transpose(1, 2) for z in self.c_attn(self.ln_1(x)).split(c, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0)
        x = x + self.c_proj(y.transpose(1, 2).reshape(b, t, c))
        return x + F.dropout(self.c_out(F.gelu(self.c_fc(self.ln_2(x)))), self.dropout, self.training)


class NanoGPT(nn.Module):
    """nanoGPT's model: tied embedding and head, its loss taken in its forward from
    `targets` (`ignore_index=-1`), only the last position's logits without them. `loss`
    sets how: "plain" as nanoGPT; "sum", "smoothing", "bias" (a head with a bias),
    "bfloat16" (a bfloat16 model whose logits the loss casts to float32),
    "z-loss" (the logits read again), "transposed" (the classes along dimension 1)."""

    def __init__(self, loss: str = "plain", dropout: float = 0.0, layers: int = 2) -> None:
        super().__init__()
        self.loss = loss
        self.wte, self.wpe = nn.Embedding(VOCAB, WIDTH), nn.Embedding(TOKENS, WIDTH)
        self.h = nn.ModuleList(Block(dropout) for _ in range(layers))
        self.ln_f = nn.LayerNorm(WIDTH)
        self.lm_head = nn.Linear(WIDTH, VOCAB, bias=loss == "bias")
        self.wte.weight = self.lm_head.weight
        if loss == "bfloat16":
            self.to(torch.bfloat16)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> tuple:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for block in self.h:
            x = block(x)
        x = self.ln_f(x)
        if targets is None:
            return self.lm_head(x[:, [-1], :]), None
        logits = self.lm_head(x)
        if self.loss == "bfloat16":
            return logits, F.cross_entropy(logits.float().view(-1, VOCAB), targets.view(-1), ignore_index=-1)
        if self.loss == "transposed":
            return logits, F.cross_entropy(logits.transpose(1, 2), targets, ignore_index=-1)
        flat = logits.view(-1, logits.size(-1))
        options = {"sum": dict(reduction="sum"), "smoothing": dict(label_smoothing=0.1)}.get(self.loss, {})
        loss = F.cross_entropy(flat, targets.view(-1), ignore_index=-1, **options)
        if self.loss == "z-loss":
            loss = loss + 1e-2 * logits.logsumexp(-1).square().mean()
        return logits, loss


def _batch(batch: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(1)
    idx, targets = torch.randint(0, VOCAB, (batch, TOKENS)), torch.randint(0, VOCAB, (batch, TOKENS))
    targets[0, :7] = -1
    return idx, targets


def _step(model: nn.Module, idx: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    torch.manual_seed(2)
    model.zero_grad()
    _, loss = model(idx, targets)
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def _close(a: tuple, b: tuple, rtol: float = 1e-5, atol: float = 1e-6) -> None:
    torch.testing.assert_close(a[0], b[0], rtol=rtol, atol=atol)
    for name in a[1]:
        torch.testing.assert_close(a[1][name], b[1][name], rtol=rtol, atol=atol, msg=name)


@pytest.mark.parametrize("loss", ["plain", "sum", "smoothing", "bias"])
def test_a_loss_taken_in_the_forward_runs_in_chunks_as_the_model_computes_it(loss: str) -> None:
    """Below the least peak of the whole head, the plan runs the forward's cross-entropy
    in chunks: loss and gradients as unplanned, logits None where the loss read them,
    the last position's logits as unplanned where no targets are given, and the measured
    peak the predicted one."""
    model = NanoGPT(loss)
    idx, targets = _batch()
    expected = _step(model, idx, targets)
    whole = optremat.plan(model, (idx, targets), 1.0, head_chunks=None, time_limit=5, deterministic=True)
    plan = optremat.plan(model, (idx, targets), 0.5, time_limit=5, deterministic=True)
    assert plan.predicted_peak_bytes < min(whole.predicted_peak_bytes, plan.baseline_peak_bytes * 0.5)
    assert plan.chunking is not None and plan.chunking.chunks and plan.chunking.head == "wte.weight"
    assert f"in {plan.chunking.chunks} token chunks" in plan.summary()
    with torch.no_grad():
        last = model(idx)[0]
    optremat.apply(model, plan)
    _close(_step(model, idx, targets), expected)
    assert model(idx, targets)[0] is None
    with torch.no_grad():
        torch.testing.assert_close(model(idx)[0], last, rtol=0, atol=0)
    measured = measure_step(model, (idx, targets)).peak_bytes
    assert abs(measured - plan.predicted_peak_bytes) <= 0.02 * plan.predicted_peak_bytes


def test_dropout_in_the_blocks_draws_the_same_numbers_with_the_head_in_chunks() -> None:
    model = NanoGPT(dropout=0.2)
    idx, targets = _batch()
    expected = _step(model, idx, targets)
    optremat.apply(model, optremat.plan(model, (idx, targets), 0.4, time_limit=5, deterministic=True))
    _close(_step(model, idx, targets), expected)


def test_logits_cast_to_float32_run_in_chunks_and_a_lower_precision_loss_runs_whole() -> None:
    """A bfloat16 head whose logits the loss casts to float32 runs in chunks, each
    chunk's logits cast as the whole ones were; a loss over logits laid out otherwise
    (classes along dimension 1) is not the chunked loss, and asking for chunks says so."""
    model = NanoGPT("bfloat16")
    idx, targets = _batch()
    expected = _step(model, idx, targets)
    plan = optremat.plan(model, (idx, targets), 1.0, head_chunks=4, time_limit=5)
    optremat.apply(model, plan)
    chunked = _step(model, idx, targets)
    torch.testing.assert_close(chunked[0], expected[0], rtol=1e-3, atol=1e-3)
    with pytest.raises(ValueError, match="F.cross_entropy over the logits of an nn.Linear head"):
        optremat.plan(NanoGPT("transposed"), (idx, targets), 1.0, head_chunks=4, time_limit=5)
    assert optremat.plan(NanoGPT("transposed"), (idx, targets), 1.0, time_limit=5).chunking is None


def test_logits_read_again_in_the_forward_are_computed_and_priced_so() -> None:
    """A z-loss over the logits reads them after the cross-entropy: they are computed
    there as the model computes them (and returned, as they are held anyway), and the
    plan prices that step."""
    model = NanoGPT("z-loss")
    idx, targets = _batch()
    expected = _step(model, idx, targets)
    logits = model(idx, targets)[0]
    plan = optremat.plan(model, (idx, targets), 1.0, head_chunks=4, time_limit=5)
    optremat.apply(model, plan)
    _close(_step(model, idx, targets), expected)
    torch.testing.assert_close(model(idx, targets)[0], logits, rtol=0, atol=0)
    measured = measure_step(model, (idx, targets)).peak_bytes
    assert abs(measured - plan.predicted_peak_bytes) <= 0.02 * plan.predicted_peak_bytes


class Rewriting(NanoGPT):
    """`NanoGPT` whose forward, after the plan was made, does something to the logits
    before its loss reads them (`mode`), as the plan never saw."""

    mode = "plain"

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> tuple:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        flat = logits.float().view(-1, VOCAB)
        if self.mode == "padding masked":
            logits[..., VOCAB - 24:] = float("-inf")
        elif self.mode == "scaled in place":
            logits.mul_(0.5)
        elif self.mode == "gradient hook":
            logits.register_hook(lambda grad: grad.clamp(-1e-5, 1e-5))
        elif self.mode == "gradient kept":
            logits.retain_grad()
            self.kept = logits
        loss = F.cross_entropy(flat, targets.view(-1), ignore_index=-1)
        if self.mode == "read without gradients, then a z-loss":
            with torch.no_grad():
                self.accuracy = (logits.argmax(-1) == targets).float().mean()
            loss = loss + 1e-2 * logits.float().logsumexp(-1).square().mean()
        elif self.mode == "an autograd.Function over them":
            loss = loss + _Scaled.apply(logits.float()).mean()
        return logits, loss


class _Scaled(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x * 0.5

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad * 0.5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode", ["padding masked", "scaled in place", "gradient hook", "gradient kept",
                                  "read without gradients, then a z-loss", "an autograd.Function over them"])
def test_logits_written_or_hooked_before_the_loss_reads_them_give_the_models_loss(mode: str,
                                                                                  dtype: torch.dtype) -> None:
    """What the forward does to the logits before its cross-entropy (written in place, a
    gradient hook, their gradient kept) computes them there, and the loss reads them so,
    as the model does; a float32 copy made before the write (bfloat16) is of the logits
    before it, as the model's was. Read after it, under no_grad and then with gradients,
    or by an autograd.Function, they are the head's logits with the head's gradient."""
    torch.manual_seed(0)
    model = Rewriting().to(dtype)
    idx, targets = _batch()
    plan = optremat.plan(model, (idx, targets), 1.0, head_chunks=2, time_limit=5)
    assert plan.chunking.chunks == 2
    unplanned = Rewriting().to(dtype)
    unplanned.load_state_dict(model.state_dict())
    unplanned.mode = model.mode = mode
    expected = _step(unplanned, idx, targets)
    optremat.apply(model, plan)
    # in bfloat16 a chunked loss's gradient and a whole read's add up in another order
    _close(_step(model, idx, targets), expected, *((1e-5, 1e-6) if dtype == torch.float32 else (2e-2, 5e-4)))
    if mode == "gradient kept":
        torch.testing.assert_close(model.kept.grad, unplanned.kept.grad, rtol=1e-5, atol=1e-7)


def test_the_heads_input_written_after_the_head_read_it_is_refused() -> None:
    """With a frozen head the model's forward may write the head's input after the head
    read it; the deferred logits would be of the values written, so the loss is not
    chunked at plan time, and a step doing it only once planned says what to do."""
    model = Frozen()
    idx, targets = _batch()
    expected = _step(model, idx, targets)
    with pytest.raises(ValueError, match="head_chunks=2 cannot run"):
        optremat.plan(model, (idx, targets), 1.0, head_chunks=2, time_limit=5)
    model.write = False
    optremat.apply(model, optremat.plan(model, (idx, targets), 1.0, head_chunks=2, time_limit=5))
    model.write = True
    with pytest.raises(RuntimeError, match="written in place after the head read it"):
        _step(model, idx, targets)
    model.write = False
    optremat.remove(model)
    model.write = True
    _close(_step(model, idx, targets), expected)


class Frozen(NanoGPT):
    """`NanoGPT` with a frozen, untied head whose input its forward halves in place after the head read it."""

    write = True

    def __init__(self) -> None:
        super().__init__()
        self.lm_head.weight = nn.Parameter(self.lm_head.weight.detach().clone(), requires_grad=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> tuple:
        x = self.ln_f(self.wte(idx) + self.wpe(torch.arange(idx.shape[1])))
        logits = self.lm_head(x)
        if self.write:
            x.mul_(0.5)
        return logits, F.cross_entropy(logits.view(-1, VOCAB), targets.view(-1), ignore_index=-1) + x.mean()


def test_a_hook_on_the_head_sees_its_logits() -> None:
    """A forward hook on the head reading its output computes the logits there: a plan
    made with it runs the head whole, and a hook added after a chunked plan sees the
    logits the model computes."""
    model = NanoGPT()
    idx, targets = _batch()
    seen = []
    hook = model.lm_head.register_forward_hook(lambda module, args, out: seen.append(out.detach().sum()))
    expected = _step(model, idx, targets)
    unplanned = seen[-1]
    assert optremat.plan(model, (idx, targets), 1.0, time_limit=5).chunking is None
    hook.remove()
    optremat.apply(model, optremat.plan(model, (idx, targets), 1.0, head_chunks=2, time_limit=5))
    model.lm_head.register_forward_hook(lambda module, args, out: seen.append(out.detach().sum()))
    seen.clear()
    _close(_step(model, idx, targets), expected)
    assert len(seen) == 1 and torch.equal(seen[0], unplanned)


def test_a_planned_model_with_its_head_in_chunks_saves_and_loads() -> None:
    model = NanoGPT()
    idx, targets = _batch()
    expected = _step(model, idx, targets)
    optremat.apply(model, optremat.plan(model, (idx, targets), 0.5, time_limit=5, deterministic=True))
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    _close(_step(loaded, idx, targets), expected)
    assert loaded(idx, targets)[0] is None
    assert loaded.state_dict().keys() == NanoGPT().state_dict().keys()


def test_a_head_no_longer_a_plain_linear_runs_whole_with_a_warning() -> None:
    """A head FSDP2 sharded as a unit of its own is of a subclass it made: the step runs
    the model's head and loss whole, as unplanned, and says the memory is not the plan's."""
    model = NanoGPT()
    idx, targets = _batch()
    expected = _step(model, idx, targets)
    optremat.apply(model, optremat.plan(model, (idx, targets), 1.0, head_chunks=2, time_limit=5))
    model.lm_head.__class__ = type("FSDPLinear", (nn.Linear,), {})
    with pytest.warns(UserWarning, match="run whole, as unplanned"):
        _close(_step(model, idx, targets), expected)
        assert model(idx, targets)[0] is not None


def test_a_classifiers_head_is_not_deferred() -> None:
    """A head about as wide as its input (a classifier's) is not one whose logits set the
    peak: its loss runs as the model runs it, and asking for chunks says why."""
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10))
    x, y = torch.randn(64, 32), torch.randint(0, 10, (64,))
    classifier = _Classifier(model)
    assert optremat.plan(classifier, (x, y), 1.0, time_limit=5).chunking is None
    with pytest.raises(ValueError, match="head_chunks=4 cannot run"):
        optremat.plan(classifier, (x, y), 1.0, head_chunks=4, time_limit=5)


class _Classifier(nn.Module):
    def __init__(self, body: nn.Module) -> None:
        super().__init__()
        self.body = body

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.body(x), y)


def _t5() -> tuple[nn.Module, dict[str, torch.Tensor]]:
    transformers = pytest.importorskip("transformers")
    config = transformers.T5Config(vocab_size=1024, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_decoder_layers=1,
                                   num_heads=4, dropout_rate=0.1, use_cache=False, decoder_start_token_id=0,
                                   pad_token_id=0)
    return transformers.T5ForConditionalGeneration(config), {"input_ids": torch.randint(1, 1024, (2, 48)),
                                                             "labels": torch.randint(1, 1024, (2, 40))}


def _bert_masked_lm() -> tuple[nn.Module, dict[str, torch.Tensor]]:
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(vocab_size=1024, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=64, max_position_embeddings=64)
    ids = torch.randint(0, 1024, (4, 48))
    labels = torch.where(torch.rand(ids.shape) < 0.3, ids, -100)
    return transformers.BertForMaskedLM(config), {"input_ids": ids, "labels": labels}


@pytest.mark.parametrize("build", [_t5, _bert_masked_lm], ids=["t5", "bert-masked-lm"])
def test_transformers_models_outside_the_forms_read_run_their_own_loss_in_chunks(build) -> None:
    """An encoder-decoder and a masked LM take their loss with `CrossEntropyLoss` over
    their head's flattened logits: it runs in chunks, as the model computes it, its
    dropout drawn alike, `outputs.logits` None."""
    torch.manual_seed(0)
    model, batch = build()
    model.train()

    def step() -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        torch.manual_seed(3)
        model.zero_grad()
        loss = model(**batch).loss
        loss.backward()
        return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}

    expected = step()
    plan = optremat.plan(model, batch, 1.0, head_chunks=4, time_limit=5)
    assert plan.chunking.chunks == 4
    optremat.apply(model, plan)
    _close(step(), expected)
    assert model(**batch).logits is None
    measured = measure_step(model, batch).peak_bytes
    assert abs(measured - plan.predicted_peak_bytes) <= 0.02 * plan.predicted_peak_bytes


def test_int32_targets_are_refused_as_eager_refuses_them() -> None:
    """Only int64 and uint8 targets are chunked, as `F.cross_entropy` takes only those:
    int32 ones reach it with the logits computed, and it refuses them as unplanned."""
    model = NanoGPT()
    idx, targets = _batch()
    optremat.apply(model, optremat.plan(model, (idx, targets), 1.0, head_chunks=2, time_limit=5))
    with pytest.raises(RuntimeError, match="Long"):
        model(idx, targets.int())
