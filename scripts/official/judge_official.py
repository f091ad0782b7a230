#!/usr/bin/env python3
"""judge_official.py — the official Mamba-3 module (state-spaces/mamba) judged by `m3h judge`,
stage by stage, on a golden case, in f32 and in bf16 autocast.

Usage (on the GPU machine: PyTorch, Triton, numpy and einops; h5py is not needed):

    python3 scripts/official/judge_official.py --mamba-src DIR --golden G.h5 --m3h M3H --out OUT
        [--precisions f32,bf16] [--no-states] [--force]
  or, where m3h is not built on the GPU machine, in two places:
    (GPU)  ... --mamba-src DIR --golden G.h5 --problem P --out OUT      (P: m3h judge
           --golden G.h5 --export-problem P, made anywhere; runs and writes the subjects only)
    (any)  ... --judge-only --golden G.h5 --m3h M3H --out OUT            (OUT as the GPU left it:
           judges OUT/subject-<p> and writes the reports and verdict.md; needs neither torch
           nor numpy)

  --mamba-src DIR   a state-spaces/mamba source tree (DIR/mamba_ssm/modules/mamba3.py). Its
                    modules are imported without running mamba_ssm/__init__.py, which imports
                    compiled extensions the Mamba3 SISO path does not use.
  --golden G.h5     (with --problem and no --m3h, only named in the judging command printed)
                    a golden case of a backbone (vocab_size 0) that stores the chunked scan
                    mode and meets the official kernels' constraints: headdim, d_state and
                    chunk_size powers of two >= 16, an even number of rope angles > 0.
                    e.g. golden/cases/official_small.h5, or a longer one made with
                    m3h golden regen --out G.h5 --d-model 64 --expand 2 --headdim 64
                      --d-state 128 --layers 2 --B 2 --T 130 --chunk-size 64 --input-dim 64
                      --zero-states --scan chunked
  --m3h M3H         the m3h executable (build-gpu/tools/m3h, or a CPU build's).
  --problem P       an exported problem folder to run instead of exporting one with --m3h.
  --judge-only      only step 4's judging, of subject folders an earlier run wrote into OUT.
  --out OUT         a folder for everything written (created; an existing non-empty one only
                    with --force, which replaces the files this script writes there).
  --precisions      which runs: f32 (module and inputs in f32, TF32 off) and/or bf16 (the same
                    under torch.autocast(bfloat16)); default both.
  --no-states       call the official kernel exactly as Mamba3.forward does (no entering
                    states, no leaving states returned): no states/* or d_states/* tensors, and
                    only golden cases with zero entering states.

What it does
  1. M3H judge --golden G --export-problem OUT/problem: G's config, weights, input X, output
     gradient d_out and entering states as NumPy files (our layouts, float64).
  2. Builds G's backbone in PyTorch around the official mixer, one Mamba3 module per layer:
         H0      = X W_in + b_in            nn.Linear (H0 = X when input_proj is the identity)
         H{l+1}  = H{l} + Mamba3_l(RMSNorm(H{l}; norm_weight_l))     residual stream in f32
         Out     = RMSNorm(H{L}; norm_f_weight)
         RMSNorm(u; w) = u / sqrt(mean(u^2) + 1e-5) * w              (in f32, in this script)
     with G's weights: our [in, out] Linear weights transposed into nn.Linear's [out, in];
     b_bias, c_bias [NH, DS] as B_bias, C_bias [NH, 1, DS]; rows r = b*T + t viewed [B, T, .].
  3. Forward, then backward of sum(Out * d_out), in each precision; every tensor the official
     code exposes is captured (module hooks, retained gradients, and a thin wrapper around the
     module's call of mamba3_siso_combined that passes the arguments on unchanged, adds G's
     entering states, and asks for the leaving states).
  4. Writes OUT/subject-<p>/ (meta.json: precision p, scan_mode chunked, linear_layout out_in;
     one float32 <key>.npy per tensor, exact for bf16 values) and runs
     M3H judge --golden G --subject-dir OUT/subject-<p> --json OUT/judge-<p>.json
     (the report in OUT/judge-<p>.txt), then writes OUT/verdict.md: one table, both precisions.

Reading the verdict: the official SISO path (mamba3_siso_combined) casts Q, K, V, Z, Trap and
Angles to bf16 and keeps its per-chunk states in bf16 whatever the module's dtype, so its "f32"
run is an f32 module around bf16 kernels, held to f32's budgets; the bf16 run is the
comparison on equal terms. Tensors computed by this script's own code (marked "script" in
verdict.md) test the plumbing, not the official module.

Which official tensor is which key (l = layer; shapes ours; "script" = this file's own
backbone code, not the official module's)
  L{l}/F2/proj             in_proj output                          [BT, IP]
  L{l}/F3/x                kernel argument V                       [BT, NH, HD]
  L{l}/F3/z                kernel argument Z (self.norm's z with is_outproj_norm)
  L{l}/F3/dt               kernel argument DT [B, NH, T], transposed to [BT, NH]
  L{l}/F3/trap_raw         kernel argument Trap (the raw logits), transposed
  L{l}/F3/angles_raw       kernel argument Angles [B, T, NH, NA], head 0
  L{l}/F4/b_normed, c_normed   B_norm / C_norm outputs [B, T, 1, NG, DS]
  L{l}/F6/adt              kernel argument ADT [B, NH, T], transposed
  L{l}/F6/y                self.norm's input y (only with is_outproj_norm; else the SiLU gate
                           is fused into the kernel and y is not exposed)
  L{l}/F7/gated            out_proj input
  L{l}/F8/out_flat         the Mamba3 module's output
  L{l}/states/ssm_state, k_state, v_state, angle_state   the kernel's final states
  L{l}/B8/d_gated          gradient of out_proj's input
  L{l}/B7/d_y              gradient of self.norm's y (is_outproj_norm only)
  L{l}/B7/d_z              gradient of Z (or self.norm's z)
  L{l}/B6/d_x              gradient of V
  L{l}/B6/d_adt_total      gradient of ADT, transposed
  L{l}/B5a/d_angles_raw    gradient of Angles summed over heads
  L{l}/B5b/d_trap_raw      gradient of Trap, transposed
  L{l}/B4b/d_b_normed, d_c_normed   gradients of the B_norm / C_norm outputs
  L{l}/B4c/d_b_raw, d_c_raw         gradients of the B_norm / C_norm inputs
  L{l}/B3/d_proj           gradient of in_proj's output
  L{l}/d_states/d_ssm_state, d_k_state, d_v_state, d_angle_state   gradients of the entering
                           states handed to the kernel (only when G's are not zero)
  grad/L{l}/in_proj_w      in_proj.weight.grad  [IP, DM]  (declared out_in)
  grad/L{l}/out_proj_w     out_proj.weight.grad [DM, DI]  (declared out_in)
  grad/L{l}/dt_bias, d_param   dt_bias.grad, D.grad
  grad/L{l}/b_bias, c_bias     B_bias.grad, C_bias.grad [NH, 1, DS] -> [NH, DS]
  grad/L{l}/b_norm_weight, c_norm_weight   B_norm.weight.grad, C_norm.weight.grad
  grad/L{l}/norm_gate_weight   norm.weight.grad (is_outproj_norm only)
  script: input_proj/input_proj_outputs, L{l}/F1/rms_vals, L{l}/F1/post_norm,
          L{l}/F8/layer_output, norm_f/norm_f_input, norm_f/norm_f_rms, norm_f/Out,
          norm_f/d_norm, L{l}/B2/d_norm, L{l}/B1/d_pre_norm, L{l}/B1/d_temporal,
          input_proj/d_input_proj_dx, grad/input_proj_w ([DM, IN], out_in), grad/input_proj_b,
          grad/L{l}/norm_weight, grad/norm_f_weight
  Not exposed by the official code (listed by m3h judge as not provided): the other F3 splits
  and activations (a_val, trap, dd_dt_raw, dd_a_raw), b_rms/c_rms, the biased and rotated
  B/C, angle_cumsum, alpha/beta/gamma, every other saved tensor of the chunked scan, and the
  B6/B5 intermediates besides those above.

Exit status: 0 every judged tensor within budget in every run, 1 some tensor over budget,
2 bad use or a failed step (one line "judge_official.py: error: ..." on stderr).
Not used by any test or build of the repository.
"""

import argparse
import contextlib
import importlib
import json
import os
import shutil
import subprocess
import sys
import traceback
import types

EPS = 1e-5


def die(msg):
    print(f"judge_official.py: error: {msg}", file=sys.stderr)
    sys.exit(2)


class Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, as every refusal of this script
        die(message)


def parse_args():
    p = Parser(description="The official Mamba3 module judged by m3h judge (see the header).")
    p.add_argument("--mamba-src")
    p.add_argument("--golden", required=True)
    p.add_argument("--m3h")
    p.add_argument("--problem")
    p.add_argument("--out", required=True)
    p.add_argument("--precisions", default="f32,bf16")
    p.add_argument("--no-states", action="store_true")
    p.add_argument("--judge-only", action="store_true")
    p.add_argument("--force", action="store_true")
    a = p.parse_args()
    a.precisions = [s for s in a.precisions.split(",") if s]
    if not a.precisions or any(s not in ("f32", "bf16") for s in a.precisions):
        die("--precisions: a comma list of f32 and bf16")
    if a.m3h is not None and not os.path.isfile(a.golden):  # without m3h it is only named
        die(f"--golden {a.golden}: no such file")
    if a.m3h is not None and not (os.path.isfile(a.m3h) and os.access(a.m3h, os.X_OK)):
        die(f"--m3h {a.m3h}: not an executable")
    if a.judge_only:
        if a.m3h is None:
            die("--judge-only needs --m3h")
        for q in a.precisions:
            if not os.path.isfile(os.path.join(a.out, f"subject-{q}", "meta.json")):
                die(f"--judge-only: no subject folder {os.path.join(a.out, f'subject-{q}')}")
        return a
    if a.mamba_src is None:
        die("--mamba-src DIR is required (the state-spaces/mamba source tree)")
    if not os.path.isfile(os.path.join(a.mamba_src, "mamba_ssm", "modules", "mamba3.py")):
        die(f"--mamba-src {a.mamba_src}: no mamba_ssm/modules/mamba3.py there")
    if a.m3h is None and a.problem is None:
        die("give --m3h M3H (export, run, judge) or --problem DIR (run only; judge elsewhere)")
    if a.problem is not None and not os.path.isfile(os.path.join(a.problem, "problem.json")):
        die(f"--problem {a.problem}: no problem.json there (m3h judge --export-problem writes one)")
    if os.path.exists(a.out) and (not os.path.isdir(a.out) or (os.listdir(a.out) and not a.force)):
        die(f"--out {a.out}: exists and is not an empty folder (pass --force to replace what "
            "this script writes there)")
    return a


def m3h(args, exe):
    """Runs m3h; returns (exit status, stdout). Status 2 is a bad input: fatal."""
    r = subprocess.run([exe] + args, capture_output=True, text=True)
    if r.returncode not in (0, 1):
        die(f"m3h {' '.join(args[:1])} failed: {r.stderr.strip() or r.stdout.strip()}")
    return r.returncode, r.stdout


def import_official(src):
    """mamba_ssm.modules.mamba3 from the source tree, without mamba_ssm/__init__.py."""
    pkg_dir = os.path.join(os.path.abspath(src), "mamba_ssm")
    stub = types.ModuleType("mamba_ssm")
    stub.__path__ = [pkg_dir]
    stub.__file__ = os.path.join(pkg_dir, "__init__.py")
    sys.modules["mamba_ssm"] = stub
    try:
        return importlib.import_module("mamba_ssm.modules.mamba3")
    except ImportError as e:
        die(f"cannot import the official Mamba3 from {src}: {e}")


def source_revision(src):
    # Only a checkout rooted at src names its revision: git would otherwise report the revision
    # of a repository that merely contains src (an exported tree inside this one, say).
    try:
        r = subprocess.run(["git", "-C", src, "rev-parse", "--show-toplevel", "--short", "HEAD"],
                           capture_output=True, text=True)
        lines = r.stdout.split()
        if r.returncode != 0 or len(lines) != 2:
            return "no git revision"
        if os.path.realpath(lines[0]) != os.path.realpath(src):
            return "no git revision (an exported tree)"
        return lines[1]
    except OSError:
        return "no git revision"


def check_case(meta, use_states):
    c, d = meta["config"], meta["derived"]
    bad = []
    if c["vocab_size"] > 0:
        bad.append("a token model (vocab_size > 0): this script builds a backbone only")
    if "chunked" not in meta["scan_modes"]:
        bad.append("the golden file stores no chunked run (the official kernels are chunked)")
    for name in ("headdim", "d_state", "chunk_size"):
        v = c[name]
        if v < 16 or v & (v - 1):
            bad.append(f"{name} {v} is not a power of two >= 16 (the official Triton kernels)")
    na = d["num_rope_angles"]
    if na == 0 or na % 2:
        bad.append(f"num_rope_angles {na}: the official kernels need an even number > 0")
    if meta["entering_states"] != "zero" and not use_states:
        bad.append("non-zero entering states need the state wrapper (drop --no-states)")
    if bad:
        die("the golden case does not fit the official module: " + "; ".join(bad))


class Taps:
    """What one forward + backward exposes, per layer: name -> tensor (gradients retained)."""

    def __init__(self):
        self.layer = 0
        self.t = {}       # (layer, name) -> tensor
        self.states = {}  # layer -> (angle, ssm, k, v) entering states (leaves) or None

    def keep(self, name, t, grad=True):
        if t is None:
            return
        if grad and t.requires_grad:
            t.retain_grad()
        self.t[(self.layer, name)] = t


class Backbone:
    """G's backbone around the official Mamba3 mixers, with G's weights."""

    def __init__(self, official, meta, arr, device):
        import torch
        c, d = meta["config"], meta["derived"]
        self.c = c
        self.L = c["n_layers"]
        f32 = torch.float32

        def w(name):
            return torch.tensor(arr["weights/" + name], dtype=f32, device=device)

        self.identity = bool(c["input_proj_identity"])
        if not self.identity:
            self.input_proj = torch.nn.Linear(c["input_dim"], c["d_model"], bias=True,
                                              device=device, dtype=f32)
            with torch.no_grad():
                self.input_proj.weight.copy_(w("input_proj_w").t())
                self.input_proj.bias.copy_(w("input_proj_b"))
        self.norm_w = [torch.nn.Parameter(w(f"L{l}/norm_weight")) for l in range(self.L)]
        self.norm_f_w = torch.nn.Parameter(w("norm_f_weight"))
        self.mixers = []
        for l in range(self.L):
            m = official.Mamba3(d_model=c["d_model"], d_state=c["d_state"], expand=c["expand"],
                                headdim=c["headdim"], ngroups=c["ngroups"],
                                rope_fraction=c["rope_fraction"], A_floor=c["a_floor"],
                                is_outproj_norm=bool(c["is_outproj_norm"]),
                                chunk_size=c["chunk_size"], layer_idx=l, device=device, dtype=f32)
            got = (m.nheads, m.num_rope_angles, m.in_proj.out_features)
            want = (d["nheads"], d["num_rope_angles"], d["in_proj_dim"])
            if got != want:
                die(f"the official module's (nheads, num_rope_angles, in_proj_dim) = {got}, "
                    f"the golden case's {want}")
            p = f"L{l}/"
            loads = {
                "in_proj.weight": w(p + "in_proj_w").t(),
                "dt_bias": w(p + "dt_bias"),
                "B_bias": w(p + "b_bias").unsqueeze(1),
                "C_bias": w(p + "c_bias").unsqueeze(1),
                "B_norm.weight": w(p + "b_norm_weight"),
                "C_norm.weight": w(p + "c_norm_weight"),
                "D": w(p + "d_param"),
                "out_proj.weight": w(p + "out_proj_w").t(),
            }
            if c["is_outproj_norm"]:
                loads["norm.weight"] = w(p + "norm_gate_weight")
            params = dict(m.named_parameters())
            if set(params) != set(loads):
                die(f"the official Mamba3 has parameters {sorted(params)}; this script loads "
                    f"{sorted(loads)}")
            with torch.no_grad():
                for name, value in loads.items():
                    if params[name].shape != value.shape:
                        die(f"official {name} is {tuple(params[name].shape)}, the golden "
                            f"weight gives {tuple(value.shape)}")
                    params[name].copy_(value)
            self.mixers.append(m)

    def zero_grad(self):
        for m in self.mixers:
            m.zero_grad(set_to_none=True)
        for p in self.norm_w + [self.norm_f_w]:
            p.grad = None
        if not self.identity:
            self.input_proj.zero_grad(set_to_none=True)


def rmsnorm(u, w):
    import torch
    rms = torch.sqrt(u.pow(2).mean(-1, keepdim=True) + EPS)
    return u / rms * w, rms


def install_taps(official, net, use_states):
    """Hooks on the official submodules and the wrapper of the kernel call; returns a holder
    whose .taps is the Taps of the run in progress."""
    holder = types.SimpleNamespace(taps=None, use_states=use_states)
    # The kernel call as the official module has it, also when an earlier Backbone of this
    # process (scripts/official/grad_accuracy.py runs one per seed) has wrapped it already.
    if not hasattr(official, "_unwrapped_siso"):
        official._unwrapped_siso = official.mamba3_siso_combined
    combined = official._unwrapped_siso

    def siso(Q, K, V, ADT, DT, Trap, Q_bias, K_bias, Angles, D=None, Z=None,
             Input_States=None, chunk_size=64, return_final_states=False, cu_seqlens=None):
        tp = holder.taps
        for name, t in (("V", V), ("ADT", ADT), ("DT", DT), ("Trap", Trap),
                        ("Angles", Angles), ("Z", Z)):
            tp.keep(name, t)
        if not holder.use_states or Input_States is not None or return_final_states:
            out = combined(Q, K, V, ADT, DT, Trap, Q_bias, K_bias, Angles, D=D, Z=Z,
                           Input_States=Input_States, chunk_size=chunk_size,
                           return_final_states=return_final_states, cu_seqlens=cu_seqlens)
            tp.keep("Y", out if not isinstance(out, tuple) else out[0])
            return out
        out = combined(Q, K, V, ADT, DT, Trap, Q_bias, K_bias, Angles, D=D, Z=Z,
                       Input_States=tp.states.get(tp.layer), chunk_size=chunk_size,
                       return_final_states=True, cu_seqlens=cu_seqlens)
        y, angle, ssm, k, v = out[:5]
        tp.keep("Y", y)
        for name, t in (("final_angle", angle), ("final_ssm", ssm), ("final_k", k),
                        ("final_v", v)):
            tp.keep(name, t, grad=False)
        return y

    official.mamba3_siso_combined = siso

    def forward_hook(name, keep_input):
        def hook(module, args, output):
            tp = holder.taps
            if keep_input:
                tp.keep(name + ".in", args[0])
                if name == "norm":
                    tp.keep("norm.z", args[1] if len(args) > 1 else None)
            tp.keep(name + ".out", output)
        return hook

    for m in net.mixers:
        m.in_proj.register_forward_hook(forward_hook("in_proj", False))
        m.B_norm.register_forward_hook(forward_hook("B_norm", True))
        m.C_norm.register_forward_hook(forward_hook("C_norm", True))
        m.out_proj.register_forward_hook(forward_hook("out_proj", True))
        if net.c["is_outproj_norm"]:
            m.norm.register_forward_hook(forward_hook("norm", True))
    return holder


def run(net, holder, meta, arr, precision, device):
    """One forward + backward; returns {key: numpy float32 array in our shape}."""
    import torch
    c, d = meta["config"], meta["derived"]
    B, T = meta["B"], meta["T"]
    BT, DM, NH, HD = B * T, c["d_model"], d["nheads"], c["headdim"]
    NA, DI = d["num_rope_angles"], d["d_inner"]
    f32 = torch.float32

    def tensor(name, shape=None, requires_grad=False):
        a = arr[name] if shape is None else arr[name].reshape(shape)
        return torch.tensor(a, dtype=f32, device=device).requires_grad_(requires_grad)

    tp = Taps()
    holder.taps = tp
    if holder.use_states and meta["entering_states"] != "zero":
        for l in range(net.L):
            tp.states[l] = tuple(tensor(f"inputs/states/{s}")[l].clone().requires_grad_(True)
                                 for s in ("angle", "ssm", "k", "v"))
    net.zero_grad()
    X = tensor("inputs/x", (B, T, c["input_dim"]), True)  # a leaf: X.grad is d_input_proj_dx
    d_out = tensor("inputs/d_out", (B, T, DM))
    layer = []  # per layer: (u, un, rms, post, mix, h_next)
    ctx = (torch.autocast("cuda", dtype=torch.bfloat16) if precision == "bf16"
           else contextlib.nullcontext())
    with ctx:
        H0 = X if net.identity else net.input_proj(X)
        H = H0.float()
        for l, m in enumerate(net.mixers):
            tp.layer = l
            u = H
            if u.requires_grad and not u.is_leaf:
                u.retain_grad()
            un = u.clone()
            un.retain_grad()
            post, rms = rmsnorm(un, net.norm_w[l])
            post.retain_grad()
            mix = m(post)
            H = u + mix.float()
            layer.append((u, un, rms, post, mix, H))
        H.retain_grad()
        Out, rms_f = rmsnorm(H, net.norm_f_w)
    loss = (Out.float() * d_out).sum()
    loss.backward()
    torch.cuda.synchronize()

    out = {}

    def put(key, t, shape):
        if t is None:
            return
        out[key] = t.detach().to(f32).reshape(shape).contiguous().cpu().numpy()

    def tr(t):  # [B, NH, T] -> [B, T, NH]
        return None if t is None else t.permute(0, 2, 1)

    def grad(t):
        return None if t is None else t.grad

    if not net.identity:
        put("input_proj/input_proj_outputs", H0, (BT, DM))
    put("input_proj/d_input_proj_dx", X.grad, (BT, c["input_dim"]))
    for l, (u, un, rms, post, mix, h_next) in enumerate(layer):
        g = lambda name: tp.t.get((l, name))
        p = f"L{l}/"
        put(p + "F1/rms_vals", rms, (BT,))
        put(p + "F1/post_norm", post, (BT, DM))
        put(p + "F2/proj", g("in_proj.out"), (BT, d["in_proj_dim"]))
        z = g("norm.z") if c["is_outproj_norm"] else g("Z")
        put(p + "F3/z", z, (BT, NH, HD))
        put(p + "F3/x", g("V"), (BT, NH, HD))
        put(p + "F3/dt", tr(g("DT")), (BT, NH))
        put(p + "F3/trap_raw", tr(g("Trap")), (BT, NH))
        if g("Angles") is not None:
            put(p + "F3/angles_raw", g("Angles")[:, :, 0, :], (BT, NA))
        put(p + "F4/b_normed", g("B_norm.out"), (BT, c["ngroups"], c["d_state"]))
        put(p + "F4/c_normed", g("C_norm.out"), (BT, c["ngroups"], c["d_state"]))
        put(p + "F6/adt", tr(g("ADT")), (BT, NH))
        if c["is_outproj_norm"]:
            put(p + "F6/y", g("norm.in"), (BT, NH, HD))
            put(p + "B7/d_y", grad(g("norm.in")), (BT, DI))
        put(p + "F7/gated", g("out_proj.in"), (BT, DI))
        put(p + "F8/out_flat", mix, (BT, DM))
        put(p + "F8/layer_output", h_next, (BT, DM))
        if g("final_ssm") is not None:
            put(p + "states/ssm_state", g("final_ssm"), (B, NH, HD, c["d_state"]))
            put(p + "states/k_state", g("final_k"), (B, NH, c["d_state"]))
            put(p + "states/v_state", g("final_v"), (B, NH, HD))
            put(p + "states/angle_state", g("final_angle"), (B, NH, NA))
        put(p + "B8/d_gated", grad(g("out_proj.in")), (BT, DI))
        put(p + "B7/d_z", grad(z), (BT, DI))
        put(p + "B6/d_x", grad(g("V")), (BT, DI))
        put(p + "B6/d_adt_total", tr(grad(g("ADT"))), (BT, NH))
        if grad(g("Angles")) is not None:
            put(p + "B5a/d_angles_raw", grad(g("Angles")).sum(2), (BT, NA))
        put(p + "B5b/d_trap_raw", tr(grad(g("Trap"))), (BT, NH))
        put(p + "B4b/d_b_normed", grad(g("B_norm.out")), (BT, c["ngroups"], c["d_state"]))
        put(p + "B4b/d_c_normed", grad(g("C_norm.out")), (BT, c["ngroups"], c["d_state"]))
        put(p + "B4c/d_b_raw", grad(g("B_norm.in")), (BT, c["ngroups"], c["d_state"]))
        put(p + "B4c/d_c_raw", grad(g("C_norm.in")), (BT, c["ngroups"], c["d_state"]))
        put(p + "B3/d_proj", grad(g("in_proj.out")), (BT, d["in_proj_dim"]))
        put(p + "B2/d_norm", post.grad, (BT, DM))
        put(p + "B1/d_pre_norm", un.grad, (BT, DM))
        put(p + "B1/d_temporal", X.grad if u is X else u.grad, (BT, DM))
        if l in tp.states:
            for s, t in zip(("angle", "ssm", "k", "v"), tp.states[l]):
                shape = {"angle": (B, NH, NA), "ssm": (B, NH, HD, c["d_state"]),
                         "k": (B, NH, c["d_state"]), "v": (B, NH, HD)}[s]
                put(p + f"d_states/d_{s}_state", t.grad, shape)
        m = net.mixers[l]
        put("grad/" + p + "in_proj_w", m.in_proj.weight.grad, (d["in_proj_dim"], DM))
        put("grad/" + p + "out_proj_w", m.out_proj.weight.grad, (DM, DI))
        put("grad/" + p + "dt_bias", m.dt_bias.grad, (NH,))
        put("grad/" + p + "d_param", m.D.grad, (NH,))
        put("grad/" + p + "b_bias", m.B_bias.grad, (NH, c["d_state"]))
        put("grad/" + p + "c_bias", m.C_bias.grad, (NH, c["d_state"]))
        put("grad/" + p + "b_norm_weight", m.B_norm.weight.grad, (c["d_state"],))
        put("grad/" + p + "c_norm_weight", m.C_norm.weight.grad, (c["d_state"],))
        if c["is_outproj_norm"]:
            put("grad/" + p + "norm_gate_weight", m.norm.weight.grad, (DI,))
        put("grad/" + p + "norm_weight", net.norm_w[l].grad, (DM,))
    put("norm_f/norm_f_input", H, (BT, DM))
    put("norm_f/norm_f_rms", rms_f, (BT,))
    put("norm_f/Out", Out, (BT, DM))
    put("norm_f/d_norm", H.grad, (BT, DM))
    put("grad/norm_f_weight", net.norm_f_w.grad, (DM,))
    if not net.identity:
        put("grad/input_proj_w", net.input_proj.weight.grad, (DM, c["input_dim"]))
        put("grad/input_proj_b", net.input_proj.bias.grad, (DM,))
    return out


def write_subject(folder, tensors, precision, implementation, force):
    import numpy as np
    tmp = folder + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    meta = {"format": "m3h-subject", "format_version": 1, "precision": precision,
            "scan_mode": "chunked", "implementation": implementation,
            "linear_layout": "out_in"}
    with open(os.path.join(tmp, "meta.json"), "w") as f:
        json.dump(meta, f, indent=2)
        f.write("\n")
    for key, a in tensors.items():
        path = os.path.join(tmp, key + ".npy")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        np.save(path, np.ascontiguousarray(a, dtype=np.float32))
    if os.path.exists(folder):
        if not force:
            die(f"{folder}: exists (pass --force)")
        shutil.rmtree(folder)
    os.rename(tmp, folder)


def by_script(key):
    """Whether this script's own backbone code (not the official module) computed the key."""
    parts = key.split("/")
    if parts[0] in ("input_proj", "norm_f"):
        return True
    if parts[0] == "grad":
        return parts[-1] in ("input_proj_w", "input_proj_b", "norm_weight", "norm_f_weight")
    stage = "/".join(parts[1:])
    return parts[1] in ("F1", "B1", "B2") or stage == "F8/layer_output"


def verdict_table(out_dir, precisions, reports):
    """OUT/verdict.md: per key, each precision's rel_l2, %budget and status."""
    cells, order = {}, []
    for p in precisions:
        with open(os.path.join(out_dir, f"judge-{p}.json")) as f:
            j = json.load(f)
        last = -1  # merge the precisions' keys, each list in chain order
        for cell in j["cells"]:
            k = cell["key"]
            if k in order:
                last = order.index(k)
            else:
                last += 1
                order.insert(last, k)
            cells[(k, p)] = cell
        reports[p]["first_fail"] = j["first_fail"]["key"] if j["first_fail"] else None
        reports[p]["n"] = j["n_checks"]
        reports[p]["n_fail"] = j["n_fail"]
        reports[p]["n_expected"] = j["judge"]["n_expected"]

    def num(v):
        return v if isinstance(v, str) else f"{v:.2e}"

    lines = ["| key | computed by | " +
             " | ".join(f"{p} rel_l2 | {p} %budget | {p}" for p in precisions) + " |",
             "|---|---|" + "---|---|---|" * len(precisions)]
    for k in order:
        row = [f"`{k}`", "script" if by_script(k) else "official"]
        for p in precisions:
            c = cells.get((k, p))
            if c is None:
                row += ["-", "-", "not provided"]
                continue
            pct = c["pct"] if isinstance(c["pct"], str) else f"{c['pct']:.1f}%"
            row += [num(c["metrics"]["rel_l2"]), pct, "ok" if c["pass"] else c["status"]]
        lines.append("| " + " | ".join(row) + " |")
    head = []
    for p in precisions:
        r = reports[p]
        head.append(f"- {p}: {r['n'] - r['n_fail']} of {r['n']} judged tensors within budget "
                    f"({r['n_expected']} in the run); first failing stage: "
                    f"{'`' + r['first_fail'] + '`' if r['first_fail'] else 'none'}; "
                    f"{r['summary']}")
    text = "\n".join(head) + "\n\n" + "\n".join(lines) + "\n"
    with open(os.path.join(out_dir, "verdict.md"), "w") as f:
        f.write(text)
    return text


def judge_all(a):
    """m3h judge on OUT/subject-<p> for every precision, then OUT/verdict.md."""
    force = ["--force"] if a.force else []
    reports, status = {}, 0
    for p in a.precisions:
        subject = os.path.join(a.out, f"subject-{p}")
        rc, text = m3h(["judge", "--golden", a.golden, "--subject-dir", subject, "--json",
                        os.path.join(a.out, f"judge-{p}.json")] + force, a.m3h)
        with open(os.path.join(a.out, f"judge-{p}.txt"), "w") as f:
            f.write(text)
        summary = [ln for ln in text.splitlines() if ln.startswith("summary:")]
        reports[p] = {"summary": summary[-1] if summary else "(no summary line)"}
        print(f"{p}: {reports[p]['summary']}")
        status = max(status, rc)
    verdict_table(a.out, a.precisions, reports)
    print(f"verdict: {os.path.join(a.out, 'verdict.md')}")
    return status


def torch_for_official():
    """numpy, torch and triton, imported, on a CUDA device, with TF32 off: (np, torch, triton)."""
    try:
        import numpy as np
        import torch
        import triton
    except ImportError as e:
        die(f"{e} (this script needs numpy, torch and triton)")
    if not torch.cuda.is_available():
        die("no CUDA device: the official kernels are Triton GPU kernels")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    return np, torch, triton


def main():
    a = parse_args()
    if a.judge_only:
        return judge_all(a)
    np, torch, triton = torch_for_official()
    os.makedirs(a.out, exist_ok=True)

    problem = a.problem
    if problem is None:
        problem = os.path.join(a.out, "problem")
        m3h(["judge", "--golden", a.golden, "--export-problem", problem] +
            (["--force"] if a.force else []), a.m3h)
    with open(os.path.join(problem, "problem.json")) as f:
        meta = json.load(f)
    arr = {name[:-4]: np.load(os.path.join(problem, name)) for name in meta["arrays"]}
    use_states = not a.no_states
    check_case(meta, use_states)

    official = import_official(a.mamba_src)
    device = torch.device("cuda")
    net = Backbone(official, meta, arr, device)
    holder = install_taps(official, net, use_states)
    rev = source_revision(a.mamba_src)
    for p in a.precisions:
        what = "f32" if p == "f32" else "bf16 autocast"
        impl = (f"state-spaces/mamba Mamba3 ({rev}) in a PyTorch backbone, {what}; "
                f"torch {torch.__version__}, triton {triton.__version__}")
        try:
            tensors = run(net, holder, meta, arr, p, device)
        except Exception:  # the official code's own error, with its traceback
            traceback.print_exc()
            if not holder.use_states or meta["entering_states"] != "zero":
                die(f"the {p} run failed (traceback above)")
            print(f"{p}: the run with the kernel's states failed (traceback above); "
                  "again as Mamba3.forward calls the kernel (as --no-states)", file=sys.stderr)
            holder.use_states = False
            try:
                tensors = run(net, holder, meta, arr, p, device)
            except Exception:
                traceback.print_exc()
                die(f"the {p} run failed (traceback above)")
        subject = os.path.join(a.out, f"subject-{p}")
        write_subject(subject, tensors, p, impl, a.force)
        print(f"{p}: {len(tensors)} tensors -> {subject}")
    if a.m3h is None:
        print("judge them where m3h is built (the folder OUT as it is here):")
        print(f"  python3 {sys.argv[0]} --judge-only --golden {a.golden} --m3h M3H --out OUT "
              f"--precisions {','.join(a.precisions)}")
        return 0
    return judge_all(a)


if __name__ == "__main__":
    try:
        status = main()
    except Exception:  # an error of torch, Triton or the official code: exit 2, not 1
        traceback.print_exc()
        die("the run failed (traceback above)")
    sys.exit(status)
