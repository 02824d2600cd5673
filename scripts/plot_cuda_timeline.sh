#!/bin/sh
# (Re)build the timeline plots, Chrome trace and summary of a profiled run from its saved events.
#   scripts/plot_cuda_timeline.sh                              # the newest events of runs/*/ or profiles/ (says which)
#   scripts/plot_cuda_timeline.sh NAME                         # runs/*/NAME.events.json (the newest) or profiles/
#   scripts/plot_cuda_timeline.sh NAME --sqlite run.sqlite     # GPU kernel times from an Nsight SQLite export
#   scripts/plot_cuda_timeline.sh [NAME] --dir other/profiles  # another folder (the newest there without NAME)
# NAME may also be a path to NAME.events.json. Relative paths are taken from the current directory; the default
# folders are every run directory under runs/ and profiles/. POSIX sh: `sh scripts/plot_cuda_timeline.sh` (dash) works as well as bash.
set -eu
root=$(cd "$(dirname "$0")/.." && pwd)
dir=
name=
if [ $# -gt 0 ]; then
  case $1 in -*) ;; *) name=$1; shift ;; esac
fi
prev=
for arg in "$@"; do  # the folder to look in, for the newest events file
  case $arg in --dir=*) dir=${arg#--dir=} ;; esac
  [ "$prev" = --dir ] && dir=$arg
  prev=$arg
done
py=$(command -v python || command -v python3) || { echo "plot_cuda_timeline.sh: no python on PATH" >&2; exit 2; }
if [ -z "$name" ]; then
  name=$("$py" -c 'import glob, os, sys
dirs = [sys.argv[1]] if sys.argv[1] else [os.path.join(sys.argv[2], "runs", "*"), os.path.join(sys.argv[2], "profiles")]
found = [f for d in dirs for f in glob.glob(os.path.join(d, "*.events.json"))]
print(max(found, key=os.path.getmtime) if found else "")' "$dir" "$root")
  if [ -z "$name" ]; then
    echo "plot_cuda_timeline.sh: no *.events.json in ${dir:-runs/*/ or profiles/}; profile a run with --profile first, or give NAME" >&2
    echo "usage: $0 [NAME] [--sqlite FILE] [--dir DIR]" >&2
    exit 2
  fi
  echo "plot_cuda_timeline.sh: no NAME given: re-plotting the newest, $name" >&2
fi
PYTHONPATH=$root${PYTHONPATH:+:$PYTHONPATH}
export PYTHONPATH
cd "$root"  # the default folders are the repository's; NAME and --dir were taken from where the script was run
case $name in /*|*.events.json) case $name in /*) ;; *) name=$OLDPWD/$name ;; esac ;; esac
if [ -n "$dir" ]; then
  case $dir in /*) ;; *) dir=$OLDPWD/$dir ;; esac
  set -- "$@" --dir "$dir"
fi
exec "$py" -m chimera.cli timeline plot "$name" "$@"
