"""Host memory behaviour shared by the runtime's workers and the profiler, so that both allocate (and collect
garbage) alike."""

from __future__ import annotations

import gc
import time


def keep_freed_memory() -> None:
    """Stop glibc from handing freed activation memory back to the kernel after every micro-batch.

    With glibc's defaults, tensors above the (dynamic) mmap threshold are mmap'ed and munmap'ed one by one
    and the heap top is trimmed, so every forward after a backward page-faults fresh, zeroed pages: in 1F1B
    on CPU that cost ~3,000 minor faults per action on BERT-tiny's head stage (+20 % step time over GPipe,
    which frees in bulk). Keeping allocations up to 32 MiB on the heap and never trimming it lets the next
    micro-batch reuse the pages, as a caching allocator does on GPU.

    A thread other than the main one (a Ray actor with concurrency groups runs its tasks on one) allocates from
    its own arena, whose extra heaps glibc unmaps as soon as they are empty, whatever the trim threshold: there,
    a step that needs a second heap mapped and unmapped it every time (BERT-tiny under Ray: ~25,000 minor faults
    a second on one rank, none in the same job without Ray). A top pad of a whole heap (64 MiB: address space,
    no pages until touched) keeps them. No-op where glibc's mallopt is absent.
    """
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        m_trim_threshold, m_top_pad, m_mmap_threshold = -1, -2, -3
        libc.mallopt(m_mmap_threshold, 32 * 2**20)
        libc.mallopt(m_trim_threshold, 2**30)
        libc.mallopt(m_top_pad, 64 * 2**20)
    except (OSError, AttributeError):
        pass


class StepCollector:
    """Python's garbage collector run between steps, never inside one (``--python-gc step``).

    A worker process holds some 300,000 Python objects (torch, Ray's actor machinery, the stage modules). The
    automatic collector scans all of them in a full collection, which the allocation churn of autograd sets off
    every few steps at a random point: measured here, 0.2 s of one worker's CPU per collection, on the critical
    path of a step that then runs 10-30 % slower than its neighbours (and the young collections add ~25 % to the
    Python time of every small action). :meth:`start` collects once and freezes what set-up built (never scanned
    again: it lives as long as the worker) and switches automatic collection off; :meth:`after_step` collects
    the garbage of the step that ended (the young objects only: ~2 ms for 20,000 of them). ``enabled=False``
    (``--python-gc auto``) leaves Python's collector as it is. Usage::

        with StepCollector() as gc_between_steps:
            for step in steps:
                run(step)
                gc_between_steps.after_step()
    """

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self.was_enabled: bool | None = None  # set while started

    def start(self) -> StepCollector:
        """Collect, freeze the heap built so far, and switch automatic collection off (when enabled)."""
        if self.enabled and self.was_enabled is None:
            self.was_enabled = gc.isenabled()
            gc.collect()
            gc.freeze()
            gc.disable()
        return self

    def after_step(self) -> float:
        """Collect the garbage of the step that ended; returns the seconds it took (0 when not started)."""
        if self.was_enabled is None:
            return 0.0
        t = time.perf_counter()
        gc.collect()
        return time.perf_counter() - t

    def close(self) -> None:
        """Give the process its automatic collector back, as it was before :meth:`start`."""
        if self.was_enabled is None:
            return
        gc.unfreeze()
        if self.was_enabled:
            gc.enable()
        self.was_enabled = None

    def __enter__(self) -> StepCollector:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
