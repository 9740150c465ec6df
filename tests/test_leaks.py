"""Planning traces the model on fake tensors; whatever its code caches during the trace,
wherever the cache lives, the model's later steps compute real losses and gradients
equal to a model never planned, or planning says it cannot leave the model so."""

import functools
import gc
import types
import warnings
import weakref

import pytest
import torch
import torch.nn as nn

import optremat
from optremat import FakeTensorLeft


def _causal(tokens: int) -> torch.Tensor:
    return torch.full((tokens, tokens), float("-inf")).triu(1)


def _mask_default(tokens: int, _cache: dict = {}) -> torch.Tensor:  # noqa: B006 - the idiom under test
    if tokens not in _cache:
        _cache[tokens] = _causal(tokens)
    return _cache[tokens]


def _memo(function):
    cache = {}

    def cached(tokens: int) -> torch.Tensor:
        if tokens not in cache:
            cache[tokens] = function(tokens)
        return cache[tokens]
    return cached


_mask_closure = _memo(_causal)
_NAMES = types.SimpleNamespace(cache={})


def _mask_namespace(tokens: int) -> torch.Tensor:
    if tokens not in _NAMES.cache:
        _NAMES.cache[tokens] = (_causal(tokens),)
    return _NAMES.cache[tokens][0]


class Attention(nn.Module):
    def __init__(self, how: str, width: int = 32) -> None:
        super().__init__()
        self.how = how
        self.qkv, self.out = nn.Linear(width, 3 * width), nn.Linear(width, width)

    @staticmethod
    @functools.lru_cache(maxsize=4)
    def _mask_static(tokens: int) -> torch.Tensor:
        return _causal(tokens)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        masks = {"default argument": _mask_default, "closure": _mask_closure, "namespace": _mask_namespace,
                 "static lru_cache": self._mask_static}
        mask = masks[self.how](x.shape[1])
        q, k, v = self.qkv(x).chunk(3, -1)
        return x + self.out(((q @ k.transpose(-1, -2)) / 8 + mask).softmax(-1) @ v)


def _square_mean(out: torch.Tensor) -> torch.Tensor:
    return out.square().mean()


@pytest.mark.parametrize("how", ["default argument", "closure", "namespace", "static lru_cache"])
def test_a_mask_cached_during_planning_is_computed_again_for_real(how: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*[Attention(how) for _ in range(3)])
    x = torch.randn(4, 40 + len(how), 32)  # a length no other case cached
    plan = optremat.plan(model, x, 0.7, loss_fn=_square_mean, time_limit=5)
    loss = _square_mean(model(x))
    grads = torch.autograd.grad(loss, list(model.parameters()))
    assert type(loss) is torch.Tensor and all(type(g) is torch.Tensor for g in grads)
    unplanned = nn.Sequential(*[Attention(how) for _ in range(3)])
    unplanned.load_state_dict(model.state_dict())
    optremat.apply(model, plan)
    want = torch.autograd.grad(_square_mean(unplanned(x)), list(unplanned.parameters()))
    for got, wanted in zip(torch.autograd.grad(_square_mean(model(x)), list(model.parameters())), want):
        torch.testing.assert_close(got, wanted, rtol=0, atol=0)


class Rope(nn.Module):
    """A table computed on first use and kept as an attribute."""

    def __init__(self) -> None:
        super().__init__()
        self.cached = None

    def forward(self, tokens: int) -> torch.Tensor:
        if self.cached is None or self.cached.shape[0] != tokens:
            self.cached = torch.linspace(0, 1, tokens)[:, None]
        return self.cached


class HiddenRope(nn.Module):
    """Its table's module kept out of the module tree (as a teacher or shared table often is)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 32))
        self.ropes = [Rope()]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x + self.ropes[0](x.shape[1]))


def test_a_cache_planning_cannot_restore_is_refused_and_a_model_run_once_plans() -> None:
    """A table cached by a module out of the module tree holds the trace's fake tensor
    afterwards: planning says so and how to avoid it; run once on the batch first, the
    model caches the real table and plans."""
    model, x = HiddenRope(), torch.randn(4, 24, 32)
    for _ in range(2):  # planned again as it is, it is refused again
        with pytest.raises(FakeTensorLeft, match="attribute of a Rope.*run the model once"):
            optremat.plan(model, x, 1.0, loss_fn=_square_mean, time_limit=5)
    model.ropes[0].cached = None
    model(x)
    optremat.plan(model, x, 1.0, loss_fn=_square_mean, time_limit=5)
    assert type(_square_mean(model(x))) is torch.Tensor


def test_a_transformers_model_caching_with_its_own_lru_cache_trains_as_unplanned() -> None:
    """BEiT caches its relative position index with transformers' own lru_cache: after
    planning, the model's loss and gradients are real and the unplanned model's."""
    transformers = pytest.importorskip("transformers")
    config = transformers.BeitConfig(image_size=32, patch_size=8, num_channels=3, hidden_size=32,
                                     num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                                     use_relative_position_bias=True, num_labels=3)
    torch.manual_seed(0)
    model = transformers.BeitForImageClassification(config).train()
    unplanned = transformers.BeitForImageClassification(config).train()
    unplanned.load_state_dict(model.state_dict())
    batch = {"pixel_values": torch.randn(2, 3, 32, 32), "labels": torch.tensor([0, 2])}
    optremat.apply(model, optremat.plan(model, batch, 1.0, time_limit=5))

    def step(m: nn.Module) -> list[torch.Tensor]:
        torch.manual_seed(1)
        loss = m(**batch).loss
        return [loss, *torch.autograd.grad(loss, list(m.parameters()))]

    got, want = step(model), step(unplanned)
    assert all(type(t) is torch.Tensor for t in got)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


class _Cycle:
    def __init__(self) -> None:
        self.me = self


@pytest.mark.parametrize("frozen_before", [False, True])
def test_planning_leaves_the_collector_as_it_found_it(frozen_before: bool) -> None:
    """Planning looks through only what it made by freezing the heap from before it; after
    it returns or fails, the heap is unfrozen (or left frozen as the caller froze it),
    garbage from before planning is collected, and what its traces cached in a cache from
    before it (frozen with the heap) is taken out."""
    model = nn.Sequential(Attention("closure"), Attention("closure"))
    model(torch.randn(2, 16, 32))  # the cache holds a real mask: a dict the collector tracks
    planned, failed = (torch.randn(2, n, 32) for n in ((26, 27) if frozen_before else (21, 22)))
    if frozen_before:
        gc.freeze()
    try:
        garbage = weakref.ref(_Cycle())
        optremat.plan(model, planned, 1.0, loss_fn=_square_mean, time_limit=5)
        assert (gc.get_freeze_count() > 0) == frozen_before
        assert type(_mask_closure(planned.shape[1])) is torch.Tensor
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            with pytest.raises(optremat.ExtractionError, match="no_such_method"):
                optremat.plan(model, failed, 1.0, loss_fn=lambda out: out.no_such_method(), time_limit=5)
        assert not [w for w in seen if "optremat" in str(w.message)]  # the error's own fake tensors are no cache
        assert type(_mask_closure(failed.shape[1])) is torch.Tensor
        assert (gc.get_freeze_count() > 0) == frozen_before
    finally:
        gc.unfreeze()
    gc.collect()
    assert garbage() is None


def test_a_trace_outside_planning_is_swept_by_the_next_plan() -> None:
    """A trace no planning call swept (optremat.tracing.extract.trace) leaves a fake mask in
    the model's cache; the next plan, though its heap from before is frozen, takes it out."""
    from optremat.tracing.extract import trace

    model, x = nn.Sequential(Attention("closure"), Attention("closure")), torch.randn(2, 29, 32)
    trace(model, x, _square_mean)
    assert type(_mask_closure(29)) is not torch.Tensor
    optremat.plan(model, x, 1.0, loss_fn=_square_mean, time_limit=5)
    assert type(_mask_closure(29)) is torch.Tensor
