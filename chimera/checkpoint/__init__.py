"""Checkpoint directories and manifests: where a checkpoint lives, what its manifest says, whether it may be
resumed, and which old ones to prune. The runtime writes them (``chimera.runtime.checkpoint``); the compiler
verifies a ``--resume`` target and the Ray layer finds the last one after a lost worker::

    point = resume_point(job, "ckpt")        # the newest complete checkpoint, verified against the job
    prune("ckpt", keep=3)                    # the three newest complete checkpoints stay

Layout of a checkpoint directory ``DIR/step-00000006`` (6 steps done): one file per rank written with
torch.distributed.checkpoint, DCP's ``.metadata``, and ``manifest.json`` (identity, layout, step, optimizer groups,
LR schedule, SHA-256 of every file), written last: a directory without a manifest is an interrupted write.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Any

from chimera.job import Job, ResumePoint

MANIFEST = "manifest.json"
FORMAT = 1


class CheckpointError(ValueError):
    """A checkpoint that is missing, incomplete, corrupt or made for another run; says what differs."""


def identity(job: Job) -> dict[str, Any]:
    """What must match to resume at all: the model (name, parameter counts, shapes), optimizer and seed."""
    return {"model": job.chain.name, "fingerprint": job.chain.fingerprint(), "layers": job.chain.num_layers,
            "optimizer": job.run.optimizer, "seed": job.run.seed}


def layout(job: Job) -> dict[str, Any]:
    """How the layers were spread: a different layout re-partitions (parameters are keyed by layer)."""
    s = job.layout
    return {"schedule": s.schedule, "stages": s.stages, "data_parallel": s.data_parallel, "mode": s.mode,
            "chunks": s.chunks, "micro_batches": s.micro_batches, "micro_batch_size": s.micro_batch_size,
            "stage_layers": [list(x) for x in job.stage_layers]}


def step_dir(root: str | Path, steps_done: int) -> Path:
    return Path(root) / f"step-{steps_done:08d}"


def due(step: int, every: int, steps: int) -> bool:
    """Whether the state after ``step`` is saved: after every ``every``-th step (0: none) and after the last."""
    return step == steps - 1 or (every > 0 and (step + 1) % every == 0)


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


def sha256(path: Path) -> str:
    """The SHA-256 of a file's bytes (hex)."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


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
        if sha256(p / name) != digest:
            raise CheckpointError(f"{p / name} is corrupt (its SHA-256 differs from the manifest's); resume from an "
                                  f"earlier checkpoint: {', '.join(str(c) for c in complete(p.parent) if c != p) or 'none'}")
    return p, manifest


def resume_point(job: Job, path: str) -> ResumePoint:
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
    if step >= job.run.steps:
        raise CheckpointError(f"{p} has {step} steps done and --steps is {job.run.steps}; raise --steps to more "
                              f"than {step}")
    return ResumePoint(str(p.resolve()), step, manifest, manifest["layout"] == layout(job))


def prune(root: str | Path, keep: int) -> list[Path]:
    """Delete the oldest complete checkpoints under ``root`` so that ``keep`` remain (never the newest; ``keep`` 0:
    none deleted). Returns what was deleted."""
    if keep <= 0:
        return []
    done = complete(root)
    old = done[:-keep] if len(done) > keep else []
    for p in old:
        shutil.rmtree(p, ignore_errors=True)
    return old
