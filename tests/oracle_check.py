#!/usr/bin/env python3
"""Runs one executable-spec script of shared/spec/oracle and checks what it prints.

The scripts (layer_check.py, ssm_check.py) compare the gradient formulas of MODEL.md §6 with
central finite differences (and sequential with chunked) in pure-Python double precision and
print their maximum errors. This wrapper fails (exit 1) when a printed error exceeds BOUND or
when the script prints no error figure at all, so the check asserts instead of only printing.

Usage: oracle_check.py SCRIPT [ARGS...]
"""
import re
import subprocess
import sys

BOUND = 1e-6
# "abs err 5.61e-10", "seq err 1.40e-10", "chunk err …", "fwd max diff 1.1e-16", "state diff …"
PATTERN = re.compile(r"(?:err|diff)\s+([-+0-9.eE]+|nan|inf)")


def main() -> int:
    if len(sys.argv) < 2:
        print("usage: oracle_check.py SCRIPT [ARGS...]", file=sys.stderr)
        return 2
    cmd = [sys.executable] + sys.argv[1:]
    run = subprocess.run(cmd, capture_output=True, text=True)
    sys.stdout.write(run.stdout)
    sys.stderr.write(run.stderr)
    if run.returncode != 0:
        print(f"oracle_check: {' '.join(cmd)} exited with {run.returncode}")
        return 1
    figures = [float(m.group(1)) for m in PATTERN.finditer(run.stdout)]
    if not figures:
        print("oracle_check: the script printed no error figure")
        return 1
    worst = max(figures, key=lambda v: v if v == v else float("inf"))
    if not worst <= BOUND:
        print(f"oracle_check: worst printed error {worst:.3e} exceeds {BOUND:.0e}")
        return 1
    print(f"oracle_check: {len(figures)} figures, worst {worst:.3e} <= {BOUND:.0e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
