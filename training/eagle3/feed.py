"""The data feed: one packed row per rank and step, read ahead on a thread while the step before computes, and the
position in the epoch plan that a checkpoint records."""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

from eagle3 import checkpoint as ckpt
from eagle3.data import DatasetReader


def advance(state: ckpt.TrainerState, samples: int, plan_len: int) -> None:
    """Count one finished step: the position moves on in the epoch plan (`plan_len` steps), or to the next epoch.

    >>> s = ckpt.TrainerState(step=9, epoch=0, step_in_epoch=9, samples_seen=30, world_size=1, max_seq_len=512,
    ...                       seed=0)
    >>> advance(s, samples=3, plan_len=10)
    >>> s.step, s.epoch, s.step_in_epoch, s.samples_seen
    (10, 1, 0, 33)
    """
    state.step += 1
    state.step_in_epoch += 1
    state.samples_seen += samples
    if state.step_in_epoch >= plan_len:
        state.epoch, state.step_in_epoch = state.epoch + 1, 0


class RowPrefetcher:
    """Reads the coming steps' rows in one background thread while the current step computes.

    The thread has its own DatasetReader (its own shard handles), so nothing is shared with the main
    thread's reads during validation; every read of this reader runs on that one thread. A row is read
    straight into its final tensors (`DatasetReader.read_row`), in pinned memory when `pin_memory` (CUDA) so the
    step's copy to the GPU runs with non_blocking=True. Up to `depth` rows are queued ahead (`schedule`, in step
    order); rows rotate through depth + 2 row buffers, reused without a new allocation (page faults or pinned
    allocations cost as much as the read itself): a row returned by `get` stays valid until the next `get`
    returns (the trainer uses it for one step). Errors (bad shard, out of memory) surface in `get`.
    """

    def __init__(self, data_dir: str, max_seq_len: int, pin_memory: bool, depth: int = 1, held: tuple | None = None):
        if depth < 1:
            raise ValueError(f"prefetch depth {depth} must be at least 1")
        self.reader = DatasetReader(data_dir)
        self.max_seq_len = max_seq_len
        self.pin_memory = pin_memory
        self.depth = depth
        # a context-parallel rank's share of each row (DatasetReader.read_row); None: all of it
        self.held = held
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="eagle3-fetch")
        self.pending: list[tuple[tuple[int, int], Future]] = []  # oldest first, at most `depth`
        # the step's row, one spare, `depth` queued: a read never lands in the row the caller holds
        self.buffers: list[dict | None] = [None] * (depth + 2)
        self.turn = 0  # the buffer the next read fills (used on the worker thread only)

    def fetch(self, sample_ids: list[int], filler_id: int) -> tuple[dict, bool]:
        """The packed row of `sample_ids`; (row, real). An empty assignment becomes a zero-weight filler row
        (what Trainer.fetch_row returns, read without the per-sample copies)."""
        real = bool(sample_ids)
        ids = sample_ids if real else [filler_id]
        slot, self.turn = self.turn, (self.turn + 1) % len(self.buffers)
        row = self.reader.read_row(
            ids, self.max_seq_len, pin_memory=self.pin_memory, out=self.buffers[slot], held=self.held
        )
        self.buffers[slot] = row
        if not bool(row["loss_mask"].any()):
            real = False  # nothing supervised (all prompt): the loss is 0, the step keeps ranks in step
        return row, real

    def scheduled(self, key: tuple[int, int]) -> bool:
        return any(k == key for k, _ in self.pending)

    def schedule(self, key: tuple[int, int], sample_ids: list[int], filler_id: int) -> None:
        """Queue the read of an upcoming step's row; at most `depth` are queued (the oldest is dropped)."""
        if len(self.pending) >= self.depth:
            self.pending.pop(0)[1].cancel()
        self.pending.append((key, self.pool.submit(self.fetch, sample_ids, filler_id)))

    def get(self, key: tuple[int, int], sample_ids: list[int], filler_id: int) -> tuple[dict, bool]:
        while self.pending:
            queued, future = self.pending.pop(0)
            if queued == key:
                return future.result()
            future.cancel()  # a stale read (another position): dropped
        # Not prefetched (the first step, a resume): read it now, on the same thread, after any stale read.
        return self.pool.submit(self.fetch, sample_ids, filler_id).result()

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)
        self.reader.close()
        self.buffers = [None] * len(self.buffers)
