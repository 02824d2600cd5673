"""Options of the Ray launcher (the training options live in ``chimera.config``).

    launch = LaunchConfig(address="auto", placement="spread", pre_cmd=("nvidia-smi -L",))
    launch.check()     # raises ConfigError with what to change, before Ray starts
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass

from chimera.config import ConfigError

PLACEMENTS = ("pack", "spread", "stage-pairs")


@dataclass(frozen=True)
class LaunchConfig:
    """Where and how the workers start.

    Attributes:
        address: None starts a local Ray on loopback; ``"auto"`` or ``host:port`` joins a cluster.
        placement: ``pack``, ``spread`` or ``stage-pairs`` (``ray_launch.placement``).
        pre_cmd: shell commands run once on every node before training.
        env: ``KEY=VALUE`` for the workers (NCCL_*/GLOO_* of the driver are passed on anyway).
        ship_code: ship chimera's code with Ray's runtime_env (None: when joining a cluster).
        connect_timeout_s: joining the cluster and reserving the workers' resources.
    """

    address: str | None = None
    placement: str = "pack"
    pre_cmd: tuple[str, ...] = ()
    env: tuple[str, ...] = ()
    ship_code: bool | None = None
    connect_timeout_s: float = 60.0

    def check(self) -> LaunchConfig:
        """Raise :class:`ConfigError` naming the flag to change; return self."""
        if self.placement not in PLACEMENTS:
            raise ConfigError(f"--placement must be one of {', '.join(PLACEMENTS)}, got {self.placement!r}")
        bad_env = [e for e in self.env if "=" not in e or not e.split("=", 1)[0]]
        if bad_env:
            raise ConfigError(f"--env takes KEY=VALUE, got {bad_env[0]!r}")
        if self.connect_timeout_s <= 0:
            raise ConfigError(f"--connect-timeout must be > 0 seconds, got {self.connect_timeout_s}")
        return self


def add_launch_args(p: argparse.ArgumentParser) -> None:
    """The launcher's flags."""
    d = LaunchConfig()
    p.add_argument("--address", default=None,
                   help="Ray cluster to join ('auto' or host:port); default: start a local Ray on loopback")
    p.add_argument("--placement", default=d.placement, choices=PLACEMENTS,
                   help="pack: neighbours share a node; spread: round-robin; stage-pairs: pairs (0,1),(2,3).. per node")
    p.add_argument("--pre-cmd", action="append", default=[], help="shell command run once on every node first "
                   "(repeatable)")
    p.add_argument("--env", action="append", default=[], help="KEY=VALUE for the workers, e.g. "
                   "NCCL_SOCKET_IFNAME=eth0 (repeatable)")
    p.add_argument("--ship-code", dest="ship_code", action="store_true", default=None,
                   help="ship chimera's code to the workers with runtime_env (default when --address is given)")
    p.add_argument("--no-ship-code", dest="ship_code", action="store_false")
    p.add_argument("--connect-timeout", dest="connect_timeout_s", type=float, default=d.connect_timeout_s,
                   help="seconds to join the Ray cluster and reserve the workers' resources")


def launch_from_args(ns: argparse.Namespace) -> LaunchConfig:
    """The launch options of parsed flags."""
    names = {f.name for f in dataclasses.fields(LaunchConfig)}
    kw = {k: v for k, v in vars(ns).items() if k in names}
    for key in ("pre_cmd", "env"):
        kw[key] = tuple(kw.get(key) or ())
    return LaunchConfig(**kw)
