"""Measure the bytes a training step really holds, on any device, CPU included.

The planner (eagle3/plan/model.py) predicts peak memory from formulas; this module measures what the same code
allocates so that the formulas can be checked on a machine without a GPU. Two trackers:

- ``LiveBytesTracker``: a TorchDispatchMode that sees every tensor an op returns. It counts each storage
  once (views share it) from the op that created it until Python frees it (a weakref callback on the
  storage), and keeps the running total and its peak. Storages that first appear as an op *input* existed
  before the tracker started (parameters, the batch, optimizer state): they are "foreign" and never counted.
  This is the CPU analogue of ``torch.cuda.max_memory_allocated`` minus the static state, without allocator
  rounding, fragmentation or op-internal workspaces.
- ``SavedTensorsTracker``: saved-tensor hooks; counts the unique storages autograd keeps for backward.
  Cheaper and easy to reason about, but blind to tensors kept alive by other means (activation checkpointing
  keeps its inputs in a closure, not through the hooks).

``measure_train_step`` runs one forward+backward of a callable under the live-bytes tracker and returns the
figures the planner is validated against.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


def _storages(tree) -> list[torch.UntypedStorage]:
    """The untyped storages of every dense tensor in a pytree (ops may return tuples, lists, None)."""
    out = []
    for leaf in tree_flatten(tree)[0]:
        if isinstance(leaf, torch.Tensor) and leaf.layout == torch.strided and leaf.device.type != "meta":
            try:
                out.append(leaf.untyped_storage())
            except (RuntimeError, NotImplementedError):  # tensors without a storage (e.g. some subclasses)
                continue
    return out


def storage_nbytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views of one buffer count once).

    >>> x = torch.zeros(4, 8)                    # 128 bytes
    >>> storage_nbytes([x, x[1:], x.t(), torch.zeros(2, dtype=torch.float64)])
    144
    """
    seen: dict[int, int] = {}
    for t in tensors:
        for st in _storages(t):
            seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


class LiveBytesTracker(TorchDispatchMode):
    """Live and peak bytes of the tensor storages created while the mode is active.

    >>> with LiveBytesTracker() as t:
    ...     a = torch.ones(256)                  # 1024 bytes
    ...     b = a * 2                            # +1024
    ...     del a                                # -1024
    ...     c = b + 1                            # +1024
    >>> t.live_bytes, t.peak_bytes
    (2048, 2048)
    """

    def __init__(self, record: bool = False) -> None:
        super().__init__()
        self.record = record  # keep (op, shape, dtype) per live storage for `live_by_op` (debugging, benches)
        self._origin: dict[int, tuple[str, tuple[int, ...], str]] = {}
        self.live_bytes = 0
        self.peak_bytes = 0
        self.marks: dict[str, int] = {}
        # storage id -> (weakref, nbytes); ids are only valid while the weakref is alive, which is exactly
        # the window we look them up in.
        self._tracked: dict[int, tuple[weakref.ref, int]] = {}
        self._foreign: dict[int, weakref.ref] = {}

    def _freed(self, key: int, _ref: weakref.ref) -> None:
        entry = self._tracked.pop(key, None)
        self._origin.pop(key, None)
        if entry is not None:
            self.live_bytes -= entry[1]

    def _forget_foreign(self, key: int, _ref: weakref.ref) -> None:
        self._foreign.pop(key, None)

    def _see_input(self, st: torch.UntypedStorage) -> None:
        key = id(st)
        if key not in self._tracked and key not in self._foreign:
            self._foreign[key] = weakref.ref(st, lambda r, k=key: self._forget_foreign(k, r))

    def _see_output(self, st: torch.UntypedStorage, origin=None) -> None:
        key = id(st)
        if key in self._foreign:
            return
        nbytes = st.nbytes()
        entry = self._tracked.get(key)
        if entry is None:
            self._tracked[key] = (weakref.ref(st, lambda r, k=key: self._freed(k, r)), nbytes)
            self.live_bytes += nbytes
            if self.record and origin is not None:
                self._origin[key] = origin
        elif entry[1] != nbytes:  # resized in place (out= ops): count the new size
            self._tracked[key] = (entry[0], nbytes)
            self.live_bytes += nbytes - entry[1]
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for st in _storages((args, kwargs)):
            self._see_input(st)
        out = func(*args, **kwargs)
        leaves = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        for t in leaves:
            origin = (str(func.overloadpacket.__name__), tuple(t.shape), str(t.dtype).replace("torch.", ""))
            for st in _storages(t):
                self._see_output(st, origin if self.record else None)
        return out

    def live_by_op(self) -> list[tuple[str, tuple[int, ...], str, int, int]]:
        """(op, shape, dtype, count, bytes) of the live storages, largest first (needs record=True)."""
        groups: dict[tuple, list[int]] = {}
        for key, (_ref, nbytes) in self._tracked.items():
            origin = self._origin.get(key, ("?", (), "?"))
            slot = groups.setdefault(origin, [0, 0])
            slot[0] += 1
            slot[1] += nbytes
        rows = [(*origin, count, nbytes) for origin, (count, nbytes) in groups.items()]
        return sorted(rows, key=lambda r: -r[4])

    def mark(self, name: str) -> int:
        """Remember the live bytes now under ``name`` (e.g. "forward" at the end of the forward pass)."""
        self.marks[name] = self.live_bytes
        return self.live_bytes


class SavedTensorsTracker:
    """Unique bytes autograd saves for backward while the context is active.

    Parameters and other tensors passed as ``exclude`` (the batch, frozen weights) are not activations and are
    left out.

    >>> w = torch.ones(16, 16, requires_grad=True)
    >>> x = torch.ones(4, 16)
    >>> with SavedTensorsTracker(exclude=[w, x]) as s:
    ...     y = (x @ w).relu()                   # matmul saves x and w (excluded), relu saves its output
    >>> s.saved_bytes                            # 4 x 16 fp32
    256
    """

    def __init__(self, exclude: Iterable[torch.Tensor] = ()) -> None:
        self._exclude = {st.data_ptr() for t in exclude for st in _storages(t)}
        self._saved: dict[int, int] = {}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        for st in _storages(t):
            if st.data_ptr() not in self._exclude:
                self._saved[st.data_ptr()] = st.nbytes()
        return t

    @property
    def saved_bytes(self) -> int:
        return sum(self._saved.values())

    def __enter__(self) -> SavedTensorsTracker:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)


@dataclass
class StepMemory:
    """What one forward+backward held, in bytes, counting only what the step itself allocated.

    forward: live at the end of the forward pass (activations kept for backward, the loss, the stats).
    peak: the highest live total during forward and backward (forward plus the backward's transients).
    after: still live after backward (new gradients when they did not exist before; ~0 otherwise).
    """

    forward: int
    peak: int
    after: int
    extra: dict[str, int] = field(default_factory=dict)


def measure_train_step(forward: Callable[[], torch.Tensor], backward: bool = True) -> StepMemory:
    """Run ``forward()`` (returning a scalar loss, or a tuple whose first item is the loss) and its backward
    under a LiveBytesTracker.

    Parameters, buffers, the batch and gradients that already exist are foreign to the tracker; allocate the
    gradients first (one warm-up step and ``zero_grad(set_to_none=False)``) to measure activations alone.

    >>> lin = torch.nn.Linear(32, 32, bias=False)
    >>> x = torch.ones(8, 32)
    >>> m = measure_train_step(lambda: lin(x).square().sum())
    >>> m.forward >= 8 * 32 * 4                  # lin(x) is saved by square()
    True
    """
    with LiveBytesTracker() as tracker:
        out = forward()
        loss = out[0] if isinstance(out, tuple) else out
        tracker.mark("forward")
        if backward:
            loss.backward()
        del out, loss
        tracker.mark("after")
    return StepMemory(forward=tracker.marks["forward"], peak=tracker.peak_bytes, after=tracker.marks["after"])


def measure_drafter_step(
    model,
    batch: dict,
    *,
    ttt_steps: int,
    activation_checkpointing: bool = False,
    loss_chunk_size: int = 4096,
    attention: str = "auto",
    autocast: bool = False,
    context=None,
    lk_weight: float = 0.0,
) -> StepMemory:
    """Bytes of one ttt_forward + backward of `model` on `batch`, gradients excluded.

    A warm-up step allocates the gradients first (then zeroed, not freed), so the measurement holds what the
    planner calls held + transient: activations, their gradients and temporaries, and nothing static.
    `context`: this rank's share of a context-parallel row (eagle3.context; `batch` is its shard_row).
    """
    import contextlib

    from eagle3.model import ttt_forward

    device = next(model.parameters()).device
    batch = {k: v.to(device) for k, v in batch.items()}

    def forward():
        ctx = torch.autocast(device.type, dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
        with ctx:
            return ttt_forward(
                model,
                batch,
                ttt_steps=ttt_steps,
                activation_checkpointing=activation_checkpointing,
                loss_chunk_size=loss_chunk_size,
                attention=attention,
                lk_weight=lk_weight,
                **({"context": context} if context is not None else {}),
            )

    forward()[0].backward()
    for p in model.parameters():
        if p.grad is not None:
            p.grad.zero_()
    return measure_train_step(forward)


def measure_planned_step(spec, seq_len: int, context=None) -> StepMemory:
    """Measure one forward+backward of the planner's probe step for a resolved spec (eagle3.spec.RunSpec) on the
    CPU: what the planner's activation model is validated against (tests) and what bench/memory.py prints.
    `context`: this rank's eagle3.context.ContextShard of a context-parallel run (every rank of its group calls)."""
    from eagle3 import plan
    from eagle3.context import shard_row

    torch.manual_seed(0)
    model, _, batch = plan.build_probe_step(spec, seq_len, torch.device("cpu"))
    if context is not None:
        batch = shard_row(batch, context, spec.run.ttt_steps)
    run = spec.run
    return measure_drafter_step(
        model,
        batch,
        ttt_steps=run.ttt_steps,
        autocast=run.autocast,
        loss_chunk_size=run.loss_chunk_size,
        activation_checkpointing=run.activation_checkpointing,
        attention=run.attention,
        context=context,
        lk_weight=run.lk_weight,
    )
