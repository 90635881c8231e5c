"""get_cpu_offload_context: the schedule (which layers' saved tensors leave, when they come
back, that nothing else is kept), gradients bit-equal to no offloading, for torch layers and
te.TransformerLayer (FP8 too), the argument errors; and on CUDA the real copies."""

from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch

import transformer_engine.pytorch as te
from transformer_engine.common import recipe
from transformer_engine.pytorch import cpu_offload

HIDDEN = 32


class _CopyTransfer:
    """The copies as CPU clones, logged: lets the schedule run on the CPU."""

    def __init__(self, min_numel: int = 64):
        self.min_numel = min_numel
        self.sent: list = []  # weak references to what went to the "host"
        self.reloads: list = []  # the layer of each reload, in order
        self.offloader = None

    def takes(self, t):
        return (type(t) is torch.Tensor and t.numel() >= self.min_numel
                and cpu_offload.offloadable(t))

    def to_host(self, t):
        self.sent.append(weakref.ref(t))
        return t.detach().clone()

    def to_device(self, host, device):
        self.reloads.append(self.offloader.layer_of_reload)
        return host.clone(), None

    def ready(self, reloaded):
        return reloaded[0]


class _LoggingOffloader(cpu_offload.Offloader):
    def __init__(self, *args):
        super().__init__(*args)
        self.events: list = []  # ("backward", layer) and ("reload", layer), in order
        self.layer_of_reload = None

    def begin_backward_of(self, layer):
        self.events.append(("backward", layer))
        super().begin_backward_of(layer)

    def _reload(self, layer):
        self.layer_of_reload = layer
        group = self.groups.get(layer)
        if group is not None and group.on_host is not None and group.reloaded is None:
            self.events.append(("reload", layer))
        super()._reload(layer)


def _offload(layers: int, offloaded: int, min_numel: int = 64):
    transfer = _CopyTransfer(min_numel)
    offloader = _LoggingOffloader(layers, offloaded, transfer)
    transfer.offloader = offloader
    context = cpu_offload._OffloadContext(offloader)
    return context, context.sync, transfer, offloader


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(HIDDEN, 4 * HIDDEN)
        self.fc2 = torch.nn.Linear(4 * HIDDEN, HIDDEN)

    def forward(self, x):
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(x)))


def _run(model, x, context=None, sync=None):
    h = x
    for i, layer in enumerate(model):
        if context is None:
            h = layer(h)
            continue
        with context:
            h = layer(h)
        if i < len(model) - 1:  # (Megatron-LM leaves the last layer's out, as here)
            h = sync(h)
    return h


def _grads(model, x):
    return [x.grad] + [p.grad for p in model.parameters()]


def test_offloaded_layers_keep_nothing_and_the_gradients_are_the_same():
    torch.manual_seed(0)
    model = torch.nn.ModuleList(_Block() for _ in range(4))
    x = torch.randn(8, 16, HIDDEN, requires_grad=True)
    _run(model, x).square().sum().backward()
    want = [g.clone() for g in _grads(model, x)]
    model.zero_grad(set_to_none=True)
    x.grad = None

    context, sync, transfer, offloader = _offload(4, 2)
    y = _run(model, x, context, sync)
    gc.collect()
    # Layers 0 and 1 sent their saved activations away and hold none of them.
    assert set(offloader.groups) == {0, 1}
    assert all(g.on_device is None and len(g.on_host) > 0 for g in offloader.groups.values())
    alive = [r() for r in transfer.sent if r() is not None]
    assert all(t is x for t in alive), "an offloaded activation is still on the device"
    y.square().sum().backward()
    for got, expected in zip(_grads(model, x), want, strict=True):
        assert torch.equal(got, expected)
    # Each group comes back once, while the backward of the layer after it runs (prefetch):
    # layer 1's when the backward reaches layer 2's output, layer 0's at layer 1's.
    assert offloader.events == [("backward", 2), ("reload", 1), ("backward", 1), ("reload", 0),
                                ("backward", 0)]
    assert transfer.reloads[:1] == [1] and set(transfer.reloads) == {0, 1}
    assert len(transfer.reloads) == sum(len(g.on_host) for g in offloader.groups.values())


def test_transformer_layers_in_fp8_give_the_same_gradients():
    torch.manual_seed(0)
    layers = torch.nn.ModuleList(
        te.TransformerLayer(64, 128, 4, hidden_dropout=0.0, attention_dropout=0.0, device="cpu")
        for _ in range(3))
    x = torch.randn(16, 2, 64, requires_grad=True)
    r = recipe.DelayedScaling()
    results = []
    for offloading in (False, True):
        state = copy.deepcopy(layers.state_dict())
        layers.zero_grad(set_to_none=True)
        x.grad = None
        context, sync, transfer, _ = _offload(3, 2) if offloading else (None, None, None, None)
        for _ in range(2):  # the second step under scales the first one set
            with te.fp8_autocast(fp8_recipe=r):
                y = _run(layers, x, context, sync)
            y.square().sum().backward()
        results.append(_grads(layers, x))
        if offloading:
            assert len(transfer.sent) > 0
        else:
            layers.load_state_dict(state)
    for got, want in zip(results[1], results[0], strict=True):
        assert torch.equal(got, want)


def test_a_tensor_modified_in_place_after_saving_is_an_error():
    context, sync, _, _ = _offload(2, 1)
    w = torch.randn(HIDDEN, HIDDEN, requires_grad=True)
    x = torch.randn(8, HIDDEN)
    with context:
        h = x.matmul(w)  # saves x
        x.add_(1.0)
    with pytest.raises(RuntimeError, match="modified in place"):
        sync(h)


def test_disabled_and_the_argument_errors():
    context, sync = te.get_cpu_offload_context(False, 1, 2)
    t = torch.ones(3)
    assert sync(t) is t
    with context:
        pass
    with pytest.raises(ValueError, match="num_layers must be in"):
        te.get_cpu_offload_context(True, num_layers=2, model_layers=2)
    with pytest.raises(ValueError, match="offload_activations or offload_weights"):
        te.get_cpu_offload_context(True, 1, 2, offload_activations=False)
    with pytest.raises(NotImplementedError, match="synchronization_dict"):
        te.get_cpu_offload_context(True, 1, 2, synchronization_dict={0: (True, 1, False, 0)})
    with pytest.warns(UserWarning, match="offload_weights=True has no effect"):
        te.get_cpu_offload_context(True, 1, 2, offload_weights=True)
    context, sync = te.get_cpu_offload_context(True, 1, 2)
    with pytest.raises(RuntimeError, match="before the context was entered"):
        sync(t)
    assert context.inside_context is False  # (Megatron-LM reads it)
    with context:
        assert context.inside_context is True
    assert context.inside_context is False


@pytest.mark.cuda
def test_cuda_offload_frees_the_device_memory_and_keeps_the_gradients():
    from transformer_engine.common import core

    if not torch.cuda.is_available() or not core().built_with_cuda():
        pytest.skip("needs CUDA")
    torch.manual_seed(0)
    model = torch.nn.ModuleList(_Block() for _ in range(6)).cuda()
    x = torch.randn(64, 256, HIDDEN, device="cuda", requires_grad=True)
    results, held = [], []
    for offloading in (False, True):
        model.zero_grad(set_to_none=True)
        x.grad = None
        context, sync = te.get_cpu_offload_context(offloading, 4, 6,
                                                   min_tensor_size_to_offload=1024)
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        y = _run(model, x, context if offloading else None, sync)
        torch.cuda.synchronize()
        held.append(torch.cuda.memory_allocated() - before)
        y.square().sum().backward()
        results.append([g.clone() for g in _grads(model, x)])
    for got, want in zip(results[1], results[0], strict=True):
        assert torch.equal(got, want)
    # Four of six layers keep their activations on the host: at most half the device memory.
    assert held[1] < 0.5 * held[0], held


def test_marked_tensors_stay():
    """mark_not_offload (and Megatron-LM's offloading_activation = False) keep a tensor on
    the device: autograd keeps it itself."""
    context, sync, transfer, offloader = _offload(2, 1)
    w = torch.randn(HIDDEN, HIDDEN, requires_grad=True)
    kept, megatron_kept, sent = (torch.randn(8, HIDDEN) for _ in range(3))
    te.mark_not_offload(kept, None)
    megatron_kept.offloading_activation = False
    with context:
        h = kept.matmul(w) + megatron_kept.matmul(w) + sent.matmul(w)
    sync(h)
    assert [r() for r in transfer.sent] == [sent]
