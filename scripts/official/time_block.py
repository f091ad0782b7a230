#!/usr/bin/env python3
"""time_block.py — the official Mamba-3 block's time and memory at the bench's official shape,
written as the figures file `m3h bench --against FILE` reads (harness/against.hpp).

Usage (on the GPU machine: PyTorch, Triton, einops):

    python3 scripts/official/time_block.py --mamba-src DIR --out FILE
        [--params bf16|f32] [--no-graph] [--rounds 5] [--reps 10] [--source-label TEXT] [--force]

  --mamba-src DIR  a state-spaces/mamba source tree (DIR/mamba_ssm/modules/mamba3.py); its
                   modules are imported without mamba_ssm/__init__.py, as judge_official.py does.
  --out FILE       the figures file (an existing one only with --force; written whole or not
                   at all).
  --params         bf16 (default): the blocks' parameters in bf16, as a bf16 module runs;
                   f32: parameters in f32 under torch.autocast(bfloat16), as mixed-precision
                   training runs. The input is bf16 either way.
  --no-graph       time plain launches (the default replays one CUDA graph per timed pass, as
                   `m3h bench --graph` does).
  --source-label   what to call the official tree in the file's `measured` line (default: its
                   git revision, or "an exported tree").

What is timed. A stack of n official blocks (mamba_ssm.modules.block.Block: the Triton RMSNorm
fused with the residual add, the Mamba3 mixer; residual in f32, as the official backbone builds
them) at B 8, T 4096, d_model 1024, headdim 64, d_state 128, expand 2, ngroups 1, chunk 64,
rope fraction 0.5 (32 angles, the widths of this repository's `official` preset), for n = 1 and
n = 2. The figures are the marginal block, two blocks minus one, exactly as `m3h bench --shapes
official,official2` forms its marginal layer:
  fwd_ms     forward of the stack (its output h + r of the last block);
  fwdbwd_ms  forward and backward against a fixed output gradient (f32, as the output is),
             with every parameter's gradient and the input's;
  gib_per_layer  torch's peak allocation over one forward + backward, less what was allocated
             before the stack was built (a block's weights and gradients count, as in the bench).
Each time is the median over --rounds rounds of the mean of --reps passes, timed with CUDA
events after one warm-up round (Triton tunes its kernels during the warm-up, outside any graph).

Printed: both stacks' figures, the single block's and the marginal one. Exit status: 0 written,
2 bad use or a failed step (one line "time_block.py: error: ..." on stderr). Not used by any
test or build of the repository.
"""

import argparse
import datetime
import functools
import os
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import judge_official  # noqa: E402
from judge_official import import_official, source_revision  # noqa: E402


def die(msg):
    print(f"time_block.py: error: {msg}", file=sys.stderr)
    sys.exit(2)


judge_official.die = die  # import_official's refusals name this script

SHAPE = dict(B=8, T=4096, d_model=1024, headdim=64, d_state=128, expand=2, ngroups=1, chunk=64)


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mamba-src", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--params", choices=("bf16", "f32"), default="bf16")
    p.add_argument("--no-graph", action="store_true")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--source-label")
    p.add_argument("--force", action="store_true")
    a = p.parse_args()
    if not os.path.isfile(os.path.join(a.mamba_src, "mamba_ssm", "modules", "mamba3.py")):
        die(f"--mamba-src {a.mamba_src}: no mamba_ssm/modules/mamba3.py there")
    if os.path.exists(a.out) and not a.force:
        die(f"--out {a.out} exists (--force replaces it)")
    if a.rounds < 1 or a.reps < 1:
        die("--rounds and --reps must be at least 1")
    return a


class Stack:
    """n official blocks; forward returns the last block's h + r (the residual stream's end)."""

    def __init__(self, torch, Block, Mamba3, RMSNorm, n, param_dtype):
        s = SHAPE
        mixer = functools.partial(Mamba3, d_state=s["d_state"], expand=s["expand"],
                                  headdim=s["headdim"], ngroups=s["ngroups"],
                                  chunk_size=s["chunk"], rope_fraction=0.5,
                                  device="cuda", dtype=param_dtype)
        norm = functools.partial(RMSNorm, eps=1e-5, device="cuda", dtype=param_dtype)
        self.blocks = torch.nn.ModuleList(
            Block(s["d_model"], mixer, torch.nn.Identity, norm_cls=norm, fused_add_norm=True,
                  residual_in_fp32=True) for _ in range(n))

    def params(self):
        return list(self.blocks.parameters())

    def __call__(self, x):
        h, r = x, None
        for blk in self.blocks:
            h, r = blk(h, r)
        return h + r


def timed(torch, fn, rounds, reps, graph):
    """Median over rounds of the mean ms of reps calls of fn, after two eager calls and one
    untimed round (and, with graph, three calls on a side stream and the capture)."""
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    run = fn
    if graph:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        run = g.replay
    for _ in range(reps):
        run()
    torch.cuda.synchronize()
    per = []
    for _ in range(rounds):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(reps):
            run()
        b.record()
        b.synchronize()
        per.append(a.elapsed_time(b) / reps)
    return statistics.median(per)


def measure(torch, mods, n, a):
    Block, Mamba3, RMSNorm = mods
    param_dtype = torch.bfloat16 if a.params == "bf16" else torch.float32
    torch.manual_seed(1234 + n)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    stack = Stack(torch, Block, Mamba3, RMSNorm, n, param_dtype)
    s = SHAPE
    x = torch.randn(s["B"], s["T"], s["d_model"], device="cuda", dtype=torch.bfloat16,
                    requires_grad=True)
    # The stack's output h + r is f32 (the residual is), so its gradient is too.
    dout = torch.randn(s["B"], s["T"], s["d_model"], device="cuda", dtype=torch.float32)
    autocast = (torch.autocast("cuda", dtype=torch.bfloat16) if a.params == "f32"
                else torch.autocast("cuda", enabled=False))
    params = stack.params()

    def fwd():
        with torch.no_grad(), autocast:
            stack(x)

    def fwdbwd():
        for q in params:
            q.grad = None
        x.grad = None
        with autocast:
            out = stack(x)
        out.backward(dout)

    # Memory: the peak of one eager forward + backward over what was allocated before the
    # stack was built (so a block's weights and gradients count, as in m3h bench's figure).
    # A first pass comes before it: Triton tunes its kernels on their first call per shape, in
    # the first stack measured only, and its trial buffers are no part of a block's cost.
    fwdbwd()
    for q in params:
        q.grad = None
    x.grad = None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    fwdbwd()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base

    graph = not a.no_graph
    try:
        f_ms = timed(torch, fwd, a.rounds, a.reps, graph)
        fb_ms = timed(torch, fwdbwd, a.rounds, a.reps, graph)
    except RuntimeError as e:
        die(f"{n} block(s): {'graph capture' if graph else 'a timed pass'} failed: "
            f"{str(e).splitlines()[0]}" + (" (--no-graph times plain launches)" if graph else ""))
    del stack, x, dout, params
    torch.cuda.empty_cache()
    return f_ms, fb_ms, peak / 2**30


def main():
    a = parse_args()
    try:
        import torch
        import triton  # noqa: F401  (the official kernels are Triton's)
    except ImportError as e:
        die(f"{e} (this script needs torch and triton)")
    if not torch.cuda.is_available():
        die("no CUDA device")
    official = import_official(a.mamba_src)
    import importlib
    Block = importlib.import_module("mamba_ssm.modules.block").Block
    RMSNorm = importlib.import_module("mamba_ssm.ops.triton.layer_norm").RMSNorm
    mods = (Block, official.Mamba3, RMSNorm)

    one = measure(torch, mods, 1, a)
    two = measure(torch, mods, 2, a)
    marg = tuple(t - o for t, o in zip(two, one))
    for label, (f, fb, gib) in (("1 block", one), ("2 blocks", two), ("marginal", marg)):
        print(f"{label:9s} fwd {f:7.3f} ms  fwd+bwd {fb:7.3f} ms  peak {gib:6.3f} GiB")
    if min(marg) <= 0:
        die("a marginal figure is not positive (two blocks measured no more than one); "
            "nothing written")

    card = torch.cuda.get_device_name()
    src = a.source_label or source_revision(a.mamba_src)
    when = datetime.date.today().isoformat()
    launches = "plain launches" if a.no_graph else "CUDA graphs"
    params = ("bf16 parameters" if a.params == "bf16"
              else "f32 parameters under torch.autocast(bfloat16)")
    text = (
        "# The official Mamba-3 block's figures at the bench's official shape, for\n"
        "#   m3h bench --shapes official,official2 --dtype bf16 --scan chunked --graph --against FILE\n"
        "# Written by scripts/official/time_block.py: the marginal block (two stacked official\n"
        "# blocks minus one: Triton RMSNorm fused with the residual add, the Mamba3 mixer, residual\n"
        "# in f32), B 8, T 4096, d_model 1024, headdim 64, d_state 128, expand 2, chunk 64.\n"
        f"# 1 block: fwd {one[0]:.3f} ms, fwd+bwd {one[1]:.3f} ms, peak {one[2]:.3f} GiB;\n"
        f"# 2 blocks: fwd {two[0]:.3f} ms, fwd+bwd {two[1]:.3f} ms, peak {two[2]:.3f} GiB.\n"
        f"name = official Mamba-3 block (state-spaces/mamba {src}, PyTorch+Triton, {params})\n"
        f"measured = {card}, {when}, {launches}, median of {a.rounds} rounds of {a.reps}\n"
        "dtype = bf16\n"
        f"fwd_ms = {marg[0]:.3f}\n"
        f"fwdbwd_ms = {marg[1]:.3f}\n"
        f"gib_per_layer = {marg[2]:.3f}\n")
    d = os.path.dirname(os.path.abspath(a.out))
    fd, tmp = tempfile.mkstemp(dir=d, prefix=".time_block.")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, a.out)
    print(f"written: {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
