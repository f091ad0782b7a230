#!/usr/bin/env bash
# Mutation testing on the CPU build: which small, plausible bugs does the test suite miss?
#
#   scripts/mutate.sh [options]            the full run (one CPU build, then ~10-30 s a mutant)
#   scripts/mutate.sh --check              every mutant still applies exactly once (seconds)
#
# The mutants are kept in tests/mutants/mutants.txt (its header describes the format). A full
# run copies the working tree (tracked and untracked, not ignored, files) to a scratch folder,
# configures and builds it CPU-only once, runs the mutants' test subsets once unmutated (they
# must pass, or every mutant would look killed), then for each mutant: applies it, rebuilds
# incrementally, runs ctest on the mutant's subset (its `tests:` regex, or -R, or everything)
# under a time limit, records killed (with the first failing tests) or survived, and restores
# the file. It prints one line per mutant as it goes, then the table and "killed K of N".
# The tree it is called from is only read; a mutant that no longer applies exactly once is
# refused in one line before anything is built.
#
# Options:
#   --check            only verify that every mutant applies exactly once; exit 1 if one does not
#   --list FILE        the mutant list (default: tests/mutants/mutants.txt of the tree)
#   --only REGEX       only the mutants whose id matches REGEX (grep -E)
#   -R REGEX           run this ctest regex for every mutant instead of each mutant's own
#   --all-tests        run the whole suite for every mutant (ignore the per-mutant subsets)
#   --timeout S        time limit of one mutant's ctest run, seconds (default 900)
#   --scratch DIR      work in DIR, outside the tree: a new or empty folder, or one an earlier
#                      run made (its build is reused and rebuilt incrementally); default: a new
#                      folder under $TMPDIR, removed at the end unless --keep
#   --keep             keep the default scratch folder
#   --no-baseline      skip the unmutated run of the subsets
#   -j N               build and ctest parallelism (default: nproc)
#
# Exit status: 0 every mutant killed, 1 a mutant survived or did not build, 2 a usage error or
# a stale mutant (or a subset that fails unmutated).
set -euo pipefail
shopt -u patsub_replacement 2>/dev/null || true  # '&' in a replacement is literal

die() { echo "mutate: $*" >&2; exit 2; }

src=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
list=""
only=""
regex=""
all_tests=0
limit=900
scratch=""
keep=0
baseline=1
check=0
jobs=$(nproc 2>/dev/null || echo 2)

while [[ $# -gt 0 ]]; do
  case "$1" in
    --check) check=1 ;;
    --list) list=${2:?--list needs a file}; shift ;;
    --only) only=${2:?--only needs a regex}; shift ;;
    -R) regex=${2:?-R needs a regex}; shift ;;
    --all-tests) all_tests=1 ;;
    --timeout) limit=${2:?--timeout needs seconds}; shift ;;
    --scratch) scratch=${2:?--scratch needs a folder}; shift ;;
    --keep) keep=1 ;;
    --no-baseline) baseline=0 ;;
    -j) jobs=${2:?-j needs a number}; shift ;;
    -h|--help) awk 'NR > 1 && /^#/ {sub(/^# ?/, ""); print; next} NR > 1 {exit}' "${BASH_SOURCE[0]}"; exit 0 ;;
    *) die "unknown option '$1' (see --help)" ;;
  esac
  shift
done
[[ $limit =~ ^[1-9][0-9]*$ ]] || die "--timeout must be a positive number of seconds, got '$limit'"
[[ $jobs =~ ^[1-9][0-9]*$ ]] || die "-j must be a positive number, got '$jobs'"
[[ -n $list ]] || list="$src/tests/mutants/mutants.txt"
[[ -f $list ]] || die "no mutant list at $list"

# ---- the list: blocks of
#   === ID
#   file: PATH            (relative to the tree's root)
#   tests: REGEX          (ctest -R; empty: the whole suite)
#   why: TEXT
#   - SEARCH LINE         (one or more; joined by newlines: the exact text to find)
#   + REPLACEMENT LINE    (zero or more; none: the search text is deleted)
ids=() files=() tests=() whys=() searches=() replaces=()
parse_list() {
  local line piece n=-1 lineno=0
  local -a nminus=() nplus=()
  while IFS= read -r line || [[ -n $line ]]; do
    lineno=$((lineno + 1))
    case "$line" in
      '#'*|'') continue ;;
      '=== '*)
        n=$((n + 1))
        ids[n]=${line#=== }; files[n]=""; tests[n]=""; whys[n]=""; searches[n]=""; replaces[n]=""
        nminus[n]=0 nplus[n]=0
        [[ ${ids[n]} =~ ^[a-z0-9][a-z0-9._-]*$ ]] ||
          die "$list:$lineno: a mutant id is lower-case letters, digits, '.', '_' and '-': '${ids[n]}'"
        continue ;;
    esac
    (( n >= 0 )) || die "$list:$lineno: text before the first '=== ID' line"
    case "$line" in
      'file: '*) files[n]=${line#file: } ;;
      'tests:'*) tests[n]=${line#tests:}; tests[n]=${tests[n]# } ;;
      'why: '*) whys[n]=${line#why: } ;;
      '- '*|'-')
        piece=${line#-}; piece=${piece# }
        if (( nminus[n] )); then searches[n]+=$'\n'; fi
        searches[n]+=$piece; nminus[n]=$((nminus[n] + 1)) ;;
      '+ '*|'+')
        piece=${line#+}; piece=${piece# }
        if (( nplus[n] )); then replaces[n]+=$'\n'; fi
        replaces[n]+=$piece; nplus[n]=$((nplus[n] + 1)) ;;
      *) die "$list:$lineno: not a field of a mutant: $line" ;;
    esac
  done < "$list"
  (( n >= 0 )) || die "$list holds no mutant"
  local i j
  for i in "${!ids[@]}"; do
    [[ -n ${files[i]} ]] || die "mutant ${ids[i]}: no 'file:' line"
    [[ -n ${searches[i]} ]] || die "mutant ${ids[i]}: no '- ' search line"
    [[ -n ${whys[i]} ]] || die "mutant ${ids[i]}: no 'why:' line"
    [[ ${searches[i]} != "${replaces[i]}" ]] || die "mutant ${ids[i]}: the replacement equals the search text"
    for ((j = 0; j < i; ++j)); do
      [[ ${ids[j]} != "${ids[i]}" ]] || die "mutant ${ids[i]} is listed twice"
    done
  done
}
parse_list

read_file() {  # the file's exact bytes into $content (trailing newlines kept)
  content=$(cat -- "$1"; printf x)
  content=${content%x}
}

# How often $2 occurs in $1 (literally).
count_in() {
  local rest=$1 needle=$2 c=0
  while [[ $rest == *"$needle"* ]]; do
    rest=${rest#*"$needle"}
    c=$((c + 1))
  done
  echo "$c"
}

# Every mutant must apply exactly once to the tree at $1: one line per mutant that does not.
check_tree() {
  local root=$1 bad=0 i c
  for i in "${!ids[@]}"; do
    if [[ ! -f $root/${files[i]} ]]; then
      echo "mutate: mutant ${ids[i]} is stale: ${files[i]} does not exist" >&2
      bad=1
      continue
    fi
    read_file "$root/${files[i]}"
    c=$(count_in "$content" "${searches[i]}")
    if [[ $c != 1 ]]; then
      echo "mutate: mutant ${ids[i]} is stale: its search text occurs $c times in ${files[i]}, not once" >&2
      bad=1
    fi
  done
  return $bad
}

selected=()
for i in "${!ids[@]}"; do
  if [[ -z $only ]] || grep -Eq -- "$only" <<< "${ids[i]}"; then selected+=("$i"); fi
done
(( ${#selected[@]} > 0 )) || die "no mutant id matches --only '$only'"

if (( check )); then
  if check_tree "$src"; then
    echo "mutate: ${#ids[@]} mutants, each applies exactly once to $src"
    exit 0
  fi
  exit 1
fi
check_tree "$src" || exit 2

# ---- the scratch copy ------------------------------------------------------------------------
command -v cmake >/dev/null || die "cmake is not installed"
command -v ninja >/dev/null || die "ninja is not installed"
command -v ctest >/dev/null || die "ctest is not installed"
own_scratch=0
if [[ -z $scratch ]]; then
  scratch=$(mktemp -d "${TMPDIR:-/tmp}/m3-mutate.XXXXXX")
  own_scratch=1
fi
scratch=$(realpath -m -- "$scratch")
case "$scratch/" in
  "$(realpath -- "$src")"/*) die "the scratch folder $scratch lies inside the tree $src; give one outside it" ;;
esac
# The folder is emptied in part below (its src/): only one this script made, or an empty one.
if [[ -d $scratch && -n $(ls -A -- "$scratch") && ! -f $scratch/.m3-mutate ]]; then
  die "$scratch is neither empty nor a scratch folder of mutate.sh (no .m3-mutate in it)"
fi
mkdir -p "$scratch"
touch "$scratch/.m3-mutate"
cleanup() {
  if (( own_scratch && !keep )); then rm -rf "$scratch"; fi
}
trap cleanup EXIT

tree=$scratch/src
build=$scratch/build
log=$scratch/logs
rm -rf "$tree"
mkdir -p "$tree" "$log"
# The files git shows (tracked, and untracked but not ignored) of the working tree, copied with
# their times so that a reused scratch build only rebuilds what changed.
if git -C "$src" rev-parse --is-inside-work-tree >/dev/null 2>&1; then
  (cd "$src" && git ls-files -z --cached --others --exclude-standard |
     while IFS= read -r -d '' f; do if [[ -e $f ]]; then printf '%s\0' "$f"; fi; done |
     tar --null -T - -cf -) | tar -xpf - -C "$tree"
else
  (cd "$src" && tar --exclude='./build*' --exclude=./.git -cf - .) | tar -xpf - -C "$tree"
fi
check_tree "$tree" || die "the scratch copy of $src does not take every mutant exactly once"
# A reused scratch build may hold objects compiled from a mutant (the last one of a run, or one
# an interrupted run left): the copy above gave those files back the tree's older times, which
# ninja would take as up to date. Every file a run has mutated is listed in mutated.list and
# touched here, so the build below recompiles it unmutated.
if [[ -f $scratch/mutated.list ]]; then
  while IFS= read -r f; do if [[ -f $tree/$f ]]; then touch "$tree/$f"; fi; done < "$scratch/mutated.list"
fi

echo "mutate: ${#selected[@]} of ${#ids[@]} mutants; scratch $scratch"
echo "mutate: configuring and building the CPU-only tree once (log $log/build.log)"
if [[ ! -f $build/build.ninja ]]; then
  cmake -S "$tree" -B "$build" -G Ninja -DM3_CUDA=OFF > "$log/configure.log" 2>&1 ||
    die "configuring the scratch tree failed: see $log/configure.log"
fi
cmake --build "$build" -j "$jobs" > "$log/build.log" 2>&1 ||
  die "the unmutated scratch tree does not build: see $log/build.log"
: > "$scratch/mutated.list"

regex_of() {  # the ctest regex of mutant $1 ("" = every test)
  if (( all_tests )); then echo ""; elif [[ -n $regex ]]; then echo "$regex"; else echo "${tests[$1]}"; fi
}

# ctest on regex $1 under the time limit; output into $2. Returns ctest's status (124: timeout).
run_ctest() {
  local args=(--test-dir "$build" -j "$jobs" --output-on-failure --timeout "$limit")
  [[ -n $1 ]] && args+=(-R "$1")
  timeout --kill-after=10 "$limit" ctest "${args[@]}" > "$2" 2>&1
}

# The first few failing tests of a ctest log, comma-separated.
failing_tests() {
  awk '/The following tests FAILED:/ {on = 1; next}
       on && /^[[:space:]]+[0-9]+ - / {sub(/^[[:space:]]+[0-9]+ - /, ""); sub(/ \([^)]*\)$/, "");
                                      print}' "$1" | head -n 3 | paste -sd, - | sed 's/,/, /g'
}

if (( baseline )); then
  declare -A seen=()
  for i in "${selected[@]}"; do
    r=$(regex_of "$i")
    [[ -n ${seen["x$r"]:-} ]] && continue
    seen["x$r"]=1
    echo "mutate: unmutated run of '${r:-every test}'"
    if ! run_ctest "$r" "$log/baseline.log"; then
      echo "mutate: the unmutated tree fails '${r:-every test}' ($(failing_tests "$log/baseline.log")): see $log/baseline.log" >&2
      exit 2
    fi
  done
fi

# ---- the mutants -----------------------------------------------------------------------------
results=() killers=() secs=()
killed=0 total=${#selected[@]} k=0
for i in "${selected[@]}"; do
  k=$((k + 1))
  id=${ids[i]}
  f=$tree/${files[i]}
  read_file "$f"
  original=$content
  mutated=${original/"${searches[i]}"/"${replaces[i]}"}
  echo "${files[i]}" >> "$scratch/mutated.list"
  printf '%s' "$mutated" > "$f"
  t0=$SECONDS
  result="" who=""
  if ! cmake --build "$build" -j "$jobs" > "$log/$id.build.log" 2>&1; then
    result="NO-BUILD"
    who="see $log/$id.build.log"
  else
    r=$(regex_of "$i")
    set +e
    run_ctest "$r" "$log/$id.ctest.log"
    rc=$?
    set -e
    if (( rc == 0 )); then
      if grep -q "No tests were found" "$log/$id.ctest.log"; then
        result="NO-TESTS"
        who="'$r' matches no test"
      else
        result="survived"
      fi
    elif (( rc == 124 || rc == 137 )); then
      result="killed"
      who="(time limit ${limit} s)"
    else
      result="killed"
      who=$(failing_tests "$log/$id.ctest.log")
      [[ -n $who ]] || who="(ctest status $rc)"
    fi
  fi
  printf '%s' "$original" > "$f"  # a new time: the next build recompiles it unmutated
  [[ $result == killed ]] && killed=$((killed + 1))
  results[i]=$result killers[i]=$who secs[i]=$((SECONDS - t0))
  printf '[%d/%d] %-34s %-9s %4d s  %s\n' "$k" "$total" "$id" "$result" "${secs[i]}" "$who"
done

echo
printf '%-34s %-9s %6s  %s\n' "mutant" "result" "time" "killed by / file"
for i in "${selected[@]}"; do
  printf '%-34s %-9s %5ds  %s\n' "${ids[i]}" "${results[i]}" "${secs[i]}" \
    "${killers[i]:-${files[i]}: ${whys[i]}}"
done
echo "killed $killed of $total"
(( killed == total ))
