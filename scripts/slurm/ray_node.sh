#!/bin/sh
# Start one Ray node of a SLURM job (run by chimera.sbatch through srun, one task per node) with this node's GPUs.
#   scripts/slurm/ray_node.sh [ray start flags]   exec `ray start --block --num-gpus=N [flags]`
#   scripts/slurm/ray_node.sh --gpus              print N and where it came from
# N, the GPUs of this node, is the first of: CHIMERA_GPUS_PER_NODE (an override), SLURM_GPUS_ON_NODE,
# SLURM_GPUS_PER_NODE ("4" or "a100:4"), the devices in CUDA_VISIBLE_DEVICES, the GPUs `nvidia-smi -L` lists, 0.
# POSIX sh.
set -eu
gpus() {
  if [ -n "${CHIMERA_GPUS_PER_NODE:-}" ]; then echo "$CHIMERA_GPUS_PER_NODE CHIMERA_GPUS_PER_NODE"; return; fi
  if [ -n "${SLURM_GPUS_ON_NODE:-}" ]; then echo "$SLURM_GPUS_ON_NODE SLURM_GPUS_ON_NODE"; return; fi
  if [ -n "${SLURM_GPUS_PER_NODE:-}" ]; then  # "4", "a100:4", or "a100:2,v100:2"
    echo "$SLURM_GPUS_PER_NODE" | tr ',' '\n' | awk -F: '{n += $NF} END {print n " SLURM_GPUS_PER_NODE"}'
    return
  fi
  case ${CUDA_VISIBLE_DEVICES-unset} in
    unset) ;;
    "" | NoDevFiles) echo "0 CUDA_VISIBLE_DEVICES"; return ;;
    *) echo "$CUDA_VISIBLE_DEVICES" | tr ',' '\n' | grep -c . | sed 's/$/ CUDA_VISIBLE_DEVICES/'; return ;;
  esac
  if command -v nvidia-smi >/dev/null 2>&1; then
    n=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
    echo "${n:-0} nvidia-smi"
    return
  fi
  echo "0 none"
}
found=$(gpus)
n=${found%% *}
case $n in
  '' | *[!0-9]*) echo "ray_node.sh: the GPU count '$n' (from ${found#* }) is not a whole number" >&2; exit 2 ;;
esac
if [ "${1:-}" = --gpus ]; then
  echo "$found"
  exit 0
fi
echo "ray_node.sh: $(hostname): $n GPU(s) (from ${found#* })" >&2
exec ray start --block --num-gpus="$n" --disable-usage-stats "$@"
