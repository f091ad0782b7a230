// The isolated (teacher-forced) run of the CPU reference, HARNESS.md §2: the CPU counterpart of
// gpu::run_gpu_isolated, with float compute and the storage rounding of the emulation
// (MODEL.md §8; F32 = exact float).
//
// Every stage of the backbone, in execution order (input_proj, then per layer F1 … F8, norm_f;
// norm_f backward, then per layer from the last B8 … B1, input_proj backward), runs ALONE:
// every tensor of the layer it may read is first set to the ORACLE's value (rounded to float,
// and to bf16/f16 where the registry marks the tensor typed), the stage function of the
// reference runs, and only that stage's outputs are captured. So the capture holds, under the
// usual keys, the error each stage adds by itself. The inputs the oracle does not capture come
// from the Problem: X, dOut, the entering states (zero leaving-state gradients). The residual
// gradient δ entering a layer's backward is the oracle's d_temporal of the layer above (or
// norm_f/d_norm for the last layer). Each parameter gradient comes from one stage of one
// layer, so "grad/…" holds that stage's contribution on the oracle's inputs.
//
// Stages are the registry's: in the sequential mode B6 is the BPTT, its RoPE tail and the
// α/β/γ glue together (d_k and d_q are B6 outputs read by the same stage); the "states" keys
// come from F5 (angle) and F6 (ssm, k, v), the "d_states" keys from B6 and B5a.
//
// `fault` (layer 0 only) injects the negative controls of backbone_gpu.hpp into the stage's
// output, exactly as documented there, so that the harness's own detection of a broken stage
// is testable without a device.
#pragma once

#include "backbone_gpu.hpp"  // gpu::Fault (plain C++)
#include "capture.hpp"
#include "config.hpp"
#include "precision.hpp"
#include "problem.hpp"

namespace m3::harness {

// `oracle` must hold every registry tensor of (pb, mode) (run_reference<double>); a missing or
// mis-shaped key is an m3::Error naming it. `storage`: F32, BF16 or F16. With a `sink` the
// Capture streams (capture.hpp).
Capture run_reference_isolated(const Problem& pb, ScanMode mode, const Capture& oracle,
                               Precision storage, gpu::Fault fault = gpu::Fault::None,
                               const TensorSink& sink = {});

// The value of `f` rounded (to nearest even) to `mantissa_bits` explicit mantissa bits with
// f32's exponent range: 7 is bf16; 5 is the RoundTwice fault's "bf16 with 2 fewer bits".
float round_mantissa(float f, int mantissa_bits);

}  // namespace m3::harness
