// Paged attention on the CPU: one pass over K and V per (sequence, KV head, query-row chunk).
//
// Loaded by worker/kernels/native.py (JIT-compiled with -march=native, so the
// vector code, vector_ops.h, is whatever the build machine offers: AVX2+FMA(+F16C)
// when present, else portable GCC vectors of 4 floats, else scalar). Registers
// three ops in the `blockd_attention` namespace (best_isa: the widest compiled in):
//
//   plan(seq_meta, num_kv_heads, group_size, rows_per_item, split_keys, num_threads)
//       -> (work int32 [n, 8], merges int32 [m, 4], num_partials)
//   run(query, kv_layer, block_tables, seq_meta, work, merges, partial, scale, isa, out)
//
// seq_meta is int32 [batch, 3] = (context_len, query_start, query_len). A work
// item is (seq, kv_head, row_lo, rows, key_lo, key_hi, partial, 0): query
// tokens row_lo .. row_lo+rows-1 of the sequence, all g = Hq / Hkv query heads
// of that KV head (R = rows * g query rows), against keys key_lo .. key_hi-1.
// Items are sorted by cost and taken dynamically by the threads.
//
// Per item (flash-attention style online softmax, all math in float32):
//   Q [R, D] <- query rows * scale (float32 copy)
//   for each chunk of kChunk keys (spanning blocks; key rows found through the table):
//       prefetch the next chunk's K and V rows (blocks are scattered in the pool),
//         spread over this chunk's loops; the last chunk prefetches the first
//         chunk of the item the thread takes next
//       S [R, n] = Q K^T; causal mask; m, l, O rescaled; O += softmax-numerator(S) V
//   out = O / l  (rounded once to the pool's dtype), or (O, m, l) into a partial slot
// A decode item whose keys were split across threads (few sequences, long
// contexts) leaves partials that merge() combines with the log-sum-exp rule.
//
// Every K/V row is read once per item; the whole query group of a KV head
// shares that read (GQA/MQA cost no extra memory traffic).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <tuple>
#include <type_traits>
#include <vector>

#include "vector_ops.h"

namespace blockd {
namespace {

constexpr int kChunk = 32;  // keys per online-softmax step (2 blocks of 16)
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

enum Isa : int64_t { kAuto = 0, kScalar = 1, kVec4 = 2, kAvx2 = 3 };

// ------------------------------------------------------------ micro-kernels

// Prefetch rows[j0 .. j1) of D elements each. Callers spread these over their
// key loops, a row or a tile of rows at a time, so the core goes on computing
// while the lines arrive: the next chunk's K rows during this chunk's Q K^T,
// its V rows during P V. Issued all at once (256 lines for a 32-key chunk of
// fp32 rows of 64), they filled the miss queue and the core waited for them
// instead (the kernel took as long as reading the rows plus computing on
// them). Locality 1 (prefetcht2) rather than 3: on the AMD EPYC measured it
// was 25% faster, as t0 evicts the L1 lines the current chunk is using.
template <class T>
inline void prefetch_span(const T* const* rows, int j0, int j1, int D) {
  for (int j = j0; j < j1; ++j) {
    const char* c = reinterpret_cast<const char*>(rows[j]);
    for (int off = 0; off < D * int(sizeof(T)); off += 64) __builtin_prefetch(c + off, 0, 1);
  }
}

// S[i][j] = q_i . k_j for RB query rows x KB keys, D a multiple of W.
template <class P, class T, int RB, int KB>
inline void qk_tile(const float* q, int D, const T* const* krow, float* S, int ldS) {
  typename P::V acc[RB][KB];
#pragma GCC unroll 16
  for (int i = 0; i < RB; ++i)
#pragma GCC unroll 16
    for (int j = 0; j < KB; ++j) acc[i][j] = P::zero();
  for (int d = 0; d < D; d += P::W) {
    typename P::V k[KB];
#pragma GCC unroll 16
    for (int j = 0; j < KB; ++j) k[j] = P::load(krow[j] + d);
#pragma GCC unroll 16
    for (int i = 0; i < RB; ++i) {
      typename P::V qv = P::loadf(q + i * D + d);
#pragma GCC unroll 16
      for (int j = 0; j < KB; ++j) acc[i][j] = P::fma(qv, k[j], acc[i][j]);
    }
  }
#pragma GCC unroll 16
  for (int i = 0; i < RB; ++i)
#pragma GCC unroll 16
    for (int j = 0; j < KB; ++j) S[i * ldS + j] = P::hsum(acc[i][j]);
}

template <class P, class T, int RB, int KB>
inline void qk_rows(const float* q, int D, const T* const* krow, int n, float* S, int ldS,
                    const T* const* pf, int pf_n) {
  int j = 0;
  for (; j + KB <= n; j += KB) {
    if (j < pf_n) prefetch_span(pf, j, std::min(pf_n, j + KB), D);
    qk_tile<P, T, RB, KB>(q, D, krow + j, S + j, ldS);
  }
  for (; j < n; ++j) qk_tile<P, T, RB, 1>(q, D, krow + j, S + j, ldS);
  if (j < pf_n) prefetch_span(pf, j, pf_n, D);
}

// Tiles sized for 16 vector registers; a policy whose vector spans kRegs
// registers takes proportionally fewer keys (or output columns) per tile.
template <class P>
constexpr int tiles(int n) { return n / P::kRegs > 0 ? n / P::kRegs : 1; }

template <class P, class T>
void qk(const float* q, int R, int D, const T* const* krow, int n, float* S, int ldS, const T* const* pf,
        int pf_n) {
  int r = 0;  // the first pass over the keys also prefetches pf (the next chunk's K rows)
  for (; r + 4 <= R; r += 4, pf_n = 0) qk_rows<P, T, 4, tiles<P>(2)>(q + r * D, D, krow, n, S + r * ldS, ldS, pf, pf_n);
  for (; r + 2 <= R; r += 2, pf_n = 0) qk_rows<P, T, 2, tiles<P>(4)>(q + r * D, D, krow, n, S + r * ldS, ldS, pf, pf_n);
  for (; r < R; ++r, pf_n = 0) qk_rows<P, T, 1, tiles<P>(4)>(q + r * D, D, krow, n, S + r * ldS, ldS, pf, pf_n);
}

// O[i][d0 : d0 + CW*W] += sum_j P[i][j] * v_j[d0 : ...] for RB rows.
template <class P, class T, int RB, int CW>
inline void pv_tile(const float* Pm, int ldP, const T* const* vrow, int n, float* O, int D, int d0,
                    const T* const* pf, int pf_n) {
  typename P::V acc[RB][CW];
#pragma GCC unroll 16
  for (int i = 0; i < RB; ++i)
#pragma GCC unroll 16
    for (int c = 0; c < CW; ++c) acc[i][c] = P::loadf(O + i * D + d0 + c * P::W);
  for (int j = 0; j < n; ++j) {
    if (j < pf_n) prefetch_span(pf, j, j + 1, D);
    typename P::V v[CW];
#pragma GCC unroll 16
    for (int c = 0; c < CW; ++c) v[c] = P::load(vrow[j] + d0 + c * P::W);
#pragma GCC unroll 16
    for (int i = 0; i < RB; ++i) {
      typename P::V p = P::set1(Pm[i * ldP + j]);
#pragma GCC unroll 16
      for (int c = 0; c < CW; ++c) acc[i][c] = P::fma(p, v[c], acc[i][c]);
    }
  }
#pragma GCC unroll 16
  for (int i = 0; i < RB; ++i)
#pragma GCC unroll 16
    for (int c = 0; c < CW; ++c) P::storef(O + i * D + d0 + c * P::W, acc[i][c]);
}

template <class P, class T, int RB, int CW>
inline void pv_rows(const float* Pm, int ldP, const T* const* vrow, int n, float* O, int D, const T* const* pf,
                    int pf_n) {
  int d = 0;
  for (; d + CW * P::W <= D; d += CW * P::W, pf_n = 0) pv_tile<P, T, RB, CW>(Pm, ldP, vrow, n, O, D, d, pf, pf_n);
  for (; d < D; d += P::W, pf_n = 0) pv_tile<P, T, RB, 1>(Pm, ldP, vrow, n, O, D, d, pf, pf_n);
  if (pf_n > n) prefetch_span(pf, n, pf_n, D);
}

template <class P, class T>
void pv(const float* Pm, int ldP, int R, const T* const* vrow, int n, float* O, int D, const T* const* pf,
        int pf_n) {
  int r = 0;  // the first pass also prefetches pf (the next chunk's V rows)
  for (; r + 4 <= R; r += 4, pf_n = 0) pv_rows<P, T, 4, tiles<P>(2)>(Pm + r * ldP, ldP, vrow, n, O + r * D, D, pf, pf_n);
  for (; r + 2 <= R; r += 2, pf_n = 0) pv_rows<P, T, 2, tiles<P>(4)>(Pm + r * ldP, ldP, vrow, n, O + r * D, D, pf, pf_n);
  for (; r < R; ++r, pf_n = 0) pv_rows<P, T, 1, tiles<P>(8)>(Pm + r * ldP, ldP, vrow, n, O + r * D, D, pf, pf_n);
}

// ------------------------------------------------------------ one work item

struct Problem {
  const void* query;      // [total_q, Hq, D]
  const void* kv;         // [2, N, H, b, D]
  void* out;              // [total_q, Hq, D]
  const int32_t* tables;  // [batch, max_blocks]
  const int32_t* meta;    // [batch, 3]
  float* partial;         // [num_partials, g, D + 2]: O, then m, l
  int64_t num_blocks, max_blocks;
  int H, b, D, g;
  float scale;
};

struct Scratch {
  std::vector<float> q, o, s, m, l;
  std::vector<const void*> ptrs;  // K rows, V rows; this chunk and the next
  Scratch(int max_rows, int D) : q(size_t(max_rows) * D), o(size_t(max_rows) * D),
      s(size_t(max_rows) * kChunk), m(max_rows), l(max_rows), ptrs(4 * kChunk) {}
};

template <class T>
inline void chunk_rows(const Problem& p, const int32_t* table, int head, int k0, int n, const T** krow,
                       const T** vrow) {
  const T* k_base = static_cast<const T*>(p.kv);
  const size_t half = size_t(p.num_blocks) * p.H * p.b * p.D;
  int block = k0 / p.b, offset = k0 % p.b;  // one division per chunk, not per key
  const T* row = k_base + ((size_t(table[block]) * p.H + head) * p.b + offset) * p.D;
  for (int j = 0; j < n; ++j) {
    krow[j] = row;
    vrow[j] = row + half;
    row += p.D;
    if (++offset == p.b && j + 1 < n) {
      offset = 0;
      row = k_base + (size_t(table[++block]) * p.H + head) * p.b * p.D;
    }
  }
}

template <class P>
void softmax_update(float* S, int ldS, int R, int n, float* m, float* l, float* O, int D) {
  const int npad = (n + P::W - 1) / P::W * P::W;
  for (int r = 0; r < R; ++r) {
    float* row = S + r * ldS;
    for (int j = n; j < npad; ++j) row[j] = kNegInf;
    typename P::V mx = P::set1(kNegInf);
    for (int j = 0; j < npad; j += P::W) mx = P::max(mx, P::loadf(row + j));
    const float m_old = m[r], m_new = std::max(m_old, P::hmax(mx));
    if (m_new == kNegInf) {  // every key so far is masked for this row
      std::fill(row, row + n, 0.f);
      continue;
    }
    const typename P::V vm = P::set1(m_new);
    typename P::V sum = P::zero();
    for (int j = 0; j < npad; j += P::W) {
      typename P::V e = P::exp(P::loadf(row + j) - vm);
      P::storef(row + j, e);
      sum = sum + e;
    }
    const float alpha = m_old == kNegInf ? 0.f : std::exp(m_old - m_new);
    l[r] = l[r] * alpha + P::hsum(sum);
    m[r] = m_new;
    if (alpha != 1.f) {
      float* o = O + size_t(r) * D;
      for (int d = 0; d < D; ++d) o[d] *= alpha;
    }
  }
}

// Where element i of a row (of a run of rows, D a multiple of P::W) sits in
// the kernel's float copies: in order, or permuted like P's loads.
template <class P>
inline int slot(int i) {
  if constexpr (P::kPermuted) return P::slot(i);
  return i;
}

template <class P, class T>
void run_item(const Problem& p, const int32_t* w, const int32_t* w_next, Scratch& sc) {
  const int seq = w[0], head = w[1], row_lo = w[2], rows = w[3], key_lo = w[4], key_hi = w[5];
  const int D = p.D, g = p.g, R = rows * g, Hq = p.H * g;
  const int ctx = p.meta[seq * 3], q_start = p.meta[seq * 3 + 1], q_len = p.meta[seq * 3 + 2];
  const int first_pos = ctx - q_len + row_lo;  // position of the item's first query token
  const T* query = static_cast<const T*>(p.query);
  float* q = sc.q.data();
  float* O = sc.o.data();
  float* S = sc.s.data();
  for (int t = 0; t < rows; ++t) {  // the g heads of one token are contiguous
    const T* src = query + (size_t(q_start + row_lo + t) * Hq + size_t(head) * g) * D;
    float* dst = q + size_t(t) * g * D;
    for (int i = 0; i < g * D; ++i) dst[slot<P>(i)] = static_cast<float>(src[i]) * p.scale;
  }
  std::fill(O, O + size_t(R) * D, 0.f);
  std::fill(sc.m.begin(), sc.m.begin() + R, kNegInf);
  std::fill(sc.l.begin(), sc.l.begin() + R, 0.f);
  const int32_t* table = p.tables + size_t(seq) * p.max_blocks;
  const T** cur_k = reinterpret_cast<const T**>(sc.ptrs.data());
  const T** cur_v = cur_k + kChunk;
  const T** nxt_k = cur_v + kChunk;
  const T** nxt_v = nxt_k + kChunk;
  chunk_rows<T>(p, table, head, key_lo, std::min(kChunk, key_hi - key_lo), cur_k, cur_v);
  for (int k0 = key_lo; k0 < key_hi; k0 += kChunk) {
    const int n = std::min(kChunk, key_hi - k0);
    int n_next = std::min(kChunk, key_hi - k0 - kChunk);
    if (n_next > 0) {  // blocks are scattered: fetch the next chunk while this one computes
      chunk_rows<T>(p, table, head, k0 + kChunk, n_next, nxt_k, nxt_v);
    } else if (w_next != nullptr) {  // the last chunk: fetch the thread's next item's first one
      n_next = std::min(kChunk, w_next[5] - w_next[4]);
      chunk_rows<T>(p, p.tables + size_t(w_next[0]) * p.max_blocks, w_next[1], w_next[4], n_next, nxt_k, nxt_v);
    } else {
      n_next = 0;
    }
    qk<P, T>(q, R, D, cur_k, n, S, kChunk, nxt_k, n_next);
    for (int t = 0; t < rows; ++t) {  // causal: token t sees keys <= first_pos + t
      const int visible = first_pos + t - k0 + 1;
      if (visible >= n) continue;
      for (int i = 0; i < g; ++i)
        std::fill(S + (t * g + i) * kChunk + std::max(visible, 0), S + (t * g + i) * kChunk + n, kNegInf);
    }
    softmax_update<P>(S, kChunk, R, n, sc.m.data(), sc.l.data(), O, D);
    pv<P, T>(S, kChunk, R, cur_v, n, O, D, nxt_v, n_next);
    std::swap(cur_k, nxt_k);
    std::swap(cur_v, nxt_v);
  }
  if (w[6] >= 0) {  // split keys: leave (O, m, l) for merge()
    float* dst = p.partial + size_t(w[6]) * g * (D + 2);
    for (int i = 0; i < g; ++i) {
      for (int d = 0; d < D; ++d) dst[i * (D + 2) + d] = O[size_t(i) * D + slot<P>(d)];
      dst[i * (D + 2) + D] = sc.m[i];
      dst[i * (D + 2) + D + 1] = sc.l[i];
    }
    return;
  }
  T* out = static_cast<T*>(p.out);
  for (int t = 0; t < rows; ++t) {
    T* dst = out + (size_t(q_start + row_lo + t) * Hq + size_t(head) * g) * D;
    for (int i = 0; i < g; ++i) {
      const float inv = 1.f / sc.l[t * g + i];
      const float* o = O + size_t(t * g + i) * D;
      for (int d = 0; d < D; ++d) dst[i * D + d] = static_cast<T>(o[slot<P>(d)] * inv);
    }
  }
}

template <class T>
void merge_one(const Problem& p, const int32_t* mg) {
  const int seq = mg[0], head = mg[1], first = mg[2], count = mg[3], D = p.D, g = p.g;
  const int q_start = p.meta[seq * 3 + 1];
  T* dst = static_cast<T*>(p.out) + (size_t(q_start) * p.H * g + size_t(head) * g) * D;
  std::vector<float> acc(D);
  for (int i = 0; i < g; ++i) {
    float m_max = kNegInf;
    for (int c = 0; c < count; ++c)
      m_max = std::max(m_max, p.partial[(size_t(first + c) * g + i) * (D + 2) + D]);
    float total = 0.f;
    std::fill(acc.begin(), acc.end(), 0.f);
    for (int c = 0; c < count; ++c) {
      const float* part = p.partial + (size_t(first + c) * g + i) * (D + 2);
      const float w = part[D] == kNegInf ? 0.f : std::exp(part[D] - m_max);
      total += part[D + 1] * w;
      for (int d = 0; d < D; ++d) acc[d] += part[d] * w;
    }
    for (int d = 0; d < D; ++d) dst[i * D + d] = static_cast<T>(acc[d] / total);
  }
}

template <class P, class T>
void run_all(const Problem& p, const at::Tensor& work, const at::Tensor& merges, int max_rows) {
  const int64_t n = work.size(0);
  const int32_t* items = work.data_ptr<int32_t>();
  std::atomic<int64_t> next{0};
  const int64_t teams = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), n));
  at::parallel_for(0, teams, 1, [&](int64_t, int64_t) {
    Scratch sc(max_rows, p.D);
    // While plenty of items are left a thread claims its next one before it
    // runs this one, so this one's last chunk can prefetch the next one's
    // first. Near the end it claims one at a time: an item held in reserve
    // while the other threads run dry would serialise a small batch.
    for (int64_t i = next.fetch_add(1); i < n;) {
      const int64_t j = n - i > 2 * teams ? next.fetch_add(1) : -1;
      run_item<P, T>(p, items + 8 * i, j >= 0 && j < n ? items + 8 * j : nullptr, sc);
      i = j >= 0 ? j : next.fetch_add(1);
    }
  });
  const int32_t* mg = merges.data_ptr<int32_t>();
  at::parallel_for(0, merges.size(0), 1, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) merge_one<T>(p, mg + 4 * i);
  });
}

template <class T>
void dispatch_isa(const Problem& p, const at::Tensor& work, const at::Tensor& merges, int max_rows,
                  int64_t isa) {
#ifdef BLOCKD_AVX2
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    if ((isa == kAuto || isa == kAvx2) && p.D % 16 == 0)
      return run_all<Avx2Bf16PairOps, T>(p, work, merges, max_rows);
  }
  if ((isa == kAuto || isa == kAvx2) && p.D % 8 == 0) return run_all<Avx2Ops, T>(p, work, merges, max_rows);
#endif
  if ((isa == kAuto || isa == kAvx2 || isa == kVec4) && p.D % 4 == 0)
    return run_all<Vec4Ops, T>(p, work, merges, max_rows);
  run_all<ScalarOps, T>(p, work, merges, max_rows);
}

// ------------------------------------------------------------ ops

void run(const at::Tensor& query, const at::Tensor& kv_layer, const at::Tensor& block_tables,
         const at::Tensor& seq_meta, const at::Tensor& work, const at::Tensor& merges,
         const at::Tensor& partial, double scale, int64_t isa, const at::Tensor& out) {
  TORCH_CHECK(query.is_cpu() && query.is_contiguous() && query.dim() == 3, "query: contiguous [T, Hq, D] on CPU");
  TORCH_CHECK(kv_layer.is_contiguous() && kv_layer.dim() == 5 && kv_layer.size(0) == 2,
              "kv_layer: contiguous [2, N, H, b, D]");
  TORCH_CHECK(out.is_contiguous() && out.sizes() == query.sizes() && out.scalar_type() == query.scalar_type(),
              "out must match query");
  TORCH_CHECK(kv_layer.scalar_type() == query.scalar_type(), "query and kv_layer dtypes differ");
  for (const at::Tensor* t : {&block_tables, &seq_meta, &work, &merges})
    TORCH_CHECK(t->scalar_type() == at::kInt && t->is_contiguous(), "index tensors: contiguous int32");
  TORCH_CHECK(partial.scalar_type() == at::kFloat && partial.is_contiguous(), "partial: contiguous float32");
  Problem p;
  p.query = query.data_ptr();
  p.kv = kv_layer.data_ptr();
  p.out = out.data_ptr();
  p.tables = block_tables.data_ptr<int32_t>();
  p.meta = seq_meta.data_ptr<int32_t>();
  p.partial = partial.data_ptr<float>();
  p.num_blocks = kv_layer.size(1);
  p.max_blocks = block_tables.size(1);
  p.H = int(kv_layer.size(2));
  p.b = int(kv_layer.size(3));
  p.D = int(kv_layer.size(4));
  p.g = int(query.size(1) / p.H);
  p.scale = float(scale);
  const int32_t* items = work.data_ptr<int32_t>();
  int max_rows = 1;
  for (int64_t i = 0; i < work.size(0); ++i) max_rows = std::max(max_rows, items[8 * i + 3] * p.g);
  switch (query.scalar_type()) {
    case at::kFloat: return dispatch_isa<float>(p, work, merges, max_rows, isa);
    case at::kBFloat16: return dispatch_isa<c10::BFloat16>(p, work, merges, max_rows, isa);
    case at::kHalf: return dispatch_isa<c10::Half>(p, work, merges, max_rows, isa);
    default: TORCH_CHECK(false, "paged attention supports float32, bfloat16 and float16, not ",
                         query.scalar_type());
  }
}

// Work items for a validated batch; see the header comment. Decode items of
// long sequences are split along the keys when the batch alone cannot keep
// num_threads busy (split_keys: smallest piece, a multiple of kChunk).
std::tuple<at::Tensor, at::Tensor, int64_t> plan(const at::Tensor& seq_meta, int64_t num_kv_heads,
                                                  int64_t group_size, int64_t rows_per_item,
                                                  int64_t split_keys, int64_t num_threads) {
  TORCH_CHECK(seq_meta.scalar_type() == at::kInt && seq_meta.is_contiguous() && seq_meta.dim() == 2,
              "seq_meta: contiguous int32 [batch, 3]");
  const int32_t* meta = seq_meta.data_ptr<int32_t>();
  const int64_t batch = seq_meta.size(0);
  struct Item { int32_t f[8]; int64_t cost; };
  std::vector<Item> items;
  int64_t decode_pairs = 0, longest = 0;
  for (int64_t s = 0; s < batch; ++s) {
    if (meta[3 * s + 2] == 1) { decode_pairs += num_kv_heads; longest = std::max<int64_t>(longest, meta[3 * s]); }
  }
  // Pieces per decode pair so that the decode work spreads over ~2 items per thread.
  int64_t pieces = 1;
  if (decode_pairs > 0 && decode_pairs < 2 * num_threads && split_keys > 0)
    pieces = std::min<int64_t>((2 * num_threads + decode_pairs - 1) / decode_pairs,
                               std::max<int64_t>(1, longest / split_keys));
  std::vector<int32_t> merges;
  int32_t partials = 0;
  for (int64_t s = 0; s < batch; ++s) {
    const int32_t ctx = meta[3 * s], q_len = meta[3 * s + 2];
    const int32_t rows = q_len == 1 ? 1 : int32_t(std::max<int64_t>(1, rows_per_item));
    for (int32_t lo = 0; lo < q_len; lo += rows) {
      const int32_t m = std::min(rows, q_len - lo), keys = ctx - q_len + lo + m;
      for (int32_t h = 0; h < num_kv_heads; ++h) {
        int64_t split = q_len == 1 ? std::min<int64_t>(pieces, keys / std::max<int64_t>(1, split_keys)) : 1;
        if (split <= 1) {
          items.push_back({{int32_t(s), h, lo, m, 0, keys, -1, 0}, int64_t(m) * group_size * keys});
          continue;
        }
        const int32_t step = int32_t((keys / split + kChunk - 1) / kChunk * kChunk);
        merges.insert(merges.end(), {int32_t(s), h, partials, 0});
        for (int32_t k = 0; k < keys; k += step) {
          items.push_back({{int32_t(s), h, 0, 1, k, std::min(keys, k + step), partials++, 0},
                           int64_t(group_size) * std::min(step, keys - k)});
          merges.back() += 1;
        }
      }
    }
  }
  std::stable_sort(items.begin(), items.end(), [](const Item& a, const Item& b) { return a.cost > b.cost; });
  at::Tensor work = at::empty({int64_t(items.size()), 8}, seq_meta.options());
  int32_t* w = work.data_ptr<int32_t>();
  for (size_t i = 0; i < items.size(); ++i) std::memcpy(w + 8 * i, items[i].f, sizeof(items[i].f));
  at::Tensor mg = at::empty({int64_t(merges.size() / 4), 4}, seq_meta.options());
  if (!merges.empty()) std::memcpy(mg.data_ptr<int32_t>(), merges.data(), merges.size() * sizeof(int32_t));
  return {work, mg, int64_t(partials)};
}

int64_t best_isa() {
#ifdef BLOCKD_AVX2
  return kAvx2;
#else
  return kVec4;
#endif
}

}  // namespace
}  // namespace blockd

TORCH_LIBRARY(blockd_attention, m) {
  m.def("plan(Tensor seq_meta, int num_kv_heads, int group_size, int rows_per_item, int split_keys, "
        "int num_threads) -> (Tensor, Tensor, int)", &blockd::plan);
  m.def("run(Tensor query, Tensor kv_layer, Tensor block_tables, Tensor seq_meta, Tensor work, "
        "Tensor merges, Tensor(a!) partial, float scale, int isa, Tensor(b!) out) -> ()", &blockd::run);
  m.def("best_isa() -> int", &blockd::best_isa);
}
