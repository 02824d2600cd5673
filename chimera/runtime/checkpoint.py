"""Checkpoints keyed by layer: save in the background, verify, resume on any D, W or schedule.

A checkpoint is one directory ``DIR/step-00000006`` (6 steps done) written with torch.distributed.checkpoint
(DCP): every rank writes its own file of what it owns, rank 0 writes DCP's ``.metadata``; then rank 0 adds
``manifest.json`` (identity, layout, step, optimizer groups, LR schedule, SHA-256 of every file and, for a chain
made by :func:`chimera.models.decompose.decompose`, its ``source`` record, which :mod:`chimera.export` reads). Keys:

* ``layer{i}.{param}`` and ``optim.layer{i}.{param}.{state}``: parameters and optimizer state of layer ``i``,
  written once (by the replica of the stage in the first pipe of data-parallel group 0; replicas are bitwise
  equal), so a run with another partition loads exactly the layers its stages hold;
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
import hashlib
import json
import os
import shutil
import signal
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

MANIFEST = "manifest.json"
FORMAT = 1


class CheckpointError(ValueError):
    """A checkpoint that is missing, incomplete, corrupt or made for another run; says what differs."""


@dataclass(frozen=True)
class ResumePoint:
    """A verified checkpoint to start from: its directory, the step to run next and its manifest."""

    path: str
    step: int
    manifest: dict[str, Any]
    same_layout: bool  # same schedule, D, W, N and B: every rank gets its own RNG state back


def identity(job: Any) -> dict[str, Any]:
    """What must match to resume at all: the model (name, parameter counts, shapes), optimizer and seed."""
    from chimera.profile.format import fingerprint

    t = job.cfg.training
    return {"model": job.chain.name, "fingerprint": fingerprint(job.chain), "layers": job.chain.num_layers,
            "optimizer": t.optimizer, "seed": t.seed}


def layout(job: Any) -> dict[str, Any]:
    """How the layers were spread: a different layout re-partitions (parameters are keyed by layer)."""
    s = job.cfg.schedule
    return {"schedule": s.name, "stages": s.stages, "data_parallel": s.data_parallel, "mode": s.mode,
            "chunks": s.chunks, "micro_batches": s.micro_batches, "micro_batch_size": s.micro_batch_size,
            "stage_layers": [list(x) for x in job.stage_layers]}


def step_dir(root: str | Path, steps_done: int) -> Path:
    return Path(root) / f"step-{steps_done:08d}"


def partial_dir(root: str | Path, steps_done: int) -> Path:
    return Path(root) / f".step-{steps_done:08d}.partial"


def remove_partial(root: str | Path | None) -> list[Path]:
    """Delete the directories of interrupted writes under ``root`` (before a launch); returns them."""
    if root is None or not Path(root).is_dir():
        return []
    stale = sorted(Path(root).glob(".step-*.partial"))
    for p in stale:
        shutil.rmtree(p, ignore_errors=True)
    return stale


def complete(root: str | Path) -> list[Path]:
    """The complete checkpoints under ``root`` (those with a manifest), oldest first."""
    return sorted(p for p in Path(root).glob("step-*") if (p / MANIFEST).is_file())


def _sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read(path: str | Path) -> tuple[Path, dict[str, Any]]:
    """The checkpoint at ``path`` (a step directory, or a checkpoint root: its latest) and its verified
    manifest; :class:`CheckpointError` names a missing, extra or corrupt file."""
    p = Path(path)
    if not p.is_dir():
        raise CheckpointError("no such directory")
    if not (p / MANIFEST).is_file():
        found = complete(p)
        if not found:
            raise CheckpointError(f"no complete checkpoint in {p} (none has a {MANIFEST}; an interrupted write "
                                  "leaves none)")
        p = found[-1]
    try:
        manifest = json.loads((p / MANIFEST).read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{p / MANIFEST} is unreadable: {e}") from None
    if manifest.get("format") != FORMAT:
        raise CheckpointError(f"{p} has checkpoint format {manifest.get('format')}, this chimera reads {FORMAT}")
    files = manifest["files"]
    on_disk = {f.name for f in p.iterdir() if f.name != MANIFEST}
    missing, extra = sorted(set(files) - on_disk), sorted(on_disk - set(files))
    if missing or extra:
        raise CheckpointError(f"{p}: files {'missing: ' + str(missing) if missing else ''}"
                              f"{' unexpected: ' + str(extra) if extra else ''} (not the checkpoint the manifest lists)")
    for name, digest in sorted(files.items()):
        if _sha256(p / name) != digest:
            raise CheckpointError(f"{p / name} is corrupt (its SHA-256 differs from the manifest's); resume from an "
                                  f"earlier checkpoint: {', '.join(str(c) for c in complete(p.parent) if c != p) or 'none'}")
    return p, manifest


def resume_point(job: Any, path: str) -> ResumePoint:
    """Verify the checkpoint at ``path`` against ``job``: refused (with what differs) when it is another model,
    optimizer or seed, or leaves no step to run; a different layout is fine (re-partitioned by layer)."""
    p, manifest = read(path)
    want = identity(job)
    diff = [f"{k}: checkpoint {manifest['identity'].get(k)!r}, this run {v!r}" for k, v in want.items()
            if manifest["identity"].get(k) != v]
    if diff:
        raise CheckpointError(f"{p} was made by another run ({'; '.join(diff)}); resume with the same model, "
                              "optimizer and seed, or start without --resume")
    step = manifest["step"]
    if step >= job.cfg.training.steps:
        raise CheckpointError(f"{p} has {step} steps done and --steps is {job.cfg.training.steps}; raise --steps")
    return ResumePoint(str(p.resolve()), step, manifest, manifest["layout"] == layout(job))


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
    reader = dcp.FileSystemReader(str(p))
    saved = reader.read_metadata().state_dict_metadata
    out = {k: torch.empty(md.size, dtype=md.properties.dtype) for k, md in saved.items() if hasattr(md, "size")}
    with warnings.catch_warnings():  # DCP warns that it loads in one process, which is the intent here
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(out, storage_reader=reader, no_dist=True)
    return out


class Checkpointer:
    """One worker's side of saving and restoring (module docstring)."""

    def __init__(self, job: Any, rank: int, worker: int, dp_rank: int, stages: Any, device: torch.device) -> None:
        self.job, self.rank, self.stages, self.device = job, rank, stages, device
        t = job.cfg.training
        self.root, self.every, self.steps = t.checkpoint_dir, t.checkpoint_every, t.steps
        first_pipe = job.schedule.pipes[0]
        self.owns = lambda key: dp_rank == 0 and key[0] == first_pipe
        self.group = dist.new_group(backend="gloo")  # DCP's collectives, apart from the pipeline's
        self.thread: threading.Thread | None = None
        self.error: BaseException | None = None
        self.kill_at = t.debug_kill_in_save

    # -- saving ------------------------------------------------------------------------------------------
    def due(self, step: int) -> bool:
        """Whether the state after ``step`` is saved: every ``--checkpoint-every`` steps, and after the last."""
        if self.root is None:
            return False
        return step == self.steps - 1 or (self.every > 0 and (step + 1) % self.every == 0)

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

    def _copy(self) -> dict[str, Any]:
        state: dict[str, Any] = {}
        opt = self.stages.optimizer.state
        for key, p in _layer_params(self.stages, self.owns):
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
            dcp.save(state, storage_writer=dcp.FileSystemWriter(str(tmp)), process_group=self.group)
            if manifest is None:
                return
            if self.kill_at == steps_done - 1:  # fault injection: die with the data written, before the manifest
                os.kill(os.getpid(), signal.SIGKILL)
            manifest["files"] = {f.name: _sha256(f) for f in sorted(tmp.iterdir())}
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
        reader = dcp.FileSystemReader(point.path)
        saved = reader.read_metadata().state_dict_metadata
        params = _layer_params(self.stages)
        missing = sorted({k for k, _ in params if k not in saved})
        if missing:
            raise CheckpointError(f"{point.path} has no {missing[:3]}: not a checkpoint of this model")
        target: dict[str, Any] = {}
        for key, p in params:
            target[key] = p.detach()
            for name, md in saved.items():
                if name.startswith(f"optim.{key}.") and name.count(".") == key.count(".") + 2:
                    target[name] = torch.empty(md.size, dtype=md.properties.dtype)
        rng = [f"rng.rank{self.rank}.cpu"] + ([f"rng.rank{self.rank}.cuda"] if self.device.type == "cuda" else [])
        if point.same_layout:
            for k in rng:
                target[k] = torch.empty(saved[k].size, dtype=saved[k].properties.dtype)
        with torch.no_grad():
            dcp.load(target, storage_reader=reader, process_group=self.group)
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


def check_checkpoints(job: Any) -> Any:
    """Make the checkpoint paths absolute (workers may run elsewhere) and check a checkpoint to resume from."""
    t = job.cfg.training
    if t.checkpoint_dir is None and t.resume is None:
        return job
    import dataclasses

    from chimera.validation import ConfigError

    ckpt = os.path.abspath(t.checkpoint_dir) if t.checkpoint_dir else None
    cfg = dataclasses.replace(job.cfg, training=dataclasses.replace(t, checkpoint_dir=ckpt))
    job = dataclasses.replace(job, cfg=cfg)
    if t.resume is None:
        return job
    try:
        return dataclasses.replace(job, resume=resume_point(job, t.resume))
    except CheckpointError as e:
        raise ConfigError(f"--resume {t.resume}: {e}") from None
