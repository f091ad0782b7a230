// Internal to gpu/ (verification): 64-bit digests of device buffers, computed on the device, for
// m3h determinism at CI scale (HARNESS.md §7): one launch hashes every segment (a registry
// tensor's buffer, a parameter gradient's slot) and one small download brings the digests back,
// so a repeat run copies no tensor to the host.
//
//   digest[s] = Σ_i mix(i, word_i) + mix(n_s, s)   (mod 2^64)
//   word_i    the i-th 16-bit word of segment s (every element is 2 or 4 bytes)
//   mix       the SplitMix64 finaliser of (i << 16 | word) ^ a per-segment constant
// Integer sums are exact and order-free, so the blocks add their partial sums with one integer
// atomic each and the digest is the same bits whatever the schedule (MODEL.md §7 forbids
// floating-point atomics; integer ones are exact). Any change of one bit changes the digest
// (a different mix value), a collision of two different buffers has probability ~2^-64.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "config.hpp"

namespace m3::gpu {

struct DigestSegment {
  const void* p;
  Idx bytes;  // a multiple of 2
};

// segments: a DEVICE array of n entries; max_bytes the largest; out: n digests (device).
void digest_segments(cudaStream_t s, const DigestSegment* segments, int n, Idx max_bytes,
                     std::uint64_t* out);

}  // namespace m3::gpu
