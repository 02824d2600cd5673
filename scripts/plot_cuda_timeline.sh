#!/usr/bin/env bash
# (Re)build the timeline plots, Chrome trace and summary of a profiled run from its saved events.
#   scripts/plot_cuda_timeline.sh NAME                       # profiles/NAME.events.json
#   scripts/plot_cuda_timeline.sh NAME --sqlite run.sqlite   # GPU kernel times from an Nsight SQLite export
#   scripts/plot_cuda_timeline.sh NAME --dir other/profiles
set -euo pipefail
if [ $# -lt 1 ]; then
  echo "usage: $0 NAME [--sqlite FILE] [--dir DIR]" >&2
  exit 2
fi
cd "$(dirname "$0")/.."
exec python -m chimera.cli timeline plot "$@"
