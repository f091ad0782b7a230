#!/usr/bin/env bash
# Whether a change keeps the GPU code's arithmetic, read from the SASS on this machine (no device
# call): each CUDA source is compiled to a cubin twice, at BASE and in the working tree, with the
# build's own flags, and the two disassemblies are compared function by function
# (scripts/fp-forms.py sass-diff: `same` = equal up to register allocation, so the same bits;
# `same arith` = the same float, tensor-core, memory and branch instructions on the same values,
# in order or as a dataflow, the integer address work placed differently; `DIFFERS` = not shown
# equal, naming the first arithmetic instruction that differs and whether the op shapes are
# equal; the comparison does not follow loops, so a rescheduled loop can read DIFFERS).
#
#   scripts/sass-diff.sh [--build DIR] [--out DIR] [--force] [--jobs N] BASE [SRC.cu...]
#
# BASE: a git revision. SRC: .cu files of the CUDA library (paths from the repository root);
# without them, every gpu/ .cu file that BASE..tree changed or that includes (directly or
# through other headers, by file name) a changed header of gpu/ or reference/ (the CUDA code
# includes reference/'s config, error and stage headers). The flags are the build's:
# DIR/compile_commands.json (default build-gpu; configure one with
# `cmake -S . -B build-gpu -DM3_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90a`, no build needed), with
# its -c/-o replaced by -cubin for sm_90a and the source root by one scratch directory that
# holds the tree's files, then BASE's (nvcc's code depends on the source's path).
# The disassembler: scripts/find-cuobjdump.sh's ($M3_CUOBJDUMP, else cuobjdump on the PATH, else
# .sass-tools/bin/cuobjdump from scripts/fetch-sass-tools.sh). The SASS is this machine's
# ptxas's; it is the device's where both have the same CUDA release.
# Writes under --out (default sass-diff/): per source NAME.base.sass, NAME.tree.sass and
# NAME.diff (the per-function verdicts; a source of host code only reads "no kernel on either
# side"), and summary.txt (one line per source); an existing
# --out is kept unless --force. Prints the summary. Exit 0 where every function is `same` or
# `same arith`, 1 where one differs or is on one side only, 2 on bad use or a failed compile
# (one line naming it).
set -euo pipefail

die() {
  echo "sass-diff.sh: $*" >&2
  exit 2
}
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="$root/build-gpu"
out="$root/sass-diff"
force=0
jobs="$(nproc)"
base=""
srcs=()
while (($#)); do
  case "$1" in
    --build) [[ $# -ge 2 ]] || die "--build needs a directory"; build="$2"; shift 2 ;;
    --out) [[ $# -ge 2 ]] || die "--out needs a directory"; out="$2"; shift 2 ;;
    --jobs) [[ $# -ge 2 && "$2" =~ ^[1-9][0-9]*$ ]] || die "--jobs needs a positive count"
            jobs="$2"; shift 2 ;;
    --force) force=1; shift ;;
    -*) die "unknown option $1" ;;
    *) if [[ -z "$base" ]]; then base="$1"; else srcs+=("$1"); fi; shift ;;
  esac
done
[[ -n "$base" ]] || die "usage: sass-diff.sh [--build DIR] [--out DIR] [--force] [--jobs N] BASE [SRC.cu...]"
cd "$root"
git rev-parse -q --verify "$base^{commit}" >/dev/null || die "$base is not a revision of this repository"
db="$build/compile_commands.json"
[[ -f "$db" ]] || die "no $db (configure a CUDA build: cmake -S . -B build-gpu -DM3_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90a)"
cuobjdump="$(bash scripts/find-cuobjdump.sh 2>&1)" || die "${cuobjdump#find-cuobjdump.sh: }"
if [[ -e "$out" && $force -eq 0 ]]; then die "$out exists (--force replaces it)"; fi

# The default sources: changed gpu/ files, closed over #include "name" by file name.
if ((${#srcs[@]} == 0)); then
  mapfile -t changed < <(git diff --name-only "$base" -- gpu reference)
  ((${#changed[@]})) || die "BASE..tree changes nothing under gpu/ or reference/ (name the sources)"
  declare -A hit=()
  for f in "${changed[@]}"; do hit["$f"]=1; done
  mapfile -t all < <(git ls-files gpu reference | grep -E '\.(cu|cuh|h|hpp)$')
  grew=1
  while ((grew)); do
    grew=0
    for f in "${all[@]}"; do
      [[ -n "${hit[$f]:-}" ]] && continue
      for c in "${!hit[@]}"; do
        if grep -qE "#include \"([^\"]*/)?$(basename "$c")\"" "$f"; then hit["$f"]=1; grew=1; break; fi
      done
    done
  done
  for f in "${!hit[@]}"; do [[ "$f" == *.cu && -f "$f" ]] && srcs+=("$f"); done
  mapfile -t srcs < <(printf '%s\n' "${srcs[@]}" | sort)
fi
((${#srcs[@]})) || die "no .cu source to compare"

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/out"

# Both sides are compiled from one path, $work/src: nvcc names an anonymous namespace after the
# source's path, and that name alone moves ptxas's code (an unchanged chunked_bwd.cu compiled
# from two directories read DIFFERS in one kernel). So the tree's files are copied there and
# compiled, then BASE's archive takes their place and is compiled.
src_dir="$work/src"
# One compile line per source: the build's command with -c SRC -o OBJ → -cubin -o CUBIN for
# sm_90a, the repository root → $src_dir.
commands() {  # commands SIDE
  python3 - "$db" "$root" "$src_dir" "$work/out" "$1" "${srcs[@]}" <<'EOF'
import json, shlex, sys
db, root, tree, out, side, srcs = *sys.argv[1:6], sys.argv[6:]
entries = {e["file"]: e for e in json.load(open(db))}
for src in srcs:
    e = entries.get(f"{root}/{src}")
    if e is None:
        sys.stderr.write(f"sass-diff.sh: {src} is not in {db}\n")
        sys.exit(1)
    args = e.get("arguments") or shlex.split(e["command"])
    name = src.replace("/", "_")
    cmd, skip = [], 0
    for a in args:
        if skip:
            skip -= 1
            continue
        if a in ("-c", "-o"):
            skip = 1
            continue
        if a.startswith("--generate-code") or a.startswith("-gencode") or a.startswith("-arch"):
            continue
        cmd.append(a.replace(root + "/", tree + "/"))
    cmd += ["-arch=sm_90a", "-cubin", "-o", f"{out}/{name}.{side}.cubin", f"{tree}/{src}"]
    print(e["directory"] + "\t" + name + "." + side + "\t" + shlex.join(cmd))
EOF
}
commands tree >"$work/commands.tree" ||
  die "no compile command for a source (is it in the CUDA library of $build?)"
commands base >"$work/commands.base"

# compile_side SIDE: that side's commands, $jobs at a time, each awaited by its own pid (the
# oldest first): `wait -n` can miss a job that ended before it was called and return 127, a
# failure with no log; `wait PID` returns that job's status however long ago it ended. A failed
# compile ends the run.
compile_side() {
  local failed=0 dir name cmd pid
  local -a pids=()
  while IFS=$'\t' read -r dir name cmd; do
    if ((${#pids[@]} >= jobs)); then
      wait "${pids[0]}" || failed=1
      pids=("${pids[@]:1}")
    fi
    ( (cd "$dir" && eval "$cmd") >"$work/out/$name.log" 2>&1 || { echo "sass-diff.sh: $name failed" >&2; exit 1; } ) &
    pids+=("$!")
  done <"$work/commands.$1"
  for pid in "${pids[@]}"; do
    wait "$pid" || failed=1
  done
  if ((failed)); then
    for l in "$work"/out/*.log; do
      [[ -s "$l" ]] && { echo "--- $(basename "$l" .log)"; tail -n 5 "$l"; }
    done >&2
    die "a compile failed (its log above)"
  fi
}

echo "sass-diff.sh: ${#srcs[@]} sources in the tree, then at $base, $jobs at a time"
mkdir "$src_dir"
# The working tree as it is (tracked and untracked files, not the ignored ones).
git ls-files -z --cached --others --exclude-standard |
  tar --null --ignore-failed-read -T - -cf - 2>/dev/null | tar -x -C "$src_dir" ||
  die "cannot copy the working tree"
compile_side tree
rm -rf "$src_dir"
mkdir "$src_dir"
git archive "$base" | tar -x -C "$src_dir" || die "git archive $base failed"
compile_side base

status=0
: >"$work/out/summary.txt"
for src in "${srcs[@]}"; do
  name="${src//\//_}"
  for side in base tree; do
    "$cuobjdump" -sass "$work/out/$name.$side.cubin" >"$work/out/$name.$side.sass" ||
      die "$cuobjdump cannot read $name.$side.cubin"
  done
  # A source of host code only has no function on either side: nothing to compare. Functions on
  # one side only are a difference.
  kernels=0
  for side in base tree; do
    if grep -q "Function :" "$work/out/$name.$side.sass"; then kernels=$((kernels + 1)); fi
  done
  if ((kernels == 0)); then
    echo "no kernel on either side" >"$work/out/$name.diff"
  elif ((kernels == 1)); then
    echo "DIFFERS: kernels on one side only" >"$work/out/$name.diff"
    status=1
  else
    rc=0
    python3 scripts/fp-forms.py sass-diff "$work/out/$name.base.sass" \
      "$work/out/$name.tree.sass" >"$work/out/$name.diff" || rc=$?
    ((rc <= 1)) || die "fp-forms.py sass-diff failed on $src"
    ((rc == 0)) || status=1
  fi
  echo "$src: $(tail -n 1 "$work/out/$name.diff" | sed 's/^# //')" | tee -a "$work/out/summary.txt"
done
rm -f "$work"/out/*.cubin "$work"/out/*.log
rm -rf "$out"
mkdir -p "$(dirname "$out")"
mv "$work/out" "$out"
echo "sass-diff.sh: per-function verdicts in $out/ (NAME.diff)"
exit "$status"
