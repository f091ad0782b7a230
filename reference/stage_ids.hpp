// The stages of the backbone, once (docs/MODEL.md §4–§6, §10). Every stage is one row of
// M3_STAGES; the enum StageId, the names, the scope and direction of each stage and which
// stage writes a pseudo-stage's tensors all come from these rows, so a stage is added in one
// place and a misspelt stage is a compile error, not a failed lookup at run time.
//
//   X(id, scope, dir, writer)
//     id      the stage's name in the registry, the capture keys and every report
//     scope   Layer: runs once per layer; Backbone: once per pass (input_proj, norm_f, the
//             language-model ends)
//     dir     Forward or Backward for a layer stage; Both for a backbone stage that also has a
//             backward of its own (named "<stage> (bwd)" in the stage table and profiles)
//     writer  the stage itself for a stage that runs; for a pseudo-stage, a name that groups
//             tensors written by another stage, that stage: states (the leaving states) by
//             F6, d_states (the entering-state gradients) by B6, B4c (d_b_raw, d_c_raw) by
//             B4b. Two tensors differ from their pseudo-stage's writer: the leaving angle
//             state is F5's, its gradient B5a's (registry.hpp writing_stage).
//
// Rows are in execution order within each pass: the forward backbone and layer stages, then
// the backward ones, as chain.hpp drives them.
#pragma once

#include <string>
#include <string_view>

namespace m3 {

enum class Dir { Forward, Backward };
enum class Scope { Backbone, Layer };
// The directions a stage runs in (StageRow::dirs).
enum class Dirs { Forward, Backward, Both };

#define M3_STAGES(X)                    \
  X(input_proj, Backbone, Both, input_proj) \
  X(F1, Layer, Forward, F1)             \
  X(F2, Layer, Forward, F2)             \
  X(F3, Layer, Forward, F3)             \
  X(F4, Layer, Forward, F4)             \
  X(F5, Layer, Forward, F5)             \
  X(F4ef, Layer, Forward, F4ef)         \
  X(F5b, Layer, Forward, F5b)           \
  X(F6, Layer, Forward, F6)             \
  X(F7, Layer, Forward, F7)             \
  X(F8, Layer, Forward, F8)             \
  X(states, Layer, Forward, F6)         \
  X(norm_f, Backbone, Both, norm_f)     \
  X(head, Backbone, Both, head)         \
  X(loss, Backbone, Forward, loss)      \
  X(B8, Layer, Backward, B8)            \
  X(B7, Layer, Backward, B7)            \
  X(B6, Layer, Backward, B6)            \
  X(B5a, Layer, Backward, B5a)          \
  X(B5b, Layer, Backward, B5b)          \
  X(B4b, Layer, Backward, B4b)          \
  X(B4c, Layer, Backward, B4b)          \
  X(B3, Layer, Backward, B3)            \
  X(B2, Layer, Backward, B2)            \
  X(B1, Layer, Backward, B1)            \
  X(d_states, Layer, Backward, B6)

enum class StageId : unsigned char {
#define M3_STAGE_ENUM(id, scope, dirs, writer) id,
  M3_STAGES(M3_STAGE_ENUM)
#undef M3_STAGE_ENUM
};

struct StageRow {
  StageId id;
  const char* name;
  Scope scope;
  Dirs dirs;
  StageId writer;
};

inline constexpr StageRow kStageRows[] = {
#define M3_STAGE_ROW(id, scope, dirs, writer) \
  {StageId::id, #id, Scope::scope, Dirs::dirs, StageId::writer},
    M3_STAGES(M3_STAGE_ROW)
#undef M3_STAGE_ROW
};
inline constexpr int kStageCount = static_cast<int>(sizeof(kStageRows) / sizeof(kStageRows[0]));

constexpr const StageRow& stage_row(StageId s) { return kStageRows[static_cast<int>(s)]; }
constexpr const char* stage_name(StageId s) { return stage_row(s).name; }
constexpr Scope stage_scope(StageId s) { return stage_row(s).scope; }
// A pseudo-stage runs no code of its own: its tensors are written by stage_row(s).writer.
constexpr bool is_pseudo(StageId s) { return stage_row(s).writer != s; }

// The stage of a name as the registry and the reports spell it ("F6", "norm_f"; a stage
// table name's " (bwd)" suffix is not part of it). Throws m3::Error naming an unknown stage.
StageId stage_id(std::string_view name);
// Whether `name` is a stage's name (for user input that may be a pattern or a typo).
bool is_stage_name(std::string_view name);

// A stage as a type: executors of the driver (chain.hpp) overload one function per stage on
// these, so that a stage without its function fails to compile.
template <StageId s>
struct Stage {
  static constexpr StageId id = s;
};

}  // namespace m3
