"""``chimera profile``: profile a model's layers (and optionally the communication) for the planner.

    chimera profile --model bert-tiny --micro-batch-sizes 1,2,4,8 --comm local -o p.json  # as the probe's 2 workers
    chimera profile --chain mypkg.models:chain --micro-batch-sizes 4 --concurrent 4    # as 4 workers would run
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

from chimera.cli import PROBES
from chimera.cli.common import add_model_args, model_of
from chimera.cli.options import UsageError, add_field, deprecated_alias
from chimera.profile import CommProfile, ProfileError
from chimera.profile.comm import measure_comm_local
from chimera.profile.layers import profile_chain


def _sizes(text: str) -> list[int]:
    try:
        sizes = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"micro-batch sizes must be >= 1, got {text!r}")
    return sizes


def local_probe(args: argparse.Namespace) -> CommProfile:
    """``--comm local``: processes on this machine (``--probe-workers`` of them)."""
    return measure_comm_local(args.probe_workers, "nccl" if args.device == "cuda" else "gloo")


def _probe(name: str) -> Callable[[argparse.Namespace], CommProfile]:
    """The probe registered as ``name`` (:data:`chimera.cli.PROBES`; the Ray layer adds ``ray``)."""
    module, _, function = PROBES[name].partition(":")
    return getattr(importlib.import_module(module), function)


def add_parser(sub: Any, parser_class: type) -> None:
    """The ``chimera profile`` subcommand."""
    p = sub.add_parser("profile", help="profile a model's layers (and the communication) for the planner")
    add_model_args(p)
    add_field(p, "device", default="cpu", help="device to profile on")
    p.add_argument("--micro-batch-sizes", type=_sizes, default=[1, 2, 4, 8],
                   help="comma-separated, e.g. 1,2,4,8 (default: 1,2,4,8)")
    p.add_argument("--reps", type=int, default=5, help="timed repetitions per operation (default: 5)")
    p.add_argument("--warmup", type=int, default=2, help="discarded repetitions before them (default: 2)")
    add_field(p, "threads", default=None, help="torch threads per process while profiling (default: torch's; with "
              "--concurrent N, this machine's cores / N, as N workers take them)")
    p.add_argument("--concurrent", type=int, default=None,
                   help="profile in this many processes at once, as that many workers sharing this machine would "
                        "run (the timings of the slowest are kept; training profiles this way). On CPU give the "
                        "number of workers that will share one machine: chimera plan warns when the profile differs "
                        "(default: on CPU with --comm local, --probe-workers, the workers the rest of the profile "
                        "is measured with; else 1)")
    p.add_argument("--comm", choices=("none", *PROBES), default="none",
                   help="also measure communication: local processes, or Ray workers where the Ray layer is "
                        "installed (default: none)")
    p.add_argument("--probe-workers", type=int, default=2,
                   help="processes or Ray workers of the communication probe (default: 2)")
    deprecated_alias(p, "--workers", "--probe-workers", "probe_workers", type=int)
    p.add_argument("--address", default=None, help="with --comm ray: the Ray cluster to join (default: a local Ray)")
    p.add_argument("-o", "--output", default=None, help="profile file (default: profiles/MODEL.profile.json)")
    p.set_defaults(func=cmd_profile)


def default_concurrent(device: str, comm: str, probe_workers: int) -> int:
    """Processes to profile at once when ``--concurrent`` is not given: on CPU with ``--comm local``, the probe's
    workers (its p2p, allreduce and the runtime's time per action are measured with that many processes of this
    machine running, so the layers are timed as the same workers would run them: one profile, one assumption about
    how many share the cores); else 1."""
    return probe_workers if device == "cpu" and comm == "local" else 1


def cmd_profile(args: argparse.Namespace) -> int:
    """Profile a model's layers (and optionally the communication); write the profile and print a table."""
    if args.reps < 1 or args.warmup < 0 or (args.threads is not None and args.threads < 1) or args.probe_workers < 2 \
            or (args.concurrent is not None and args.concurrent < 1):
        raise UsageError("need --reps >= 1, --warmup >= 0, --threads >= 1, --concurrent >= 1 and --probe-workers >= 2")
    if args.concurrent is None:
        args.concurrent = default_concurrent(args.device, args.comm, args.probe_workers)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda, but torch sees no GPU here")
    if args.device == "cuda" and args.comm == "local" and torch.cuda.device_count() < args.probe_workers:
        raise UsageError(f"--comm local --device cuda runs one process per GPU: --probe-workers {args.probe_workers} "
                         f"but {torch.cuda.device_count()} GPU(s) here")
    chain = model_of(args)
    try:
        comm = _probe(args.comm)(args) if args.comm != "none" else None
        prof = profile_chain(chain, args.micro_batch_sizes, device=args.device, reps=args.reps, warmup=args.warmup,
                             threads=args.threads, comm=comm, concurrent=args.concurrent)
        if args.comm == "local":  # the runtime's own time per action and per step, measured by running it here
            from chimera.calibrate import runtime_costs

            fixed, step_s = runtime_costs(args.probe_workers, args.device, comm.p2p.latency_s if comm else 0.0)
            prof = replace(prof, actions=fixed, step_s=step_s)
    except (ProfileError, RuntimeError) as e:  # RuntimeError: the Ray probe's RunError
        print(f"error: {e}", file=sys.stderr)
        return 1
    path = prof.save(args.output or f"profiles/{chain.name}.profile.json")
    b = prof.micro_batch_sizes[-1]
    print(f"{prof.model} on {prof.device} ({prof.dtype}, {prof.threads} threads, {prof.concurrent} process(es) at "
          f"once), micro-batch size {b}:")
    print(f"{'layer':>5} {'kind':<22} {'params':>10} {'fwd ms':>8} {'bwd ms':>8} {'stash KiB':>10}")
    for layer in prof.layers:
        c = layer.costs[b]
        print(f"{layer.index:>5} {layer.kind[:22]:<22} {layer.params:>10} {c.forward.median_s * 1e3:>8.3f} "
              f"{c.backward.median_s * 1e3:>8.3f} {c.stash_bytes / 1024:>10.1f}")
    if prof.actions:
        print("runtime per action (ms): " + ", ".join(f"{k} {v * 1e3:.3f}" for k, v in prof.actions.items())
              + f"; per step beyond its actions {prof.step_s * 1e3:.3f}")
    if prof.max_micro_batch_size is not None:
        print(f"largest micro-batch size that fits: {prof.max_micro_batch_size}")
    if comm is not None:
        ar = ", ".join(f"{n}: {link.latency_s * 1e6:.0f} us + {link.bandwidth_Bps / 1e9:.2f} GB/s"
                       for n, link in comm.allreduce.items())
        print(f"comm ({comm.where}): p2p {comm.p2p.latency_s * 1e6:.0f} us + {comm.p2p.bandwidth_Bps / 1e9:.2f} GB/s; "
              f"allreduce {ar}")
    if prof.device == "cpu" and prof.concurrent == 1:
        print("profiled in 1 process: K workers sharing this machine's cores run slower; for them profile with "
              "--concurrent K (chimera plan says when the profile and its --workers differ)")
    print(path)
    return 0
