"""The largest micro-batch size that fits on a device: whole-chain forward+backward probes, each in a fresh process.

An out-of-memory error can leave a process's allocator (and a CUDA context) in a state that makes the next
attempt fail or pass wrongly, so every probe runs in its own process, started from the forkserver the local
launcher uses, with the chain pickled by cloudpickle::

    probe = probe_max_micro_batch_size(build_model("bert-base"), 8, device="cuda")
    probe.max_micro_batch_size, probe.device_memory_bytes, probe.probes   # probes: (size, fits, pid)

The probe measures the model's forward and backward (parameters, gradients, activations); optimizer state is
not allocated (a profile's ``optimizer_bytes`` carries it per layer).
"""

from __future__ import annotations

import os
import queue
import time
import traceback
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import cloudpickle
import torch

from chimera.microbatch import map_tensors, repeated
from chimera.models.chain import LayerChain
from chimera.models.stage import SequentialModel
from chimera.profile.format import ProfileError
from chimera.util.processes import forkserver_context, main_not_rerun


@dataclass
class MemoryProbe:
    """The largest size that fitted (None: not even 1), the device's memory and every probe's (size, fits, pid)."""

    max_micro_batch_size: int | None
    device_memory_bytes: int | None
    probes: list[tuple[int, bool, int]] = field(default_factory=list)


def largest_fitting(fits: Callable[[int], bool], start: int, *, limit: int = 1 << 16, refine: int = 2) -> int | None:
    """The largest size for which ``fits`` holds: doubling from ``start`` (halving when ``start`` does not fit),
    then ``refine`` bisection steps between the last size that fitted and the first that did not."""
    if fits(start):
        lo, hi = start, None
        while lo * 2 <= limit:
            if not fits(lo * 2):
                hi = lo * 2
                break
            lo *= 2
        if hi is None:
            return lo
    else:
        lo, hi = start // 2, start
        while lo >= 1 and not fits(lo):
            lo, hi = lo // 2, lo
        if lo < 1:
            return None
    for _ in range(refine):
        mid = (lo + hi) // 2
        if mid in (lo, hi):
            break
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def probe_max_micro_batch_size(chain: LayerChain, start: int, *, device: str = "cuda", seed: int = 0,
                               amp: bool = True, limit: int = 1 << 16, refine: int = 2, timeout_s: float = 600.0
                               ) -> MemoryProbe:
    """Search the largest micro-batch size whose forward+backward of the whole chain fits on ``device``, one
    fresh process per probed size. Any error other than running out of memory is raised as ProfileError."""
    packed = cloudpickle.dumps(chain)
    ctx = forkserver_context()
    result = MemoryProbe(None, None)

    def fits(size: int) -> bool:
        out = ctx.Queue()
        proc = ctx.Process(target=_probe_main, args=(packed, size, device, seed, amp, out), daemon=True)
        with main_not_rerun():
            proc.start()
        try:
            kind, payload, memory, pid = _answer(out, proc, size, timeout_s)
        finally:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=5)
        if kind == "error":
            raise ProfileError(f"the memory probe at micro-batch size {size} failed: {payload}")
        result.device_memory_bytes = memory
        result.probes.append((size, kind == "ok", pid))
        return kind == "ok"

    result.max_micro_batch_size = largest_fitting(fits, start, limit=limit, refine=refine)
    return result


def _answer(out: Any, proc: Any, size: int, timeout_s: float) -> tuple[str, str, int | None, int]:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return out.get(timeout=1.0)
        except queue.Empty:
            if proc.exitcode is not None:
                raise ProfileError(f"the memory probe at micro-batch size {size} exited with code {proc.exitcode} "
                                   "without an answer") from None
            if time.monotonic() > deadline:
                raise ProfileError(f"the memory probe at micro-batch size {size} gave no answer within "
                                   f"{timeout_s:g} s") from None


def _probe_main(packed: bytes, size: int, device: str, seed: int, amp: bool, out: Any) -> None:
    """In a fresh process: forward and backward of the whole chain at ``size``; report ok / oom / error."""
    pid = os.getpid()
    memory = None
    try:
        chain: LayerChain = cloudpickle.loads(packed)
        dev = torch.device(device)
        if dev.type == "cuda":
            memory = torch.cuda.get_device_properties(dev).total_memory
        model = SequentialModel(chain, seed, dev)
        inputs, labels = map_tensors(lambda t: t.to(dev), repeated(chain.example, size))
        autocast = torch.autocast("cuda", dtype=torch.bfloat16) if amp and dev.type == "cuda" else nullcontext()
        with autocast:
            loss = model(inputs, labels)
        loss.backward()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        out.put(("ok", "", memory, pid))
    except BaseException as e:  # reported to the parent: oom (does not fit) or an error it raises
        kind = "oom" if is_out_of_memory(e) else "error"
        out.put((kind, f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=4)}", memory, pid))


def is_out_of_memory(e: BaseException) -> bool:
    """Whether ``e`` says the device ran out of memory (also cuBLAS/cuDNN allocation failures)."""
    text = str(e)
    return isinstance(e, torch.OutOfMemoryError) or (isinstance(e, RuntimeError) and (
        "out of memory" in text or "ALLOC_FAILED" in text))
