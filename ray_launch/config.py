"""Options of the Ray layer: where and how the workers start, and how a run survives lost workers. Declared like
the request's sections (``chimera.config.fields``), so the ``[launch]`` table of a config file and the flags of
``chimera train`` come from these declarations.

    launch = LaunchConfig(address="auto", placement="spread", pre_cmd=("nvidia-smi -L",), max_restarts=2,
                          grace_period_s=60)
    launch.check()     # raises ConfigError with what to change, before Ray starts
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from chimera.config import ConfigError, check_section
from chimera.config.fields import option

PLACEMENTS = ("pack", "spread", "stage-pairs")


@dataclass(frozen=True)
class LaunchConfig:
    """Where and how the workers start on Ray, and how often a run restarts after a lost worker."""

    address: str | None = option(None, "Ray cluster to join ('auto' or host:port) (default: start a local Ray on "
                                 "loopback)")
    placement: str = option("pack", "pack: neighbours share a node; spread: round-robin; stage-pairs: pairs (0,1), "
                            "(2,3).. per node", choices=PLACEMENTS)
    pre_cmd: tuple[str, ...] = option((), "shell command run once on every node first (repeatable)")
    env: tuple[str, ...] = option((), "KEY=VALUE for the workers, e.g. NCCL_SOCKET_IFNAME=eth0 (repeatable)")
    ship_code: bool | None = option(None, "ship chimera's code to the workers with runtime_env (default: when "
                                    "--address is given)")
    py_modules: tuple[str, ...] = option((), "your own package or module (a path) shipped to the workers, e.g. what "
                                         "--chain imports (repeatable)")
    connect_timeout_s: float = option(60.0, "seconds to join the Ray cluster and reserve the workers' resources; "
                                      "after a worker stops answering, how long Ray may take to declare its node "
                                      "dead", flag="--connect-timeout", unit="seconds", minimum=0.001)
    max_restarts: int = option(0, "after a lost worker or node, restart from the last checkpoint at most this often, "
                               "on fewer stages when the nodes left cannot host them all (needs --checkpoint-dir)",
                               minimum=0)
    grace_period_s: float = option(25.0, "on SIGTERM: finish the steps in flight and write a checkpoint within this "
                                   "long (needs --checkpoint-dir), then exit with code 75; a second SIGTERM or the "
                                   "time running out stops at once (exit 143)", flag="--grace-period",
                                   unit="seconds", minimum=0.001)

    def check(self) -> LaunchConfig:
        """Raise :class:`ConfigError` naming the flag to change; return self."""
        check_section("launch", self)
        bad_env = [e for e in self.env if "=" not in e or not e.split("=", 1)[0]]
        if bad_env:
            raise ConfigError(f"--env takes KEY=VALUE, got {bad_env[0]!r}")
        missing = [p for p in self.py_modules if not os.path.exists(p)]
        if missing:
            raise ConfigError(f"--py-modules {missing[0]}: no such file or directory; give the path of a package "
                              "directory or a module file")
        return self
