// Tests of the safetensors format (train/safetensors.hpp), the interop names and layouts of
// export / import (train/interop.hpp), `m3h export` / `import` / `logits` and `m3h train
// --init` (docs/INTEROP.md).
//
//   Format     encode → decode gives every name, dtype, shape, byte and metadata entry back in
//              order; the header is padded to 8 bytes; hand-built files with BF16 and F16 bits
//              widen to the exact f32 values (bits worked out independently of the reader);
//              every malformed file (truncated, header length past the end, bad JSON, not an
//              object, a repeated key, unknown dtype, negative or fractional dims, a byte
//              range of the wrong length, past the data, overlapping another, bytes no tensor
//              covers, metadata not strings) is one m3::Error naming the problem
//   Interop    the official names and layouts: in_proj.weight is [ip, dm] with row r = column r
//              of our in_proj_w, out_proj and lm_head transposed, embedding not, B_bias
//              [nh, 1, ds]; round trips checkpoint → file → checkpoint → file bit-exact
//              (params bit for bit, the two files byte for byte) over token, continuous-input,
//              gated-norm and grouped configs; BF16 / F16 weights import exactly; the two
//              tensors without an official counterpart may be absent (then 0 and 1), any
//              other missing, extra, mis-shaped, non-finite or integer tensor is an error
//              naming it and both shapes; no config in the metadata is an error
//   Tokens     token rows: comments, commas, ragged rows and ids out of range
//   Logits     causal (a later token never changes an earlier position's logits) and per row
//              (a row's logits do not depend on the other rows); budgets bf16 > f32 > 0
//   CLI        export → import → export byte-identical through files; malformed files, a
//              missing tensor, an existing --out without --force and --out = the input are
//              one line "m3h: error: <command>: …", exit 2, nothing written; logits file
//   Init       `m3h train --init C` where C holds the fresh weights of seed s equals the fresh
//              run of seed s bit for bit (so only the weights differ: moments zero, step 0);
//              other weights in C give another run; a given model option that differs from
//              C's is refused naming the option
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "backend.hpp"
#include "checkpoint.hpp"
#include "error.hpp"
#include "interop.hpp"
#include "params.hpp"
#include "precision.hpp"
#include "registry.hpp"
#include "safetensors.hpp"
#include "test_io.hpp"
#include "error_of.hpp"

namespace fs = std::filesystem;
using m3::Config;
using m3::Idx;
using m3::ParamLayout;
using m3::ParamSlot;
using namespace m3::train;
namespace st = m3::st;

namespace {

using m3::test::error_of;

#define EXPECT_ERROR(stmt, needle)                                                  \
  do {                                                                              \
    const std::string msg_ = error_of([&] { stmt; });                               \
    EXPECT_NE(msg_.find(needle), std::string::npos) << "message: " << msg_;         \
    EXPECT_EQ(msg_.find('\n'), std::string::npos) << "not one line: " << msg_;      \
  } while (0)

std::uint32_t bits(float f) { return m3::float_bits(f); }
float from_bits(std::uint32_t u) { return m3::bits_float(u); }

Config token_cfg() {
  Config c;
  c.d_model = 8;
  c.d_state = 8;
  c.expand = 2;
  c.headdim = 4;
  c.ngroups = 2;
  c.n_layers = 2;
  c.chunk_size = 4;
  c.vocab_size = 5;
  c.input_dim = 5;
  return c;
}

Settings settings_of(const Config& c) {
  Settings s = config_settings(c);
  s.push_back({"task", "parity"});
  s.push_back({"precision", "bf16"});
  s.push_back({"scan", "chunked"});
  s.push_back({"T", "16"});
  return s;
}

// Parameters with no symmetry (Init::Perturbed), in the flat layout.
std::vector<float> params_of(const Config& c, std::uint64_t seed) {
  return to_flat(m3::make_params<float>(c, seed, m3::Init::Perturbed), m3::param_layout(c));
}

// A tensor's elements as float, read from its F32 bytes directly (not through to_floats).
std::vector<float> raw_f32(const st::TensorData& t) {
  EXPECT_EQ(t.dtype, st::DType::F32);
  std::vector<float> v(t.bytes.size() / 4);
  for (std::size_t i = 0; i < v.size(); ++i)
    v[i] = from_bits(static_cast<std::uint32_t>(t.bytes[4 * i]) | t.bytes[4 * i + 1] << 8 |
                     t.bytes[4 * i + 2] << 16 |
                     static_cast<std::uint32_t>(t.bytes[4 * i + 3]) << 24);
  return v;
}

std::string le64(std::uint64_t n) {
  std::string s;
  for (int i = 0; i < 8; ++i) s.push_back(static_cast<char>((n >> (8 * i)) & 0xff));
  return s;
}

// A file from a header text and data bytes.
std::string file_of(const std::string& header, const std::string& data) {
  return le64(header.size()) + header + data;
}

}  // namespace

// ---- the format -------------------------------------------------------------------------------

TEST(SafetensorsFormat, EncodeDecodeKeepsEverythingInOrder) {
  st::File f;
  f.metadata = {{"format", "pt"}, {"z.key", "last"}, {"a.key", "välue"}};
  f.tensors.push_back(st::f32_tensor("w", {2, 3}, {1, -2, 3.5f, 0, -0.0f, 1e-40f}));
  st::TensorData h{"h", st::DType::BF16, {3}, {0x80, 0x3f, 0x00, 0xc0, 0x01, 0x00}};
  f.tensors.push_back(h);
  f.tensors.push_back(st::i32_tensor("tok", {1, 2}, {7, -1}));
  f.tensors.push_back(st::f32_tensor("scalar", {}, {42}));
  const std::string bytes = st::encode(f);
  std::uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = n << 8 | static_cast<unsigned char>(bytes[static_cast<std::size_t>(i)]);
  EXPECT_EQ(n % 8, 0u) << "the header is padded to 8 bytes";
  EXPECT_EQ(bytes.size(), 8 + n + 24 + 6 + 8 + 4);
  const st::File g = st::decode(bytes, "mem");
  EXPECT_EQ(g.metadata, f.metadata);
  ASSERT_EQ(g.tensors.size(), 4u);
  for (std::size_t i = 0; i < 4; ++i) {
    EXPECT_EQ(g.tensors[i].name, f.tensors[i].name);
    EXPECT_EQ(g.tensors[i].dtype, f.tensors[i].dtype);
    EXPECT_EQ(g.tensors[i].shape, f.tensors[i].shape);
    EXPECT_EQ(g.tensors[i].bytes, f.tensors[i].bytes);
  }
  EXPECT_EQ(st::to_ints(*g.find("tok"), "mem"), (std::vector<std::int32_t>{7, -1}));
  EXPECT_EQ(bits(st::to_floats(*g.find("w"), "mem")[5]), bits(1e-40f));
  EXPECT_EQ(st::encode(g), bytes) << "decode → encode is the identity";
}

TEST(SafetensorsFormat, Bf16AndF16WidenToTheExactFloat) {
  // BF16 bits b are the float with bits b << 16; F16 values worked out by hand.
  const std::uint16_t b16[] = {0x3f80, 0xc049, 0x0001, 0x7f7f, 0x8000};
  const std::pair<std::uint16_t, float> f16[] = {
      {0x3c00, 1.0f}, {0xc000, -2.0f}, {0x3555, 0.333251953125f}, {0x0001, std::ldexp(1.0f, -24)},
      {0x7bff, 65504.0f}, {0x8000, -0.0f}};
  std::string data;
  for (std::uint16_t b : b16) data += std::string{static_cast<char>(b & 0xff), static_cast<char>(b >> 8)};
  for (const auto& [h, v] : f16) data += std::string{static_cast<char>(h & 0xff), static_cast<char>(h >> 8)};
  const std::string header =
      R"({"b":{"dtype":"BF16","shape":[5],"data_offsets":[0,10]},)"
      R"("h":{"dtype":"F16","shape":[2,3],"data_offsets":[10,22]}})";
  const st::File f = st::decode(file_of(header, data), "hand");
  const std::vector<float> b = st::to_floats(*f.find("b"), "hand");
  for (std::size_t i = 0; i < 5; ++i)
    EXPECT_EQ(bits(b[i]), static_cast<std::uint32_t>(b16[i]) << 16) << i;
  const std::vector<float> h = st::to_floats(*f.find("h"), "hand");
  for (std::size_t i = 0; i < 6; ++i) EXPECT_EQ(bits(h[i]), bits(f16[i].second)) << i;
}

TEST(SafetensorsFormat, EveryMalformedFileIsOneError) {
  const std::string ok_entry = R"("a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]})";
  const std::string data8(8, '\0');
  EXPECT_NO_THROW(st::decode(file_of("{" + ok_entry + "}", data8), "f"));
  EXPECT_ERROR(st::decode("", "f"), "truncated: 0 bytes");
  EXPECT_ERROR(st::decode(std::string("\x10\0\0", 3), "f"), "truncated: 3 bytes");
  EXPECT_ERROR(st::decode(le64(1000) + "{}", "f"), "header length 1000 runs past the end");
  EXPECT_ERROR(st::decode(le64(~0ull) + "{}", "f"), "runs past the end");
  EXPECT_ERROR(st::decode(file_of("{\"a\":", ""), "f"), "not valid JSON");
  EXPECT_ERROR(st::decode(file_of("[1, 2]", ""), "f"), "not a JSON object");
  EXPECT_ERROR(st::decode(file_of("{" + ok_entry + "," + ok_entry + "}", data8), "f"),
               "names 'a' twice");
  EXPECT_ERROR(st::decode(file_of(R"({"a":{"dtype":"F64","shape":[1],"data_offsets":[0,8]}})", data8), "f"),
               "dtype \"F64\"");
  EXPECT_ERROR(st::decode(file_of(R"({"a":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", data8), "f"),
               "shape holds -2");
  EXPECT_ERROR(st::decode(file_of(R"({"a":{"dtype":"F32","shape":[2.0],"data_offsets":[0,8]}})", data8), "f"),
               "shape holds 2.0");
  EXPECT_ERROR(st::decode(file_of(R"({"a":{"dtype":"F32","shape":[2]}})", data8), "f"),
               "has no data_offsets");
  EXPECT_ERROR(st::decode(file_of(R"({"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", data8), "f"),
               "do not hold its shape");
  EXPECT_ERROR(st::decode(file_of(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[8,0]}})", data8), "f"),
               "do not hold its shape");
  // The data cut short: the last tensor runs past it.
  EXPECT_ERROR(st::decode(file_of("{" + ok_entry + "}", std::string(5, '\0')), "f"),
               "run past the end of the data");
  EXPECT_ERROR(st::decode(file_of(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                                  R"("b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
                                  std::string(12, '\0')),
                          "f"),
               "tensors 'a' and 'b' overlap");
  EXPECT_ERROR(st::decode(file_of(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})", data8), "f"),
               "data bytes [0, 4) belong to no tensor");
  EXPECT_ERROR(st::decode(file_of("{" + ok_entry + "}", std::string(12, '\0')), "f"),
               "data bytes [8, 12) belong to no tensor");
  EXPECT_ERROR(st::decode(file_of(R"({"__metadata__":{"k":1}})", ""), "f"), "'k' is not a string");
  EXPECT_ERROR(st::decode(file_of(R"({"__metadata__":[]})", ""), "f"), "__metadata__ is not a JSON object");
  EXPECT_ERROR(st::decode(file_of(R"({"a":7})", ""), "f"), "tensor 'a' is not a JSON object");
  // The file name leads every message.
  EXPECT_ERROR(st::decode("", "dir/model.safetensors"), "dir/model.safetensors: truncated");
}

// ---- names and layouts ------------------------------------------------------------------------

TEST(SafetensorsInterop, KnownTensorsLandAtTheOfficialNamesAndLayouts) {
  const Config c = token_cfg();
  const ParamLayout layout = m3::param_layout(c);
  const std::vector<float> p = params_of(c, 11);
  const st::File f = export_model(c, settings_of(c), p);
  EXPECT_EQ(*f.meta("format"), "pt");
  EXPECT_EQ(*f.meta("m3h.setting.d_model"), "8");
  EXPECT_EQ(*f.meta("m3h.setting.task"), "parity");
  // Every parameter, in MODEL.md §2's order, under its official name.
  const std::vector<std::string> layer1 = {
      "norm.weight",         "mixer.in_proj.weight", "mixer.dt_bias",
      "mixer.B_norm.weight", "mixer.C_norm.weight",  "mixer.B_bias",
      "mixer.C_bias",        "mixer.D",              "mixer.norm.weight",
      "mixer.out_proj.weight"};
  std::vector<std::string> want = {"backbone.embedding.weight", "backbone.embedding.bias"};
  for (int l = 0; l < 2; ++l)
    for (const auto& n : layer1) want.push_back("backbone.layers." + std::to_string(l) + "." + n);
  want.push_back("backbone.norm_f.weight");
  want.push_back("lm_head.weight");
  ASSERT_EQ(f.tensors.size(), want.size());
  for (std::size_t i = 0; i < want.size(); ++i) EXPECT_EQ(f.tensors[i].name, want[i]);

  const Idx dm = c.d_model, ip = c.in_proj_dim(), di = c.d_inner(), V = c.vocab_size;
  const ParamSlot& in = layout.at(1, "in_proj_w");
  const st::TensorData* t = f.find("backbone.layers.1.mixer.in_proj.weight");
  ASSERT_NE(t, nullptr);
  EXPECT_EQ(t->shape, (std::vector<Idx>{ip, dm})) << "nn.Linear [out, in]";
  const std::vector<float> w = raw_f32(*t);
  // Row r of the file = column r of our [dm, ip] in_proj_w: the official split order is ours.
  for (Idx r = 0; r < ip; ++r)
    for (Idx i = 0; i < dm; ++i)
      ASSERT_EQ(bits(w[static_cast<std::size_t>(r * dm + i)]),
                bits(p[static_cast<std::size_t>(in.offset + i * ip + r)]))
          << "row " << r << " col " << i;
  // The z slice's first column and the angles' last: the two ends of the split.
  EXPECT_EQ(bits(w[0]), bits(p[static_cast<std::size_t>(in.offset)]));
  EXPECT_EQ(bits(w[static_cast<std::size_t>((ip - 1) * dm)]),
            bits(p[static_cast<std::size_t>(in.offset + ip - 1)]));

  const ParamSlot& out = layout.at(0, "out_proj_w");
  const std::vector<float> o = raw_f32(*f.find("backbone.layers.0.mixer.out_proj.weight"));
  EXPECT_EQ(f.find("backbone.layers.0.mixer.out_proj.weight")->shape, (std::vector<Idx>{dm, di}));
  EXPECT_EQ(bits(o[static_cast<std::size_t>(3 * di + 5)]),
            bits(p[static_cast<std::size_t>(out.offset + 5 * dm + 3)]));
  const ParamSlot& head = layout.at(-1, "head_w");
  const std::vector<float> lm = raw_f32(*f.find("lm_head.weight"));
  EXPECT_EQ(f.find("lm_head.weight")->shape, (std::vector<Idx>{V, dm}));
  EXPECT_EQ(bits(lm[static_cast<std::size_t>(4 * dm + 7)]),
            bits(p[static_cast<std::size_t>(head.offset + 7 * V + 4)]));
  // nn.Embedding is [V, dm] like our input_proj_w: no transpose.
  const ParamSlot& emb = layout.at(-1, "input_proj_w");
  const std::vector<float> e = raw_f32(*f.find("backbone.embedding.weight"));
  EXPECT_EQ(f.find("backbone.embedding.weight")->shape, (std::vector<Idx>{V, dm}));
  for (Idx i = 0; i < V * dm; ++i)
    ASSERT_EQ(bits(e[static_cast<std::size_t>(i)]), bits(p[static_cast<std::size_t>(emb.offset + i)]));
  // B_bias carries the official rank axis; the bytes are ours in order.
  const st::TensorData* bb = f.find("backbone.layers.0.mixer.B_bias");
  EXPECT_EQ(bb->shape, (std::vector<Idx>{c.nheads(), 1, c.d_state}));
  const ParamSlot& bs = layout.at(0, "b_bias");
  const std::vector<float> bv = raw_f32(*bb);
  for (Idx i = 0; i < bs.size; ++i)
    ASSERT_EQ(bits(bv[static_cast<std::size_t>(i)]), bits(p[static_cast<std::size_t>(bs.offset + i)]));
  // Continuous input: a Linear [out, in] with its bias under input_proj.
  Config x = token_cfg();
  x.vocab_size = 0;
  x.input_dim = 6;
  const st::File fx = export_model(x, config_settings(x), params_of(x, 2));
  EXPECT_EQ(fx.find("backbone.input_proj.weight")->shape, (std::vector<Idx>{x.d_model, 6}));
  EXPECT_NE(fx.find("backbone.input_proj.bias"), nullptr);
  EXPECT_EQ(fx.find("lm_head.weight"), nullptr);
}

class SafetensorsRoundTrip : public ::testing::TestWithParam<int> {};

TEST_P(SafetensorsRoundTrip, CheckpointFileCheckpointFileIsBitExact) {
  Config c = token_cfg();
  if (GetParam() == 1) c.is_outproj_norm = true;
  if (GetParam() == 2) {
    c.vocab_size = 0;
    c.input_dim = 7;
  }
  if (GetParam() == 3) {
    c.vocab_size = 0;
    c.input_dim = c.d_model;
    c.input_proj_identity = true;
    c.ngroups = 1;
    c.rope_fraction = 1.0;
  }
  const std::vector<float> p = params_of(c, 5 + static_cast<unsigned>(GetParam()));
  const Settings s = settings_of(c);
  const std::string a = st::encode(export_model(c, s, p));
  const ImportedModel m = import_model(st::decode(a, "a"), "a");
  EXPECT_TRUE(m.defaulted.empty());
  EXPECT_EQ(config_settings(m.cfg), config_settings(c));
  EXPECT_EQ(m.settings, s);
  ASSERT_EQ(m.params.size(), p.size());
  for (std::size_t i = 0; i < p.size(); ++i) ASSERT_EQ(bits(m.params[i]), bits(p[i])) << i;
  EXPECT_EQ(st::encode(export_model(m.cfg, m.settings, m.params)), a);
}
std::string round_trip_name(const ::testing::TestParamInfo<int>& i) {
  static const char* const names[] = {"tokens_silu_gate", "tokens_gated_norm",
                                      "continuous_input", "identity_input_rope1"};
  return names[i.param];
}
INSTANTIATE_TEST_SUITE_P(Configs, SafetensorsRoundTrip, ::testing::Values(0, 1, 2, 3),
                         round_trip_name);

TEST(SafetensorsInterop, Bf16AndF16WeightsImportExactly) {
  const Config c = token_cfg();
  const std::vector<float> p = params_of(c, 3);
  for (const st::DType dt : {st::DType::BF16, st::DType::F16}) {
    st::File f = export_model(c, settings_of(c), p);
    // Every tensor rebuilt by hand in the narrow type: round to nearest even, keep the bits.
    std::vector<std::vector<std::uint16_t>> narrow;
    for (st::TensorData& t : f.tensors) {
      std::vector<std::uint16_t> h;
      std::vector<std::uint8_t> bytes;
      for (float v : raw_f32(t)) {
        h.push_back(dt == st::DType::BF16 ? m3::float_to_bf16_bits(v) : m3::float_to_f16_bits(v));
        bytes.push_back(static_cast<std::uint8_t>(h.back() & 0xff));
        bytes.push_back(static_cast<std::uint8_t>(h.back() >> 8));
      }
      t.dtype = dt;
      t.bytes = bytes;
      narrow.push_back(h);
    }
    const std::string file = st::encode(f);
    const st::File g = st::decode(file, "narrow");
    const ImportedModel m = import_model(g, "narrow");
    const st::File back = export_model(m.cfg, m.settings, m.params);
    for (std::size_t k = 0; k < back.tensors.size(); ++k) {
      const std::vector<float> v = raw_f32(back.tensors[k]);
      for (std::size_t i = 0; i < v.size(); ++i) {
        const std::uint16_t h = narrow[k][i];
        // BF16: the f32 with the same upper half; F16: sign, exponent and mantissa moved over
        // (every f16 of these weights is normal or zero).
        float want;
        if (dt == st::DType::BF16) {
          want = from_bits(static_cast<std::uint32_t>(h) << 16);
        } else {
          const std::uint32_t sign = (h >> 15) & 1u, e = (h >> 10) & 31u, mant = h & 1023u;
          ASSERT_NE(e, 31u) << "an f16 overflow in the fixture";
          want = e == 0 ? std::ldexp(static_cast<float>(mant), -24) * (sign ? -1.0f : 1.0f)
                        : from_bits(sign << 31 | (e - 15 + 127) << 23 | mant << 13);
        }
        ASSERT_EQ(bits(v[i]), bits(want)) << back.tensors[k].name << "[" << i << "]";
      }
    }
  }
}

TEST(SafetensorsInterop, OptionalTensorsMayBeAbsentOthersMayNot) {
  Config c = token_cfg();
  auto without = [&](const Config& cfg, const std::vector<std::string>& names) {
    st::File f = export_model(cfg, config_settings(cfg), params_of(cfg, 9));
    std::vector<st::TensorData> keep;
    for (auto& t : f.tensors)
      if (std::find(names.begin(), names.end(), t.name) == names.end()) keep.push_back(t);
    f.tensors = keep;
    return st::decode(st::encode(f), "m.safetensors");
  };
  const ImportedModel m = import_model(
      without(c, {"backbone.embedding.bias", "backbone.layers.1.mixer.norm.weight"}), "m");
  EXPECT_EQ(m.defaulted, (std::vector<std::string>{"backbone.embedding.bias",
                                                    "backbone.layers.1.mixer.norm.weight"}));
  const ParamLayout layout = m3::param_layout(c);
  const ParamSlot& b = layout.at(-1, "input_proj_b");
  const ParamSlot& g = layout.at(1, "norm_gate_weight");
  for (Idx i = 0; i < b.size; ++i) EXPECT_EQ(m.params[static_cast<std::size_t>(b.offset + i)], 0.0f);
  for (Idx i = 0; i < g.size; ++i) EXPECT_EQ(m.params[static_cast<std::size_t>(g.offset + i)], 1.0f);
  // With the gated norm the mixer's norm.weight is a real parameter: required.
  c.is_outproj_norm = true;
  EXPECT_ERROR(import_model(without(c, {"backbone.layers.1.mixer.norm.weight"}), "m.safetensors"),
               "m.safetensors: missing tensor 'backbone.layers.1.mixer.norm.weight'");
  EXPECT_ERROR(import_model(without(c, {"backbone.layers.0.mixer.D"}), "m.safetensors"),
               "missing tensor 'backbone.layers.0.mixer.D' (expected [4] (our L0/d_param)");
}

TEST(SafetensorsInterop, BadTensorsAndMetadataAreOneErrorNamingThem) {
  const Config c = token_cfg();
  const st::File good = export_model(c, settings_of(c), params_of(c, 4));
  auto imported = [&](const std::function<void(st::File&)>& edit) {
    st::File f = good;
    edit(f);
    return import_model(st::decode(st::encode(f), "m.safetensors"), "m.safetensors");
  };
  auto find = [](st::File& f, const std::string& n) -> st::TensorData& {
    for (auto& t : f.tensors)
      if (t.name == n) return t;
    throw std::runtime_error("no " + n);
  };
  EXPECT_NO_THROW(imported([](st::File&) {}));
  const std::string ip = std::to_string(c.in_proj_dim());
  // Mis-shaped: our layout [dm, ip] instead of the official [ip, dm] (same bytes, wrong shape).
  EXPECT_ERROR(imported([&](st::File& f) {
                 auto& t = find(f, "backbone.layers.0.mixer.in_proj.weight");
                 t.shape = {c.d_model, c.in_proj_dim()};
               }),
               "tensor 'backbone.layers.0.mixer.in_proj.weight' has shape [8, " + ip + "], expected [" + ip + ", 8]");
  EXPECT_ERROR(imported([&](st::File& f) {
                 auto& t = find(f, "backbone.layers.1.mixer.B_bias");
                 t.shape = {c.nheads(), c.d_state};
               }),
               "has shape [4, 8], expected [4, 1, 8]");
  EXPECT_ERROR(imported([&](st::File& f) { f.tensors.push_back(st::f32_tensor("backbone.layers.2.norm.weight", {8}, std::vector<float>(8, 1))); }),
               "unexpected tensor 'backbone.layers.2.norm.weight' [8]");
  EXPECT_ERROR(imported([&](st::File& f) {
                 auto& t = find(f, "backbone.norm_f.weight");
                 t = st::f32_tensor(t.name, t.shape, std::vector<float>(8, std::numeric_limits<float>::quiet_NaN()));
               }),
               "'backbone.norm_f.weight' holds a non-finite value");
  EXPECT_ERROR(imported([&](st::File& f) {
                 auto& t = find(f, "backbone.layers.0.mixer.dt_bias");
                 t = st::i32_tensor(t.name, t.shape, std::vector<std::int32_t>(4, 1));
               }),
               "'backbone.layers.0.mixer.dt_bias' is I32");
  EXPECT_ERROR(imported([](st::File& f) { f.metadata.clear(); }), "no 'm3h.settings'");
  EXPECT_ERROR(imported([](st::File& f) {
                 for (auto& kv : f.metadata)
                   if (kv.first == "m3h.setting.headdim") kv.second = "3";
               }),
               "invalid model config");
  EXPECT_ERROR(imported([](st::File& f) {
                 std::vector<std::pair<std::string, std::string>> m;
                 for (auto& kv : f.metadata)
                   if (kv.first != "m3h.setting.d_state") m.push_back(kv);
                 f.metadata = m;
               }),
               "lists setting 'd_state' but has no 'm3h.setting.d_state'");
  EXPECT_ERROR(imported([](st::File& f) {
                 for (auto& kv : f.metadata)
                   if (kv.first == "m3h.setting.T") kv.second = "abc";
               }),
               "m.safetensors: __metadata__: /meta attribute 'T' is not a non-negative integer ('abc')");
  // Another config than the tensors': the first tensor whose shape differs is named.
  EXPECT_ERROR(imported([](st::File& f) {
                 for (auto& kv : f.metadata)
                   if (kv.first == "m3h.setting.d_model") kv.second = "16";
               }),
               "tensor 'backbone.embedding.weight' has shape [5, 8], expected [5, 16]");
}

// ---- token rows and logits ----------------------------------------------------------------------

TEST(SafetensorsLogits, TokenRowsParseAndRefuse) {
  const TokenRows r = parse_token_rows("# two rows\n0 1 2\n\n3,4, 0  # end\n", 5, "t.txt");
  EXPECT_EQ(r.B, 2);
  EXPECT_EQ(r.T, 3);
  EXPECT_EQ(r.tok, (std::vector<std::int32_t>{0, 1, 2, 3, 4, 0}));
  EXPECT_ERROR(parse_token_rows("0 1 2\n3 4\n", 5, "t.txt"), "t.txt: line 2 has 2 tokens");
  EXPECT_ERROR(parse_token_rows("0 5\n", 5, "t.txt"), "line 1: token '5'");
  EXPECT_ERROR(parse_token_rows("0 -1\n", 5, "t.txt"), "token '-1'");
  EXPECT_ERROR(parse_token_rows("0 1x\n", 5, "t.txt"), "token '1x'");
  EXPECT_ERROR(parse_token_rows("# nothing\n\n", 5, "t.txt"), "no token row");
}

TEST(SafetensorsLogits, CausalPerRowAndBudgetsOrdered) {
  const Config c = token_cfg();
  const std::vector<float> p = params_of(c, 8);
  TokenRows two = parse_token_rows("1 2 3 4 0 1\n4 4 3 2 1 0\n", 5, "t");
  TokenRows changed = parse_token_rows("1 2 3 0 2 2\n4 4 3 2 1 0\n", 5, "t");  // row 0 from t=3 on
  TokenRows one = parse_token_rows("4 4 3 2 1 0\n", 5, "t");
  const std::vector<m3::Precision> ps = {m3::Precision::F32, m3::Precision::BF16};
  const ModelLogits a = model_logits(c, p, two, m3::ScanMode::Chunked, ps);
  const ModelLogits b = model_logits(c, p, changed, m3::ScanMode::Chunked, ps);
  const ModelLogits o = model_logits(c, p, one, m3::ScanMode::Sequential, {});
  const Idx V = c.vocab_size, T = 6;
  ASSERT_EQ(a.logits.size(), static_cast<std::size_t>(2 * T * V));
  double changed_later = 0;
  for (Idx t = 0; t < T; ++t)
    for (Idx v = 0; v < V; ++v) {
      const std::size_t i = static_cast<std::size_t>(t * V + v);
      if (t < 3) EXPECT_EQ(a.logits[i], b.logits[i]) << "t " << t;  // causal
      else changed_later = std::max(changed_later, std::fabs(double(a.logits[i]) - b.logits[i]));
      // Row 1 alone (and in the other scan mode) gives row 1's logits.
      EXPECT_NEAR(a.logits[static_cast<std::size_t>(T * V) + i], o.logits[i], 1e-5);
    }
  EXPECT_GT(changed_later, 1e-4) << "the logits do depend on the tokens";
  ASSERT_EQ(a.budgets.size(), 2u);
  EXPECT_GT(a.budgets[0].rel_l2, 0);
  EXPECT_GT(a.budgets[1].rel_l2, 10 * a.budgets[0].rel_l2) << "bf16 allows more than f32";
  EXPECT_GT(a.budgets[1].max_abs, a.budgets[1].baseline_max_abs);
}

// ---- m3h export / import / logits / train --init -----------------------------------------------
#ifdef M3H_PATH
namespace {

class InteropCli : public ::testing::Test {
 protected:
  m3::test::TempDir tmp{"m3_interop_"};
  m3::test::CliRun m3h(const std::string& args) const {
    return m3::test::run_m3h(args, tmp.dir, tmp.dir);
  }
  void expect_error(const std::string& args, const std::string& needle) const {
    const m3::test::CliRun r = m3h(args);
    EXPECT_EQ(r.status, 2) << args << "\n" << r.out << r.err;
    EXPECT_EQ(m3::test::count_lines(r.err), 1) << r.err;
    EXPECT_NE(r.err.find(needle), std::string::npos) << args << ": " << r.err;
  }
  // A checkpoint of `params` with the token config's settings.
  void write_ckpt(const std::string& name, const Config& c, const std::vector<float>& params) const {
    CheckpointMeta meta;
    meta.settings = settings_of(c);
    meta.step = 12;
    meta.run_id = "0123456789abcdef";
    TrainState s;
    s.params = params;
    s.m.assign(params.size(), 0.5f);
    s.v.assign(params.size(), 0.25f);
    write_checkpoint(tmp.file(name), c, meta, s, false);
  }
};

}  // namespace

TEST_F(InteropCli, ExportImportExportIsByteIdenticalAndImportedIsACheckpoint) {
  const Config c = token_cfg();
  write_ckpt("c0.h5", c, params_of(c, 21));
  ASSERT_EQ(m3h("export --checkpoint c0.h5 --out a.safetensors").status, 0);
  const m3::test::CliRun imp = m3h("import a.safetensors --out c1.h5");
  ASSERT_EQ(imp.status, 0) << imp.err;
  EXPECT_NE(imp.out.find("step 0, zero AdamW moments"), std::string::npos) << imp.out;
  ASSERT_EQ(m3h("export --checkpoint c1.h5 --out b.safetensors").status, 0);
  EXPECT_EQ(m3::test::slurp(tmp.file("a.safetensors")), m3::test::slurp(tmp.file("b.safetensors")));
  Config c1;
  TrainState s0, s1;
  read_checkpoint(tmp.file("c0.h5"), nullptr, &s0);
  const CheckpointMeta meta = read_checkpoint(tmp.file("c1.h5"), &c1, &s1);
  EXPECT_EQ(config_settings(c1), config_settings(c));
  EXPECT_EQ(meta.settings, settings_of(c));
  EXPECT_EQ(meta.step, 0);
  EXPECT_EQ(meta.run_id, "");
  for (std::size_t i = 0; i < s0.params.size(); ++i) {
    ASSERT_EQ(bits(s1.params[i]), bits(s0.params[i])) << i;
    ASSERT_EQ(s1.m[i], 0.0f);
    ASSERT_EQ(s1.v[i], 0.0f);
  }
  // The imported checkpoint is one that compare reads (its model and weights).
  const m3::test::CliRun cmp = m3h("compare --checkpoint c1.h5 --B 1 --T 8 --dtype f32 --scan seq");
  EXPECT_EQ(cmp.status, 0) << cmp.out << cmp.err;
}

TEST_F(InteropCli, BadInputIsOneLineAndNothingIsWritten) {
  const Config c = token_cfg();
  write_ckpt("c0.h5", c, params_of(c, 1));
  ASSERT_EQ(m3h("export --checkpoint c0.h5 --out a.safetensors").status, 0);
  const std::string good = m3::test::slurp(tmp.file("a.safetensors"));
  std::ofstream(tmp.file("cut.safetensors"), std::ios::binary) << good.substr(0, good.size() - 3);
  expect_error("import cut.safetensors --out x.h5", "m3h: error: import: cut.safetensors: tensor 'lm_head.weight'");
  std::ofstream(tmp.file("short.safetensors"), std::ios::binary) << good.substr(0, 5);
  expect_error("import short.safetensors --out x.h5", "import: short.safetensors: truncated: 5 bytes");
  std::ofstream(tmp.file("json.safetensors"), std::ios::binary) << le64(4) << "{\"a\"";
  expect_error("import json.safetensors --out x.h5", "not valid JSON");
  expect_error("import nosuch.safetensors --out x.h5", "nosuch.safetensors: no such file");
  EXPECT_FALSE(fs::exists(tmp.file("x.h5")));
  expect_error("import a.safetensors --out c0.h5", "exists (pass --force to replace it)");
  expect_error("import a.safetensors --out a.safetensors --force", "is the input file");
  expect_error("export --checkpoint c0.h5 --out a.safetensors", "exists (pass --force");
  expect_error("export --checkpoint c0.h5 --out c0.h5 --force", "--checkpoint file");
  expect_error("import --out x.h5", "give the safetensors file");
  expect_error("export --out y.safetensors", "--checkpoint FILE is required");
  EXPECT_EQ(m3::test::slurp(tmp.file("a.safetensors")), good);
  EXPECT_FALSE(fs::exists(tmp.file("x.h5")));
  EXPECT_FALSE(fs::exists(tmp.file("y.safetensors")));
  // --force replaces, atomically, and only then.
  ASSERT_EQ(m3h("import a.safetensors --out c0.h5 --force").status, 0);
}

TEST_F(InteropCli, LogitsFileHoldsTokensLogitsAndBudgets) {
  const Config c = token_cfg();
  write_ckpt("c0.h5", c, params_of(c, 2));
  std::ofstream(tmp.file("tok.txt")) << "0 1 2 3\n4 3 2 1\n";
  const m3::test::CliRun r = m3h("logits --checkpoint c0.h5 --tokens tok.txt --out l.safetensors");
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_NE(r.out.find("budget bf16: rel_l2 <= "), std::string::npos) << r.out;
  const st::File f = st::read_file(tmp.file("l.safetensors"));
  EXPECT_EQ(f.find("tokens")->shape, (std::vector<Idx>{2, 4}));
  EXPECT_EQ(st::to_ints(*f.find("tokens"), "l"), (std::vector<std::int32_t>{0, 1, 2, 3, 4, 3, 2, 1}));
  EXPECT_EQ(f.find("logits")->shape, (std::vector<Idx>{2, 4, 5}));
  EXPECT_EQ(*f.meta("m3h.logits.scan"), "chunked");
  EXPECT_GT(std::stod(*f.meta("m3h.budget.bf16.rel_l2")), std::stod(*f.meta("m3h.budget.f32.rel_l2")));
  std::ofstream(tmp.file("bad.txt")) << "0 1 2 9\n";
  expect_error("logits --checkpoint c0.h5 --tokens bad.txt --out m.safetensors",
               "logits: bad.txt: line 1: token '9'");
  EXPECT_FALSE(fs::exists(tmp.file("m.safetensors")));
}

TEST_F(InteropCli, TrainInitStartsFromTheWeightsWithFreshMoments) {
  const std::string run =
      "train --device cpu --task parity --d-model 8 --d-state 8 --headdim 4 --layers 1 "
      "--B 2 --T 16 --steps 2 --warmup 1 --val-batches 1 --dtype f32 --seed 3";
  ASSERT_EQ(m3h(run + " --out fresh").status, 0);
  Config c;
  TrainState fresh;
  read_checkpoint(tmp.file("fresh/ckpt-00000002.h5"), &c, &fresh);
  // C holds the fresh run's own starting weights (seed 3), with moments that must be ignored.
  write_ckpt("init3.h5", c, initial_state(c, 3).params);
  const m3::test::CliRun r = m3h(run + " --out from3 --init init3.h5");
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_NE(r.out.find("weights from init3.h5 (AdamW moments zero, step 0)"), std::string::npos);
  TrainState from3;
  const CheckpointMeta m3meta = read_checkpoint(tmp.file("from3/ckpt-00000002.h5"), nullptr, &from3);
  EXPECT_EQ(m3meta.step, 2);
  for (std::size_t i = 0; i < fresh.params.size(); ++i) {
    ASSERT_EQ(bits(from3.params[i]), bits(fresh.params[i])) << i;
    ASSERT_EQ(bits(from3.m[i]), bits(fresh.m[i])) << i;
    ASSERT_EQ(bits(from3.v[i]), bits(fresh.v[i])) << i;
  }
  // Other weights: another run.
  write_ckpt("init4.h5", c, initial_state(c, 4).params);
  ASSERT_EQ(m3h(run + " --out from4 --init init4.h5").status, 0);
  TrainState from4;
  read_checkpoint(tmp.file("from4/ckpt-00000002.h5"), nullptr, &from4);
  EXPECT_NE(from4.params, fresh.params);
  // The model options default to the checkpoint's; one given must agree with it.
  const std::string bare =
      "train --device cpu --task parity --B 2 --T 16 --steps 1 --warmup 1 --val-batches 1";
  ASSERT_EQ(m3h(bare + " --out bare --init init4.h5").status, 0);
  expect_error(bare + " --out x --init init4.h5 --headdim 8 --d-model 16",
               "--d-model 16 differs from the --init checkpoint's 8");
  expect_error(run + " --out x --init init4.h5 --resume fresh/ckpt-00000002.h5", "give one of them");
}
#endif
