#!/usr/bin/env python3
"""The processes of a Ray head started by scripts/start_ray.sh: find them, list what they listen on, stop them.

Standard library only (shutdown.sh may run it with the system's python3), Linux /proc only.

    python3 scripts/ray_head.py bind-address [ADDRESS|INTERFACE]   # the IPv4 address to bind (127.0.0.1 default)
    python3 scripts/ray_head.py record-session STATE               # after `setsid ray start`: note its session
    python3 scripts/ray_head.py listeners STATE [--loopback-only]  # the head's listening TCP sockets
    python3 scripts/ray_head.py stop STATE [--grace SECONDS]       # SIGTERM, then SIGKILL after the grace

Which processes are the head's: start_ray.sh exports ``CHIMERA_RAY_HEAD=<marker>`` (saved in the STATE file) and
runs ``ray start`` in a new session (``setsid``), whose id ``record-session`` saves too. Every process of the head
(GCS, raylet, dashboard, agents, the Ray client server, workers and the jobs they run) inherits both, and only
those do; the session id survives what the marker may not (a process that rewrites its title over its
environment, a worker orphaned when its raylet stops first). A shell or a ``tail -f`` of the head's logs is never
taken for part of the head. A STATE file of an older start_ray.sh (no marker) falls back to the head's temp dir
in the command lines.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import ipaddress
import json
import os
import signal
import socket
import struct
import sys
import time
from pathlib import Path

MARKER_VAR = "CHIMERA_RAY_HEAD"
LOOPBACK_NAMES = ("", "lo", "lo0", "loopback", "localhost", "127.0.0.1")


class HeadError(RuntimeError):
    """A bad STATE file or bind address; the message says what to change."""


def read_state(path: str) -> dict[str, str]:
    """The STATE file's fields (temp_dir, address, dashboard, marker)."""
    try:
        state = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise HeadError(f"cannot read the state file {path}: {e} (remove it if no chimera Ray runs)") from None
    if not isinstance(state, dict) or not (state.get("marker") or state.get("temp_dir")):
        raise HeadError(f"{path} names neither a marker nor a temp_dir (remove it if no chimera Ray runs)")
    return state


class Proc:
    """What /proc says of one process."""

    def __init__(self, pid: int) -> None:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        self.ppid, self.sid, self.start = int(fields[1]), int(fields[3]), int(fields[19])
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            self.cmd = f.read()
        with open(f"/proc/{pid}/environ", "rb") as f:
            self.env = f.read().split(b"\0")


def _proc_table() -> dict[int, Proc]:
    """Every process this user may read, by pid."""
    table = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                table[int(name)] = Proc(int(name))
            except (OSError, IndexError, ValueError):  # gone, or another user's
                continue
    return table


def _ourselves(table: dict[int, Proc]) -> set[int]:
    """This process and its ancestors (shutdown.sh, start_ray.sh, the user's shell): never part of the head."""
    pids, pid = set(), os.getpid()
    while pid > 1:
        pids.add(pid)
        pid = table[pid].ppid if pid in table else 0
    return pids


def _marked(table: dict[int, Proc], state: dict[str, str]) -> set[int]:
    """Processes carrying the head's marker (or its temp dir in their command line, for an old STATE file)."""
    if state.get("marker"):
        tag = f"{MARKER_VAR}={state['marker']}".encode()
        found = {pid for pid, p in table.items() if tag in p.env}
    else:
        tmp = state["temp_dir"].encode()
        found = {pid for pid, p in table.items() if tmp in p.cmd}
    return found - _ourselves(table)


def head_pids(state: dict[str, str]) -> list[int]:
    """The head's processes: marked ones, those of its session, and their descendants; never this process or
    its ancestors.

    The session id is trusted unless a process that is not the head's now leads a session of that number: a
    session id is not reused while any process of the session lives, so once the leader (``ray start``) has
    exited, whoever is left in the session is the head's."""
    table = _proc_table()
    mine = _marked(table, state)
    sid = int(state.get("session") or 0)
    if sid and (sid not in table or sid in mine):
        mine |= {pid for pid, p in table.items() if p.sid == sid}
    frontier = set(mine)
    while frontier:
        frontier = {pid for pid, p in table.items() if p.ppid in frontier and pid not in mine}
        mine |= frontier
    return sorted(mine - _ourselves(table))


def record_session(path: str) -> int | None:
    """Add the session id of the marked processes to the STATE file, if they share one that is not ours (that
    is, ``ray start`` ran under setsid); returns it."""
    state = read_state(path)
    table = _proc_table()
    sids = {table[pid].sid for pid in _marked(table, state)}
    if len(sids) != 1 or os.getsid(0) in sids:
        return None
    state["session"] = sids.pop()
    Path(path).write_text(json.dumps(state) + "\n")
    return state["session"]


def _started(pid: int) -> int | None:
    """When ``pid`` started (clock ticks after boot); None when it is gone or a zombie."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except OSError:
        return None
    return None if fields[0] == b"Z" else int(fields[19])


def _signal(pids: list[int], sig: int, known: dict[int, int]) -> None:
    """Send ``sig`` to those of ``pids`` that are still the processes listed in ``known`` (no reused pid)."""
    for pid in pids:
        if _started(pid) == known[pid]:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)


def _name(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


# Ray's own order (``ray stop``): the raylets first (their agents fate-share with them), the GCS last
STAGES = (lambda n: n == "raylet", lambda n: n not in ("raylet", "gcs_server"), lambda n: n == "gcs_server")


def stop(state: dict[str, str], grace_s: float) -> tuple[list[int], list[int]]:
    """Stop the head's processes in Ray's order: SIGTERM each group, SIGKILL what is alive after a third of
    ``grace_s``; returns (stopped, killed). Processes that appear meanwhile (a worker starting) are stopped too;
    the first listing is kept, so a process orphaned meanwhile is not lost."""
    known: dict[int, int] = {}  # pid -> start time
    stopped: set[int] = set()
    killed: list[int] = []

    def alive(pid: int) -> bool:
        return _started(pid) == known[pid]

    for pick in STAGES:
        group: set[int] = set()
        deadline = time.monotonic() + grace_s / len(STAGES)
        while True:
            for pid in head_pids(state):
                known.setdefault(pid, _started(pid) or -1)
            fresh = [p for p in set(known) - stopped if alive(p) and pick(_name(p))]
            _signal(fresh, signal.SIGTERM, known)
            stopped |= set(fresh)
            group |= set(fresh)
            left = [p for p in group if alive(p)]
            if not left and not fresh:
                break
            if time.monotonic() > deadline:
                _signal(left, signal.SIGKILL, known)
                killed += left
                break
            time.sleep(0.2)
    end = time.monotonic() + 5
    while any(alive(p) for p in killed) and time.monotonic() < end:
        time.sleep(0.1)
    return sorted(stopped), sorted(killed)


def _socket_inodes(pid: int) -> set[str]:
    inodes = set()
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if link.startswith("socket:["):
                inodes.add(link[8:-1])
    except OSError:
        pass
    return inodes


def _listening_tcp() -> dict[str, tuple[str, int]]:
    """inode -> (address, port) of every listening TCP socket (IPv4 and IPv6) in /proc/net."""
    out = {}
    for name, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        try:
            lines = Path(f"/proc/net/{name}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            cols = line.split()
            if cols[3] != "0A":  # TCP_LISTEN
                continue
            hexip, hexport = cols[1].split(":")
            raw = bytes.fromhex(hexip)
            raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))  # each 32-bit word is host-order
            out[cols[9]] = (socket.inet_ntop(family, raw), int(hexport, 16))
    return out


def is_loopback(address: str) -> bool:
    """Whether ``address`` is a loopback address (IPv4-mapped IPv6 included)."""
    ip = ipaddress.ip_address(address)
    mapped = getattr(ip, "ipv4_mapped", None)
    return (mapped or ip).is_loopback


def listeners(pids: list[int]) -> list[tuple[int, str, str, int]]:
    """(pid, process name, address, port) of every TCP socket the processes ``pids`` listen on."""
    table = _listening_tcp()
    found = []
    for pid in pids:
        try:
            name = Path(f"/proc/{pid}/comm").read_text().strip()
        except OSError:
            continue
        for inode in _socket_inodes(pid):
            if inode in table:
                found.append((pid, name, *table[inode]))
    return sorted(found)


def bind_address(value: str) -> str:
    """The IPv4 address to bind for ``value``: empty or a loopback name -> 127.0.0.1; an interface name -> its
    address; an address -> itself, if this machine has it."""
    if value in LOOPBACK_NAMES:
        return "127.0.0.1"
    names = [name for _, name in socket.if_nameindex()]
    if value in names:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            try:  # SIOCGIFADDR
                raw = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", value.encode()[:15]))
            except OSError:
                raise HeadError(f"interface {value} has no IPv4 address; give an address instead") from None
        return socket.inet_ntoa(raw[20:24])
    try:
        ip = ipaddress.IPv4Address(value)
    except ValueError:
        raise HeadError(f"{value!r} is neither an IPv4 address nor an interface of this machine "
                        f"({', '.join(names)})") from None
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((str(ip), 0))
        except OSError:
            raise HeadError(f"{value} is not an address of this machine (interfaces: {', '.join(names)})") from None
    return str(ip)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("bind-address", help="the IPv4 address for CHIMERA_RAY_BIND / --bind")
    b.add_argument("value", nargs="?", default="")
    rs = sub.add_parser("record-session", help="add the session id of the head's processes to STATE")
    rs.add_argument("state")
    ls = sub.add_parser("listeners", help="the head's listening TCP sockets")
    ls.add_argument("state")
    ls.add_argument("--loopback-only", action="store_true", help="exit 1 if any listens beyond loopback")
    st = sub.add_parser("stop", help="stop the head's processes")
    st.add_argument("state")
    st.add_argument("--grace", type=float, default=15.0, help="seconds between SIGTERM and SIGKILL")
    st.add_argument("--caller", default="ray_head.py", help="the name its messages start with")
    args = p.parse_args(argv)
    try:
        if args.cmd == "bind-address":
            print(bind_address(args.value))
            return 0
        if args.cmd == "record-session":
            print(record_session(args.state) or "")
            return 0
        state = read_state(args.state)
    except HeadError as e:
        print(f"{Path(sys.argv[0]).name}: {e}", file=sys.stderr)
        return 2
    if args.cmd == "listeners":
        found = listeners(head_pids(state))
        bad = [f for f in found if not is_loopback(f[2])]
        for pid, name, host, port in found:
            print(f"{name} (pid {pid}) listens on {host}:{port}")
        if args.loopback_only and bad:
            print("not on loopback: " + ", ".join(f"{n} (pid {pid}) on {h}:{port}" for pid, n, h, port in bad),
                  file=sys.stderr)
            return 1
        return 0
    stopped, killed = stop(state, args.grace)
    where = state.get("temp_dir", "?")
    print(f"{args.caller}: stopped {len(stopped)} process(es) of the chimera Ray in {where}"
          + (f" ({len(killed)} after SIGKILL: pids {killed})" if killed else ""))
    left = [p for p in head_pids(state) if _started(p) is not None]
    if left:
        print(f"{args.caller}: still alive: {', '.join(f'{_name(p)} (pid {p})' for p in left)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
