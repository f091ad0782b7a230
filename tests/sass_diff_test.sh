#!/usr/bin/env bash
# scripts/sass-diff.sh end to end in a scratch repository, with a stand-in compiler and
# disassembler: the "compiler" copies the source and the headers it includes (from the -I
# directories it was given) into the cubin, the "disassembler" prints the `//@` lines as SASS.
# So the test sees which tree each side was compiled from: a change only in a header (of gpu/ or
# reference/) must reach the source that includes it (default source list), the base side must
# read the base's header (the -I paths rewritten), both sides are compiled from one directory
# (the stand-in's code, like nvcc's, depends on it), a register renaming is `same` (exit 0), a
# product fused the other way `DIFFERS` (exit 1), a source of host code only reads "no kernel on
# either side", and bad use (no compile database, an existing --out, a bad revision, a failed
# compile, no disassembler) is one line and exit 2; find-cuobjdump.sh's order ($M3_CUOBJDUMP,
# the PATH, .sass-tools).
# Usage: sass_diff_test.sh SCRIPTS_DIR
set -euo pipefail
scripts="$1"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
fail() { echo "FAIL: $*"; exit 1; }

repo="$work/repo"
mkdir -p "$repo/scripts" "$repo/gpu" "$work/build" "$work/bin"
cp "$scripts/sass-diff.sh" "$scripts/fp-forms.py" "$scripts/find-cuobjdump.sh" "$repo/scripts/"

cat >"$work/bin/nvcc" <<'EOF'
#!/usr/bin/env bash
# The stand-in compiler: needs -cubin and -arch=sm_90a; writes SRC and its included headers
# (looked up in the -I directories) to the -o file.
out="" inc=() cubin=0 arch=0
while (($#)); do
  case "$1" in
    -o) out="$2"; shift ;;
    -I*) inc+=("${1#-I}") ;;
    -cubin) cubin=1 ;;
    -arch=sm_90a) arch=1 ;;
    -c) echo "nvcc stand-in: -c left in the command" >&2; exit 1 ;;
  esac
  src="$1"
  shift
done
((cubin && arch)) || { echo "nvcc stand-in: not -cubin -arch=sm_90a" >&2; exit 1; }
grep -q BROKEN "$src" && { echo "nvcc stand-in: $src: error" >&2; exit 1; }
{ cat "$src"; sed -n 's/^#include "\(.*\)"$/\1/p' "$src" | while read -r h; do
    for d in "${inc[@]}"; do [[ -f "$d/$h" ]] && { cat "$d/$h"; break; }; done
  done
  # As nvcc's: the code of a kernel file depends on the directory it was compiled from.
  if grep -q '^//@' "$src"; then
    printf '//@ Function : _Z1pv\n//@ FMUL R1, R2, %d\n' "$(dirname "$src" | cksum | cut -d' ' -f1)"
  fi; } >"$out"
EOF
cat >"$work/bin/cuobjdump" <<'EOF'
#!/usr/bin/env bash
# The stand-in disassembler: `cuobjdump -sass FILE` prints FILE's //@ lines as SASS.
[[ "$1" == -sass ]] || exit 1
awk '/^\/\/@ Function : /{print "\t\t" substr($0, 4); next}
     /^\/\/@ /{printf "        /*%04x*/                   %s ;\n", n, substr($0, 5); n += 16}' "$2"
EOF
chmod +x "$work/bin/nvcc" "$work/bin/cuobjdump"
export M3_CUOBJDUMP="$work/bin/cuobjdump"

cat >"$repo/gpu/k.cu" <<'EOF'
#include "h.cuh"
//@ Function : _Z1kv
//@ FMUL R2, R3, R4
//@ FFMA R5, R6, R7, -R2
EOF
cat >"$repo/gpu/h.cuh" <<'EOF'
//@ Function : _Z1hv
//@ FMUL R2, R3, R4
//@ FFMA R5, R6, R7, -R2
EOF
mkdir -p "$repo/reference"
printf '#include "r.hpp"\n//@ Function : _Z1ov\n//@ FADD R1, R2, R3\n' >"$repo/gpu/other.cu"
printf '//@ Function : _Z1rv\n//@ FMUL R1, R2, R3\n' >"$repo/reference/r.hpp"
echo "// host code only: no kernel" >"$repo/gpu/host.cu"
python3 - "$work/build/compile_commands.json" "$work/build" "$repo" "$work/bin/nvcc" <<'EOF'
import json, sys
db, build, repo, nvcc = sys.argv[1:]
json.dump([{"directory": build, "file": f"{repo}/gpu/{f}",
            "command": f"{nvcc} -O3 --generate-code=arch=compute_90a,code=[compute_90a,sm_90a] "
                       f"-I{repo}/gpu -I{repo}/reference -x cu -c {repo}/gpu/{f} -o gpu/{f}.o"}
           for f in ("k.cu", "other.cu", "host.cu")], open(db, "w"))
EOF
git -C "$repo" init -q
git -C "$repo" add -A
git -C "$repo" -c user.name=t -c user.email=t@t commit -qm base

run() {  # run EXPECTED_EXIT ARGS...: sass-diff.sh's output in $out
  local want="$1" rc=0
  shift
  out="$(bash "$repo/scripts/sass-diff.sh" --build "$work/build" "$@" 2>&1)" || rc=$?
  [[ $rc == "$want" ]] || fail "sass-diff.sh $*: exit $rc (want $want): $out"
}

# 1. The header's registers renamed: only k.cu includes it, and it stays the same.
sed -i 's/R5, R6, R7, -R2/R9, R6, R7, -R2/' "$repo/gpu/h.cuh"
run 0 --out "$work/o1" HEAD
grep -qx 'gpu/k.cu: same: 3' <<<"$out" || fail "a renaming: $out"
[[ "$(grep -c '^gpu/' <<<"$out")" == 1 ]] || fail "sources beyond k.cu: $out"
[[ -f "$work/o1/gpu_k.cu.diff" && -f "$work/o1/summary.txt" ]] || fail "no verdicts written"

# 2. The header's other product fused: k.cu's _Z1hv differs, its own kernel does not.
sed -i 's/FFMA R9, R6, R7, -R2/FFMA R9, -R3, R4, R2/' "$repo/gpu/h.cuh"
run 1 --out "$work/o2" HEAD
grep -qx 'gpu/k.cu: DIFFERS: 1, same: 2' <<<"$out" || fail "a fused product: $out"
grep -q '^DIFFERS at arithmetic instruction 1 .* _Z1hv$' "$work/o2/gpu_k.cu.diff" ||
  fail "the differing function: $(cat "$work/o2/gpu_k.cu.diff")"
# Named sources are taken as given.
run 0 --out "$work/o3" HEAD gpu/other.cu
grep -qx 'gpu/other.cu: same: 3' <<<"$out" || fail "a named source: $out"
# A source of host code only has nothing to compare, and says so.
run 0 --out "$work/o8" HEAD gpu/host.cu
grep -qx 'gpu/host.cu: no kernel on either side' <<<"$out" || fail "a host-only source: $out"
# A reference/ header (the CUDA code includes reference/'s config and stage headers) reaches
# the gpu/ source that includes it.
sed -i 's/FMUL R1, R2, R3/FMUL R4, R2, R3/' "$repo/reference/r.hpp"
run 1 --out "$work/o7" HEAD
grep -qx 'gpu/other.cu: same: 3' <<<"$out" || fail "a reference/ header's includer: $out"

# 3. Refusals.
refuse() {  # refuse WHAT ARGS...
  local what="$1"
  shift
  run 2 "$@"
  [[ "$(grep -c . <<<"$out")" == 1 && "$out" == sass-diff.sh:* ]] || fail "$what: not one line: $out"
}
refuse "an existing --out" --out "$work/o1" HEAD
run 1 --out "$work/o1" --force HEAD
refuse "a bad revision" --out "$work/o4" no-such-rev
refuse "an unknown option" --bogus HEAD
out="$(bash "$repo/scripts/sass-diff.sh" --build "$work/nobuild" --out "$work/o5" HEAD 2>&1)" && fail "no database: exit 0"
[[ "$out" == *"no $work/nobuild/compile_commands.json"* ]] || fail "no database: $out"
echo "//@ BROKEN" >>"$repo/gpu/k.cu"
rc=0
out="$(bash "$repo/scripts/sass-diff.sh" --build "$work/build" --out "$work/o6" HEAD 2>&1)" || rc=$?
[[ $rc == 2 && "$(tail -n 1 <<<"$out")" == "sass-diff.sh: a compile failed (its log above)" ]] ||
  fail "a failed compile: exit $rc: $out"
[[ ! -e "$work/o6" ]] || fail "a failed compile wrote $work/o6"

# The disassembler (find-cuobjdump.sh): $M3_CUOBJDUMP, else the PATH's, else .sass-tools/bin's
# of the repository; one that is not executable is one line and exit 2, with no fallback.
find="$repo/scripts/find-cuobjdump.sh"
mkdir -p "$work/pathbin" "$repo/.sass-tools/bin"
printf '#!/bin/sh\n' >"$work/pathbin/cuobjdump"
printf '#!/bin/sh\n' >"$repo/.sass-tools/bin/cuobjdump"
chmod +x "$work/pathbin/cuobjdump" "$repo/.sass-tools/bin/cuobjdump"
[[ "$(bash "$find")" == "$M3_CUOBJDUMP" ]] || fail "find-cuobjdump: \$M3_CUOBJDUMP not first"
[[ "$(M3_CUOBJDUMP= PATH="$work/pathbin:/usr/bin:/bin" bash "$find")" == \
   "$work/pathbin/cuobjdump" ]] || fail "find-cuobjdump: the PATH's not before .sass-tools"
if ! PATH=/usr/bin:/bin command -v cuobjdump >/dev/null; then
  [[ "$(M3_CUOBJDUMP= PATH=/usr/bin:/bin bash "$find")" == "$repo/.sass-tools/bin/cuobjdump" ]] ||
    fail "find-cuobjdump: .sass-tools not the last resort"
fi
out="$(M3_CUOBJDUMP="$work/none" bash "$find" 2>&1)" &&
  fail "find-cuobjdump: a missing one accepted"
[[ "$(grep -c . <<<"$out")" == 1 && "$out" == "find-cuobjdump.sh: no cuobjdump at $work/none"* ]] ||
  fail "find-cuobjdump: $out"
out="$(M3_CUOBJDUMP="$work/none" bash "$repo/scripts/sass-diff.sh" --build "$work/build" \
  --out "$work/o7" HEAD 2>&1)" && fail "sass-diff without a disassembler: exit 0"
[[ "$out" == "sass-diff.sh: no cuobjdump at $work/none"* ]] || fail "sass-diff's refusal: $out"

echo "sass_diff_test: all checks passed"
