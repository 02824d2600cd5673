#!/usr/bin/env bash
# Stop what chimera started, and nothing else (never kills by process name).
#   ./shutdown.sh                          the local Ray head of scripts/start_ray.sh (found by its own temp dir)
#   ./shutdown.sh --cluster CONFIG.yaml    a `ray up` cluster: `ray down -y CONFIG.yaml`
# A training run's own local Ray needs no shutdown: the driver stops it on exit, on errors and on Ctrl-C.
set -euo pipefail
cd "$(dirname "$0")"
if [ "${1:-}" = "--cluster" ]; then
  exec ray down -y "${2:?usage: ./shutdown.sh --cluster ray_launch/cluster.yaml}"
fi
state=${CHIMERA_RAY_STATE:-profiles/.chimera_ray.json}
if [ ! -f "$state" ]; then
  echo "shutdown.sh: nothing to stop ($state not found; a run's own Ray stops with the run)"
  exit 0
fi
python3 - "$state" <<'PY'
import json, os, signal, sys, time

state = json.load(open(sys.argv[1]))
tmp = state["temp_dir"]
roots, parent = set(), {}
for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        with open(f"/proc/{pid}/stat") as f:
            parent[int(pid)] = int(f.read().rsplit(")", 1)[1].split()[1])
    except OSError:
        continue
    if int(pid) != os.getpid() and tmp in cmd:
        roots.add(int(pid))
# the head's processes carry the temp dir in their command line; their children (workers, agents) are ours too
mine, frontier = set(roots), set(roots)
while frontier:
    frontier = {p for p, pp in parent.items() if pp in frontier and p not in mine}
    mine |= frontier
mine = sorted(mine)
for pid in mine:
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        pass
deadline = time.time() + 15
alive = list(mine)
while alive and time.time() < deadline:
    time.sleep(0.3)
    alive = [p for p in alive if os.path.exists(f"/proc/{p}") and open(f"/proc/{p}/stat").read().split()[2] != "Z"]
for pid in alive:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
print(f"shutdown.sh: stopped {len(mine)} process(es) of the chimera Ray in {tmp}")
PY
rm -f "$state"
