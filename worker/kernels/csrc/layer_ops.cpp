// A decoder layer's elementwise math in one pass each (float32, CPU), for
// worker/model/fused.py; compiled into the same library as paged_attention.cpp
// (worker/kernels/native.py). Registers, in the `blockd_layer` namespace:
//
//   rms_norm(x [T, H], weight [H], eps) -> out [T, H]
//       out = weight * (x * 1/sqrt(mean(x^2) + eps))
//   add_rms_norm(x [T, H], residual [T, H], weight [H], eps) -> (sum [T, H], out [T, H])
//       sum = residual + x; out = rms_norm(sum)
//   rotary(qkv [T, (Hq + 2 Hkv) D], cos [T, D], sin [T, D], Hq, Hkv) -> (q [T, Hq, D], k, v [T, Hkv, D])
//       q, k rotated (rotate-half form: x * cos + rotate_half(x) * sin), v copied
//   add(a [T, H], b [T, H]) -> a + b
//   silu_mul(gate_up [T, 2I]) -> silu(gate_up[:, :I]) * gate_up[:, I:]  [T, I]
//   argmax_rows(x [B, V]) -> int64 [B]: torch.argmax(x, -1) (first maximum; a NaN counts as the
//       maximum, the first NaN wins), for worker/sampling.py's greedy tokens
//   copy_rows(dst [R, W], rows int64 [n], src [n, W]) -> ()
//       dst[rows[i]] = src[i], any dtype (the prepared step's K/V write, worker/runtime.py)
//
// Why: transformers' Llama layer runs these as 6-10 separate torch ops each
// (pow, mean, add, rsqrt, mul, mul; rotate_half's slices, neg and cat), every
// one a pass over the activations and, past torch's grain size, an OpenMP
// region of its own. Here each is one pass, and a decode step's few rows run
// on the calling thread (a parallel region costs more than the work, and
// much more when another process holds a core).
//
// Numerics: the products and sums are the ones transformers computes, each
// rounded to float32 as torch rounds them (no FMA contraction: see the pragma);
// only the order of the mean's sum differs (float32 rounding, ~1e-7 relative).
// worker/model/fused.py has the torch fallback; tests/worker/test_kernels.py compares the two.

#pragma GCC optimize("fp-contract=off")

#include <ATen/Parallel.h>
#include <ATen/ThreadLocalState.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/silu.h>
#include <omp.h>
#include <torch/library.h>

#include <cmath>
#ifdef __AVX512F__
#include <immintrin.h>
#endif
#include <cstdint>
#include <cstring>
#include <exception>
#include <tuple>

namespace blockd_layer {
namespace {

// Rows per parallel chunk: at least ~64K elements of work per chunk, so a
// decode batch (tens of rows) stays on the calling thread.
int64_t grain(int64_t width) { return std::max<int64_t>(1, 65536 / std::max<int64_t>(1, width)); }

void check_rows(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kFloat && x.device().is_cpu(),
              name, " must be a contiguous float32 CPU tensor [tokens, width]");
}

// 1/sqrt(mean(x^2) + eps) of one row; 16 partial sums so the loop vectorises.
inline float inv_rms(const float* x, int64_t n, float eps) {
  float acc[16] = {0};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    for (int j = 0; j < 16; ++j) acc[j] += x[i + j] * x[i + j];
  float sum = 0.f;
  for (int j = 0; j < 16; ++j) sum += acc[j];
  for (; i < n; ++i) sum += x[i] * x[i];
  float mean = sum / static_cast<float>(n);
  return 1.f / std::sqrt(mean + eps);
}

inline void norm_row(const float* x, const float* w, float* out, int64_t n, float eps) {
  const float r = inv_rms(x, n, eps);
  for (int64_t i = 0; i < n; ++i) out[i] = w[i] * (x[i] * r);
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(x, "x");
  const int64_t T = x.size(0), H = x.size(1);
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == H && weight.is_contiguous() &&
              weight.scalar_type() == at::kFloat, "weight must be a contiguous float32 [", H, "]");
  at::Tensor out = at::empty({T, H}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, T, grain(H), [&](int64_t lo, int64_t hi) {
    for (int64_t t = lo; t < hi; ++t) norm_row(xp + t * H, wp, op + t * H, H, static_cast<float>(eps));
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                const at::Tensor& weight, double eps) {
  check_rows(x, "x");
  check_rows(residual, "residual");
  TORCH_CHECK(x.sizes() == residual.sizes(), "x and residual differ in shape");
  const int64_t T = x.size(0), H = x.size(1);
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == H && weight.is_contiguous() &&
              weight.scalar_type() == at::kFloat, "weight must be a contiguous float32 [", H, "]");
  at::Tensor sum = at::empty({T, H}, x.options());
  at::Tensor out = at::empty({T, H}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* rp = residual.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* sp = sum.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, T, grain(H), [&](int64_t lo, int64_t hi) {
    for (int64_t t = lo; t < hi; ++t) {
      float* s = sp + t * H;
      for (int64_t i = 0; i < H; ++i) s[i] = rp[t * H + i] + xp[t * H + i];
      norm_row(s, wp, op + t * H, H, static_cast<float>(eps));
    }
  });
  return {sum, out};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> rotary(const at::Tensor& qkv, const at::Tensor& cos,
                                                      const at::Tensor& sin, int64_t q_heads, int64_t kv_heads) {
  check_rows(qkv, "qkv");
  check_rows(cos, "cos");
  check_rows(sin, "sin");
  const int64_t T = qkv.size(0), D = cos.size(1), half = D / 2;
  TORCH_CHECK(D % 2 == 0 && q_heads > 0 && kv_heads > 0 && qkv.size(1) == (q_heads + 2 * kv_heads) * D,
              "qkv must be [tokens, (q_heads + 2 kv_heads) * head_dim] with an even head_dim");
  TORCH_CHECK(cos.sizes() == sin.sizes() && cos.size(0) == T, "cos and sin must be [tokens, head_dim]");
  at::Tensor q = at::empty({T, q_heads, D}, qkv.options());
  at::Tensor k = at::empty({T, kv_heads, D}, qkv.options());
  at::Tensor v = at::empty({T, kv_heads, D}, qkv.options());
  const int64_t W = qkv.size(1);
  const float* src = qkv.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  float* qp = q.data_ptr<float>();
  float* kp = k.data_ptr<float>();
  float* vp = v.data_ptr<float>();
  at::parallel_for(0, T, grain(W), [&](int64_t lo, int64_t hi) {
    for (int64_t t = lo; t < hi; ++t) {
      const float* row = src + t * W;
      const float* c = cp + t * D;
      const float* s = sp + t * D;
      for (int64_t h = 0; h < q_heads + kv_heads; ++h) {
        const float* x = row + h * D;
        float* o = h < q_heads ? qp + (t * q_heads + h) * D : kp + (t * kv_heads + h - q_heads) * D;
        // rotate_half(x) = (-x2, x1): each product rounded, then the sum, as torch does
        for (int64_t i = 0; i < half; ++i) {
          float a = x[i] * c[i];
          float b = -x[i + half] * s[i];
          o[i] = a + b;
        }
        for (int64_t i = half; i < D; ++i) {
          float a = x[i] * c[i];
          float b = x[i - half] * s[i];
          o[i] = a + b;
        }
      }
      const float* vs = row + (q_heads + kv_heads) * D;
      float* vo = vp + t * kv_heads * D;
      for (int64_t i = 0; i < kv_heads * D; ++i) vo[i] = vs[i];
    }
  });
  return {q, k, v};
}

// a + b, elementwise (the residual add closing a layer) on the calling thread
// for a decode batch.
at::Tensor add(const at::Tensor& a, const at::Tensor& b) {
  check_rows(a, "a");
  check_rows(b, "b");
  TORCH_CHECK(a.sizes() == b.sizes(), "a and b differ in shape");
  const int64_t T = a.size(0), H = a.size(1);
  at::Tensor out = at::empty({T, H}, a.options());
  const float* ap = a.data_ptr<float>();
  const float* bp = b.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, T, grain(H), [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo * H; i < hi * H; ++i) op[i] = ap[i] + bp[i];
  });
  return out;
}

// The SiLU-gated MLP's activation: torch's own silu and mul kernels (their
// vectorised exp; the same float32 results as the torch fallback). A decode
// batch ([64, 1536] per half for SmolLM2, ~100K elements: past torch's grain,
// so each of the two ops would open an OpenMP region of its own) runs in one
// region for both ops, each thread running silu then mul on its own rows.
// Inside a region torch's loops run serially, so the bits are the serial ones.
// Measured in the model, right after the gate/up GEMM (SmolLM2, 64 rows):
//
// * AVX2 (Sleef's 8-wide exp, ~1.8 ns an element): ~300 us of work on one
//   thread (~440 us after the GEMM); one region ~100 us less a layer.
// * AVX-512 on an AMD EPYC (2 vCPUs, workers' GOMP_SPINCOUNT=30000,
//   worker/openmp.py): 261 us a call on one thread (47 us alone: after the
//   GEMM the team's other thread spins beside it), 117 us in one region
//   (torch.profiler, 2026-12-06). AVX-512 once ran on the calling thread
//   alone, measured on an Intel VM while workers slept between regions
//   (OMP_WAIT_POLICY=PASSIVE): ~20 us of work against 60-75 us for a region
//   that first woke a thread.
//
// One thread (a single row, or already inside a region): at::parallel_for
// asks omp_get_max_threads(), a per-thread setting, so lowering it for the
// call keeps torch's loops here (c10::ParallelGuard does not:
// at::in_parallel_region() ignores it).
struct OnCallingThread {
  const int previous = omp_get_max_threads();
  OnCallingThread() { omp_set_num_threads(1); }
  ~OnCallingThread() { omp_set_num_threads(previous); }
};

// Up to this many gate_up elements (a decode batch of 64 rows is 196,608 for
// SmolLM2) the above applies; a prefill's thousands of rows keep torch's
// threads for each op (serial, 1,152 rows took ~0.85 + 0.42 ms a layer).
constexpr int64_t kSerialSiluElements = int64_t(1) << 18;

void silu_mul_rows(const at::Tensor& gate_up, at::Tensor& out, int64_t lo, int64_t hi) {
  const int64_t inter = out.size(1);
  at::Tensor rows = out.narrow(0, lo, hi - lo), gate_up_rows = gate_up.narrow(0, lo, hi - lo);
  at::silu_out(rows, gate_up_rows.narrow(1, 0, inter));
  rows.mul_(gate_up_rows.narrow(1, inter, inter));
}

at::Tensor silu_mul(const at::Tensor& gate_up) {
  check_rows(gate_up, "gate_up");
  TORCH_CHECK(gate_up.size(1) % 2 == 0, "gate_up needs an even width (gate and up side by side)");
  const int64_t T = gate_up.size(0), inter = gate_up.size(1) / 2;
  at::Tensor out = at::empty({T, inter}, gate_up.options());
  if (gate_up.numel() > kSerialSiluElements) {
    silu_mul_rows(gate_up, out, 0, T);
    return out;
  }
  const int64_t threads = at::in_parallel_region() ? 1 : std::min<int64_t>(at::get_num_threads(), T);
  if (threads <= 1) {
    OnCallingThread serial;
    silu_mul_rows(gate_up, out, 0, T);
    return out;
  }
  // the team's threads run ATen ops: they need the caller's thread-local
  // state (inference mode: `out` is an inference tensor)
  const at::ThreadLocalState state;
  std::exception_ptr error;
#pragma omp parallel num_threads(threads)
  {
    const int64_t n = omp_get_num_threads(), t = omp_get_thread_num();
    const int64_t lo = T * t / n, hi = T * (t + 1) / n;
    try {
      at::ThreadLocalStateGuard guard(state);
      if (hi > lo) silu_mul_rows(gate_up, out, lo, hi);
    } catch (...) {
#pragma omp critical
      error = std::current_exception();
    }
  }
  if (error) std::rethrow_exception(error);
  return out;
}

// The greedy pick over a step's logits ([64, 49152] for SmolLM2: 12.6 MB).
// torch's argmax reduces a row with scalar compares (~0.9 ms here, 2
// threads); this keeps 16 running maxima and their first indices in
// AVX-512 lanes. The answer is torch's exactly: strict > keeps each lane's
// first occurrence, lanes tie-break to the smaller index, and a row with a
// NaN is rescanned in torch's order (the first NaN is the answer).
int64_t argmax_scalar(const float* x, int64_t n) {
  int64_t best_i = 0;
  float best = x[0];
  if (std::isnan(best)) return 0;
  for (int64_t j = 1; j < n; ++j) {
    if (std::isnan(x[j])) return j;
    if (x[j] > best) best = x[j], best_i = j;
  }
  return best_i;
}

int64_t argmax_row(const float* x, int64_t n) {
#ifdef __AVX512F__
  if (n >= 16 && n < (int64_t(1) << 31)) {
    __m512 best = _mm512_loadu_ps(x);
    __m512i idx = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m512i best_i = idx;
    const __m512i step = _mm512_set1_epi32(16);
    __mmask16 nan = _mm512_cmp_ps_mask(best, best, _CMP_UNORD_Q);
    int64_t j = 16;
    for (; j + 16 <= n; j += 16) {
      idx = _mm512_add_epi32(idx, step);
      const __m512 v = _mm512_loadu_ps(x + j);
      nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
      const __mmask16 gt = _mm512_cmp_ps_mask(v, best, _CMP_GT_OQ);
      best = _mm512_mask_mov_ps(best, gt, v);
      best_i = _mm512_mask_mov_epi32(best_i, gt, idx);
    }
    if (nan) return argmax_scalar(x, n);
    alignas(64) float lane[16];
    alignas(64) int32_t lane_i[16];
    _mm512_store_ps(lane, best);
    _mm512_store_si512(reinterpret_cast<void*>(lane_i), best_i);
    float top = lane[0];
    int64_t top_i = lane_i[0];
    for (int l = 1; l < 16; ++l)
      if (lane[l] > top || (lane[l] == top && lane_i[l] < top_i)) top = lane[l], top_i = lane_i[l];
    for (; j < n; ++j) {  // past every lane's index, so strict > keeps the first occurrence
      if (std::isnan(x[j])) return j;
      if (x[j] > top) top = x[j], top_i = j;
    }
    return top_i;
  }
#endif
  return argmax_scalar(x, n);
}

at::Tensor argmax_rows(const at::Tensor& x) {
  check_rows(x, "x");
  const int64_t B = x.size(0), V = x.size(1);
  TORCH_CHECK(V > 0, "x needs at least one column");
  at::Tensor out = at::empty({B}, x.options().dtype(at::kLong));
  const float* xp = x.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, B, std::max<int64_t>(1, (int64_t(1) << 18) / V), [&](int64_t lo, int64_t hi) {
    for (int64_t r = lo; r < hi; ++r) op[r] = argmax_row(xp + r * V, V);
  });
  return out;
}

// dst[rows[i]] = src[i] for whole rows of any dtype (a layer's new K or V
// into its pool rows): one memcpy per row, on the calling thread (a decode
// step writes a few hundred rows of a few hundred bytes).
void copy_rows(at::Tensor& dst, const at::Tensor& rows, const at::Tensor& src) {
  TORCH_CHECK(dst.dim() == 2 && src.dim() == 2 && dst.is_contiguous() && src.is_contiguous() &&
              dst.device().is_cpu() && src.device().is_cpu(), "dst and src must be contiguous 2-D CPU tensors");
  TORCH_CHECK(dst.scalar_type() == src.scalar_type() && dst.size(1) == src.size(1),
              "dst and src must have one dtype and row width");
  TORCH_CHECK(rows.dim() == 1 && rows.scalar_type() == at::kLong && rows.is_contiguous() &&
              rows.size(0) == src.size(0), "rows must be a contiguous int64 [src rows]");
  const int64_t n = rows.size(0), limit = dst.size(0);
  const int64_t bytes = src.size(1) * static_cast<int64_t>(src.element_size());
  const int64_t* r = rows.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) TORCH_CHECK(r[i] >= 0 && r[i] < limit, "row ", r[i], " is outside [0, ", limit, ")");
  char* d = static_cast<char*>(dst.data_ptr());
  const char* s = static_cast<const char*>(src.data_ptr());
  for (int64_t i = 0; i < n; ++i) std::memcpy(d + r[i] * bytes, s + i * bytes, bytes);
}

}  // namespace
}  // namespace blockd_layer

TORCH_LIBRARY(blockd_layer, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor", &blockd_layer::rms_norm);
  m.def("add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)",
        &blockd_layer::add_rms_norm);
  m.def("add(Tensor a, Tensor b) -> Tensor", &blockd_layer::add);
  m.def("silu_mul(Tensor gate_up) -> Tensor", &blockd_layer::silu_mul);
  m.def("argmax_rows(Tensor x) -> Tensor", &blockd_layer::argmax_rows);
  m.def("copy_rows(Tensor(a!) dst, Tensor rows, Tensor src) -> ()", &blockd_layer::copy_rows);
  m.def("rotary(Tensor qkv, Tensor cos, Tensor sin, int q_heads, int kv_heads) -> (Tensor, Tensor, Tensor)",
        &blockd_layer::rotary);
}
