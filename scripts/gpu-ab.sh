#!/usr/bin/env bash
# A/B of two versions in one device call (docs/PERF.md's method: one build's runs spread by 1–2 %
# and machines by as much, so a change is measured against its base on the same machine, in the
# same call, the two run alternately).
#
#   here:        scripts/gpu-ab.sh pack REV [--force]
#                  REV's sources (git archive of the build's inputs: the top-level CMakeLists.txt,
#                  scripts/ and every top-level folder of REV that has a CMakeLists.txt of its
#                  own, which is what the top-level file can add) into build-ab/base.tar and
#                  its commit into build-ab/base.rev; an existing pack is kept unless --force.
#                  Carry build-ab with the device call (the device's copy of the tree has no .git).
#   GPU machine: scripts/gpu-ab.sh run [--rounds N] [--ncu] [--deadline S] [-- BENCH_ARGS...]
#                  builds the working tree (scripts/gpu-check.sh's build into build-gpu/) and the
#                  pack (m3h only, build-ab/base/) at once, then runs `m3h bench BENCH_ARGS` N
#                  times on each side, base first, alternately (N = 2; the default arguments are
#                  the marginal layer's: default, official and official2 shapes, bf16 and f16,
#                  chunked, Recompute none, graph replays); --ncu adds one official forward +
#                  backward per dtype under Nsight Compute on each side, the per-kernel table
#                  of scripts/ncu-compare.sh (base → tree) and each side's layer roofline
#                  (scripts/ncu-roofline.sh --launches layer: the layer's launches of that
#                  one-layer run, found in each side's file by the norms around them, so that a
#                  change that adds or removes a launch inside the layer keeps its window;
#                  AB_LAUNCHES_BASE and AB_LAUNCHES_TREE give a side's own list instead, e.g.
#                  21-32,36-61). Prints the summary last.
#                  --no-build: the builds of an earlier run on this machine, as they are (the
#                  binaries: $AB_M3H_BASE and $AB_M3H_TREE, default build-ab/base/build/tools/m3h
#                  and build-gpu/tools/m3h).
#                  --deadline S: done S seconds after run started (builds included), so that a
#                  time-limited call still returns the summary and logs: no bench or ncu run
#                  starts later and one running then is stopped; a round it cuts is dropped
#                  whole (a base without its tree would skew the medians) and --ncu is then not
#                  run. The summary covers the rounds done, AB_PACK packs as usual, and the exit
#                  status is 1 when fewer rounds than asked were done.
#   GPU machine: scripts/gpu-ab.sh build
#                  run's two builds and nothing else, so that one device call can build, run the
#                  tree's tests (build-gpu/tests/m3_gpu_tests) and only then time both sides with
#                  `run --no-build`. Its logs as run's (base-build.log, tree-build/).
#   anywhere:    scripts/gpu-ab.sh summary DIR
#                  the table of a run's logs: per marginal-layer line of the bench (dtype, scan,
#                  recompute), the fwd and fwd+bwd ms of every round on each side, their medians
#                  and tree − base.
# Logs under ${OUT:-gpu-logs}/ab/: bench-{base,tree}-K.txt, builds, ncu-*.csv, ncu-*-vs.txt,
# ncu-*-roofline.txt; with AB_PACK=1 all of them in ab/logs.tar.gz instead (for the device tool,
# which returns at most 8 files per call).
# Bad use (an unknown command or option, a bad revision, no pack, a failed build, a bench that
# gives no marginal line): a one-line error and exit 2.
set -euo pipefail

die() {
  echo "gpu-ab.sh: $*" >&2
  exit 2
}
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
ab="${AB_DIR:-$root/build-ab}"
# The build's inputs of a revision: the top-level CMakeLists.txt, scripts/, and every top-level
# folder with a CMakeLists.txt (a folder the top-level file adds must have one), so that a folder
# added later is packed without a list to keep up to date.
build_inputs() {  # build_inputs COMMIT: one path a line
  local commit="$1" d
  echo CMakeLists.txt
  echo scripts
  git -C "$root" ls-tree --name-only -d "$commit" | while read -r d; do
    [[ "$d" == scripts ]] && continue
    if git -C "$root" cat-file -e "$commit:$d/CMakeLists.txt" 2>/dev/null; then echo "$d"; fi
  done
}

pack() {
  local rev="" force=0
  for a in "$@"; do
    case "$a" in
      --force) force=1 ;;
      -*) die "pack: unknown option $a" ;;
      *) [[ -z "$rev" ]] || die "pack: one revision only (got $rev and $a)"; rev="$a" ;;
    esac
  done
  [[ -n "$rev" ]] || die "usage: gpu-ab.sh pack REV [--force]"
  local commit
  commit="$(git -C "$root" rev-parse --verify --quiet "$rev^{commit}")" ||
    die "pack: not a revision of this repository: $rev"
  if [[ -e "$ab/base.tar" && $force == 0 ]]; then
    die "pack: $ab/base.tar exists (base $(cat "$ab/base.rev" 2>/dev/null || echo '?'));" \
      "--force replaces it"
  fi
  mkdir -p "$ab"
  local present=()
  local sources=()
  mapfile -t sources < <(build_inputs "$commit")
  for p in "${sources[@]}"; do
    if git -C "$root" cat-file -e "$commit:$p" 2>/dev/null; then present+=("$p"); fi
  done
  ((${#present[@]} > 0)) || die "pack: $rev holds none of ${sources[*]}"
  git -C "$root" archive --format=tar -o "$ab/base.tar.tmp" "$commit" "${present[@]}" ||
    die "pack: git archive of $rev failed"
  mv "$ab/base.tar.tmp" "$ab/base.tar"
  echo "$commit" >"$ab/base.rev"
  echo "packed $rev ($commit) into $ab/base.tar: carry build-ab with the device call"
}

# summary DIR: the table of bench-{base,tree}-K.txt under DIR.
summary() {
  [[ $# -eq 1 ]] || die "usage: gpu-ab.sh summary DIR"
  local dir="$1"
  [[ -d "$dir" ]] || die "summary: no directory $dir"
  local files=("$dir"/bench-base-*.txt "$dir"/bench-tree-*.txt)
  [[ -e "${files[0]}" && -e "${files[-1]}" ]] ||
    die "summary: no bench-base-K.txt and bench-tree-K.txt in $dir"
  # "marginal layer (official2 - official), bf16 chunked rc=none : fwd 2.162 ms, fwd+bwd ..."
  # → "side|bf16 chunked rc=none|2.162|6.454"
  local re='^marginal layer ([^)]*), \([^:]*[^ :]\) *: fwd \([0-9.]*\) ms, '
  re+='fwd+bwd \([0-9.]*\) ms.*'
  local rows f side
  rows="$(for f in "${files[@]}"; do
    side="$(basename "$f" .txt)"
    side="${side#bench-}"
    sed -n "s/$re/\\1|\\2|\\3/p" "$f" | sed "s/^/${side%%-*}|/"
  done)"
  [[ -n "$rows" ]] || die "summary: no marginal-layer line in $dir's bench logs"
  awk -F'|' '
    function median(list,    n, a, i, j, t) {
      n = split(list, a, " ")
      for (i = 2; i <= n; i++) for (j = i; j > 1 && a[j - 1] + 0 > a[j] + 0; j--) {
        t = a[j]; a[j] = a[j - 1]; a[j - 1] = t
      }
      return n % 2 ? a[(n + 1) / 2] + 0 : (a[n / 2] + a[n / 2 + 1]) / 2
    }
    {
      key = $2
      if (!(key in seen)) { seen[key] = 1; order[++nk] = key }
      fw[$1, key] = fw[$1, key] " " $3
      fb[$1, key] = fb[$1, key] " " $4
    }
    END {
      printf "%-26s %-5s %-30s %-30s %8s %8s\n", "marginal layer", "side", "fwd ms (runs)",
             "fwd+bwd ms (runs)", "fwd", "fwd+bwd"
      for (k = 1; k <= nk; k++) {
        key = order[k]
        for (s = 1; s <= 2; s++) {
          side = s == 1 ? "base" : "tree"
          if (!((side, key) in fw)) { printf "%-26s %-5s (no runs)\n", key, side; continue }
          m1[side] = median(fw[side, key]); m2[side] = median(fb[side, key])
          printf "%-26s %-5s %-30s %-30s %8.3f %8.3f\n", key, side, substr(fw[side, key], 2),
                 substr(fb[side, key], 2), m1[side], m2[side]
        }
        if (((("base", key) in fw)) && ((("tree", key) in fw)))
          printf "%-26s %-5s %-30s %-30s %+8.3f %+8.3f\n", key, "diff", "tree - base (medians)",
                 "", m1["tree"] - m1["base"], m2["tree"] - m2["base"]
      }
    }' <<<"$rows"
}

# The layer's launches in ncu's run of one official forward + backward: ncu-roofline.sh finds
# them in each side's file by the norms around them (ncu-roofline.sh --launches layer), so a
# change that adds or removes a launch keeps the two sides' layers comparable.
kLayerLaunches=layer

# The logs of run and build: $OUT/ab (default gpu-logs/ab).
logs_dir() { echo "${OUT:-$root/gpu-logs}/ab"; }

# build_both LOGS CMD: the pack (m3h only, build-ab/base/build) and the working tree (build-gpu/)
# at once, logs under LOGS (made here, after the pack is found); CMD names the caller in errors.
build_both() {
  local logs="$1" cmd="$2"
  [[ -f "$ab/base.tar" ]] || die "$cmd: no pack ($ab/base.tar): gpu-ab.sh pack REV first, here"
  mkdir -p "$logs"
  local base_src="$ab/base"
  rm -rf "$base_src"
  mkdir -p "$base_src"
  tar -xf "$ab/base.tar" -C "$base_src" || die "$cmd: cannot unpack $ab/base.tar"
  local boost=()
  [[ -d "$root/.boost" ]] && boost=(-DM3_BOOST_BUNDLE="$root/.boost")
  local jobs
  jobs="$(nproc 2>/dev/null || echo 8)"
  # The tree's architecture (gpu-check.sh: ${M3_CUDA_ARCH:-90a}), so that a base with wgmma
  # kernels runs them; a base without them builds the same kernels for 90a as for 90.
  (cmake -S "$base_src" -B "$base_src/build" -G Ninja -DM3_CUDA=ON \
     -DCMAKE_CUDA_ARCHITECTURES="${M3_CUDA_ARCH:-90a}" \
     "${boost[@]}" >"$logs/base-configure.log" 2>&1 &&
   cmake --build "$base_src/build" -j "$((jobs / 2 > 0 ? jobs / 2 : 1))" --target m3h \
     >"$logs/base-build.log" 2>&1) &
  local base_pid=$!
  local tree_ok=1
  GPU_CHECK_ONLY=none OUT="$logs/tree-build" bash "$root/scripts/gpu-check.sh" \
    >"$logs/tree-build.log" 2>&1 || tree_ok=0
  wait "$base_pid" ||
    die "$cmd: the base ($(cat "$ab/base.rev")) did not build: $logs/base-build.log"
  ((tree_ok)) || die "$cmd: the working tree did not build: $logs/tree-build/"
}

# timed SECONDS CMD...: CMD, stopped when SECONDS have passed (exit 124 or 137) where SECONDS is
# not empty.
timed() {
  local left="$1"
  shift
  if [[ -z "$left" ]]; then "$@"; else timeout --kill-after=10 "$left" "$@"; fi
}

run() {
  local rounds=2 ncu=0 build=1 bench_args=() deadline="" t_start
  t_start=$(date +%s)
  while (($#)); do
    case "$1" in
      --rounds)
        [[ $# -ge 2 && "$2" =~ ^[1-9][0-9]*$ ]] || die "run: --rounds takes a positive count"
        rounds="$2"
        shift 2
        ;;
      --deadline)
        [[ $# -ge 2 && "$2" =~ ^[1-9][0-9]*$ ]] || die "run: --deadline takes a positive number of seconds"
        deadline="$2"
        shift 2
        ;;
      --ncu) ncu=1; shift ;;
      --no-build) build=0; shift ;;
      --) shift; bench_args=("$@"); break ;;
      *) die "run: unknown argument $1 (bench arguments go after --)" ;;
    esac
  done
  ((${#bench_args[@]} > 0)) || bench_args=(--no-reference --shapes "default,official,official2"
    --dtype "bf16,f16" --scan chunked --recompute none --graph)
  local logs
  logs="$(logs_dir)"
  local m3h_base="${AB_M3H_BASE:-$ab/base/build/tools/m3h}"
  local m3h_tree="${AB_M3H_TREE:-$root/build-gpu/tools/m3h}"
  mkdir -p "$logs"
  rm -f "$logs"/bench-base-*.txt "$logs"/bench-tree-*.txt  # an earlier run's rounds
  if ((build)); then
    build_both "$logs" run
  else
    for b in "$m3h_base" "$m3h_tree"; do
      [[ -x "$b" ]] || die "run: --no-build, but there is no $b"
    done
  fi
  local -A bin=([base]="$m3h_base" [tree]="$m3h_tree")
  echo "base $(cat "$ab/base.rev" 2>/dev/null || echo '(no pack)'), tree: the working tree"
  # left: the seconds before the deadline ("" without one).
  left() { [[ -z "$deadline" ]] || echo $((deadline - ($(date +%s) - t_start))); }
  local done_rounds=0 rc l
  for ((k = 1; k <= rounds; k++)); do
    for side in base tree; do
      l="$(left)"
      if [[ -n "$l" ]] && ((l <= 0)); then break 2; fi
      rc=0
      timed "$l" "${bin[$side]}" bench "${bench_args[@]}" >"$logs/bench-$side-$k.txt" 2>&1 || rc=$?
      if [[ -n "$l" ]] && ((rc == 124 || rc == 137)); then
        echo "round $k $side: stopped at the deadline (--deadline $deadline)"
        break 2
      fi
      ((rc == 0)) || die "run: the $side bench failed (round $k): $logs/bench-$side-$k.txt"
      echo "round $k $side: $(grep -c '^marginal' "$logs/bench-$side-$k.txt") marginal lines"
    done
    done_rounds=$k
  done
  # A round that the deadline cut leaves no half: its base alone would skew the medians.
  if [[ -e "$logs/bench-base-$((done_rounds + 1)).txt" ]]; then
    echo "round $((done_rounds + 1)): dropped (the deadline came before its tree side ended)"
    rm -f "$logs/bench-base-$((done_rounds + 1)).txt" "$logs/bench-tree-$((done_rounds + 1)).txt"
  fi
  if ((done_rounds < rounds)); then
    echo "run: $done_rounds of $rounds rounds before the deadline (--deadline $deadline s)"
    ncu=0
  fi
  if ((done_rounds == 0)); then
    [[ -z "${AB_PACK:-}" ]] || bash "$root/scripts/pack-logs.sh" "$logs" || true
    echo "gpu-ab.sh: run: no round finished before the deadline" >&2
    return 1
  fi
  if ((ncu)); then
    command -v ncu >/dev/null || die "run: --ncu, but ncu is not on the PATH"
    # ncu-layer.sh profiles with ncu-roofline.sh's metrics, so that each side's layer has its
    # floors and budgets too; ncu-compare.sh reads the durations among them.
    local -A launches=([base]="${AB_LAUNCHES_BASE:-$kLayerLaunches}"
                       [tree]="${AB_LAUNCHES_TREE:-$kLayerLaunches}")
    for d in bf16 f16; do
      for side in base tree; do
        l="$(left)"
        if [[ -n "$l" ]] && ((l <= 0)); then
          echo "ncu $d $side: not run (--deadline $deadline s)"
          continue
        fi
        rm -f "$logs/ncu-$side-$d.csv" "$logs/ncu-$side-$d-roofline.txt"  # this run's own
        timed "$l" bash "$root/scripts/ncu-layer.sh" "${bin[$side]}" "$d" "$logs/ncu-$side-$d" \
          --launches "${launches[$side]}" || true
      done
      bash "$root/scripts/ncu-compare.sh" "$logs/ncu-base-$d.csv" "$logs/ncu-tree-$d.csv" \
        "base" "tree" >"$logs/ncu-$d-vs.txt" 2>&1 || true
      echo "ncu $d, base -> tree (largest differences):"
      head -n 8 "$logs/ncu-$d-vs.txt"
      tail -n 1 "$logs/ncu-$d-vs.txt"
      echo "ncu $d, the layer's roofline, base then tree:"
      for side in base tree; do
        # ncu-roofline.sh says which launches `layer` found; an explicit list is as given.
        grep -m 1 '^launches: ' "$logs/ncu-$side-$d-roofline.txt" ||
          echo "launches: ${launches[$side]}"
        grep -E "^(kernels but|GEMMs \(cuBLAS\):|all kernels)" \
          "$logs/ncu-$side-$d-roofline.txt" || true
      done
    done
  fi
  summary "$logs"
  # AB_PACK=1: the logs under $logs into one logs.tar.gz there (scripts/pack-logs.sh; an --ncu
  # run writes about 20 files, the device tool returns 8).
  if [[ -n "${AB_PACK:-}" ]]; then
    bash "$root/scripts/pack-logs.sh" "$logs" || die "run: AB_PACK: the logs were not packed"
  fi
  ((done_rounds == rounds))
}

# build: the two builds of run, alone.
build() {
  [[ $# -eq 0 ]] || die "build: no arguments (got $*)"
  build_both "$(logs_dir)" build
  echo "built base $(cat "$ab/base.rev") (build-ab/base/build) and the working tree (build-gpu)"
}

[[ $# -ge 1 ]] ||
  die "usage: gpu-ab.sh pack REV [--force] | build | run [--rounds N] [--ncu] [-- ARGS] | summary DIR"
cmd="$1"
shift
case "$cmd" in
  pack) pack "$@" ;;
  build) build "$@" ;;
  run) run "$@" ;;
  summary) summary "$@" ;;
  *) die "unknown command $cmd (pack, build, run or summary)" ;;
esac
