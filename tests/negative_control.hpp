// The negative controls' shape and faults (docs/HARNESS.md §4), shared by the CPU checks of the
// isolated machinery (test_isolated.cpp) and the GPU negative controls
// (test_isolated_negative.cpp):
// d_model 32, headdim 16, d_state 16, 2 layers, B 2, T 40, chunk 16 (3 chunks, the last one
// short), seed 21; one fault per kind of error — a dropped term (drop-beta, F5b), a sign
// (flip-angle, F5), an index (chunk-boundary, F6), a rounding (round-twice, F6).
#pragma once

#include "backbone_gpu.hpp"
#include "run.hpp"

namespace m3::harness::negative {

inline constexpr gpu::Fault kFaults[] = {gpu::Fault::DropBeta, gpu::Fault::FlipAngleSign,
                                         gpu::Fault::ChunkBoundaryOff, gpu::Fault::RoundTwice};

inline RunSpec spec(bool outproj_norm = false) {
  RunSpec s;
  s.cfg.d_model = 32;
  s.cfg.input_dim = 32;
  s.cfg.headdim = 16;
  s.cfg.d_state = 16;
  s.cfg.n_layers = 2;
  s.cfg.chunk_size = 16;
  s.cfg.is_outproj_norm = outproj_norm;
  s.B = 2;
  s.T = 40;
  s.seed = 21;
  return s;
}

}  // namespace m3::harness::negative
