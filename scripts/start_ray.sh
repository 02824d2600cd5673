#!/usr/bin/env bash
# Start a persistent local Ray head for chimera that several runs can join (--address auto / ray job submit).
# Loopback only, token authentication on (Ray's default), its own temp dir so that shutdown.sh stops exactly it.
#   scripts/start_ray.sh [extra `ray start` flags]
# Environment: CHIMERA_RAY_TMP (temp dir), CHIMERA_RAY_PORT (GCS, 6390), CHIMERA_RAY_DASHBOARD_PORT (8266),
#              CHIMERA_RAY_AGENT_PORT (job agent, 52366), CHIMERA_RAY_CLIENT_PORT (10011),
#              CHIMERA_RAY_CPUS (nproc), CHIMERA_RAY_STATE (profiles/.chimera_ray.json)
# The ports differ from Ray's defaults so that this head can run beside another Ray on the same machine.
set -euo pipefail
cd "$(dirname "$0")/.."
export RAY_AUTH_MODE=token   # clients (ray job submit, ray status) need it too: RAY_AUTH_MODE=token ray job ...
tmp=${CHIMERA_RAY_TMP:-/tmp/chimera-ray-$(id -u)}
port=${CHIMERA_RAY_PORT:-6390}
dash=${CHIMERA_RAY_DASHBOARD_PORT:-8266}
state=${CHIMERA_RAY_STATE:-profiles/.chimera_ray.json}
if [ -f "$state" ]; then
  echo "start_ray.sh: $state exists: a chimera Ray is already running (stop it with ./shutdown.sh)" >&2
  exit 1
fi
mkdir -p "$(dirname "$state")"
ray start --head --node-ip-address=127.0.0.1 --port="$port" --temp-dir="$tmp" \
  --include-dashboard=true --dashboard-host=127.0.0.1 --dashboard-port="$dash" \
  --dashboard-agent-listen-port="${CHIMERA_RAY_AGENT_PORT:-52366}" --ray-client-server-port="${CHIMERA_RAY_CLIENT_PORT:-10011}" \
  --num-cpus="${CHIMERA_RAY_CPUS:-$(nproc)}" --disable-usage-stats "$@"
# the job agent starts a moment after the head: wait until job submission answers (at most 90 s)
for _ in $(seq 90); do
  if ray job list --address "http://127.0.0.1:$dash" >/dev/null 2>&1; then break; fi
  sleep 1
done
printf '{"temp_dir": "%s", "address": "127.0.0.1:%s", "dashboard": "http://127.0.0.1:%s"}\n' "$tmp" "$port" "$dash" > "$state"
echo "chimera Ray: address 127.0.0.1:$port, dashboard http://127.0.0.1:$dash; stop it with ./shutdown.sh"
echo "submit jobs with: RAY_AUTH_MODE=token ray job submit --address http://127.0.0.1:$dash --working-dir . -- python scripts/prof_steps_ray_multinode.py"
