// The decoder's linear layers on the CPU through oneDNN's matmul primitive.
//
// Loaded by worker/kernels/native.py as a library of its own (it links the
// oneDNN of the onednn-cpu-gomp wheel, libdnnl.so.3, which may be missing:
// then PackedLinear keeps torch's oneDNN inner product). Registers, in the
// `blockd_matmul` namespace:
//
//   pack(weight [N, K] float32) -> Tensor: the weight reordered once into the
//       blocked layout the matmul primitive picks for kRowsHint rows (a plain
//       float32 tensor of that many bytes, so it is freed like any tensor)
//   run(x [M, K], packed, bias [N]?, N) -> [M, N] = x @ weight.T + bias, any M
//   warm(N, K, bias) -> int: builds the primitives of every row count a call can
//       use (1 .. kMaxRows) for an [N, K] weight now, so that no step pays for
//       one (a worker calls it at start: ~0.15 s a weight shape); returns kMaxRows
//   version() -> int: oneDNN's major * 10000 + minor * 100 + patch
//
// Why not torch's own oneDNN: torch reaches it for float32 linears only as
// the inner-product primitive (mkldnn::_linear_pointwise); vLLM's CPU
// backend runs oneDNN's matmul primitive, whose brgemm kernels were
// 4-9% faster over SmolLM2's projections and LM head at 64 decode rows and
// 18% at 16 on the AMD EPYC measured (weights from memory, as a step reads
// them; docs/benchmarks.md). torch does not export its bundled oneDNN's
// symbols, hence the wheel. It uses GNU OpenMP: the process's one libgomp
// (torch's, loaded first under the same soname), so the matmul runs on the
// same thread team as every other op.
//
// A primitive is built for one row count (oneDNN's runtime row count ran
// an order of magnitude slower), about 0.6 ms each, and cached. So that a
// stream of prefills of ever new lengths does not build primitives forever,
// rows go in pieces of at most kMaxRows: every step reuses the primitives
// of at most kMaxRows row counts per weight shape, built once each (a
// 256-row piece runs the GEMM as fast as a whole prefill: SmolLM2's
// weights stay compute-bound at that many rows).

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <tuple>

#include <oneapi/dnnl/dnnl.hpp>

namespace blockd_matmul {
namespace {

using dnnl::memory;

// The row count the weight layout is chosen for: a decode batch's order of
// magnitude (worker/model/linear.py's BATCH_HINT); any row count runs on it.
constexpr int64_t kRowsHint = 64;
// The most rows one primitive runs (see the header comment).
constexpr int64_t kMaxRows = 256;

dnnl::engine& cpu() {
  static dnnl::engine engine(dnnl::engine::kind::cpu, 0);
  return engine;
}

memory::desc rows_desc(int64_t m, int64_t n) { return memory::desc({m, n}, memory::data_type::f32, memory::format_tag::ab); }

// The packed weight's layout for [K, N] float32: the primitive's own choice
// for kRowsHint rows, the same every time it is asked (pack and run agree).
memory::desc weight_desc(int64_t k, int64_t n) {
  memory::desc any({k, n}, memory::data_type::f32, memory::format_tag::any);
  dnnl::matmul::primitive_desc pd(cpu(), rows_desc(kRowsHint, k), any, rows_desc(kRowsHint, n));
  return pd.weights_desc();
}

struct Cached {
  memory::desc weights;
  dnnl::matmul primitive;
};

std::mutex cache_lock;
std::map<std::tuple<int64_t, int64_t, int64_t, bool>, std::shared_ptr<const Cached>> cache;  // (M, N, K, bias)

// shared, so a caller holds its primitive without holding the lock
std::shared_ptr<const Cached> primitive(int64_t m, int64_t n, int64_t k, bool with_bias) {
  std::lock_guard<std::mutex> guard(cache_lock);
  auto key = std::make_tuple(m, n, k, with_bias);
  auto it = cache.find(key);
  if (it != cache.end()) return it->second;
  memory::desc w = weight_desc(k, n), src = rows_desc(m, k), dst = rows_desc(m, n);
  dnnl::matmul::primitive_desc pd = with_bias
      ? dnnl::matmul::primitive_desc(cpu(), src, w, rows_desc(1, n), dst)
      : dnnl::matmul::primitive_desc(cpu(), src, w, dst);
  return cache.emplace(key, std::make_shared<const Cached>(Cached{w, dnnl::matmul(pd)})).first->second;
}

void check_weight(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat && weight.device().is_cpu(),
              "weight must be a float32 CPU matrix [out_features, in_features]");
}

at::Tensor pack(const at::Tensor& weight_in) {
  check_weight(weight_in);
  const at::Tensor weight = weight_in.contiguous();
  const int64_t n = weight.size(0), k = weight.size(1);
  memory::desc packed_desc = weight_desc(k, n);
  at::Tensor packed = at::empty({int64_t((packed_desc.get_size() + 3) / 4)}, weight.options());
  // nn.Linear's [N, K] read as [K, N]: strides (1, K)
  memory src(memory::desc({k, n}, memory::data_type::f32, memory::dims{1, k}), cpu(), weight.data_ptr());
  memory dst(packed_desc, cpu(), packed.data_ptr());
  dnnl::stream stream(cpu());
  dnnl::reorder(src, dst).execute(stream, src, dst);
  stream.wait();
  return packed;
}

at::Tensor run(const at::Tensor& x_in, const at::Tensor& packed, const std::optional<at::Tensor>& bias,
               int64_t n) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kFloat && x_in.device().is_cpu(),
              "x must be a float32 CPU matrix [rows, in_features]");
  const at::Tensor x = x_in.contiguous();
  const int64_t m = x.size(0), k = x.size(1);
  at::Tensor out = at::empty({m, n}, x.options());
  if (m == 0) return out;
  const bool with_bias = bias.has_value() && bias->defined();
  if (with_bias)
    TORCH_CHECK(bias->numel() == n && bias->scalar_type() == at::kFloat && bias->is_contiguous(),
                "bias must be float32 [", n, "]");
  // the first piece's primitive; the weights' layout is the same for every row count
  std::shared_ptr<const Cached> c = primitive(std::min(m, kMaxRows), n, k, with_bias);
  TORCH_CHECK(packed.is_contiguous() && packed.scalar_type() == at::kFloat &&
                  size_t(packed.numel()) * 4 >= c->weights.get_size(),
              "packed is not a weight of ", n, " x ", k, " packed by blockd_matmul::pack");
  dnnl::stream stream(cpu());
  memory weights(c->weights, cpu(), packed.data_ptr());
  const float* x_rows = x.data_ptr<float>();
  float* out_rows = out.data_ptr<float>();
  for (int64_t m0 = 0; m0 < m; m0 += kMaxRows) {
    const int64_t rows = std::min(kMaxRows, m - m0);
    if (rows != std::min(m, kMaxRows)) c = primitive(rows, n, k, with_bias);  // the last, shorter piece
    memory src(rows_desc(rows, k), cpu(), const_cast<float*>(x_rows + m0 * k));
    memory dst(rows_desc(rows, n), cpu(), out_rows + m0 * n);
    if (with_bias) {
      memory b(rows_desc(1, n), cpu(), bias->data_ptr());
      c->primitive.execute(stream, {{DNNL_ARG_SRC, src}, {DNNL_ARG_WEIGHTS, weights}, {DNNL_ARG_BIAS, b},
                                    {DNNL_ARG_DST, dst}});
    } else {
      c->primitive.execute(stream, {{DNNL_ARG_SRC, src}, {DNNL_ARG_WEIGHTS, weights}, {DNNL_ARG_DST, dst}});
    }
  }
  stream.wait();
  return out;
}

int64_t warm(int64_t n, int64_t k, bool with_bias) {
  TORCH_CHECK(n > 0 && k > 0, "warm needs a weight shape, got ", n, " x ", k);
  for (int64_t rows = 1; rows <= kMaxRows; ++rows) primitive(rows, n, k, with_bias);
  return kMaxRows;
}

int64_t version() {
  const dnnl_version_t* v = dnnl_version();
  return int64_t(v->major) * 10000 + v->minor * 100 + v->patch;
}

}  // namespace
}  // namespace blockd_matmul

TORCH_LIBRARY(blockd_matmul, m) {
  m.def("pack(Tensor weight) -> Tensor", &blockd_matmul::pack);
  m.def("run(Tensor x, Tensor packed, Tensor? bias, int out_features) -> Tensor", &blockd_matmul::run);
  m.def("warm(int out_features, int in_features, bool bias) -> int", &blockd_matmul::warm);
  m.def("version() -> int", &blockd_matmul::version);
}
