"""``chimera profile``: profile a preset's layers (and optionally the communication) for the planner.

    chimera profile --model bert-tiny --micro-batch-sizes 1,2,4,8 --comm local -o profiles/bert-tiny.profile.json
"""

from __future__ import annotations

import argparse
import sys
from typing import Any


def _sizes(text: str) -> list[int]:
    try:
        sizes = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"micro-batch sizes must be >= 1, got {text!r}")
    return sizes


def add_profile_parser(sub: Any) -> None:
    """The ``chimera profile`` subcommand."""
    p = sub.add_parser("profile", help="profile a model's layers (and the communication) for the planner")
    p.add_argument("--model", required=True, help="preset name (bert-tiny, gpt2-small, ...)")
    p.add_argument("--seq-len", type=int, default=None, help="sequence length (default: the preset's)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="device to profile on")
    p.add_argument("--micro-batch-sizes", type=_sizes, default=[1, 2, 4, 8], help="comma-separated, e.g. 1,2,4,8")
    p.add_argument("--reps", type=int, default=5, help="timed repetitions per operation")
    p.add_argument("--warmup", type=int, default=2, help="discarded repetitions before them")
    p.add_argument("--threads", type=int, default=None, help="torch threads while profiling (default: torch's)")
    p.add_argument("--comm", choices=("none", "local", "ray"), default="none",
                   help="also measure communication: local processes or Ray workers")
    p.add_argument("--workers", type=int, default=2, help="processes/workers of the communication probe")
    p.add_argument("--address", default=None, help="with --comm ray: the Ray cluster to join (default: a local Ray)")
    p.add_argument("-o", "--output", default=None, help="profile file (default: profiles/MODEL.profile.json)")
    p.set_defaults(func=cmd_profile)


def cmd_profile(args: argparse.Namespace) -> int:
    """Profile a preset's layers (and optionally the communication); write the profile and print a table."""
    import torch

    from chimera.cli import UsageError
    from chimera.models import PRESETS, build_model
    from chimera.profile import ProfileError
    from chimera.profile.layers import profile_chain

    if args.model not in PRESETS:
        raise UsageError(f"unknown model {args.model!r}; known models: {', '.join(sorted(PRESETS))}")
    if args.reps < 1 or args.warmup < 0 or (args.threads is not None and args.threads < 1) or args.workers < 2:
        raise UsageError("need --reps >= 1, --warmup >= 0, --threads >= 1 and --workers >= 2")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda, but torch sees no GPU here")
    if args.device == "cuda" and args.comm == "local" and torch.cuda.device_count() < args.workers:
        raise UsageError(f"--comm local --device cuda runs one process per GPU: --workers {args.workers} but "
                         f"{torch.cuda.device_count()} GPU(s) here")
    try:
        chain = build_model(args.model, seq_len=args.seq_len)
    except ValueError as e:
        raise UsageError(str(e)) from None
    try:
        comm = _measure_comm(args) if args.comm != "none" else None
        prof = profile_chain(chain, args.micro_batch_sizes, device=args.device, reps=args.reps, warmup=args.warmup,
                             threads=args.threads, comm=comm)
    except (ProfileError, RuntimeError) as e:  # RuntimeError: the Ray probe's RunError
        print(f"error: {e}", file=sys.stderr)
        return 1
    path = prof.save(args.output or f"profiles/{args.model}.profile.json")
    b = prof.micro_batch_sizes[-1]
    print(f"{prof.model} on {prof.device} ({prof.dtype}, {prof.threads} threads), micro-batch size {b}:")
    print(f"{'layer':>5} {'kind':<22} {'params':>10} {'fwd ms':>8} {'bwd ms':>8} {'stash KiB':>10}")
    for layer in prof.layers:
        c = layer.costs[b]
        print(f"{layer.index:>5} {layer.kind[:22]:<22} {layer.params:>10} {c.forward.median_s * 1e3:>8.3f} "
              f"{c.backward.median_s * 1e3:>8.3f} {c.stash_bytes / 1024:>10.1f}")
    if prof.max_micro_batch_size is not None:
        print(f"largest micro-batch size that fits: {prof.max_micro_batch_size}")
    if comm is not None:
        ar = ", ".join(f"{n}: {link.latency_s * 1e6:.0f} us + {link.bandwidth_Bps / 1e9:.2f} GB/s"
                       for n, link in comm.allreduce.items())
        print(f"comm ({comm.where}): p2p {comm.p2p.latency_s * 1e6:.0f} us + {comm.p2p.bandwidth_Bps / 1e9:.2f} GB/s; "
              f"allreduce {ar}")
    print(path)
    return 0


def _measure_comm(args: argparse.Namespace) -> Any:
    if args.comm == "local":
        from chimera.profile.comm import measure_comm_local

        return measure_comm_local(args.workers, "nccl" if args.device == "cuda" else "gloo")
    from ray_launch import keep_local_ray_on_loopback

    keep_local_ray_on_loopback(["--address", args.address] if args.address else [])
    from ray_launch.commprobe import measure_comm_ray
    from ray_launch.config import LaunchConfig

    return measure_comm_ray(args.workers, args.device, LaunchConfig(address=args.address),
                            log=lambda msg: print(msg, file=sys.stderr))
