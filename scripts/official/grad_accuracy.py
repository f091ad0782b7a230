#!/usr/bin/env python3
"""grad_accuracy.py — our bf16 parameter gradients against the official Mamba-3 module's under
bf16 autocast, both measured against the same double-precision oracle, over several seeds.

Usage (on the GPU machine: PyTorch, Triton, numpy, einops, a CUDA build of m3h):

    python3 scripts/official/grad_accuracy.py --mamba-src DIR --m3h M3H --out OUT
        [--seeds 1-8] [--problem "--B 2 --T 512 ..."] [--deadline S] [--force | --resume]

  --mamba-src DIR  a state-spaces/mamba source tree (as scripts/official/judge_official.py).
  --m3h M3H        a CUDA build of m3h (build-gpu/tools/m3h).
  --out OUT        a folder for everything written (created; an existing non-empty one only
                   with --force, which replaces what this script writes, or --resume).
  --deadline S     start no further seed after S seconds; the table then covers the seeds
                   finished (and says which).
  --resume         keep the seeds an earlier run with the same --out finished (both reports
                   there) and run only the others.
  --seeds A-B      the seeds of weights, inputs and output gradient (default 1-8), or a comma
                   list.
  --problem ARGS   the problem options of m3h golden regen (default: B 2, T 512, d_model 256,
                   headdim 64, d_state 64, expand 2, one layer, zero entering states: the
                   problem of docs/OFFICIAL-JUDGED.md's "Parameter gradients" section).

Per seed s:
  1. M3H golden regen --out OUT/s<s>/case.h5 PROBLEM --seed s --scan chunked: the oracle, the
     reference in double (Eigen), with every tensor of the chunked scan mode.
  2. The official module in PyTorch under torch.autocast(bfloat16) on that case, as
     judge_official.py --precisions bf16 --no-states runs it (its functions, in this process, so
     that Triton compiles and tunes the kernels once for every seed), judged by m3h judge
     (OUT/s<s>/official/judge-bf16.json).
  3. M3H compare --golden that case --device gpu --dtype bf16 --scan chunked --stage 'grad/*'
     --json OUT/s<s>/ours.json: our CUDA path on the same weights, inputs and output gradient.
Both error figures are rel_l2 = ||subject − oracle||₂ / ||oracle||₂ of each parameter gradient
against the same oracle tensor (HARNESS.md's metric). The table gives, per gradient, the
geometric mean over the seeds of each side, their ratio (ours / official: below 1 is ours more
accurate) and on how many seeds ours was at or below the official module's error; the last row
is the geometric mean over every gradient both sides provide. Written to OUT/accuracy.md and
OUT/accuracy.json, and printed.

The seed matters: one problem's rel_l2 of a small gradient such as d_param (8 values) moves by
a factor of two from seed to seed, so a comparison of the two implementations needs the same
seeds on both sides and several of them.

Exit status: 0 done, 2 bad use or a failed step (one line "grad_accuracy.py: error: ..." on
stderr). Not used by any test or build of the repository.
"""

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import time

DEFAULT_PROBLEM = ("--B 2 --T 512 --d-model 256 --headdim 64 --d-state 64 --expand 2 "
                   "--layers 1 --zero-states")


def die(msg):
    print(f"grad_accuracy.py: error: {msg}", file=sys.stderr)
    sys.exit(2)


class Parser(argparse.ArgumentParser):
    def error(self, message):
        die(message)


def parse_seeds(text):
    try:
        if "-" in text:
            a, b = (int(v) for v in text.split("-", 1))
            seeds = list(range(a, b + 1))
        else:
            seeds = [int(v) for v in text.split(",") if v]
    except ValueError:
        die(f"--seeds '{text}': expected A-B or a comma list of integers")
    if not seeds or any(s < 0 for s in seeds):
        die(f"--seeds '{text}': expected at least one seed >= 0")
    return seeds


def run(cmd, log, times):
    """Runs cmd with its output in log; appends its wall seconds to times; its exit status."""
    t = time.time()
    with open(log, "w") as f:
        r = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT)
    times.append(time.time() - t)
    return r.returncode


def grad_errors(json_path, precision_field):
    """{key: rel_l2} of the grad/ cells of an m3h compare or judge JSON report."""
    with open(json_path) as f:
        j = json.load(f)
    out = {}
    for c in j["cells"]:
        if not c["key"].startswith("grad/"):
            continue
        if precision_field and c.get("precision") not in (None, "bf16"):
            continue
        v = c["metrics"]["rel_l2"]
        if isinstance(v, (int, float)):
            out[c["key"]] = float(v)
    return out


def run_official(jo, a, case, out):
    """The official module on `case` in bf16 autocast, judged: out/judge-bf16.json."""
    import numpy as np
    import torch
    os.makedirs(out, exist_ok=True)
    problem = os.path.join(out, "problem")
    jo.m3h(["judge", "--golden", case, "--export-problem", problem], a.m3h)
    with open(os.path.join(problem, "problem.json")) as f:
        meta = json.load(f)
    arr = {name[:-4]: np.load(os.path.join(problem, name)) for name in meta["arrays"]}
    jo.check_case(meta, False)
    device = torch.device("cuda")
    net = jo.Backbone(jo.OFFICIAL, meta, arr, device)
    holder = jo.install_taps(jo.OFFICIAL, net, False)
    tensors = jo.run(net, holder, meta, arr, "bf16", device)
    subject = os.path.join(out, "subject-bf16")
    jo.write_subject(subject, tensors, "bf16", "state-spaces/mamba Mamba3, bf16 autocast", False)
    rc, text = jo.m3h(["judge", "--golden", case, "--subject-dir", subject, "--json",
                       os.path.join(out, "judge-bf16.json")], a.m3h)
    with open(os.path.join(out, "judge-bf16.txt"), "w") as f:
        f.write(text)


def geo(values):
    vals = [v for v in values if v > 0]
    return math.exp(sum(math.log(v) for v in vals) / len(vals)) if vals else float("nan")


def main():
    p = Parser(description="bf16 parameter gradients: ours against the official module's.")
    p.add_argument("--mamba-src", required=True)
    p.add_argument("--m3h", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--seeds", default="1-8")
    p.add_argument("--problem", default=DEFAULT_PROBLEM)
    p.add_argument("--force", action="store_true")
    p.add_argument("--resume", action="store_true")
    p.add_argument("--deadline", type=float, default=None)
    a = p.parse_args()
    if a.force and a.resume:
        die("--force and --resume: one or the other")
    seeds = parse_seeds(a.seeds)
    if not (os.path.isfile(a.m3h) and os.access(a.m3h, os.X_OK)):
        die(f"--m3h {a.m3h}: not an executable")
    if not os.path.isfile(os.path.join(a.mamba_src, "mamba_ssm", "modules", "mamba3.py")):
        die(f"--mamba-src {a.mamba_src}: no mamba_ssm/modules/mamba3.py there")
    if os.path.isdir(a.out) and os.listdir(a.out) and not (a.force or a.resume):
        die(f"--out {a.out}: exists and is not empty (--force replaces what this script writes, "
            "--resume keeps its finished seeds)")
    os.makedirs(a.out, exist_ok=True)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import judge_official as jo  # noqa: E402 (this folder's script, as a module)
    jo.torch_for_official()
    jo.OFFICIAL = jo.import_official(a.mamba_src)

    ours, official = {}, {}
    start = time.time()
    for i, s in enumerate(seeds):
        if a.deadline is not None and time.time() - start > a.deadline:
            print(f"deadline: seeds from {s} on not run", flush=True)
            break
        d = os.path.join(a.out, f"s{s}")
        ours_json = os.path.join(d, "ours.json")
        official_json = os.path.join(d, "official", "judge-bf16.json")
        if a.resume and os.path.isfile(ours_json) and os.path.isfile(official_json):
            ours[s] = grad_errors(ours_json, True)
            official[s] = grad_errors(official_json, False)
            print(f"seed {s} kept from the earlier run ({i + 1}/{len(seeds)})", flush=True)
            continue
        if os.path.isdir(d) and os.listdir(d):
            if not (a.force or a.resume):
                die(f"{d}: exists and is not empty")
            shutil.rmtree(d)  # an unfinished seed (--resume) or one to replace (--force)
        os.makedirs(d, exist_ok=True)
        times = []
        case = os.path.join(d, "case.h5")
        if run([a.m3h, "golden", "regen", "--out", case, "--seed", str(s), "--scan", "chunked"]
               + a.problem.split(), os.path.join(d, "regen.log"), times):
            die(f"seed {s}: golden regen failed (see {d}/regen.log)")
        t = time.time()
        run_official(jo, a, case, os.path.join(d, "official"))
        times.append(time.time() - t)
        rc = run([a.m3h, "compare", "--golden", case, "--device", "gpu", "--dtype", "bf16",
                  "--scan", "chunked", "--stage", "grad/*", "--json", ours_json],
                 os.path.join(d, "ours.log"), times)
        if rc not in (0, 1):
            die(f"seed {s}: m3h compare failed (see {d}/ours.log)")
        ours[s] = grad_errors(ours_json, True)
        official[s] = grad_errors(official_json, False)
        print(f"seed {s} done ({i + 1}/{len(seeds)}): regen {times[0]:.1f} s, official "
              f"{times[1]:.1f} s, ours {times[2]:.1f} s", flush=True)

    seeds = [s for s in seeds if s in ours]
    if not seeds:
        die("no seed finished")
    keys = [k for k in ours[seeds[0]] if all(k in official[s] and k in ours[s] for s in seeds)]
    rows, ratios = [], []
    for k in keys:
        go, gf = geo([ours[s][k] for s in seeds]), geo([official[s][k] for s in seeds])
        wins = sum(ours[s][k] <= official[s][k] for s in seeds)
        rows.append({"key": k, "ours": go, "official": gf, "ratio": go / gf, "ours_at_or_below": wins,
                     "per_seed": {str(s): [ours[s][k], official[s][k]] for s in seeds}})
        ratios.append(go / gf)
    overall = geo(ratios)
    lines = [f"bf16 parameter gradients, rel_l2 against the double oracle; geometric means over "
             f"seeds {','.join(map(str, seeds))}",
             f"problem: {a.problem}", "",
             "| gradient | ours | official | ours / official | ours <= official |",
             "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| `{r['key']}` | {r['ours']:.3e} | {r['official']:.3e} | {r['ratio']:.3f} | "
                     f"{r['ours_at_or_below']} of {len(seeds)} |")
    lines.append(f"| geometric mean of the ratios ({len(rows)} gradients) | | | {overall:.3f} | |")
    text = "\n".join(lines) + "\n"
    with open(os.path.join(a.out, "accuracy.md"), "w") as f:
        f.write(text)
    with open(os.path.join(a.out, "accuracy.json"), "w") as f:
        json.dump({"seeds": seeds, "problem": a.problem, "rows": rows, "ratio_geomean": overall},
                  f, indent=1)
    print(text, end="")


if __name__ == "__main__":
    main()
