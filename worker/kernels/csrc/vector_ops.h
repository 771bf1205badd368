// Vector policies for the CPU attention kernel (paged_attention.cpp): the same
// templates run on 8-wide AVX2+FMA (when the build machine has it: the kernel is
// compiled with -march=native), portable 4-wide GCC vectors, or scalar floats.
// Each policy gives loads (converting float32 / bfloat16 / float16 to float32),
// FMA, max, horizontal sum/max and exp for softmax numerators. bfloat16 on
// AVX2 has its own 16-wide policy (Avx2Bf16PairOps) whose loads permute the
// elements; kPermuted says so, and kRegs how many registers one vector takes.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define BLOCKD_AVX2 1
#endif

namespace blockd {

// ------------------------------------------------------------ vector policies

struct ScalarOps {
  using V = float;
  static constexpr int W = 1;
  static constexpr int kRegs = 1;
  static constexpr bool kPermuted = false;
  static V zero() { return 0.f; }
  static V set1(float x) { return x; }
  static V loadf(const float* p) { return *p; }
  static void storef(float* p, V v) { *p = v; }
  static V fma(V a, V b, V c) { return a * b + c; }
  static V max(V a, V b) { return a > b ? a : b; }
  static float hsum(V v) { return v; }
  static float hmax(V v) { return v; }
  static V exp(V x) { return std::exp(x); }
  template <class T>
  static V load(const T* p) { return static_cast<float>(*p); }
};

// Portable 4-wide vectors (SSE on x86, NEON on ARM), for any CPU without AVX2.
struct Vec4Ops {
  typedef float V __attribute__((vector_size(16)));
  static constexpr int W = 4;
  static constexpr int kRegs = 1;
  static constexpr bool kPermuted = false;
  static V zero() { return V{0.f, 0.f, 0.f, 0.f}; }
  static V set1(float x) { return V{x, x, x, x}; }
  static V loadf(const float* p) { V v; std::memcpy(&v, p, sizeof(V)); return v; }
  static void storef(float* p, V v) { std::memcpy(p, &v, sizeof(V)); }
  static V fma(V a, V b, V c) { return a * b + c; }
  static V max(V a, V b) { return a > b ? a : b; }
  static float hsum(V v) { return (v[0] + v[1]) + (v[2] + v[3]); }
  static float hmax(V v) { return std::max(std::max(v[0], v[1]), std::max(v[2], v[3])); }
  static V exp(V x) { return V{std::exp(x[0]), std::exp(x[1]), std::exp(x[2]), std::exp(x[3])}; }
  template <class T>
  static V load(const T* p) {
    return V{static_cast<float>(p[0]), static_cast<float>(p[1]), static_cast<float>(p[2]),
             static_cast<float>(p[3])};
  }
};

#ifdef BLOCKD_AVX2
struct Avx2Ops {
  using V = __m256;
  static constexpr int W = 8;
  static constexpr int kRegs = 1;
  static constexpr bool kPermuted = false;
  static V zero() { return _mm256_setzero_ps(); }
  static V set1(float x) { return _mm256_set1_ps(x); }
  static V loadf(const float* p) { return _mm256_loadu_ps(p); }
  static void storef(float* p, V v) { _mm256_storeu_ps(p, v); }
  static V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static V max(V a, V b) { return _mm256_max_ps(a, b); }
  static float hsum(V v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
  static float hmax(V v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
  // exp(x) for x <= 0 (softmax numerators): Cody-Waite range reduction and a
  // degree-5 polynomial (Cephes expf coefficients), ~2 ulp; exactly 0 below -87.
  static V exp(V x) {
    const V lo = _mm256_set1_ps(-87.0f);
    const V underflow = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
    x = _mm256_max_ps(x, lo);
    x = _mm256_min_ps(x, _mm256_set1_ps(88.0f));
    V n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    V r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    V y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(underflow, _mm256_mul_ps(y, _mm256_castsi256_ps(e)));
  }
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static V load(const c10::BFloat16* p) {  // bf16 is the top half of a float32
    __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
  }
  static V load(const c10::Half* p) {
#ifdef __F16C__
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
    alignas(32) float f[8];
    for (int i = 0; i < 8; ++i) f[i] = static_cast<float>(p[i]);
    return _mm256_load_ps(f);
#endif
  }
};

// bfloat16 on AVX2 as 16-wide pairs of float vectors: one 256-bit load of 16
// bf16 values widens into the even elements (shift left 16) and the odd ones
// (mask the high halves), 2 cheap ops per 16 values where Avx2Ops::load
// needs a widening shuffle and a shift per 8. Elements come out permuted
// (evens, then odds, per 16): every float vector the kernel keeps alongside
// (the scaled query rows, the output accumulators) is stored in the same
// order (kPermuted), so dot products and row updates are unchanged; the
// kernel puts values back in order when it writes them out.
struct Avx2Bf16PairOps {
  struct V {
    __m256 e, o;
    friend V operator+(V a, V b) { return {_mm256_add_ps(a.e, b.e), _mm256_add_ps(a.o, b.o)}; }
    friend V operator-(V a, V b) { return {_mm256_sub_ps(a.e, b.e), _mm256_sub_ps(a.o, b.o)}; }
  };
  static constexpr int W = 16;
  static constexpr int kRegs = 2;
  static constexpr bool kPermuted = true;
  static V zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
  static V set1(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
  static V loadf(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
  static void storef(float* p, V v) { _mm256_storeu_ps(p, v.e); _mm256_storeu_ps(p + 8, v.o); }
  static V fma(V a, V b, V c) { return {_mm256_fmadd_ps(a.e, b.e, c.e), _mm256_fmadd_ps(a.o, b.o, c.o)}; }
  static V max(V a, V b) { return {_mm256_max_ps(a.e, b.e), _mm256_max_ps(a.o, b.o)}; }
  static float hsum(V v) { return Avx2Ops::hsum(_mm256_add_ps(v.e, v.o)); }
  static float hmax(V v) { return Avx2Ops::hmax(_mm256_max_ps(v.e, v.o)); }
  static V exp(V x) { return {Avx2Ops::exp(x.e), Avx2Ops::exp(x.o)}; }
  static V load(const c10::BFloat16* p) {
    const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return {_mm256_castsi256_ps(_mm256_slli_epi32(w, 16)),
            _mm256_castsi256_ps(_mm256_and_si256(w, _mm256_set1_epi32(int(0xFFFF0000u))))};
  }
  // where element d of a row sits in the permuted order
  static int slot(int d) { return (d & ~15) + ((d & 1) ? 8 : 0) + ((d & 15) >> 1); }
};
#endif

}  // namespace blockd
