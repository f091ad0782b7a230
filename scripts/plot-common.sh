# Sourced by the plot scripts (plot-positions.sh, plot-depth.sh): what they share about their
# arguments and their output file. Each function takes the script's name for its messages.
#
#   plot_args NAME USAGE MIN MAX "$@"   sets force (0/1, from --force) and args (the others);
#                                       USAGE and exit 2 unless MIN ≤ #args ≤ MAX
#   plot_tools NAME HINT TOOL...        exits 0 with "NAME: skipped: TOOL is not installed
#                                       (HINT)" when a tool is missing: no file is written
#   plot_out NAME OUT                   exit 2, one line, when OUT exists and is not a regular
#                                       file, exists without --force, or its folder does not

plot_args() {
  local name="$1" usage="$2" min="$3" max="$4" a
  shift 4
  force=0
  args=()
  for a in "$@"; do
    if [[ "$a" == --force ]]; then force=1; else args+=("$a"); fi
  done
  if ((${#args[@]} < min || ${#args[@]} > max)); then
    echo "usage: bash scripts/$name.sh $usage" >&2
    exit 2
  fi
}

plot_tools() {
  local name="$1" hint="$2" tool
  shift 2
  for tool in "$@"; do
    if ! command -v "$tool" >/dev/null 2>&1; then
      echo "$name: skipped: $tool is not installed ($hint)"
      exit 0
    fi
  done
}

plot_out() {
  local name="$1" out="$2"
  if [[ -e "$out" || -L "$out" ]]; then
    [[ -f "$out" ]] || { echo "$name: error: $out exists and is not a regular file" >&2; exit 2; }
    ((force == 1)) || { echo "$name: error: $out exists (pass --force to replace it)" >&2; exit 2; }
  fi
  local dir
  dir="$(dirname -- "$out")"
  [[ -d "$dir" ]] || { echo "$name: error: folder $dir does not exist" >&2; exit 2; }
}
