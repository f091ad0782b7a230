#!/usr/bin/env bash
# scripts/ncu-layer.sh with a stand-in ncu that records its arguments and prints a miniature
# one-layer profile: the profiled command (the binary's official bf16/f16 forward + backward)
# and the metrics (ncu-roofline.sh's), the two files it writes and the roofline of the layer's
# launches (found by the norms, or as --launches gives them); and the refusals (outputs that
# exist, left as they were; a bad dtype; a missing binary; no ncu; ncu failing, with its status;
# a profile whose layer cannot be found).
# Usage: ncu_layer_test.sh SCRIPT
set -euo pipefail
script="$1"
here="$(cd "$(dirname "$script")" && pwd)"
# shellcheck source=ncu_test_lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/ncu_test_lib.sh"
fail() {
  echo "FAIL: $*"
  exit 1
}
mkdir -p "$work/bin" "$work/out"
cat >"$work/bin/ncu" <<'STANDIN'
#!/usr/bin/env bash
printf '%s\n' "$*" >"$NCU_ARGS"
if [[ -n "${NCU_FAIL:-}" ]]; then echo "==ERROR== the stand-in fails"; exit 3; fi
echo "==PROF== Connected to process 1 (m3h)"
cat "$NCU_CSV"
STANDIN
chmod +x "$work/bin/ncu"
printf '#!/bin/sh\nexit 0\n' >"$work/m3h"
chmod +x "$work/m3h"
ncu_layer_csv >"$work/layer.csv"
export PATH="$work/bin:$PATH" NCU_ARGS="$work/args" NCU_CSV="$work/layer.csv"

bash "$script" "$work/m3h" f16 "$work/out/a" || fail "a run: exit $?"
want="--clock-control none --print-units base --metrics $(bash "$here/ncu-roofline.sh" --metrics)"
want+=" --csv $work/m3h bench --no-reference --shapes official --dtype f16 --scan chunked"
want+=" --recompute none --warmup 0 --repeats 1"
[[ "$(cat "$work/args")" == "$want" ]] || fail "ncu's arguments: $(cat "$work/args")"
grep -q '^==PROF== Connected' "$work/out/a.csv" && grep -qF "$(sed -n 2p "$work/layer.csv")" \
  "$work/out/a.csv" || fail "a.csv is not ncu's output"
[[ "$(head -n 1 "$work/out/a-roofline.txt")" == \
   "launches: 4-6,9-12 (the layer's, found by its norms)" ]] ||
  fail "the roofline's launches: $(head -n 1 "$work/out/a-roofline.txt")"
[[ "$(tail -n +2 "$work/out/a-roofline.txt")" == \
   "$(bash "$here/ncu-roofline.sh" "$work/layer.csv" --launches 4-6,9-12)" ]] ||
  fail "the roofline is not the layer's: $(cat "$work/out/a-roofline.txt")"

bash "$script" "$work/m3h" bf16 "$work/out/b" --launches 4-6 --copy 1000 ||
  fail "--launches: exit $?"
[[ "$(cat "$work/out/b-roofline.txt")" == \
   "$(bash "$here/ncu-roofline.sh" "$work/layer.csv" --launches 4-6 --copy 1000)" ]] ||
  fail "--launches 4-6 --copy 1000: $(cat "$work/out/b-roofline.txt")"

cp "$work/out/a-roofline.txt" "$work/kept.txt"
expect_refusal "$script" "an existing output" "$work/m3h" f16 "$work/out/a"
cmp -s "$work/out/a-roofline.txt" "$work/kept.txt" || fail "an existing output was replaced"
expect_refusal "$script" "a bad dtype" "$work/m3h" f32 "$work/out/c"
expect_refusal "$script" "a missing binary" "$work/none" bf16 "$work/out/c"
expect_refusal "$script" "an unknown option" "$work/m3h" bf16 "$work/out/c" --fast
expect_refusal "$script" "too few arguments" "$work/m3h" bf16
NCU_FAIL=1 expect_refusal "$script" "a failing ncu" "$work/m3h" bf16 "$work/out/d"
rc=0
NCU_FAIL=1 bash "$script" "$work/m3h" bf16 "$work/out/e" 2>/dev/null || rc=$?
((rc == 3)) || fail "a failing ncu: exit $rc, not ncu's 3"
NCU_CSV="$work/out/a-roofline.txt" expect_refusal "$script" "a profile without the layer" \
  "$work/m3h" bf16 "$work/out/f"
if ! PATH=/usr/bin:/bin command -v ncu >/dev/null; then
  PATH=/usr/bin:/bin expect_refusal "$script" "no ncu on the PATH" "$work/m3h" bf16 "$work/out/g"
fi
echo "ncu-layer: the profiled command, its files, the layer's roofline and refusals checked"
