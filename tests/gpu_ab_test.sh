#!/usr/bin/env bash
# scripts/gpu-ab.sh without a GPU: `pack` in a throwaway repository (the archive holds the
# build's inputs of the revision asked for, not the working tree's; an existing pack is kept
# without --force; a bad revision is refused), `summary` on bench logs written here (medians per
# side and tree − base for each marginal-layer line), and the refusals of every command, each one
# line and exit 2 (`run` without a pack stops before it builds anything); `run --no-build` over
# stand-ins for the two binaries (the sides alternate base first, the bench arguments pass
# through, the summary is that run's; AB_PACK=1 packs the run's logs into ab/logs.tar.gz; --ncu
# profiles each side and dtype through ncu-layer.sh, with a stand-in ncu).
# Usage: gpu_ab_test.sh SCRIPT
set -euo pipefail
script="$1"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
fail() {
  echo "FAIL: $*"
  exit 1
}
expect_refusal() {  # expect_refusal WHAT CMD...: exit 2 and one gpu-ab.sh line on stderr
  local what="$1" msg rc=0
  shift
  msg="$("$@" 2>&1 >/dev/null)" || rc=$?
  [[ $rc == 2 ]] || fail "$what: exit $rc, not 2: $msg"
  [[ "$(grep -c . <<<"$msg")" == 1 && "$msg" == gpu-ab.sh:* ]] ||
    fail "$what: not one gpu-ab.sh line: $msg"
}

# --- pack --------------------------------------------------------------------------------------
repo="$work/repo"
mkdir -p "$repo/scripts" "$repo/gpu" "$repo/notes"
cp "$script" "$repo/scripts/gpu-ab.sh"
for f in pack-logs.sh ncu-layer.sh ncu-roofline.sh ncu-compare.sh ncu-csv.awk; do
  cp "$(dirname "$script")/$f" "$repo/scripts/$f"
done
echo "project(x)" >"$repo/CMakeLists.txt"
echo "first" >"$repo/gpu/k.cu"
echo "add_library(k k.cu)" >"$repo/gpu/CMakeLists.txt"
echo "not a build input" >"$repo/NOTES.md"
echo "a folder without a CMakeLists.txt" >"$repo/notes/a.md"
g() { git -C "$repo" -c user.name=t -c user.email=t@t "$@"; }
g init -q
g add -A
g commit -q -m one
first="$(g rev-parse HEAD)"
echo "second" >"$repo/gpu/k.cu"
mkdir -p "$repo/bench"  # a folder the build adds later, which the pack must follow
echo "add_executable(b b.cu)" >"$repo/bench/CMakeLists.txt"
echo "int main() {}" >"$repo/bench/b.cu"
g add -A
g commit -q -m two
echo "uncommitted" >"$repo/gpu/k.cu"
export AB_DIR="$work/ab"
ab() { bash "$repo/scripts/gpu-ab.sh" "$@"; }
ab pack HEAD~1 >/dev/null
[[ -f "$AB_DIR/base.tar" ]] || fail "no base.tar"
[[ "$(cat "$AB_DIR/base.rev")" == "$first" ]] || fail "base.rev is not the packed commit"
listing="$(tar -tf "$AB_DIR/base.tar")"
grep -qx "gpu/k.cu" <<<"$listing" || fail "gpu/k.cu not packed"
grep -qx "CMakeLists.txt" <<<"$listing" || fail "CMakeLists.txt not packed"
grep -qx "scripts/gpu-ab.sh" <<<"$listing" || fail "scripts/ not packed"
if grep -q "NOTES.md" <<<"$listing"; then fail "a file that is no build input"; fi
if grep -q "^notes/" <<<"$listing"; then fail "a folder without a CMakeLists.txt"; fi
if grep -q "^bench/" <<<"$listing"; then fail "a folder the packed revision does not have"; fi
[[ "$(tar -xOf "$AB_DIR/base.tar" gpu/k.cu)" == first ]] || fail "not the revision's content"
sum="$(cksum <"$AB_DIR/base.tar")"
expect_refusal "a second pack without --force" ab pack HEAD
[[ "$(cksum <"$AB_DIR/base.tar")" == "$sum" ]] || fail "the refused pack changed base.tar"
ab pack HEAD --force >/dev/null
[[ "$(tar -xOf "$AB_DIR/base.tar" gpu/k.cu)" == second ]] || fail "--force did not replace it"
# (the listing first: grep -q stops reading early, and pipefail would count tar's broken pipe)
listing="$(tar -tf "$AB_DIR/base.tar")"
grep -qx "bench/b.cu" <<<"$listing" || fail "the folder added later not packed"
expect_refusal "a bad revision" ab pack no-such-rev --force
expect_refusal "pack without a revision" ab pack
expect_refusal "pack with two revisions" ab pack HEAD HEAD~1 --force
expect_refusal "an unknown pack option" ab pack HEAD --frce

# --- summary -----------------------------------------------------------------------------------
logs="$work/logs"
mkdir -p "$logs"
bench() {  # bench FILE BF16_FWD BF16_FB F16_FWD F16_FB
  {
    echo "m3h bench: GPU path, CUDA events"
    echo "official  bf16  chunked  none       1  32768        2.447          2.447          7.181"
    printf 'marginal layer (official2 - official), bf16 chunked rc=none: fwd %s ms, ' "$2"
    printf 'fwd+bwd %s ms, 5.077 Mtok/s\n' "$3"
    printf 'marginal layer (official2 - official), f16 chunked rc=none : fwd %s ms, ' "$4"
    printf 'fwd+bwd %s ms, 4.905 Mtok/s\n' "$5"
  } >"$1"
}
bench "$logs/bench-base-1.txt" 2.10 6.50 2.40 6.90
bench "$logs/bench-tree-1.txt" 2.00 6.40 2.20 6.70
bench "$logs/bench-base-2.txt" 2.30 6.60 2.50 7.00
bench "$logs/bench-tree-2.txt" 2.02 6.20 2.30 6.80
bench "$logs/bench-base-3.txt" 2.20 6.55 2.45 6.95
bench "$logs/bench-tree-3.txt" 2.01 6.30 2.25 6.75
out="$(ab summary "$logs")"
row() { grep -E "^$1 +$2 " <<<"$out" | awk '{print $(NF - 1), $NF}'; }
[[ "$(row 'bf16 chunked rc=none' base)" == "2.200 6.550" ]] || fail "bf16 base medians: $out"
[[ "$(row 'bf16 chunked rc=none' tree)" == "2.010 6.300" ]] || fail "bf16 tree medians: $out"
[[ "$(row 'bf16 chunked rc=none' diff)" == "-0.190 -0.250" ]] || fail "bf16 diff: $out"
[[ "$(row 'f16 chunked rc=none' diff)" == "-0.200 -0.200" ]] || fail "f16 diff: $out"
grep -qE "^bf16 chunked rc=none +base +2.10 2.30 2.20 " <<<"$out" || fail "runs in order: $out"
[[ "$(grep -c . <<<"$out")" == 7 ]] || fail "a header and three rows per line: $out"
rm "$logs"/bench-base-3.txt "$logs"/bench-tree-3.txt
out="$(ab summary "$logs")"
[[ "$(row 'bf16 chunked rc=none' base)" == "2.200 6.550" ]] || fail "the median of two runs: $out"
mkdir -p "$work/none" "$work/nolines"
expect_refusal "a summary without logs" ab summary "$work/none"
echo "no marginal line" >"$work/nolines/bench-base-1.txt"
cp "$work/nolines/bench-base-1.txt" "$work/nolines/bench-tree-1.txt"
expect_refusal "logs without marginal lines" ab summary "$work/nolines"
expect_refusal "a missing directory" ab summary "$work/missing"

# --- run --no-build, over stand-ins for the two m3h binaries ------------------------------------
# Each stand-in appends "SIDE ARGS" to calls.txt and prints the marginal lines of a bench whose
# fwd+bwd is 6.5 + round/100 ms on the base side and 0.1 ms less on the tree side.
mkdir -p "$work/bin"
for side in base tree; do
  cat >"$work/bin/m3h-$side" <<STUB
#!/usr/bin/env bash
echo "$side \$*" >>"$work/calls.txt"
k=\$(grep -c "^$side " "$work/calls.txt")
[[ -e "$work/fail-$side" ]] && exit 3
[[ -e "$work/slow" ]] && sleep "\$(cat "$work/slow")"
fb=\$(awk -v k="\$k" -v s="$side" 'BEGIN { printf "%.3f", 6.5 + k / 100 - (s == "tree") * 0.1 }')
echo "marginal layer (official2 - official), bf16 chunked rc=none: fwd 2.100 ms, fwd+bwd \$fb ms, x"
STUB
  chmod +x "$work/bin/m3h-$side"
done
export AB_M3H_BASE="$work/bin/m3h-base" AB_M3H_TREE="$work/bin/m3h-tree"
runlogs="$work/out"
mkdir -p "$runlogs/ab"
touch "$runlogs/ab/bench-base-9.txt"  # an earlier run's round: not part of this one's summary
out="$(OUT="$runlogs" ab run --no-build --rounds 3 -- --shapes official --dtype bf16)"
[[ "$(cut -d' ' -f1 "$work/calls.txt" | tr '\n' ' ')" == "base tree base tree base tree " ]] ||
  fail "sides not alternated base first: $(cat "$work/calls.txt")"
[[ "$(sed -n 1p "$work/calls.txt")" == "base bench --shapes official --dtype bf16" ]] ||
  fail "bench arguments not passed through: $(sed -n 1p "$work/calls.txt")"
[[ ! -e "$runlogs/ab/bench-base-9.txt" ]] || fail "an earlier run's round was kept"
[[ "$(row 'bf16 chunked rc=none' base)" == "2.100 6.520" ]] || fail "run's base medians: $out"
[[ "$(row 'bf16 chunked rc=none' diff)" == "+0.000 -0.100" ]] || fail "run's diff: $out"
rm "$work/calls.txt"
OUT="$runlogs" ab run --no-build --rounds 1 >/dev/null
grep -q "^tree bench --no-reference --shapes default,official,official2 --dtype bf16,f16 " \
  "$work/calls.txt" || fail "the default bench arguments: $(cat "$work/calls.txt")"
# AB_PACK=1: the run's logs in ab/logs.tar.gz and nothing else beside it (scripts/pack-logs.sh).
out="$(AB_PACK=1 OUT="$runlogs" ab run --no-build --rounds 2)"
[[ "$(row 'bf16 chunked rc=none' diff)" == "+0.000 -0.100" ]] || fail "AB_PACK's summary: $out"
[[ "$(ls "$runlogs/ab")" == logs.tar.gz ]] || fail "AB_PACK left: $(ls "$runlogs/ab")"
[[ "$(tar -tzf "$runlogs/ab/logs.tar.gz" | sort | tr '\n' ' ')" == \
  "bench-base-1.txt bench-base-2.txt bench-tree-1.txt bench-tree-2.txt " ]] ||
  fail "AB_PACK's archive: $(tar -tzf "$runlogs/ab/logs.tar.gz")"
[[ "$(tar -xzOf "$runlogs/ab/logs.tar.gz" bench-tree-2.txt)" == marginal* ]] ||
  fail "AB_PACK's archive does not hold the bench output"
msg="$(bash "$repo/scripts/pack-logs.sh" "$work/missing" 2>&1)" && fail "pack-logs.sh of a missing dir"
[[ "$msg" == "pack-logs.sh: no directory $work/missing" ]] || fail "pack-logs.sh's refusal: $msg"
touch "$work/fail-tree"
OUT="$runlogs" expect_refusal "a failing bench" ab run --no-build --rounds 1
rm "$work/fail-tree"
AB_M3H_TREE="$work/bin/missing" OUT="$runlogs" expect_refusal "--no-build without a build" \
  ab run --no-build

# --ncu with a stand-in ncu (a miniature one-layer profile, tests/ncu_test_lib.sh): each side
# and dtype through scripts/ncu-layer.sh, an earlier run's files replaced, and each side's layer
# roofline in the output.
(source "$(dirname "${BASH_SOURCE[0]}")/ncu_test_lib.sh" && ncu_layer_csv) >"$work/layer.csv"
printf '#!/usr/bin/env bash\necho "$*" >>"%s"\ncat "%s"\n' "$work/ncu-calls.txt" \
  "$work/layer.csv" >"$work/bin/ncu"
chmod +x "$work/bin/ncu"
echo stale >"$runlogs/ab/ncu-tree-f16-roofline.txt"
out="$(PATH="$work/bin:$PATH" OUT="$runlogs" ab run --no-build --rounds 1 --ncu)" ||
  fail "run --ncu: $out"
[[ "$(grep -c ' bench --no-reference --shapes official ' "$work/ncu-calls.txt")" == 4 ]] ||
  fail "run --ncu: not four profiles: $(cat "$work/ncu-calls.txt")"
for side in base tree; do
  for d in bf16 f16; do
    grep -q "m3h-$side bench .* --dtype $d " "$work/ncu-calls.txt" ||
      fail "run --ncu: no $side $d profile"
    [[ "$(head -n 1 "$runlogs/ab/ncu-$side-$d-roofline.txt")" == "launches: 4-6,9-12 "* ]] ||
      fail "run --ncu: ncu-$side-$d-roofline.txt: $(cat "$runlogs/ab/ncu-$side-$d-roofline.txt")"
  done
done
[[ "$(grep -c '^kernels but the GEMMs: 5 launches' <<<"$out")" == 4 &&
   "$(grep -c '^launches: 4-6,9-12 ' <<<"$out")" == 4 ]] ||
  fail "run --ncu: each side's layer roofline not printed: $out"

# --deadline: benches of 0.6 s, five rounds asked, 3 s given: the rounds done are whole (as many
# base logs as tree logs), fewer than five, and the exit status says so; a bench that would take
# 30 s is stopped at a 2 s deadline, long before its end.
echo 0.6 >"$work/slow"
rm -rf "$runlogs/ab"
rc=0
out="$(OUT="$runlogs" ab run --no-build --rounds 5 --deadline 3 2>&1)" || rc=$?
[[ $rc == 1 ]] || fail "--deadline: exit $rc (want 1): $out"
nb=$(ls "$runlogs/ab" | grep -c '^bench-base-' || true)
nt=$(ls "$runlogs/ab" | grep -c '^bench-tree-' || true)
[[ $nb == "$nt" ]] || fail "--deadline left a half round: $(ls "$runlogs/ab")"
((nb < 5)) || fail "--deadline: all five rounds ran"
[[ "$out" == *"$nb of 5 rounds before the deadline"* || ($nb == 0 && "$out" == *"no round finished"*) ]] ||
  fail "--deadline: not said: $out"
echo 30 >"$work/slow"
t0=$(date +%s)
rc=0
out="$(OUT="$runlogs" ab run --no-build --rounds 1 --deadline 2 2>&1)" || rc=$?
[[ $rc == 1 && "$out" == *"stopped at the deadline"* && "$out" == *"no round finished"* ]] ||
  fail "--deadline over a long bench: exit $rc: $out"
(($(date +%s) - t0 < 15)) || fail "--deadline waited for the bench"
rm "$work/slow"

# --- run and the command line --------------------------------------------------------------------
AB_DIR="$work/empty" expect_refusal "run without a pack" ab run
[[ ! -e "$work/empty/base" ]] || fail "run without a pack unpacked something"
AB_DIR="$work/empty" OUT="$work/out-build" expect_refusal "build without a pack" ab build
[[ ! -e "$work/empty/base" && ! -e "$work/out-build" ]] ||
  fail "build without a pack unpacked or wrote something"
expect_refusal "build with an argument" ab build --rounds 2
expect_refusal "run --rounds 0" ab run --rounds 0
expect_refusal "run --deadline soon" ab run --deadline soon
expect_refusal "run with a stray argument" ab run --official
expect_refusal "an unknown command" ab bench
expect_refusal "no command" ab
echo "gpu-ab: pack, summary, run --no-build (with --ncu) and refusals checked"
