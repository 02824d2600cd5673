"""Checkpoints keyed by layer, the runtime's side: save in the background, restore on any D, W or schedule
(directories, manifests and pruning: :mod:`chimera.checkpoint`).

A checkpoint is one directory ``DIR/step-00000006`` (6 steps done) written with torch.distributed.checkpoint
(DCP): every rank writes its own file of what it owns, rank 0 writes DCP's ``.metadata``; then rank 0 adds
``manifest.json`` (identity, layout, step, optimizer groups, LR schedule, SHA-256 of every file and, for a chain
made by :func:`chimera.models.decompose.decompose`, its ``source`` record, which :mod:`chimera.export` reads). Keys:

* ``layer{i}.{param}`` and ``optim.layer{i}.{param}.{state}``: parameters and optimizer state of layer ``i``,
  written once (by the replica of the stage in the first pipe of data-parallel group 0; replicas are bitwise
  equal), so a run with another partition loads exactly the layers its stages hold; with the optimizer state
  sharded (``--shard-optimizer``) each parameter's state is written by the rank that owns it and read back by the
  rank that owns it in the resumed run (the keys are the same: sharded and unsharded runs resume each other);
* ``rng.rank{r}.cpu`` / ``.cuda``: every rank's RNG states (restored when the layout is the same);
* the data position is the step itself: the data are addressed by (step, micro-batch, data-parallel rank).

Atomicity: the files go to ``DIR/.step-00000006.partial``; only once every rank's file is written and synced does
rank 0 write the manifest (last, synced) and rename the directory into place, so an interrupted write never
replaces the last good checkpoint (launchers remove stale ``.partial`` directories before starting).

Saving stalls the step only for a copy of the state to the CPU; a background thread writes it (the next save
waits for the previous one). DCP's collectives run on a process group of their own, so they never interleave
with the pipeline's.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from chimera.checkpoint import (
    FORMAT,
    MANIFEST,
    CheckpointError,
    due,
    identity,
    layout,
    partial_dir,
    prune,
    read,
    sha256,
    step_dir,
)
from chimera.job import Job, ResumePoint


def _dcp() -> Any:
    """torch.distributed.checkpoint, imported on first use: it costs ~0.65 s of imports (sympy, DTensor) that a
    worker of a run without checkpoints would pay at every start."""
    import torch.distributed.checkpoint as dcp

    return dcp


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _layer_params(stages: Any, keep: Callable[[tuple[str, int]], bool] = lambda key: True
                  ) -> list[tuple[str, torch.nn.Parameter]]:
    """(key, parameter) of every layer in the worker's stage replicas ``(pipe, stage)`` that ``keep`` accepts."""
    out = []
    for key, mod in stages.modules.items():
        if not keep(key):
            continue
        for i, layer in zip(mod.indices, mod.layers):
            for name, p in layer.named_parameters(remove_duplicate=False):
                out.append((f"layer{i}.{name}", p))
    return out


def load(path: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint (a step directory or a root: its latest), verified, on the CPU, by key."""
    p, _ = read(path)
    reader = _dcp().FileSystemReader(str(p))
    saved = reader.read_metadata().state_dict_metadata
    out = {k: torch.empty(md.size, dtype=md.properties.dtype) for k, md in saved.items() if hasattr(md, "size")}
    with warnings.catch_warnings():  # DCP warns that it loads in one process, which is the intent here
        warnings.simplefilter("ignore", UserWarning)
        _dcp().load(out, storage_reader=reader, no_dist=True)
    return out


class Checkpointer:
    """One worker's side of saving and restoring (module docstring)."""

    def __init__(self, job: Job, rank: int, worker: int, dp_rank: int, stages: Any, device: torch.device) -> None:
        self.job, self.rank, self.stages, self.device = job, rank, stages, device
        c = job.checkpoint
        self.root, self.every, self.steps, self.keep = c.dir, c.every, job.run.steps, c.keep_last
        first_pipe = job.schedule.pipes[0]
        self.owns = lambda key: dp_rank == 0 and key[0] == first_pipe
        self.group = dist.new_group(backend="gloo")  # DCP's collectives, apart from the pipeline's
        self.thread: threading.Thread | None = None
        self.error: BaseException | None = None
        self.kill_at = c.debug_kill_in_save

    # -- saving ------------------------------------------------------------------------------------------
    def due(self, step: int) -> bool:
        """Whether the state after ``step`` is saved: every ``--checkpoint-every`` steps, and after the last."""
        return self.root is not None and due(step, self.every, self.steps)

    def after_step(self, step: int) -> float:
        """Save the state after ``step`` when due: copy it to the CPU here, write it in a background thread.
        Returns the seconds the step was held (the copy, and waiting for a previous write still running)."""
        if not self.due(step):
            return 0.0
        t0 = time.perf_counter()
        self.wait()
        state = self._copy()
        manifest = self._manifest(step + 1) if self.rank == 0 else None
        self.thread = threading.Thread(target=self._write, args=(step + 1, state, manifest), daemon=True,
                                       name=f"checkpoint-{step + 1}")
        self.thread.start()
        held = time.perf_counter() - t0
        if step == self.steps - 1:
            self.wait()
        return held

    def save_now(self, step: int) -> str:
        """Save the state after ``step`` now, whether due or not (the last step a stopped run finished), and wait
        until it is written; returns its directory. Every rank calls it (the write is collective)."""
        if self.root is None:
            raise RuntimeError(f"worker {self.rank}: no --checkpoint-dir to save to")
        if not self.due(step):  # a due step's save is already under way
            self.wait()
            state = self._copy()
            self._write(step + 1, state, self._manifest(step + 1) if self.rank == 0 else None)
        self.wait()
        return str(step_dir(self.root, step + 1))

    def _copy(self) -> dict[str, Any]:
        state: dict[str, Any] = {}
        opt = self.stages.optimizer.state
        sharded = self.stages.sharded is not None  # the state of a parameter lives on its owner alone, saved there
        written = {key for key, _ in _layer_params(self.stages, self.owns)}
        for key, p in _layer_params(self.stages, lambda replica: sharded or self.owns(replica)):
            if key in written:
                state[key] = p.detach().to("cpu", copy=True)
            for k, v in opt.get(p, {}).items():
                if isinstance(v, torch.Tensor):
                    state[f"optim.{key}.{k}"] = v.detach().to("cpu", copy=True)
        state[f"rng.rank{self.rank}.cpu"] = torch.get_rng_state()
        if self.device.type == "cuda":
            state[f"rng.rank{self.rank}.cuda"] = torch.cuda.get_rng_state(self.device)
        return state

    def _manifest(self, steps_done: int) -> dict[str, Any]:
        groups = [{k: v for k, v in g.items() if k != "params"} for g in self.stages.optimizer.param_groups]
        sched = {k: v for k, v in self.stages.lr_schedule.state_dict().items() if k != "lr_lambdas"}
        source = getattr(self.job.chain, "source", None)  # a decomposed model's original names (chimera.export)
        return {"format": FORMAT, "step": steps_done, "identity": identity(self.job), "layout": layout(self.job),
                "optimizer_groups": groups, "lr_schedule": sched, "world_size": self.job.world_size,
                **({"source": source} if source is not None else {})}

    def _write(self, steps_done: int, state: dict[str, Any], manifest: dict[str, Any] | None) -> None:
        try:
            tmp = partial_dir(self.root, steps_done)
            dcp = _dcp()
            dcp.save(state, storage_writer=dcp.FileSystemWriter(str(tmp)), process_group=self.group)
            if manifest is None:
                return
            if self.kill_at == steps_done - 1:  # fault injection: die with the data written, before the manifest
                os.kill(os.getpid(), signal.SIGKILL)
            manifest["files"] = {f.name: sha256(f) for f in sorted(tmp.iterdir())}
            for f in tmp.iterdir():
                _fsync(f)
            (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
            _fsync(tmp / MANIFEST)
            _fsync(tmp)
            final = step_dir(self.root, steps_done)
            if final.exists():  # an earlier run's checkpoint of the same step, replaced as a whole
                shutil.rmtree(final)
            os.replace(tmp, final)
            _fsync(Path(self.root))
            prune(self.root, self.keep)  # only once the new one is complete: the newest is never deleted
        except BaseException as e:  # raised in the training thread by wait()
            self.error = e

    def wait(self) -> None:
        """Wait for the write in progress; raise its error, if any."""
        if self.thread is not None:
            self.thread.join()
            self.thread = None
        if self.error is not None:
            err, self.error = self.error, None
            raise RuntimeError(f"worker {self.rank}: writing a checkpoint under {self.root} failed: {err}") from err

    # -- restoring ---------------------------------------------------------------------------------------
    def restore(self, point: ResumePoint) -> None:
        """Load the parameters and optimizer state of this worker's layers, the optimizer groups, the LR schedule
        and (same layout) this rank's RNG states from ``point``."""
        reader = _dcp().FileSystemReader(point.path)
        saved = reader.read_metadata().state_dict_metadata
        params = _layer_params(self.stages)
        missing = sorted({k for k, _ in params if k not in saved})
        if missing:
            raise CheckpointError(f"{point.path} has no {missing[:3]}: not a checkpoint of this model")
        target: dict[str, Any] = {}
        owned = {id(p) for p in self.stages.sharded.owned} if self.stages.sharded else None
        for key, p in params:
            target[key] = p.detach()
            if owned is not None and id(p) not in owned:  # sharded: another rank keeps its state
                continue
            for name, md in saved.items():
                if name.startswith(f"optim.{key}.") and name.count(".") == key.count(".") + 2:
                    target[name] = torch.empty(md.size, dtype=md.properties.dtype)
        rng = [f"rng.rank{self.rank}.cpu"] + ([f"rng.rank{self.rank}.cuda"] if self.device.type == "cuda" else [])
        if point.same_layout:
            for k in rng:
                target[k] = torch.empty(saved[k].size, dtype=saved[k].properties.dtype)
        with torch.no_grad():
            _dcp().load(target, storage_reader=reader, process_group=self.group)
        opt = self.stages.optimizer
        for key, p in params:
            state = {name.rsplit(".", 1)[1]: (t if name.endswith(".step") else t.to(p.device))
                     for name, t in target.items() if name.startswith(f"optim.{key}.")}
            if state:
                opt.state[p] = state
        for group, saved_group in zip(opt.param_groups, point.manifest["optimizer_groups"]):
            group.update({k: tuple(v) if isinstance(v, list) else v for k, v in saved_group.items()})
        self.stages.lr_schedule.load_state_dict(dict(point.manifest["lr_schedule"], lr_lambdas=[None]))
        if point.same_layout:
            torch.set_rng_state(target[rng[0]])
            if len(rng) > 1:
                torch.cuda.set_rng_state(target[rng[1]], self.device)

    def close(self) -> None:
        """Wait for a write in progress (errors are not raised again here)."""
        with contextlib.suppress(Exception):
            self.wait()
