#!/usr/bin/env bash
# scripts/gpu-ab.sh without a GPU: `pack` in a throwaway repository (the archive holds the
# build's inputs of the revision asked for, not the working tree's; an existing pack is kept
# without --force; a bad revision is refused), `summary` on bench logs written here (medians per
# side and tree − base for each marginal-layer line), and the refusals of every command, each one
# line and exit 2 (`run` without a pack stops before it builds anything).
# Usage: gpu_ab_test.sh SCRIPT
set -euo pipefail
script="$1"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
fail() {
  echo "FAIL: $*"
  exit 1
}
expect_refusal() {  # expect_refusal WHAT CMD...
  local what="$1" msg
  shift
  if msg="$("$@" 2>&1)"; then fail "$what was accepted: $msg"; fi
  [[ "$(grep -c . <<<"$msg")" == 1 && "$msg" == gpu-ab.sh:* ]] ||
    fail "$what: not one gpu-ab.sh line: $msg"
}

# --- pack --------------------------------------------------------------------------------------
repo="$work/repo"
mkdir -p "$repo/scripts" "$repo/gpu"
cp "$script" "$repo/scripts/gpu-ab.sh"
echo "project(x)" >"$repo/CMakeLists.txt"
echo "first" >"$repo/gpu/k.cu"
echo "not a build input" >"$repo/NOTES.md"
g() { git -C "$repo" -c user.name=t -c user.email=t@t "$@"; }
g init -q
g add -A
g commit -q -m one
first="$(g rev-parse HEAD)"
echo "second" >"$repo/gpu/k.cu"
g commit -q -am two
echo "uncommitted" >"$repo/gpu/k.cu"
export AB_DIR="$work/ab"
ab() { bash "$repo/scripts/gpu-ab.sh" "$@"; }
ab pack HEAD~1 >/dev/null
[[ -f "$AB_DIR/base.tar" ]] || fail "no base.tar"
[[ "$(cat "$AB_DIR/base.rev")" == "$first" ]] || fail "base.rev is not the packed commit"
listing="$(tar -tf "$AB_DIR/base.tar")"
grep -qx "gpu/k.cu" <<<"$listing" || fail "gpu/k.cu not packed"
grep -qx "CMakeLists.txt" <<<"$listing" || fail "CMakeLists.txt not packed"
if grep -q "NOTES.md" <<<"$listing"; then fail "a file that is no build input"; fi
[[ "$(tar -xOf "$AB_DIR/base.tar" gpu/k.cu)" == first ]] || fail "not the revision's content"
sum="$(cksum <"$AB_DIR/base.tar")"
expect_refusal "a second pack without --force" ab pack HEAD
[[ "$(cksum <"$AB_DIR/base.tar")" == "$sum" ]] || fail "the refused pack changed base.tar"
ab pack HEAD --force >/dev/null
[[ "$(tar -xOf "$AB_DIR/base.tar" gpu/k.cu)" == second ]] || fail "--force did not replace it"
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

# --- run and the command line --------------------------------------------------------------------
AB_DIR="$work/empty" expect_refusal "run without a pack" ab run
[[ ! -e "$work/empty/base" ]] || fail "run without a pack unpacked something"
expect_refusal "run --rounds 0" ab run --rounds 0
expect_refusal "run with a stray argument" ab run --official
expect_refusal "an unknown command" ab bench
expect_refusal "no command" ab
echo "gpu-ab: pack, summary and refusals checked"
