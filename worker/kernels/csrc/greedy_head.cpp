// The greedy token of each row from a bfloat16 screen of the LM head, for
// worker/model/greedy_head.py; compiled into the same library as
// paged_attention.cpp (worker/kernels/native.py). Registers, in the
// `blockd_head` namespace:
//
//   screen_argmax(approx [M, V] bf16, x [M, K] f32, weight [V, K] f32, norms [V] f32,
//                 coef, rel) -> int64 [M]
//       the token v of each row whose exact logit x . weight[v] is largest, or -1
//       where the row cannot be screened (a non-finite approximate logit)
//
// How: `approx` is x @ weight.T computed from both sides rounded to bfloat16
// (and its result rounded to bfloat16 again). Each approximate logit a[v] is
// within e[v] = coef * |x| * norms[v] + rel * |a[v]| of the exact one (the
// caller derives coef and rel: see greedy_head.py). So the exact maximum is at
// least L = max_v (a[v] - e[v]), and only tokens with a[v] + e[v] >= L can
// reach it; those few (about four a row on SmolLM2) get their logit computed
// exactly (float64 sums of float32 products, which are exact), and the largest
// wins, the lowest index on a tie, as torch.argmax.
//
// Why: a decode step's LM head is its largest GEMM (SmolLM2-135M: 49,152 x
// 576, a sixth of the step's time at 64 rows in float32); in bfloat16 it
// takes half the time, and these two passes over the approximate row (L2
// resident) cost a few percent of it.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

namespace blockd_head {
namespace {

inline float bf16_to_float(uint16_t bits) {
  const uint32_t wide = static_cast<uint32_t>(bits) << 16;
  float out;
  std::memcpy(&out, &wide, sizeof(out));
  return out;
}

// A candidate's exact logit: float64 sums of float32 products (each exact in float64).
inline double exact_logit(const float* x, const float* w, int64_t K) {
  double logit = 0.0;
  for (int64_t i = 0; i < K; ++i) logit += static_cast<double>(x[i]) * w[i];
  return logit;
}

// The screened token of one row (see the header), or -1.
int64_t screen_row(const uint16_t* a, const float* x, const float* weight, const float* norms, int64_t V,
                   int64_t K, double coef, float rel) {
  double sq = 0.0;
  for (int64_t i = 0; i < K; ++i) sq += static_cast<double>(x[i]) * x[i];
  // the bound a little wider than derived, so its own float32 rounding cannot narrow it
  const float scale = static_cast<float>(coef * std::sqrt(sq) * 1.001);
  const float absolute = 1e-30f;  // flushed subnormal products
  auto bound = [&](float av, int64_t v) { return scale * norms[v] + rel * std::fabs(av) + absolute; };
  float lower = -std::numeric_limits<float>::infinity();
  int64_t v = 0;
#ifdef __AVX512F__
  // 16 logits at a time; a NaN lane never wins a max, so non-finite rows are caught below
  const __m512 vscale = _mm512_set1_ps(scale), vrel = _mm512_set1_ps(rel), vabs = _mm512_set1_ps(absolute);
  auto load = [&](int64_t at) {
    const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + at));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
  };
  auto vbound = [&](__m512 av, int64_t at) {
    return _mm512_add_ps(_mm512_fmadd_ps(vrel, _mm512_abs_ps(av), vabs),
                         _mm512_mul_ps(vscale, _mm512_loadu_ps(norms + at)));
  };
  __m512 lanes = _mm512_set1_ps(lower), nonfinite = _mm512_setzero_ps();
  for (; v + 16 <= V; v += 16) {
    const __m512 av = load(v);
    lanes = _mm512_max_ps(lanes, _mm512_sub_ps(av, vbound(av, v)));
    nonfinite = _mm512_or_ps(nonfinite, _mm512_sub_ps(av, av));  // 0 for finite, NaN otherwise
  }
  lower = _mm512_reduce_max_ps(lanes);
  for (int64_t w = v; w < V; ++w) {
    const float av = bf16_to_float(a[w]);
    if (!std::isfinite(av)) return -1;
    lower = std::max(lower, av - bound(av, w));
  }
  if (_mm512_cmp_ps_mask(nonfinite, nonfinite, _CMP_UNORD_Q) != 0 || !std::isfinite(lower)) return -1;
  int64_t best = -1;
  double best_logit = 0.0;
  const __m512 vlower = _mm512_set1_ps(lower);
  for (v = 0; v + 16 <= V; v += 16) {
    const __m512 av = load(v);
    __mmask16 hit = _mm512_cmp_ps_mask(_mm512_add_ps(av, vbound(av, v)), vlower, _CMP_GE_OQ);
    while (hit) {
      const int64_t c = v + __builtin_ctz(hit);
      hit &= hit - 1;
      const double logit = exact_logit(x, weight + c * K, K);
      if (best < 0 || logit > best_logit) best = c, best_logit = logit;
    }
  }
#else
  for (; v < V; ++v) {
    const float av = bf16_to_float(a[v]);
    if (!std::isfinite(av)) return -1;
    lower = std::max(lower, av - bound(av, v));
  }
  if (!std::isfinite(lower)) return -1;
  int64_t best = -1;
  double best_logit = 0.0;
  v = 0;
#endif
  for (; v < V; ++v) {  // what the vector loop left (all of the row without AVX-512)
    const float av = bf16_to_float(a[v]);
    if (av + bound(av, v) < lower) continue;
    const double logit = exact_logit(x, weight + v * K, K);
    if (best < 0 || logit > best_logit) best = v, best_logit = logit;
  }
  return best;
}

at::Tensor screen_argmax(const at::Tensor& approx, const at::Tensor& x, const at::Tensor& weight,
                         const at::Tensor& norms, double coef, double rel) {
  TORCH_CHECK(approx.dim() == 2 && approx.is_contiguous() && approx.scalar_type() == at::kBFloat16 &&
                  approx.device().is_cpu(), "approx must be a contiguous bfloat16 CPU tensor [rows, vocab]");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kFloat && x.device().is_cpu(),
              "x must be a contiguous float32 CPU tensor [rows, hidden]");
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous() && weight.scalar_type() == at::kFloat &&
                  weight.device().is_cpu(), "weight must be a contiguous float32 CPU tensor [vocab, hidden]");
  const int64_t M = approx.size(0), V = approx.size(1), K = x.size(1);
  TORCH_CHECK(V > 0 && x.size(0) == M && weight.size(0) == V && weight.size(1) == K,
              "approx [rows, vocab], x [rows, hidden] and weight [vocab, hidden] disagree in shape");
  TORCH_CHECK(norms.dim() == 1 && norms.size(0) == V && norms.is_contiguous() && norms.scalar_type() == at::kFloat,
              "norms must be a contiguous float32 [vocab]");
  TORCH_CHECK(coef >= 0.0 && rel >= 0.0, "coef and rel must be non-negative");
  at::Tensor out = at::empty({M}, x.options().dtype(at::kLong));
  const auto* ap = reinterpret_cast<const uint16_t*>(approx.data_ptr<at::BFloat16>());
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  const float* np = norms.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, M, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t r = lo; r < hi; ++r)
      op[r] = screen_row(ap + r * V, xp + r * K, wp, np, V, K, coef, static_cast<float>(rel));
  });
  return out;
}

}  // namespace
}  // namespace blockd_head

TORCH_LIBRARY(blockd_head, m) {
  m.def("screen_argmax(Tensor approx, Tensor x, Tensor weight, Tensor norms, float coef, float rel) -> Tensor",
        &blockd_head::screen_argmax);
}
