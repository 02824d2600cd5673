"""Per-layer profiles (Harmony-style): every layer timed alone, on its real input, at several micro-batch sizes.

The chain's example micro-batch is resized to each size by repeating its rows (so token ids and masks stay
valid); the chain runs forward layer by layer, and each layer is timed on the input it actually receives::

    from chimera.models import build_model
    from chimera.profile.layers import profile_chain

    prof = profile_chain(build_model("bert-tiny", seq_len=128), [1, 2, 4, 8], reps=5)
    prof.save("profiles/bert-tiny.profile.json")
    prof.cost(1, 4).forward.median_s            # block 0's forward at micro-batch size 4, seconds

Only one layer's parameters are on the device at a time. Inputs that cross a stage boundary are cast to the
dtypes inferred on the meta device, as the runtime does when it sends them (float32 under autocast too).
"""

from __future__ import annotations

import math
import os
import platform
import sys
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from datetime import UTC, datetime
from typing import Any

import cloudpickle
import numpy as np
import torch
from torch import nn

import chimera
from chimera.microbatch import map_tensors, repeated, tensors
from chimera.models.chain import LayerChain, TensorSpec, as_tuple, call
from chimera.profile.comm import measure_host_links
from chimera.profile.format import (
    CommProfile,
    LayerCost,
    LayerProfile,
    Profile,
    ProfileError,
    Timing,
    fingerprint,
)
from chimera.profile.memory import probe_max_micro_batch_size
from chimera.profile.timing import PACE_TIMEOUT_S, evict_caches, measure, optimizer_costs, pace, set_pace
from chimera.util.cores import core_sets, pin_process, usable_cores
from chimera.util.host_memory import StepCollector, keep_freed_memory
from chimera.util.processes import LocalProcesses, forkserver_context

BACKWARDS = {"backward_input": (True, False), "backward_weight": (False, True), "backward": (True, True)}


def profile_chain(chain: LayerChain, micro_batch_sizes: Sequence[int], *, device: str = "cpu", reps: int = 5,
                  warmup: int = 2, seed: int = 0, threads: int | None = None, comm: CommProfile | None = None,
                  amp: bool | None = None, probe_memory: bool = True, concurrent: int = 1,
                  progress: Callable[[int, int], None] | None = None) -> Profile:
    """Profile every layer of ``chain`` at every micro-batch size (module docstring).

    ``amp`` (default: on CUDA) runs forwards under bf16 autocast, as the runtime does with ``amp``. On CUDA the
    largest micro-batch size whose whole-chain forward+backward fits is probed first, each size in a fresh
    process (``probe_memory=False`` skips it); on CPU it is not probed. ``concurrent`` > 1: as that many
    workers will share this machine's cores (and their caches and memory bandwidth), profile in that many
    processes at once, in lock-step (every timed run starts in all of them together), and keep the timings of
    the slowest process: alone, a CPU worker's layers run faster than they will beside the others, and a
    synchronous step waits for its slowest worker (the cores a machine shares out are not equally fast).
    ``threads`` (per process) defaults to torch's alone, and with ``concurrent`` > 1 to this machine's cores
    shared among the processes, as that many workers take them (:func:`chimera.compile.worker_threads`); on CPU
    they are pinned to cores as that many workers' ``--cpu-affinity auto`` pins them. The
    profile records ``concurrent`` (:attr:`Profile.concurrent`), which the planner checks against the workers
    that will share a machine. ``progress(done, total)`` hears every layer profiled (one process's, when
    concurrent). Every optimizer's step is timed ``reps`` times too (at least 3): with 3, the optimizer steps of
    four bert-tiny profiles in a row summed to 7.6–11.5 ms; with 5, to 10.1–10.9.
    """
    if not isinstance(concurrent, int) or concurrent < 1:
        raise ProfileError(f"concurrent must be an integer >= 1 (processes profiled at once), got {concurrent!r}")
    if concurrent > 1:
        threads = threads or max(1, (os.cpu_count() or 1) // concurrent)
        return _concurrently(chain, micro_batch_sizes, concurrent,
                             {"device": device, "reps": reps, "warmup": warmup, "seed": seed, "threads": threads,
                              "comm": comm, "amp": amp, "probe_memory": probe_memory}, progress)
    if not micro_batch_sizes or any(not isinstance(b, int) or b < 1 for b in micro_batch_sizes):
        raise ProfileError(f"micro-batch sizes must be integers >= 1, got {list(micro_batch_sizes)}")
    sizes = sorted(set(micro_batch_sizes))
    if reps < 1 or warmup < 0 or (threads is not None and threads < 1):
        raise ProfileError(f"need reps >= 1, warmup >= 0 and threads >= 1, got {reps}, {warmup}, {threads}")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ProfileError("--device cuda, but torch sees no GPU here; profile on the machine that will train")
    amp = dev.type == "cuda" if amp is None else amp
    notes: list[str] = []
    max_mbs = memory = None
    if dev.type == "cuda" and probe_memory:
        probe = probe_max_micro_batch_size(chain, sizes[-1], device=str(dev), seed=seed, amp=amp)
        max_mbs, memory = probe.max_micro_batch_size, probe.device_memory_bytes
        notes.append(f"max micro-batch size probed (whole chain forward+backward, no optimizer state): "
                     f"{', '.join(f'{b}: {fits}' for b, fits, _ in probe.probes)}")
    else:
        notes.append(f"max_micro_batch_size not probed on {dev.type}")
    if dev.type == "cpu":
        keep_freed_memory()  # allocate as the workers do, or fresh pages cost every timed forward
    old_threads = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    collector = StepCollector().start()  # no collection inside a timed run, as in the workers' steps
    try:
        used_threads = torch.get_num_threads()
        with torch.random.fork_rng(devices=[dev] if dev.type == "cuda" else []):
            torch.manual_seed(seed)
            layers = _profile_layers(chain, sizes, dev, amp, reps, warmup, seed, notes, collector, progress)
        host_in, host_out = measure_host_links(str(dev))
    finally:
        collector.close()
        torch.set_num_threads(old_threads)
    dtype = "bfloat16-autocast" if amp and dev.type == "cuda" else _param_dtype(chain)
    if dev.type == "cuda":
        notes.append(f"device: {torch.cuda.get_device_name(dev)}")
    return Profile(model=chain.name, fingerprint=fingerprint(chain), device=dev.type, dtype=dtype,
                   versions=current_versions(dev.type), threads=used_threads, micro_batch_sizes=sizes, layers=layers,
                   max_micro_batch_size=max_mbs, device_memory_bytes=memory, comm=comm, host_in=host_in,
                   host_out=host_out,
                   created=datetime.now(UTC).isoformat(timespec="seconds"), notes=notes)


def _concurrently(chain: LayerChain, sizes: Sequence[int], n: int, kw: dict[str, Any],
                  progress: Callable[[int, int], None] | None = None) -> Profile:
    """``profile_chain`` in ``n`` processes at once; the profile of the slowest (largest summed timings)."""
    packed = cloudpickle.dumps((chain, list(sizes), kw))
    results: list[dict[str, Any]] = []
    barrier = forkserver_context().Barrier(n)
    # on CPU pinned as n workers' --cpu-affinity auto pins them (chimera.util.cores), so that they share cores alike
    cores = core_sets(usable_cores(), n, kw["threads"]) if kw["device"] == "cpu" else None
    args = [(packed, barrier, rank == 0, cores[rank] if cores else None) for rank in range(n)]  # rank 0 reports progress
    with LocalProcesses(_profile_main, args, ProfileError, "profiling process") as procs:
        for kind, payload in procs.messages(3600, lambda: f"{n - len(results)} of {n} profiles"):
            if kind == "error":
                raise ProfileError(f"concurrent profiling failed: {payload}")
            if kind == "progress":
                if progress is not None:
                    progress(*payload)
                continue
            results.append(payload)
            if len(results) == n:
                procs.finished = True
                break
    totals = [_total_seconds(r) for r in results]
    slowest = int(np.argmax(totals))
    merged = results[slowest]
    merged["concurrent"] = n
    merged["notes"].append(f"profiled in {n} processes at once (as {n} workers share this machine"
                           f"{', each pinned to its cores as they will be' if cores else ''}); the timings of "
                           f"the slowest (totals {', '.join(f'{t:.4f}' for t in totals)} s)")
    return Profile.from_dict(merged)


def _total_seconds(profile: dict[str, Any]) -> float:
    """All of a profile's median timings and optimizer steps, summed (how fast its process ran)."""
    return sum(t["median_s"] for layer in profile["layers"] for cost in layer["costs"].values()
               for t in cost.values() if isinstance(t, dict)) + sum(
        s for layer in profile["layers"] for s in layer["optimizer_s"].values())


def _profile_main(packed: bytes, barrier: Any, report: bool, cpus: frozenset[int] | None, out: Any) -> None:
    set_pace(lambda: barrier.wait(PACE_TIMEOUT_S))
    if cpus is not None:
        pin_process(cpus)
    try:
        chain, sizes, kw = cloudpickle.loads(packed)
        progress = (lambda done, total: out.put(("progress", (done, total)))) if report else None
        out.put(("ok", profile_chain(chain, sizes, progress=progress, **kw).to_dict()))
    except BaseException as e:  # reported to the parent
        out.put(("error", f"{type(e).__name__}: {e}"))


def current_versions(device: str = "cpu") -> dict[str, str]:
    """The library versions a profile depends on (transformers only when it is imported)."""
    out = {"torch": torch.__version__, "chimera": chimera.__version__, "python": platform.python_version()}
    if "transformers" in sys.modules:
        out["transformers"] = sys.modules["transformers"].__version__
    if device == "cuda" and torch.version.cuda:
        out["cuda"] = torch.version.cuda
    return out


def _profile_layers(chain: LayerChain, sizes: list[int], dev: torch.device, amp: bool, reps: int, warmup: int,
                    seed: int, notes: list[str], collector: StepCollector,
                    progress: Callable[[int, int], None] | None = None) -> list[LayerProfile]:
    batches = {b: map_tensors(lambda t: t.to(dev), repeated(chain.example, b)) for b in sizes}
    xs = {b: batches[b][0] for b in sizes}
    autocast = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if amp and dev.type == "cuda" else nullcontext
    out = []
    for i in range(chain.num_layers):
        layer = chain.build_layers([i], seed, dev)[0]
        last = i == chain.num_layers - 1
        costs = {}
        for b in sizes:
            run = LayerRun(layer, xs[b], chain.boundaries(b)[i] if i else None, autocast, dev,
                           (chain.loss, batches[b][1]) if last else None)
            out_specs = None if last else chain.boundaries(b)[i + 1]
            costs[b] = run.cost(reps, warmup, out_specs)
            if out_specs is not None:
                xs[b] = run.next_input(out_specs)
        empty = [k for k in BACKWARDS if getattr(costs[sizes[0]], k).reps == 0]
        if empty:
            notes.append(f"layer {i}: nothing to differentiate for {', '.join(empty)} (timing 0, reps 0)")
        params = list(layer.parameters())
        tied = {}  # the other end of every tied pair this layer holds -> the shared parameter's bytes
        for (k, name_k), (j, name_j) in chain.tied_parameters():
            if i in (k, j):
                tied[j if i == k else k] = _nbytes(layer.get_parameter(name_k if i == k else name_j))
        opt_bytes, opt_s = optimizer_costs(layer, reps=max(3, reps))
        out.append(LayerProfile(i, type(layer).__name__, sum(p.numel() for p in params),
                                sum(_nbytes(p) for p in params), opt_bytes, costs, tied, opt_s))
        del layer
        collector.after_step()
        if progress is not None:
            progress(i + 1, chain.num_layers)
    return out


class LayerRun:
    """One layer at one micro-batch size: its captured input (detached) and how to time it.

    ``specs`` are the input's boundary specs (None for layer 0, which reads the micro-batch's inputs and has no
    input gradient); ``loss`` is ``(loss_fn, labels)`` for the last layer, whose forward includes the loss.
    """

    def __init__(self, layer: nn.Module, x: Any, specs: list[TensorSpec] | None,
                 autocast: Callable[[], AbstractContextManager[Any]], device: torch.device,
                 loss: tuple[Callable[[Any, Any], torch.Tensor], Any] | None = None) -> None:
        self.layer, self.x, self.specs, self.autocast, self.device, self.loss = layer, x, specs, autocast, device, loss
        self.params = [p for p in layer.parameters() if p.requires_grad]
        self._grad_out: list[torch.Tensor] | None = None

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def leaves(self) -> tuple[Any, list[torch.Tensor]]:
        """A fresh alias of the input (leaves with grad where the spec asks) and those needing grad."""
        if self.specs is None:
            return self.x, []
        x = tuple(t.detach().requires_grad_(s.requires_grad and t.is_floating_point()) for t, s in zip(self.x, self.specs))
        return x, [t for t in x if t.requires_grad]

    def forward(self, x: Any) -> Any:
        with self.autocast():
            out = call(self.layer, x)
            return self.loss[0](out, self.loss[1]) if self.loss is not None else out

    def _outputs(self, out: Any) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
        """The tensors a backward starts from and their gradients (random, fixed per run; none for the loss)."""
        if self.loss is not None:
            return [out], None
        outs = [t for t in as_tuple(out) if t.requires_grad]
        if self._grad_out is None:
            gen = torch.Generator().manual_seed(len(outs))
            self._grad_out = [torch.randn(t.shape, generator=gen).to(self.device, t.dtype) for t in outs]
        return outs, self._grad_out

    def start_cold(self) -> None:
        """Before a timed run: evict the caches (in training, other layers ran since this one's weights and
        activations were last touched), wait for the device, then for the concurrent profilers (:func:`pace`)."""
        evict_caches(self.device)
        self.sync()
        pace()

    def time_forward(self) -> float:
        x, _ = self.leaves()
        self.start_cold()
        t0 = time.perf_counter()
        out = self.forward(x)
        self.sync()
        elapsed = time.perf_counter() - t0
        del out  # freed outside the timed region, as the runtime keeps it for the backward
        return elapsed

    def time_recompute(self) -> float:
        """A recomputing backward's forward: under the RNG state the first forward ran with, with grad."""
        x, _ = self.leaves()
        cuda = self.device.type == "cuda"
        state = torch.get_rng_state(), torch.cuda.get_rng_state(self.device) if cuda else None
        self.start_cold()
        t0 = time.perf_counter()
        with torch.random.fork_rng(devices=[self.device] if cuda else []):
            torch.set_rng_state(state[0])
            if state[1] is not None:
                torch.cuda.set_rng_state(state[1], self.device)
            out = self.forward(x)
        self.sync()
        elapsed = time.perf_counter() - t0
        del out
        return elapsed

    def targets(self, inputs: list[torch.Tensor], wrt_input: bool, wrt_weight: bool) -> list[torch.Tensor]:
        return (inputs if wrt_input else []) + (self.params if wrt_weight else [])

    def time_backward(self, wrt_input: bool, wrt_weight: bool) -> float:
        """A fresh forward (not timed), then the gradients w.r.t. the inputs and/or the parameters (timed).

        As in the runtime, the gradients accumulate into ``.grad``, and the parameters' already hold one (as for
        every micro-batch after a step's first), so the timing includes the in-place sum.
        """
        x, inputs = self.leaves()
        outs, grads = self._outputs(self.forward(x))
        targets = self.targets(inputs, wrt_input, wrt_weight)
        if wrt_weight:
            for p in self.params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
        self.start_cold()
        t0 = time.perf_counter()
        torch.autograd.backward(outs, grads, inputs=targets)
        self.sync()
        elapsed = time.perf_counter() - t0
        for t in inputs:  # dropped outside the timed region (the runtime sends them on)
            t.grad = None
        return elapsed

    def stash_bytes(self) -> int:
        """Bytes of the unique storages the autograd graph saves during the forward, parameters excluded."""
        # storages are told apart by their StorageImpl (``_cdata``), which also works on the meta device
        params = {p.untyped_storage()._cdata for p in self.layer.parameters()}
        saved: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            try:
                s = t.untyped_storage()
            except (RuntimeError, NotImplementedError):  # tensors without storage (e.g. some subclasses)
                return t
            if s._cdata not in params and s.nbytes():
                saved[s._cdata] = max(saved.get(s._cdata, 0), s.nbytes())
            return t

        x, _ = self.leaves()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            self.forward(x)
        return sum(saved.values())

    def cost(self, reps: int, warmup: int, out_specs: list[TensorSpec] | None = None) -> LayerCost:
        """Every timing, the stash and the input/output bytes (``out_specs``: the output's boundary specs; None
        for the last layer, whose output bytes are those of what the loss reads)."""
        x, inputs = self.leaves()
        has_outs = bool(self._outputs(self.forward(x))[0])
        timings = {"forward": measure(self.time_forward, reps, warmup),
                   "recompute": measure(self.time_recompute, reps, warmup)}
        for name, (wi, ww) in BACKWARDS.items():
            if has_outs and self.targets(inputs, wi, ww):
                timings[name] = measure(lambda wi=wi, ww=ww: self.time_backward(wi, ww), reps, warmup)
            else:
                timings[name] = Timing(0.0, 0.0, 0)
        if out_specs is not None:
            out_bytes = sum(math.prod(s.shape) * s.dtype.itemsize for s in out_specs)
        else:
            with torch.no_grad(), self.autocast():
                out_bytes = sum(_nbytes(t) for t in tensors(call(self.layer, self.x)))
        return LayerCost(**timings, stash_bytes=self.stash_bytes(),
                         input_bytes=sum(_nbytes(t) for t in tensors(self.x)), output_bytes=out_bytes)

    def next_input(self, specs: list[TensorSpec]) -> tuple[torch.Tensor, ...]:
        """The output (no graph), cast to the dtypes of the boundary specs, as a stage would send it."""
        with torch.no_grad(), self.autocast():
            out = as_tuple(call(self.layer, self.x))
        return tuple(t.detach().to(s.dtype) for t, s in zip(out, specs))


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _param_dtype(chain: LayerChain) -> str:
    dtypes = {p.dtype for p in chain.build_layers([0], 0, "meta")[0].parameters() if p.is_floating_point()}
    return str(dtypes.pop() if len(dtypes) == 1 else torch.get_default_dtype()).removeprefix("torch.")
