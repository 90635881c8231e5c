"""Activation offloading to the CPU between a layer's forward and its backward.

NVIDIA TE's ``get_cpu_offload_context`` (Megatron-LM's ``--cpu-offloading``): a model of
``model_layers`` layers runs each layer's forward inside the returned context and passes the
layer's output through the returned function::

    context, sync = get_cpu_offload_context(True, num_layers=2, model_layers=4)
    for layer in layers:
        with context:
            x = layer(x)
        x = sync(x)

The tensors that the first ``num_layers`` layers save for their backward go to pinned CPU
memory once the layer's forward is done (``sync``), by copies on a stream of their own, and
their GPU memory is released as those copies finish; so during the forward of the later
layers the GPU holds only the later layers' activations. The backward brings them back:
when it reaches a layer's output (a hook that ``sync`` registers) it starts copying that
layer's and the layer before it's tensors back on the same stream, and each saved tensor,
when autograd unpacks it, makes the compute stream wait for its copy. A layer's reloaded
tensors are released when the backward moves on to the layer before it. The values are the
same bits (copies), and so are the gradients.

Offloaded: plain CUDA tensors (not parameters, views of parameters or tensor subclasses) of at
least ``min_tensor_size_to_offload`` elements, each copied whole (a dense layout's strides
kept, others made contiguous). The last layer is never offloaded: its backward comes first.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Callable, Optional

import torch

__all__ = ["get_cpu_offload_context", "mark_not_offload"]

DEFAULT_MIN_TENSOR_SIZE_TO_OFFLOAD = 2**20  # elements: smaller tensors stay (copies cost more)


def mark_not_offload(*tensors: Optional[torch.Tensor]) -> None:
    """Keeps these tensors on the device when autograd saves them inside the offload context
    (NVIDIA's call; None is skipped)."""
    for t in tensors:
        if t is not None:
            t._te_do_not_offload = True


def offloadable(t: torch.Tensor) -> bool:
    """Not marked to stay (mark_not_offload, or Megatron-LM's ``offloading_activation =
    False``), and neither a parameter's view (the parameter stays on the device anyway)."""
    return (not getattr(t, "_te_do_not_offload", False)
            and getattr(t, "offloading_activation", True) is not False
            and not isinstance(t._base, torch.nn.Parameter))


class CudaTransfer:
    """The copies of the offloaded tensors, on a CUDA stream of their own."""

    def __init__(self, min_numel: int) -> None:
        self.min_numel = min_numel
        self._stream: Optional[torch.cuda.Stream] = None

    def takes(self, t: torch.Tensor) -> bool:
        return (type(t) is torch.Tensor and t.is_cuda and t.numel() >= self.min_numel
                and offloadable(t))

    def stream(self, device: torch.device) -> torch.cuda.Stream:
        if self._stream is None:
            self._stream = torch.cuda.Stream(device)
        return self._stream

    def to_host(self, t: torch.Tensor) -> torch.Tensor:
        """A pinned CPU copy of ``t``, made after everything the compute stream has issued; the
        GPU memory of ``t`` is reused only once the copy is done (record_stream)."""
        stream = self.stream(t.device)
        stream.wait_stream(torch.cuda.current_stream(t.device))
        with torch.cuda.stream(stream):
            host = torch.empty_like(t, device="cpu", pin_memory=True)
            host.copy_(t, non_blocking=True)
        t.record_stream(stream)
        return host

    def to_device(self, host: torch.Tensor, device: torch.device) -> tuple:
        """(the GPU copy of ``host``, the event of its copy), issued on the transfer stream."""
        stream = self.stream(device)
        with torch.cuda.stream(stream):
            t = torch.empty_like(host, device=device)
            t.copy_(host, non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        return t, event

    def ready(self, reloaded: tuple) -> torch.Tensor:
        """The reloaded tensor, for use on the current stream once its copy is done."""
        t, event = reloaded
        current = torch.cuda.current_stream(t.device)
        current.wait_event(event)
        t.record_stream(current)
        return t


class _Saved:
    """What autograd keeps for an offloaded tensor: where to find it again."""

    __slots__ = ("layer", "index")

    def __init__(self, layer: int, index: int) -> None:
        self.layer, self.index = layer, index


class _Group:
    """One layer's offloaded tensors: on the device until the layer's forward ends, then on
    the host, then (in the backward) reloaded."""

    __slots__ = ("devices", "on_device", "on_host", "reloaded", "versions")

    def __init__(self) -> None:
        self.on_device: Optional[list] = []
        self.devices: list = []
        self.versions: list = []  # each tensor's version counter when autograd saved it
        self.on_host: Optional[list] = None
        self.reloaded: Optional[list] = None


class Offloader:
    """The schedule: which layer runs, which layers' tensors go to the host and when they
    come back. ``transfer`` makes the copies (CudaTransfer; the tests give one of their own)."""

    def __init__(self, model_layers: int, offloaded_layers: int, transfer) -> None:
        self.model_layers, self.offloaded_layers = model_layers, offloaded_layers
        self.transfer = transfer
        self.layer = -1
        self.groups: dict[int, _Group] = {}

    def begin_layer(self) -> int:
        """A layer's forward begins; the first layer's begins a new step, which drops what the
        last step left (host copies of a step whose backward did not run, or ran already)."""
        self.layer = (self.layer + 1) % self.model_layers
        if self.layer == 0:
            self.groups.clear()
        return self.layer

    def pack(self, t: torch.Tensor):
        layer = self.layer
        if not (0 <= layer < self.offloaded_layers) or not self.transfer.takes(t):
            return t
        group = self.groups.setdefault(layer, _Group())
        if group.on_device is None:  # (saved after the layer's end: kept where it is)
            return t
        group.on_device.append(t)
        group.devices.append(t.device)
        group.versions.append(t._version)
        return _Saved(layer, len(group.on_device) - 1)

    def unpack(self, saved):
        if not isinstance(saved, _Saved):
            return saved
        group = self.groups.get(saved.layer)
        if group is None:
            raise RuntimeError("cpu_offload: a tensor offloaded in an earlier step was asked for "
                               "after a new step's forward began; run the backward before the "
                               "next forward")
        if group.on_device is not None:  # the layer's forward never ended (sync not called)
            return group.on_device[saved.index]
        self._reload(saved.layer)
        return self.transfer.ready(group.reloaded[saved.index])

    def end_layer(self, layer: int) -> None:
        """The layer's forward is done: its tensors start for the host, and the references to
        their device memory go."""
        group = self.groups.get(layer)
        if group is None or group.on_device is None:
            return
        for t, version in zip(group.on_device, group.versions, strict=True):
            # (autograd's own check of saved tensors, which the copies would otherwise skip)
            if t._version != version:
                raise RuntimeError(f"cpu_offload: a tensor that layer {layer} saved for its "
                                   f"backward was modified in place afterwards (version "
                                   f"{version} -> {t._version}); its gradient would be wrong")
        group.on_host = [self.transfer.to_host(t) for t in group.on_device]
        group.on_device = None

    def begin_backward_of(self, layer: int) -> None:
        """The backward reaches the layer's output: its tensors and the previous layer's start
        coming back; the later layers' reloaded tensors, whose backward is done, go."""
        for done in [k for k in self.groups if k > layer]:
            self.groups[done].reloaded = None
        self._reload(layer)
        self._reload(layer - 1)

    def _reload(self, layer: int) -> None:
        group = self.groups.get(layer)
        if group is None or group.on_host is None or group.reloaded is not None:
            return
        group.reloaded = [self.transfer.to_device(host, device)
                          for host, device in zip(group.on_host, group.devices, strict=True)]


class _OffloadContext:
    """One layer's forward (``with``), and ``sync`` for its output."""

    def __init__(self, offloader: Offloader) -> None:
        self.offloader = offloader
        self.layer: Optional[int] = None
        self._hooks: Optional[torch.autograd.graph.saved_tensors_hooks] = None

    @property
    def inside_context(self) -> bool:
        """Whether a layer's forward runs inside the context now (NVIDIA's attribute, which
        Megatron-LM's layers read)."""
        return self._hooks is not None

    def __enter__(self) -> "_OffloadContext":
        if self._hooks is not None:
            raise RuntimeError("cpu_offload: the context was entered again inside itself; "
                               "enter it once per layer, and call the sync function on the "
                               "layer's output after leaving it")
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise NotImplementedError("cpu_offload: offloading inside CUDA graph capture is not "
                                      "implemented (the copies would be captured with fresh "
                                      "host buffers each step)")
        self.layer = self.offloader.begin_layer()
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self.offloader.pack,
                                                               self.offloader.unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        hooks, self._hooks = self._hooks, None
        hooks.__exit__(*exc)

    def sync(self, tensor: torch.Tensor) -> torch.Tensor:
        """The layer's output, unchanged: its forward is over (its tensors go to the host), and
        the backward will say when it reaches it (their copies come back)."""
        if self.layer is None:
            raise RuntimeError("cpu_offload: the sync function was called before the context "
                               "was entered")
        layer, offloader = self.layer, self.offloader
        offloader.end_layer(layer)
        if tensor.grad_fn is not None:
            tensor.grad_fn.register_prehook(lambda grads: offloader.begin_backward_of(layer))
        return tensor


def get_cpu_offload_context(enabled: bool = False, num_layers: int = 1, model_layers: int = 1,
                            offload_activations: bool = True, offload_weights: bool = False,
                            double_buffering: bool = False, synchronization_dict=None,
                            min_tensor_size_to_offload: int = DEFAULT_MIN_TENSOR_SIZE_TO_OFFLOAD,
                            retain_pinned_cpu_buffers: bool = False,
                            ) -> tuple[contextlib.AbstractContextManager, Callable]:
    """(context, sync): offloads the activations of the first ``num_layers`` of
    ``model_layers`` layers to the CPU (see the module's docstring for the calls).

    ``enabled=False`` gives a context that does nothing and the identity. ``offload_weights``
    does nothing (weights stay on the device; NVIDIA TE deprecated it too), but at least one
    of the two must be True. ``double_buffering`` and ``retain_pinned_cpu_buffers`` are
    accepted and change nothing here (the host buffers come from torch's pinned-memory cache);
    a ``synchronization_dict`` (a custom schedule) is not implemented.
    """
    op = "get_cpu_offload_context"
    if not offload_activations and not offload_weights:
        raise ValueError(f"{op}: offload_activations or offload_weights must be True (nothing "
                         "to offload otherwise)")
    if offload_weights:
        warnings.warn(f"{op}: offload_weights=True has no effect: weights stay on the device",
                      stacklevel=2)
    if synchronization_dict is not None:
        raise NotImplementedError(f"{op}: synchronization_dict (a custom offload schedule) is "
                                  "not implemented; give num_layers instead")
    if not enabled or not offload_activations:
        return contextlib.nullcontext(), lambda tensor: tensor
    if model_layers < 1 or not 0 <= num_layers <= model_layers - 1:
        raise ValueError(f"{op}: num_layers must be in [0, model_layers - 1] (the last layer's "
                         f"backward comes first, so it is never offloaded), got num_layers="
                         f"{num_layers}, model_layers={model_layers}")
    if min_tensor_size_to_offload < 0:
        raise ValueError(f"{op}: min_tensor_size_to_offload must be >= 0, got "
                         f"{min_tensor_size_to_offload}")
    context = _OffloadContext(Offloader(model_layers, num_layers,
                                        CudaTransfer(min_tensor_size_to_offload)))
    return context, context.sync
