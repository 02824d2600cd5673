#!/bin/sh
# Stop what chimera started, and nothing else (never kills by process name).
#   ./shutdown.sh                          the Ray head of scripts/start_ray.sh: every process it started (GCS,
#                                          raylet, dashboard, agents, the Ray client server, workers, jobs), found
#                                          by the marker and session that start_ray.sh recorded in its state file
#   ./shutdown.sh --cluster CONFIG.yaml    a `ray up` cluster: `ray down -y CONFIG.yaml`
# CHIMERA_RAY_STATE names the state file (default profiles/.chimera_ray.json; relative: to the repository root).
# Stopping takes seconds (SIGTERM in Ray's order, SIGKILL after CHIMERA_RAY_GRACE seconds, default 15, in all).
# A training run's own local Ray needs no shutdown: the driver stops it on exit, on errors and on Ctrl-C.
# POSIX sh: `sh shutdown.sh` (dash) works as well as bash.
set -eu
cd "$(dirname "$0")"
case "${1:-}" in
  --cluster)
    [ $# -ge 2 ] || { echo "usage: ./shutdown.sh --cluster ray_launch/cluster.yaml" >&2; exit 2; }
    exec ray down -y "$2" ;;
  "") ;;
  *) echo "usage: ./shutdown.sh [--cluster CONFIG.yaml] (got '$1')" >&2; exit 2 ;;
esac
state=${CHIMERA_RAY_STATE:-profiles/.chimera_ray.json}
if [ ! -f "$state" ]; then
  echo "shutdown.sh: nothing to stop ($state not found; a run's own Ray stops with the run)"
  exit 0
fi
python3 scripts/ray_head.py stop "$state" --grace "${CHIMERA_RAY_GRACE:-15}" --caller shutdown.sh
rm -f "$state"
