#!/usr/bin/env bash
# Stop the local Ray that chimera started (recorded in profiles/.chimera_ray.json by scripts/start_ray.sh or
# the driver with --keep-ray). Never kills processes by name.
set -euo pipefail
cd "$(dirname "$0")"
state=profiles/.chimera_ray.json
if [ ! -f "$state" ]; then
  echo "shutdown.sh: nothing to stop (no $state: chimera's driver stops the Ray it starts itself on exit)"
  exit 0
fi
python3 - "$state" <<'PY'
import json, os, signal, sys, time
state = json.load(open(sys.argv[1]))
pids = state.get("pids", [])
for pid in pids:
    try:
        os.kill(pid, signal.SIGTERM)
        print(f"stopped pid {pid}")
    except ProcessLookupError:
        pass
deadline = time.time() + 10
for pid in pids:
    while time.time() < deadline:
        try:
            os.kill(pid, 0)
            time.sleep(0.2)
        except ProcessLookupError:
            break
PY
rm -f "$state"
