"""Profiles taken for planning inside a run (``--partition planned``, ``--schedule auto``, ``--plan auto``): a brief
profile of the model as the workers will run it (device, threads per worker, as many processes at once as workers
share the machine), kept in ``profiles/`` and reused while it matches the model, device, library versions, threads
and sizes::

    prof = cached_profile(chain, [4], "cpu", threads=1, concurrent=sharing(4, "cpu"))
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from tqdm import tqdm

from chimera.profile import CommProfile, Profile, ProfileError
from chimera.profile.comm import measure_comm_local
from chimera.profile.layers import profile_chain

PROFILE_DIR = Path("profiles")


def sharing(world: int, device: str) -> int:
    """How many processes to profile at once: on CPU every worker (they share the machine's cores, also when
    they outnumber them, and each timing should carry its share), on GPUs 1 (one device each)."""
    return 1 if device == "cuda" else max(1, world)


def trust_note(profile: Profile, workers: int, nodes: int = 1, cores: int | None = None) -> str:
    """How far a plan from ``profile`` for ``workers`` workers on ``nodes`` machines can be trusted: "" when the
    profile was taken as the workers will run, else a sentence saying what differs, which way the step times are
    likely off and the profile command that fixes it.

    On CPU the workers on one machine share its cores (:func:`sharing`): a profile taken by fewer processes at once
    (``chimera profile --concurrent``) timed every layer with more of the machine than a worker will have, so its
    step times come out low (by about workers per machine / processes profiled at once, or more: 2.1-2.2x for
    bert-tiny on 2 workers of a 2-core machine). With as many processes,
    each should also have run the threads a worker will (``cores`` // workers per machine; ``cores``: this
    machine's, by default)."""
    per_machine = -(-workers // max(1, nodes))
    share = sharing(per_machine, profile.device)
    done = f"profile ran {profile.concurrent} process{'es' if profile.concurrent > 1 else ''} at once"
    redo = f"re-profile with chimera profile --concurrent {share}"
    if profile.concurrent < share:
        return (f"{done}; {share} workers will share this machine's cores: step times are likely under-predicted "
                f"(by ~{share / profile.concurrent:.3g}x or more); {redo}")
    if profile.concurrent > share:
        who = (f"each worker has a {profile.device} device of its own" if profile.device != "cpu" else
               f"{share} worker{'s' if share > 1 else ''} will share one machine")
        return f"{done}; {who}: step times are likely over-predicted; {redo}"
    if profile.device != "cpu":
        return ""
    cores = cores or os.cpu_count() or 1
    threads = max(1, cores // share)
    if profile.threads != threads:
        return (f"profile ran {profile.threads} thread(s) per process; each of {share} worker(s) on this {cores}-core "
                f"machine runs {threads} (chimera train's default): step times may be off; {redo} --threads "
                f"{threads}")
    return ""


def profile_path(chain: Any, device: str, threads: int, concurrent: int) -> Path:
    """Where the profile of ``chain`` taken this way is kept."""
    return PROFILE_DIR / f"{chain.name}.{device}.t{threads}.x{concurrent}.profile.json"


def local_comm(world: int, device: str) -> Callable[[], CommProfile] | None:
    """How to measure the links between ``world`` workers on this machine (gloo on CPU), for a planning profile;
    None where one process alone runs (nothing to measure) or on GPUs (one per process, not all here)."""
    if world < 2 or device != "cpu":
        return None
    return lambda: measure_comm_local(world, "gloo", reps=2)


def cached_profile(chain: Any, sizes: Sequence[int], device: str, threads: int, concurrent: int = 1,
                   comm: Callable[[], CommProfile] | None = None, reps: int = 3,
                   progress: Callable[[str], None] | None = None) -> Profile:
    """A profile of ``chain`` at ``sizes`` on ``device`` with ``threads`` threads per process and ``concurrent``
    processes at once: the one kept in ``profiles/`` when it still matches, else a new one (taken and kept).
    ``progress`` (a line printer) makes a new profile show a progress bar over the layers and say where it is kept."""
    path = profile_path(chain, device, threads, concurrent)
    try:
        prof = Profile.load(path).check(chain, device=device)
        if set(sizes) <= set(prof.micro_batch_sizes) and prof.threads == threads:
            if comm is not None and prof.comm is None:  # the layers are still right: measure the links only
                prof = dataclasses.replace(prof, comm=comm())
                prof.save(path)
            return prof
    except ProfileError:
        pass
    desc = (f"profiling {chain.name} for planning (micro-batch sizes {', '.join(map(str, sorted(set(sizes))))}, "
            f"{concurrent} process(es) at once)")
    with tqdm(total=chain.num_layers, desc=desc, unit="layer", disable=progress is None, file=sys.stderr,
              dynamic_ncols=True, leave=False) as bar:
        def advance(done: int, total: int) -> None:
            bar.update(done - bar.n)

        prof = profile_chain(chain, sorted(set(sizes)), device=device, reps=reps, warmup=1, threads=threads,
                             comm=comm() if comm else None, concurrent=concurrent, progress=advance)
    prof.save(path)
    if progress:
        progress(f"profiled {chain.name} ({chain.num_layers} layers) for planning: kept in {path}")
    return prof
