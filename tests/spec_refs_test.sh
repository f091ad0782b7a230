#!/usr/bin/env bash
# Every "MODEL.md §X", "HARNESS.md §X" and "TRAINING.md §X" cited in the repository resolves to a
# numbered heading of docs/MODEL.md, docs/HARNESS.md or docs/TRAINING.md.
#
#   spec_refs_test.sh REPO_ROOT      check the repository; exit 0 all resolve, 1 otherwise
#   spec_refs_test.sh --self-test    build a temporary tree with good and bad citations and check
#                                    that exactly the bad ones are reported (so the test can fail)
#
# Scanned: the tracked files (git ls-files; every file when REPO_ROOT is not a git work tree)
# under reference/ gpu/ harness/ golden/ train/ tools/ tests/ scripts/, README.md, docs/*.md
# (not docs/log/ or other docs subfolders) and every CMakeLists.txt; binary files are skipped.
# A citation is the document name, "§" (spaces around it optional) and a number N or N.M…;
# numbers chained to it by "–", "-", "/", "," or " and " with their own "§" ("MODEL.md §6.2–§6.4",
# "§5.3/§12.4") belong to the same document and are checked too. A heading numbered X is a line
# "## X. Title" or "### X Title" (any level from ##). Each unresolved citation is one line
# "file:line: DOC.md §X"; a missing document is one line "docs/DOC.md: missing". Exit 1 if any.
set -u
export LC_ALL=C

readonly DOCS=(MODEL HARNESS TRAINING)
readonly NUM='[0-9]+(\.[0-9]+)*'
readonly CITE="(MODEL|HARNESS|TRAINING)\\.md ?§ ?${NUM}((–|-|/|, ?| and )§ ?${NUM})*"

usage() {
  echo "usage: spec_refs_test.sh REPO_ROOT | --self-test" >&2
  exit 2
}

# The files to scan, relative to $1, one per line.
scanned_files() {
  local root=$1
  if git -C "$root" rev-parse --is-inside-work-tree >/dev/null 2>&1 &&
     [ "$(cd "$root" && git rev-parse --show-toplevel 2>/dev/null)" = "$(cd "$root" && pwd -P)" ]; then
    (cd "$root" && git ls-files)
  else
    (cd "$root" && find . -type f -not -path './.git/*' -not -path './build*' | sed 's|^\./||')
  fi | grep -E '^((reference|gpu|harness|golden|train|tools|tests|scripts)/|README\.md$|docs/[^/]+\.md$|(.*/)?CMakeLists\.txt$)' |
    while IFS= read -r f; do [ -f "$root/$f" ] && printf '%s\n' "$f"; done
}

# "DOC X" for every numbered heading of the three documents.
headings() {
  local root=$1 doc
  for doc in "${DOCS[@]}"; do
    awk -v doc="$doc" '
      /^##+[ \t]+[0-9]+(\.[0-9]+)*\.?([ \t]|$)/ {
        s = $0; sub(/^##+[ \t]+/, "", s); match(s, /^[0-9]+(\.[0-9]+)*/)
        print doc " " substr(s, 1, RLENGTH)
      }' "$root/docs/$doc.md"
  done
}

check() {
  local root=$1 doc fail=0
  [ -d "$root" ] || { echo "spec_refs_test: no such directory: $root" >&2; return 2; }
  for doc in "${DOCS[@]}"; do
    if [ ! -f "$root/docs/$doc.md" ]; then
      echo "docs/$doc.md: missing"
      fail=1
    fi
  done
  [ "$fail" = 0 ] || return 1

  local files heads
  files=$(scanned_files "$root")
  heads=$(headings "$root")
  [ -n "$files" ] || { echo "spec_refs_test: no files to scan under $root" >&2; return 1; }

  # file:line:match for every citation (grep -o: one line per match), then one "file:line: DOC §X"
  # per cited number, kept when DOC has no heading X.
  local out
  out=$( (cd "$root" && printf '%s\n' "$files" | tr '\n' '\0' |
            xargs -0 grep -IHnoE "$CITE" 2>/dev/null) |
         awk -v heads="$heads" '
           BEGIN {
             n = split(heads, h, "\n")
             for (i = 1; i <= n; ++i) if (h[i] != "") have[h[i]] = 1
           }
           {
             # file:line:citation (a file name holds no ":" in this repository).
             p = index($0, ":"); file = substr($0, 1, p - 1); rest = substr($0, p + 1)
             p = index(rest, ":"); line = substr(rest, 1, p - 1); cite = substr(rest, p + 1)
             ++total
             doc = cite; sub(/\.md.*/, "", doc)
             s = cite
             while (match(s, /§ ?[0-9]+(\.[0-9]+)*/)) {
               num = substr(s, RSTART, RLENGTH); sub(/^§ ?/, "", num)
               if (!((doc " " num) in have)) print file ":" line ": " doc ".md §" num
               s = substr(s, RSTART + RLENGTH)
             }
           }
           END { print "#total " total + 0 > "/dev/stderr" }' 2>"${TMPDIR:-/tmp}/spec_refs.$$")
  local total
  total=$(sed -n 's/^#total //p' "${TMPDIR:-/tmp}/spec_refs.$$")
  rm -f "${TMPDIR:-/tmp}/spec_refs.$$"
  if [ -n "$out" ]; then
    printf '%s\n' "$out"
    echo "spec_refs_test: FAIL $(printf '%s\n' "$out" | wc -l | tr -d ' ') unresolved of ${total:-0} citations"
    return 1
  fi
  if [ "${total:-0}" = 0 ]; then
    echo "spec_refs_test: FAIL no citation found under $root (the scan itself is broken)"
    return 1
  fi
  echo "spec_refs_test: PASS all ${total} citations resolve ($(printf '%s\n' "$files" | wc -l | tr -d ' ') files scanned)"
  return 0
}

# The self-test's citations are spelled with $S for "§", so that this file itself holds no
# citation that a scan of the repository would report.
self_test_in() {
  local t=$1 ok=1 out rc S='§'
  mkdir -p "$t/docs/log" "$t/reference" "$t/tools" "$t/other"
  printf '# M\n\n## 1. One\n\n### 1.2 One two\n\n## 6. Six\n\n### 6.4 Six four\n' >"$t/docs/MODEL.md"
  printf '# H\n\n## 3. Three\n' >"$t/docs/HARNESS.md"
  printf '# T\n\n## 2. Two\n\n### 2.6 Two six\n' >"$t/docs/TRAINING.md"
  printf '%s\n' "// MODEL.md ${S}1.2 and HARNESS.md${S}3 and TRAINING.md ${S} 2.6" \
    "// MODEL.md ${S}6–${S}6.4" >"$t/reference/good.cpp"
  printf '%s\n' "// fine: MODEL.md ${S}1" "// MODEL.md ${S}9.9 is not there" \
    "// TRAINING.md ${S}2.6, ${S}2.7" >"$t/tools/bad.cpp"
  printf '%s\n' "MODEL.md ${S}77 in a log" >"$t/docs/log/history.md"     # excluded folder
  printf '%s\n' "MODEL.md ${S}78 outside the scanned folders" >"$t/other/x.cpp"
  if command -v git >/dev/null 2>&1; then
    (cd "$t" && git init -q . && git add -A) || { echo "self-test: git init failed"; return 1; }
  fi

  expect() {  # expect DESCRIPTION STATUS: STATUS 0 = the expectation holds
    if [ "$2" = 0 ]; then echo "self-test ok:   $1"; else echo "self-test FAIL: $1"; ok=0; fi
  }
  out=$(check "$t"); rc=$?
  printf '%s\n' "$out" | sed 's/^/  | /'
  [ "$rc" = 1 ]; expect "a tree with bad citations fails (exit 1)" $?
  printf '%s\n' "$out" | grep -qxF "tools/bad.cpp:2: MODEL.md ${S}9.9"
  expect "the missing heading is reported as file:line: citation" $?
  printf '%s\n' "$out" | grep -qxF "tools/bad.cpp:3: TRAINING.md ${S}2.7"
  expect "a chained citation is checked past its first number" $?
  ! printf '%s\n' "$out" | grep -qE "good\.cpp|bad\.cpp:1:|bad\.cpp:3: TRAINING\.md ${S}2\.6"
  expect "resolving citations are not reported" $?
  ! printf '%s\n' "$out" | grep -qE "${S}77|${S}78"
  expect "docs/log/ and unscanned folders are ignored" $?

  rm "$t/tools/bad.cpp"
  [ -d "$t/.git" ] && (cd "$t" && git add -A)
  out=$(check "$t"); rc=$?
  [ "$rc" = 0 ]; expect "the same tree without the bad file passes (exit 0): $out" $?

  rm "$t/docs/HARNESS.md"
  [ -d "$t/.git" ] && (cd "$t" && git add -A)
  out=$(check "$t"); rc=$?
  [ "$rc" = 1 ] && printf '%s\n' "$out" | grep -qx 'docs/HARNESS.md: missing'
  expect "a missing document fails" $?

  [ "$ok" = 1 ]
}

self_test() {
  local t rc
  t=$(mktemp -d "${TMPDIR:-/tmp}/spec_refs_self.XXXXXX") || exit 2
  self_test_in "$t"; rc=$?
  rm -rf "$t"
  if [ "$rc" = 0 ]; then echo "spec_refs_test --self-test: PASS"; return 0; fi
  echo "spec_refs_test --self-test: FAIL"
  return 1
}

[ $# = 1 ] || usage
case "$1" in
  --self-test) self_test; exit $? ;;
  -h|--help) usage ;;
  *) check "$1"; exit $? ;;
esac
