# Sourced by scripts/setup.sh and scripts/setup_engine.sh: stop in one line, before anything is installed, when a
# folder's filesystem has less free space than an install needs (a full disk would otherwise fail pip halfway).
#
#   need_space DIR GIB WHAT    # exit 1 unless DIR's filesystem has GIB GiB free; WHAT says what needs it
#
# SPECHEADS_SETUP_MIN_FREE_GIB, when set, replaces every GIB (0 turns the check off).
need_space() {
  local dir=$1 gib=${SPECHEADS_SETUP_MIN_FREE_GIB:-$2} what=$3 free_kib
  while [ ! -d "$dir" ]; do dir=$(dirname "$dir"); done
  free_kib=$(df -Pk "$dir" | awk 'NR == 2 {print $4}')
  if [ -n "$free_kib" ] && [ "$free_kib" -lt $((gib * 1024 * 1024)) ]; then
    echo "[setup] $what needs about $gib GiB free on the filesystem of $dir; it has $((free_kib / 1024 / 1024)) GiB free: free some space (or point ${4:-the venv} elsewhere) and run again" >&2
    exit 1
  fi
}
