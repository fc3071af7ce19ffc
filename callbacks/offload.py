"""CPUOffload: keep the optimizer state and idle model copies in host memory between stages.

What lives where, around one global step:

    between stages   opt_state: host       module.ref_params (and other `reference_attrs`): host
    update stage     opt_state: device     (Trainer.on_update_start -> updates -> on_update_end)
    logps stage      ref_params: a device copy exists only inside `module.compute_logps`

"Host" is the device's host memory kind when the backend has one, otherwise NumPy:

- GPU/TPU backends list `pinned_host` (page-locked: fast, asynchronous DMA) and often
  `unpinned_host` among `device.addressable_memories()`; `pinned_host` is preferred. Host arrays
  stay `jax.Array`s with the same sharding, only `memory_kind` changes, so sharded optimizer
  states keep their layout.
- The CPU backend (jax >= 0.4.31) also lists `pinned_host` and `unpinned_host`. They are the same
  RAM as `device`, so offloading saves nothing there, but the placements change exactly as on a
  GPU: that is what the tests observe.
- A backend without host memory kinds falls back to `jax.device_get` (NumPy arrays); the device
  shardings are remembered so the arrays return to the same layout.

Moving bits between memories copies them exactly, so a run with CPUOffload makes the same
updates, bit for bit, as a run without it. The cost is one host->device copy of the optimizer
state per step and one of the reference params per logps micro batch.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from rlbolt.callback import Callback
from rlbolt.run_info import RunInfo
from rlbolt.state import TrainState

log = logging.getLogger(__name__)
HOST_KINDS = ("pinned_host", "unpinned_host")


def host_memory_kind(device: jax.Device | None = None) -> str | None:
    """The host memory kind offloaded arrays use on `device` (default: the first device).

    Returns:
      "pinned_host", else "unpinned_host", else None (the backend has no host memory kinds:
      offloading then uses NumPy arrays).
    """
    device = device or jax.devices()[0]
    try:
        kinds = {memory.kind for memory in device.addressable_memories()}
    except (AttributeError, NotImplementedError, RuntimeError):  # older or plugin backends
        return None
    return next((kind for kind in HOST_KINDS if kind in kinds), None)


def placement(x: Any) -> str:
    """Where one leaf lives: its memory kind ("device", "pinned_host", ...), or "numpy"."""
    if isinstance(x, jax.Array):
        return x.sharding.memory_kind or "device"
    return "numpy" if isinstance(x, np.ndarray) else type(x).__name__


class Offloaded:
    """A pytree moved to host memory, plus the shardings that bring it back to the device.

    Args:
      tree: a pytree of `jax.Array`s on the device (other leaves are left alone).
      host_kind: a host memory kind, or None to fall back to NumPy arrays.
    """

    def __init__(self, tree: Any, host_kind: str | None):
        leaves, self.treedef = jax.tree.flatten(tree)
        # The device sharding each array returns to (None: not a jax.Array, never moved).
        self.shardings = [_device_sharding(x) if isinstance(x, jax.Array) else None for x in leaves]
        self.host = jax.tree.unflatten(self.treedef, [_to_host(x, s, host_kind) for x, s in zip(leaves, self.shardings)])

    def to_device(self) -> Any:
        """A device copy of the tree (the host copy stays; dropping the result frees the device memory)."""
        leaves = jax.tree.leaves(self.host)
        return jax.tree.unflatten(self.treedef, [x if s is None else jax.device_put(x, s)
                                                 for x, s in zip(leaves, self.shardings)])


def _device_sharding(x: jax.Array) -> jax.sharding.Sharding:
    sharding = x.sharding
    if sharding.memory_kind in HOST_KINDS:  # already offloaded (e.g. a restored checkpoint)
        default = next(iter(sharding.device_set)).default_memory().kind
        return sharding.with_memory_kind(default)
    return sharding


def _leaf_to_device(x: Any) -> Any:
    if isinstance(x, jax.Array):
        return jax.device_put(x, _device_sharding(x))
    return jax.device_put(x) if isinstance(x, np.ndarray) else x


def _to_host(x: Any, device_sharding: Any, host_kind: str | None) -> Any:
    if device_sharding is None:
        return x
    if host_kind is None:
        return np.asarray(jax.device_get(x))
    return jax.device_put(x, device_sharding.with_memory_kind(host_kind))


class CPUOffload(Callback):
    """Keeps the optimizer state and the module's idle model copies in host memory between stages.

    Place it after ModelCheckpoint in the callback list, so a state restored at fit start is
    offloaded from the first step (otherwise it is offloaded after the first update).

    Args:
      optimizer_state: keep `TrainState.opt_state` in host memory except during the update stage.
      reference: keep the module's idle model copies (the frozen reference policy of a KL term) in
        host memory except inside `module.compute_logps`.
      reference_attrs: None (default): the copies the module's card declares
        (`ModuleCard.idle_copies`; an LMPolicyModule's colocated reference when algorithm.beta > 0).
        Or the names of module attributes holding idle parameter pytrees, for a module without a
        card; missing or None ones are skipped.
      host_kind: "pinned_host", "unpinned_host", "numpy", or None to pick the best the backend has.

    Attributes:
      host_kind: the host placement in use ("pinned_host", "unpinned_host" or "numpy"), set at fit start.
      offloaded_attrs: the module attributes actually offloaded in this fit.
    """

    def __init__(self, optimizer_state: bool = True, reference: bool = True,
                 reference_attrs: Sequence[str] | None = None, host_kind: str | None = None):
        if host_kind not in (None, "numpy", *HOST_KINDS):
            raise ValueError(f"CPUOffload(host_kind={host_kind!r}); use None (auto), 'numpy', or one of {HOST_KINDS}")
        if isinstance(reference_attrs, str):
            raise TypeError(f"CPUOffload(reference_attrs={reference_attrs!r}): pass a sequence, e.g. ({reference_attrs!r},)")
        self.optimizer_state, self.reference = optimizer_state, reference
        self.reference_attrs = None if reference_attrs is None else tuple(reference_attrs)
        self._requested_kind = host_kind
        self.host_kind: str | None = None
        self.offloaded_attrs: tuple[str, ...] = ()
        self._opt: Offloaded | None = None
        self._refs: dict[str, Offloaded] = {}
        self._slots: dict[str, tuple[Callable[[], Any], Callable[[Any], None]]] = {}
        self._module = None

    # -- hooks ------------------------------------------------------------------------------------
    def on_fit_start(self, run: RunInfo, state: TrainState) -> TrainState | None:
        kind = self._requested_kind or host_memory_kind() or "numpy"
        if kind != "numpy" and kind not in {m.kind for m in jax.devices()[0].addressable_memories()}:
            raise ValueError(f"CPUOffload(host_kind={kind!r}): device {jax.devices()[0]} has no such memory; "
                             "use host_kind=None to pick what the backend has")
        self.host_kind = kind
        log.info("CPUOffload: host placement %s on %s", kind, jax.devices()[0].platform)
        if self.reference:
            self._offload_module(run.module, run.card)
        return self.on_update_end(run, state)

    def on_update_start(self, run: RunInfo, state: TrainState) -> TrainState | None:
        """Brings the optimizer state to the device for the step's updates."""
        if not self.optimizer_state:
            return None
        if self._opt is not None and state.opt_state is self._opt.host:
            return state.replace(opt_state=self._opt.to_device())
        # Replaced since it was offloaded (a checkpoint restored after this callback's on_fit_start).
        return state.replace(opt_state=jax.tree.map(_leaf_to_device, state.opt_state))

    def on_update_end(self, run: RunInfo, state: TrainState) -> TrainState | None:
        """Moves the updated optimizer state back to host memory."""
        if not self.optimizer_state:
            return None
        self._opt = Offloaded(state.opt_state, self._jax_kind)
        return state.replace(opt_state=self._opt.host)

    def on_fit_end(self, run: RunInfo, state: TrainState) -> None:
        self._restore_module()

    def on_exception(self, run: RunInfo, exc: BaseException) -> None:
        self._restore_module()

    # -- the reference copies -----------------------------------------------------------------------
    @property
    def _jax_kind(self) -> str | None:
        return None if self.host_kind == "numpy" else self.host_kind

    def _offload_module(self, module, card) -> None:
        self._module = module
        self._slots = _idle_slots(module, card, self.reference_attrs)
        self._refs = {name: Offloaded(get(), self._jax_kind) for name, (get, _) in self._slots.items()}
        self.offloaded_attrs = tuple(self._refs)
        if not self._refs:
            log.info("CPUOffload: module %s declares no idle model copy; only the optimizer state is offloaded",
                     type(module).__name__)
            return
        for name, offloaded in self._refs.items():
            self._slots[name][1](offloaded.host)
        original = module.compute_logps
        refs, slots = self._refs, self._slots

        def compute_logps(params: Any, batch: Any) -> Any:
            # The logps stage thread is the only reader of the reference copies, so swapping the
            # copies for the call cannot race; the device copies die when the call returns.
            for name, offloaded in refs.items():
                slots[name][1](offloaded.to_device())
            try:
                return original(params, batch)
            finally:
                for name, offloaded in refs.items():
                    slots[name][1](offloaded.host)

        module.compute_logps = compute_logps  # an instance attribute: removed again at fit end

    def _restore_module(self) -> None:
        module, self._module = self._module, None
        if module is None or not self._refs:
            return
        vars(module).pop("compute_logps", None)
        for name, offloaded in self._refs.items():
            self._slots[name][1](offloaded.to_device())
        self._refs, self._slots = {}, {}


def _idle_slots(module: Any, card: Any, names: tuple[str, ...] | None
                ) -> dict[str, tuple[Callable[[], Any], Callable[[Any], None]]]:
    """name -> (read, replace) of each idle parameter copy: the card's `idle_copies` (their `.params`),
    or, when the user named attributes (`reference_attrs`), those attributes of the module."""
    if names is None:
        holders = {} if card is None else dict(card.idle_copies)
        return {name: (lambda h=h: h.params, lambda value, h=h: setattr(h, "params", value))
                for name, h in holders.items() if h.params is not None}
    return {name: (lambda n=name: getattr(module, n), lambda value, n=name: setattr(module, n, value))
            for name in names if getattr(module, name, None) is not None}
