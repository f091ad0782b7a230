// The negative-control faults of backbone_gpu.hpp: their names (as `m3h compare --fault` spells
// them) and the registry stage each one corrupts. Plain C++, compiled in the CUDA build and in
// the CPU-only build alike, so that the harness and the tools parse and report faults the same
// way everywhere (injecting one needs the device; see GpuBackbone::set_fault).
#include <string>

#include "backbone_gpu.hpp"
#include "error.hpp"
#include "stage_ids.hpp"

namespace m3::gpu {

namespace {
struct FaultInfo {
  Fault fault;
  const char* name;   // command-line spelling
  const char* stage;  // registry stage corrupted ("" for none)
};
constexpr FaultInfo kFaults[] = {
    {Fault::None, "none", ""},
    {Fault::DropBeta, "drop-beta", stage_name(StageId::F5b)},
    {Fault::FlipAngleSign, "flip-angle", stage_name(StageId::F5)},
    {Fault::ChunkBoundaryOff, "chunk-boundary", stage_name(StageId::F6)},
    {Fault::RoundTwice, "round-twice", stage_name(StageId::F6)},
};
}  // namespace

const char* fault_name(Fault f) {
  for (const auto& i : kFaults)
    if (i.fault == f) return i.name;
  return "?";
}

Fault parse_fault(const std::string& s) {
  std::string known;
  for (const auto& i : kFaults) {
    if (s == i.name) return i.fault;
    known += (known.empty() ? "" : ", ") + std::string(i.name);
  }
  throw Error("parse_fault", "unknown fault '" + s + "'", "expected one of " + known);
}

const char* fault_stage(Fault f) {
  for (const auto& i : kFaults)
    if (i.fault == f) return i.stage;
  return "";
}

}  // namespace m3::gpu
