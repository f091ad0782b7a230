#!/usr/bin/env bash
# scripts/mutate.sh without a build: --check over a list written here against a small tree
# (a mutant found once passes; one found twice or not at all, or naming a missing file, is
# refused in one line naming it, exit 1), a malformed list or option is one line and exit 2,
# --check over a good list leaves the tree byte for byte as it was, and a scratch folder inside
# the tree or a foreign non-empty one is refused before anything is copied or built.
# Usage: mutate_test.sh SCRIPT
set -euo pipefail
script="$1"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
fail() {
  echo "FAIL: $*"
  exit 1
}
# expect RC WHAT NEEDLE CMD...: exit status RC, stderr of one "mutate:" line holding NEEDLE
expect() {
  local want="$1" what="$2" needle="$3" msg rc=0
  shift 3
  msg="$("$@" 2>&1 >/dev/null)" || rc=$?
  [[ $rc == "$want" ]] || fail "$what: exit $rc, not $want: $msg"
  [[ "$(grep -c . <<<"$msg")" == 1 && "$msg" == mutate:* ]] || fail "$what: not one mutate: line: $msg"
  [[ "$msg" == *"$needle"* ]] || fail "$what: '$needle' not in: $msg"
}

tree="$work/tree"
mkdir -p "$tree/scripts" "$tree/src"
cp "$script" "$tree/scripts/mutate.sh"
printf 'int f(int a) {\n  return a + 1;  // once\n}\nint g(int a) { return a * 2; }\nint h(int a) { return a * 2; }\n' \
  >"$tree/src/a.cpp"
before="$(cksum <"$tree/src/a.cpp")"
list() { printf '%s\n' "$@" >"$work/list.txt"; }
run() { bash "$tree/scripts/mutate.sh" --list "$work/list.txt" "$@"; }

# A good list: one mutant of one line, one of two lines, one deleting its text.
list '# comment' '' '=== plus-one' 'file: src/a.cpp' 'tests: ^A\.' 'why: adds one' \
  '- return a + 1;' '+ return a + 2;' \
  '=== two-lines' 'file: src/a.cpp' 'why: spans a line break' \
  '- int f(int a) {' '-   return a + 1;' '+ int f(int a) {' '+   return a;' \
  '=== deleted' 'file: src/a.cpp' 'why: drops a comment' '- // once'
out="$(run --check)" || fail "a good list: exit $?: $out"
[[ "$out" == "mutate: 3 mutants, each applies exactly once to $tree" ]] || fail "good list: $out"
[[ "$(cksum <"$tree/src/a.cpp")" == "$before" ]] || fail "--check changed the tree"

# Stale mutants: exit 1, one line each.
list '=== twice' 'file: src/a.cpp' 'why: w' '- return a * 2;' '+ return a * 3;'
expect 1 "a text found twice" "mutant twice is stale: its search text occurs 2 times in src/a.cpp" run --check
list '=== gone' 'file: src/a.cpp' 'why: w' '- return a - 1;' '+ return a;'
expect 1 "a text not found" "mutant gone is stale: its search text occurs 0 times" run --check
list '=== nofile' 'file: src/b.cpp' 'why: w' '- x' '+ y'
expect 1 "a missing file" "mutant nofile is stale: src/b.cpp does not exist" run --check
# A full run refuses a stale mutant the same way, before copying or building anything.
expect 2 "a full run with a stale mutant" "mutant gone is stale" \
  bash -c "printf '=== gone\nfile: src/a.cpp\nwhy: w\n- return a - 1;\n' >'$work/list.txt'; \
           bash '$tree/scripts/mutate.sh' --list '$work/list.txt' --scratch '$work/s1'"
[[ ! -e "$work/s1" ]] || fail "a stale mutant left a scratch folder"

# Malformed lists and options: exit 2.
list 'file: src/a.cpp'
expect 2 "text before the first mutant" "before the first '=== ID' line" run --check
list '=== Bad Id' 'file: src/a.cpp' 'why: w' '- a'
expect 2 "a bad id" "a mutant id is lower-case" run --check
list '=== x' 'file: src/a.cpp' '- return a + 1;'
expect 2 "no why" "mutant x: no 'why:' line" run --check
list '=== x' 'file: src/a.cpp' 'why: w' '- return a + 1;' 'oops'
expect 2 "a stray line" "not a field of a mutant: oops" run --check
list '=== x' 'file: src/a.cpp' 'why: w' '- return a + 1;' '=== x' 'file: src/a.cpp' 'why: w' '- // once'
expect 2 "a repeated id" "mutant x is listed twice" run --check
expect 2 "an unknown option" "unknown option '--frobnicate'" run --frobnicate
expect 2 "a bad timeout" "--timeout must be a positive number" run --timeout 0

# Scratch folders the script must not use.
list '=== plus-one' 'file: src/a.cpp' 'why: adds one' '- return a + 1;' '+ return a + 2;'
expect 2 "a scratch inside the tree" "lies inside the tree" run --scratch "$tree/scratch"
[[ ! -e "$tree/scratch" ]] || fail "the refused scratch folder was created in the tree"
mkdir -p "$work/foreign"
echo keep >"$work/foreign/notes.txt"
expect 2 "a foreign non-empty folder" "neither empty nor a scratch folder of mutate.sh" \
  run --scratch "$work/foreign"
[[ "$(cat "$work/foreign/notes.txt")" == keep ]] || fail "the foreign folder was touched"
echo "mutate_test: all passed"
