#!/usr/bin/env bash
# Start a persistent Ray head for chimera that several runs can join (--address auto / ray job submit).
# Token authentication stays on (Ray's default); its own temp dir and a marker in its processes' environment,
# so that ./shutdown.sh stops exactly what this script started (the Ray client server included) and nothing else.
#   scripts/start_ray.sh [--bind ADDRESS|INTERFACE] [--dry-run] [extra `ray start` flags]
#
# Where it listens:
#   default (or --bind lo / 127.0.0.1)  loopback only: every process of the head (GCS, raylet, dashboard, agents,
#       Ray client server, workers) binds 127.0.0.1 (RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 before `ray start`, as
#       Ray does on laptops, and --node-ip-address=127.0.0.1); the script checks this after the start and fails
#       if anything listens beyond loopback. Clients of a loopback head need the same variable for the GCS
#       address: RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 RAY_AUTH_MODE=token ray status --address 127.0.0.1:PORT
#       (`ray job submit --address http://127.0.0.1:DASHBOARD_PORT` needs only RAY_AUTH_MODE=token). A loopback head
#       is one machine: no other node can join it (nor a second `ray start` here: Ray refuses to join under
#       RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0); use --bind for a cluster.
#   --bind ADDRESS|INTERFACE (or CHIMERA_RAY_BIND)  a real cluster: the head advertises that IPv4 address (an
#       interface name, e.g. eth0, stands for its address) and its dashboard binds it. Ray's GCS, raylet and
#       agents then listen on every interface (Ray cannot limit them to one): keep the ports behind a firewall.
# Environment (defaults in brackets):
#   CHIMERA_RAY_BIND [loopback]        as --bind
#   CHIMERA_RAY_TMP [/tmp/chimera-ray-UID]  Ray's temp dir (absolute path)
#   CHIMERA_RAY_PORT [6390] GCS; CHIMERA_RAY_DASHBOARD_PORT [8266]; CHIMERA_RAY_AGENT_PORT [52366] job agent;
#   CHIMERA_RAY_CLIENT_PORT [20011] Ray client server (ray://); they differ from Ray's defaults so that this head
#       can run beside another Ray on the same machine, and must lie outside the worker port range:
#   CHIMERA_RAY_MIN_WORKER_PORT [10002], CHIMERA_RAY_MAX_WORKER_PORT [19999] (Ray's defaults, passed explicitly)
#   CHIMERA_RAY_CPUS [max(nproc, 8)]   CPU slots of the head. A worker takes one slot and the default job needs
#       4 workers, so a small machine gets 8 slots anyway (oversubscribed: fine for CPU training and tests).
#   CHIMERA_RAY_WAIT [90]              seconds for the GCS and the job API to answer; otherwise the script says
#       which did not, stops what it started and exits 1
#   CHIMERA_RAY_STATE [profiles/.chimera_ray.json]  state file read by ./shutdown.sh (relative: to the repo root)
# --dry-run prints the `ray start` command and exits. Runs under bash (re-executes itself when started by sh).
if [ -z "${BASH_VERSION:-}" ]; then exec bash "$0" "$@"; fi
set -euo pipefail
cd "$(dirname "$0")/.."
die() { echo "start_ray.sh: $*" >&2; exit 1; }

bind=${CHIMERA_RAY_BIND:-}
dry_run=0
while [ $# -gt 0 ]; do
  case $1 in
    --bind) [ $# -ge 2 ] || die "--bind needs an address or an interface, e.g. --bind eth0"; bind=$2; shift 2 ;;
    --bind=*) bind=${1#--bind=}; shift ;;
    --dry-run) dry_run=1; shift ;;
    *) break ;;
  esac
done

export RAY_AUTH_MODE=token   # clients (ray job submit, ray status) need it too: RAY_AUTH_MODE=token ray job ...
tmp=${CHIMERA_RAY_TMP:-/tmp/chimera-ray-$(id -u)}
port=${CHIMERA_RAY_PORT:-6390}
dash=${CHIMERA_RAY_DASHBOARD_PORT:-8266}
agent=${CHIMERA_RAY_AGENT_PORT:-52366}
client=${CHIMERA_RAY_CLIENT_PORT:-20011}
min_worker=${CHIMERA_RAY_MIN_WORKER_PORT:-10002}
max_worker=${CHIMERA_RAY_MAX_WORKER_PORT:-19999}
cpus=${CHIMERA_RAY_CPUS:-$(( $(nproc) > 8 ? $(nproc) : 8 ))}
wait_s=${CHIMERA_RAY_WAIT:-90}
state=${CHIMERA_RAY_STATE:-profiles/.chimera_ray.json}

case $tmp in /*) ;; *) die "CHIMERA_RAY_TMP must be an absolute path, got '$tmp'" ;; esac
case $tmp$state in *'"'* | *\\*) die "CHIMERA_RAY_TMP and CHIMERA_RAY_STATE must not contain quotes or backslashes" ;; esac
for v in port:CHIMERA_RAY_PORT dash:CHIMERA_RAY_DASHBOARD_PORT agent:CHIMERA_RAY_AGENT_PORT \
         client:CHIMERA_RAY_CLIENT_PORT min_worker:CHIMERA_RAY_MIN_WORKER_PORT max_worker:CHIMERA_RAY_MAX_WORKER_PORT; do
  name=${v%%:*} val=${!name}
  if ! [[ $val =~ ^[0-9]+$ ]] || [ "$val" -lt 1 ] || [ "$val" -gt 65535 ]; then
    die "${v#*:} must be a port (1-65535), got '$val'"
  fi
done
[ "$min_worker" -lt "$max_worker" ] || die "CHIMERA_RAY_MIN_WORKER_PORT ($min_worker) must be below CHIMERA_RAY_MAX_WORKER_PORT ($max_worker)"
for v in port:CHIMERA_RAY_PORT dash:CHIMERA_RAY_DASHBOARD_PORT agent:CHIMERA_RAY_AGENT_PORT client:CHIMERA_RAY_CLIENT_PORT; do
  name=${v%%:*} val=${!name}
  if [ "$val" -ge "$min_worker" ] && [ "$val" -le "$max_worker" ]; then
    die "${v#*:}=$val lies in Ray's worker port range $min_worker-$max_worker: pick a port outside it (or move the range with CHIMERA_RAY_MIN_WORKER_PORT / CHIMERA_RAY_MAX_WORKER_PORT)"
  fi
done
if ! [[ $cpus =~ ^[0-9]+$ ]] || [ "$cpus" -lt 1 ]; then die "CHIMERA_RAY_CPUS must be a whole number >= 1, got '$cpus'"; fi
if ! [[ $wait_s =~ ^[0-9]+$ ]] || [ "$wait_s" -lt 1 ]; then die "CHIMERA_RAY_WAIT must be whole seconds >= 1, got '$wait_s'"; fi

ip=$(python3 scripts/ray_head.py bind-address "$bind") || die "fix --bind / CHIMERA_RAY_BIND (it was '$bind')"
if [ "$ip" = 127.0.0.1 ]; then
  export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0   # read by `ray start`: every Ray server then binds 127.0.0.1
else
  export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=1
fi
cmd=(ray start --head --node-ip-address="$ip" --port="$port" --temp-dir="$tmp"
     --include-dashboard=true --dashboard-host="$ip" --dashboard-port="$dash" --dashboard-agent-listen-port="$agent"
     --ray-client-server-port="$client" --min-worker-port="$min_worker" --max-worker-port="$max_worker"
     --num-cpus="$cpus" --disable-usage-stats "$@")
if [ "$dry_run" = 1 ]; then
  echo "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=$RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER RAY_AUTH_MODE=token ${cmd[*]}"
  exit 0
fi
if [ -f "$state" ]; then
  die "$state exists: a chimera Ray is already running (stop it with ./shutdown.sh, which also removes a stale one)"
fi
command -v ray >/dev/null || die "no 'ray' on PATH: activate the environment (. .venv/bin/activate) first"

# every process of this head inherits the marker; the state file names it for shutdown.sh
CHIMERA_RAY_HEAD="chimera-$(id -u)-$$-$(date +%s)"
export CHIMERA_RAY_HEAD
mkdir -p "$(dirname "$state")"
printf '{"temp_dir": "%s", "address": "%s:%s", "dashboard": "http://%s:%s", "marker": "%s"}\n' \
  "$tmp" "$ip" "$port" "$ip" "$dash" "$CHIMERA_RAY_HEAD" > "$state"
errors=$(mktemp)
fail() {  # stop what this script started, then exit 1 with the reason
  trap - INT TERM
  echo "start_ray.sh: $*" >&2
  python3 scripts/ray_head.py stop "$state" --grace 10 --caller start_ray.sh >&2 || true
  rm -f "$state" "$errors"
  exit 1
}
trap 'fail "interrupted"' INT TERM
# a session of its own: its id finds the head's processes even where the marker is gone (see ray_head.py)
launch=()
if command -v setsid >/dev/null; then launch=(setsid -w); fi
"${launch[@]}" "${cmd[@]}" || fail "\`ray start\` failed (see its messages above)"
python3 scripts/ray_head.py record-session "$state" >/dev/null

# the job agent starts a moment after the head: wait until the GCS and job submission answer
deadline=$(( $(date +%s) + wait_s ))
gcs=down jobs=down
while :; do
  [ $gcs = up ] || { timeout 30 ray health-check --address "$ip:$port" >/dev/null 2>"$errors" && gcs=up; }
  [ $jobs = up ] || { timeout 30 ray job list --address "http://$ip:$dash" >/dev/null 2>>"$errors" && jobs=up; }
  [ $gcs = up ] && [ $jobs = up ] && break
  if [ "$(date +%s)" -ge "$deadline" ]; then
    why=$(grep -v -e '^ ' -e '^Traceback' "$errors" | tail -n 2 | tr '\n' ' ' || true)
    down=""
    [ $gcs = up ] || down="the GCS at $ip:$port (ray health-check)"
    [ $jobs = up ] || down="${down:+$down and }the job API at http://$ip:$dash (ray job list)"
    fail "Ray did not come up within $wait_s s: $down did not answer; last error: ${why:-none}; logs in $tmp/session_latest/logs"
  fi
  sleep 1
done
rm -f "$errors"
trap - INT TERM
if [ "$ip" = 127.0.0.1 ]; then
  python3 scripts/ray_head.py listeners "$state" --loopback-only >/dev/null \
    || fail "the head listens beyond loopback (above); it has been stopped"
fi
echo "chimera Ray: address $ip:$port, dashboard http://$ip:$dash, $cpus CPU slots; stop it with ./shutdown.sh"
echo "submit jobs with: RAY_AUTH_MODE=token ray job submit --address http://$ip:$dash --working-dir . -- python scripts/prof_steps_ray_multinode.py"
if [ "$ip" = 127.0.0.1 ]; then  # Ray's clients otherwise swap 127.0.0.1 for the machine's address
  echo "join it from this machine with: RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 RAY_AUTH_MODE=token python scripts/prof_steps_ray_multinode.py --address $ip:$port (ray status likewise)"
fi
