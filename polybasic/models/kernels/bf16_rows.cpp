// Row-invariant bf16 linear, attention and RMSNorm: y = x @ w^T (+ b), the kernel 'bf16_rows'
// (polybasic/models/bf16_rows.py builds it on first use; experiments/bf16_rows_kernel.py measures it).
// Two builds of one arithmetic: AVX-512 BF16 (vdpbf16ps) where the compiler targets it, and elsewhere a
// portable one (plain C++, any CPU: AVX2, or AVX-512 without BF16) that performs the same fp32 operations
// in the same order, one lane at a time (see `namespace portable`), so it is row-invariant too and, on a CPU
// that has both, gives the same bits for normal (not subnormal) values.
//
// x [M, K] bf16, w [N, K] bf16 (row-major, as nn.Linear keeps it), b [N] or none -> y [M, N] bf16.
// Every output y[m, n] is summed the same way whatever M is and wherever row m sits in x: a 16-lane fp32
// accumulator takes w[n, k:k+32] . x[m, k:k+32] (vdpbf16ps, pairs of products) for k = 0, 32, ... in
// order (a masked last step when 32 does not divide K), then one horizontal sum of its lanes, plus
// b[n] in fp32, rounded once to bf16. So a target's one-token step and each row of its k-token
// verification get the same bits, which greedy chains need to match plain decoding exactly.
// Blocking (NB rows of w by up to MB rows of x a pass, NB * MB accumulators in registers; MB_WIDE where
// that saves a pass) only decides how often a weight row is read: once from memory, then from cache for
// the next passes. While a block's passes run, the next block's weights are prefetched into L1, a few
// lines a step spread over the passes, so that the memory is busy while the core computes
// (docs/results.md, an AMD EPYC: 1.16-1.44x at 2-17 rows; none at one row, which the hardware prefetcher
// already keeps at the memory's speed).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <vector>
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define PB_BF16 1
#else
#define PB_BF16 0
#endif

namespace {

// The sum of 16 fp32 lanes in one fixed tree: lane i + lane i+8, then 4 apart, 2 apart, 1 apart (the tree GCC's
// _mm512_reduce_add_ps uses, written out so that every compiler and the portable build sum alike).
inline float tree16(const float* l) {
  float a[8], b[4];
  for (int i = 0; i < 8; ++i) a[i] = l[i] + l[i + 8];
  for (int i = 0; i < 4; ++i) b[i] = a[i] + a[i + 4];
  return (b[0] + b[2]) + (b[1] + b[3]);
}

// Row i's keys for attend: calls f(L, slot) with its L logical key positions and slot(j), the cache row of position
// j: j itself, or in a token tree (anc [M, T]) anc[i][j - lo] for the last T positions j >= lo = pos - T + 1.
template <class F>
inline void with_keys(int64_t i, int64_t pos, int64_t S, const int64_t* anc, int64_t T, F&& f) {
  if (anc) f(pos + 1, [a = anc + i * T, lo = pos - T + 1](int64_t j) { return j < lo ? j : a[j - lo]; });
  else f(std::min<int64_t>(pos + 1, S), [](int64_t j) { return j; });
}

constexpr int NB = 4;              // weight rows per block
constexpr int MB = 6;              // x rows per pass: NB * MB = 24 of the 32 vector registers accumulate
constexpr int MB_WIDE = 7;         // 28 accumulators (x then read per product), where it saves a pass (7, 13-14 rows)

#if PB_BF16
inline float hsum16(__m512 v) {  // tree16 of a vector's lanes, in registers
  const __m256 a = _mm256_add_ps(_mm512_castps512_ps256(v),
                                 _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));  // l[i] + l[i+8]
  const __m128 b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));  // a[i] + a[i+4]
  const __m128 c = _mm_add_ps(b, _mm_movehl_ps(b, b));  // b[0] + b[2], b[1] + b[3]
  return _mm_cvtss_f32(_mm_add_ss(c, _mm_shuffle_ps(c, c, 1)));
}

// out[m * nb + n] = sum_k w[n, k] x[m, k] for the block's nb weight rows and mb x rows; each step also
// prefetches `lines` cache lines of the range [pf, pf + pf_len), from offset pf_at on.
template <int mb, int nb>
inline void dot_block(const uint16_t* w, const uint16_t* x, int64_t K, float* out,
                      const char* pf, int64_t pf_at, int64_t pf_len, int lines) {
  __m512 acc[mb][nb];
  for (int m = 0; m < mb; ++m)
    for (int n = 0; n < nb; ++n) acc[m][n] = _mm512_setzero_ps();
  int64_t k = 0;
  auto step = [&](auto load) {
    __m512bh wv[nb];
    for (int n = 0; n < nb; ++n) wv[n] = (__m512bh)load(w + n * K + k);
    for (int l = 0; l < lines; ++l, pf_at += 64)
      if (pf_at < pf_len) _mm_prefetch(pf + pf_at, _MM_HINT_T0);
    for (int m = 0; m < mb; ++m) {
      const __m512bh xv = (__m512bh)load(x + m * K + k);
      for (int n = 0; n < nb; ++n) acc[m][n] = _mm512_dpbf16_ps(acc[m][n], wv[n], xv);
    }
  };
  for (; k + 32 <= K; k += 32) step([](const uint16_t* p) { return _mm512_loadu_si512(p); });
  if (k < K) {
    const __mmask32 tail = static_cast<__mmask32>((1ull << (K - k)) - 1);
    step([tail](const uint16_t* p) { return _mm512_maskz_loadu_epi16(tail, p); });
  }
  for (int m = 0; m < mb; ++m)
    for (int n = 0; n < nb; ++n) out[m * nb + n] = hsum16(acc[m][n]);
}

// dot_block for a run-time row count 1..mb.
template <int nb, int mb>
inline void dispatch(int rows, const uint16_t* w, const uint16_t* x, int64_t K, float* out,
                     const char* pf, int64_t pf_at, int64_t pf_len, int lines) {
  if constexpr (mb > 0) {
    if (rows == mb) dot_block<mb, nb>(w, x, K, out, pf, pf_at, pf_len, lines);
    else dispatch<nb, mb - 1>(rows, w, x, K, out, pf, pf_at, pf_len, lines);
  }
}

// y[:, n0:n0+nb] for every row of x, mb rows a pass; the passes prefetch [next, end) between them.
template <int nb, int mb>
void column_block(const uint16_t* w, const uint16_t* x, const float* b, at::BFloat16* y,
                  int64_t M, int64_t N, int64_t K, int64_t n0, const uint16_t* next, const uint16_t* end) {
  float out[mb * nb];
  const int64_t passes = (M + mb - 1) / mb, steps = (K + 31) / 32;
  const char* pf = reinterpret_cast<const char*>(next);
  const int64_t len = std::min<int64_t>(reinterpret_cast<const char*>(end) - pf, nb * K * 2);  // bytes
  const int lines = static_cast<int>((len / 64 + passes * steps - 1) / (passes * steps));
  for (int64_t m0 = 0, pass = 0; m0 < M; m0 += mb, ++pass) {
    const int rows = static_cast<int>(std::min<int64_t>(mb, M - m0));
    dispatch<nb, mb>(rows, w, x + m0 * K, K, out, pf, pass * steps * lines * 64, len, lines);
    for (int r = 0; r < rows; ++r)
      for (int n = 0; n < nb; ++n)
        y[(m0 + r) * N + n0 + n] = at::BFloat16(out[r * nb + n] + (b ? b[n0 + n] : 0.f));
  }
}

// Every column block of y, both cores; mb rows of x a pass.
template <int mb>
void all_blocks(const uint16_t* wp, const uint16_t* xp, const float* bp, at::BFloat16* yp,
                int64_t M, int64_t N, int64_t K) {
  const int64_t blocks = N / NB;
  const uint16_t* wend = wp + N * K;
  at::parallel_for(0, blocks + (N % NB ? 1 : 0), 16, [&](int64_t i0, int64_t i1) {  // -fopenmp: both cores
    for (int64_t i = i0; i < i1; ++i) {
      if (i < blocks) {
        column_block<NB, mb>(wp + i * NB * K, xp, bp, yp, M, N, K, i * NB, wp + (i + 1) * NB * K, wend);
      } else {
        for (int64_t n = blocks * NB; n < N; ++n) column_block<1, mb>(wp + n * K, xp, bp, yp, M, N, K, n, wend, wend);
      }
    }
  });
}
#endif

// The same arithmetic without AVX-512 BF16, one lane at a time: a 16-lane accumulator whose lane i takes, per step
// of 32 columns, the product of elements 2i+1 and then of 2i, each rounded into it (vdpbf16ps's order; a product
// of two bf16 values is exact in fp32), masked-off elements as zeros, then tree16; exp, softmax, RMSNorm and the
// roundings to bf16 as the native code computes them. The compiler vectorizes it for whatever the CPU has.
namespace portable {

inline float f32(uint16_t h) { return std::bit_cast<float>(static_cast<uint32_t>(h) << 16); }

inline float bf16_round(float v) { return static_cast<float>(at::BFloat16(v)); }  // nearest even

// sum over k < K of a[k] b[k], in the native dot product's order
inline float dot(const uint16_t* a, const uint16_t* b, int64_t K) {
  float acc[16] = {};
  for (int64_t k = 0; k < K; k += 32) {
    for (int i = 0; i < 16; ++i) {
      const int64_t odd = k + 2 * i + 1, even = k + 2 * i;
      acc[i] += odd < K ? f32(a[odd]) * f32(b[odd]) : 0.f;
      acc[i] += even < K ? f32(a[even]) * f32(b[even]) : 0.f;
    }
  }
  return tree16(acc);
}

void mm(const uint16_t* wp, const uint16_t* xp, const float* bp, at::BFloat16* yp, int64_t M, int64_t N, int64_t K) {
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n)
      for (int64_t m = 0; m < M; ++m)
        yp[m * N + n] = at::BFloat16(dot(wp + n * K, xp + m * K, K) + (bp ? bp[n] : 0.f));
  });
}

// exp_ps of one value: the same steps, each rounded as the vector instruction rounds it
inline float exp1(float x) {
  x = std::max(x, -104.f);
  const float n = std::nearbyint(x * 1.44269504089f);
  float r = std::fma(-n, 0.693359375f, x);
  r = std::fma(-n, -2.12194440e-4f, r);
  float p = 1.9875691500e-4f;
  p = std::fma(p, r, 1.3981999507e-3f);
  p = std::fma(p, r, 8.3334519073e-3f);
  p = std::fma(p, r, 4.1665795894e-2f);
  p = std::fma(p, r, 1.6666665459e-1f);
  p = std::fma(p, r, 5.0000001201e-1f);
  p = std::fma(p * r, r, r + 1.f);
  return std::ldexp(p, static_cast<int>(n));
}

// attend_row for one query head over key positions 0..L-1, position j in cache row slot(j) (s: scratch of Lp floats)
template <class Slot>
void attend_row(const uint16_t* q, const uint16_t* k, const uint16_t* v, int64_t krow, int64_t L, Slot slot,
                int64_t D, float scale, float* s, int64_t Lp, at::BFloat16* out) {
  for (int64_t j = 0; j < L; ++j) s[j] = dot(q, k + slot(j) * krow, D) * scale;
  float top = -INFINITY;
  for (int64_t j = 0; j < L; ++j) top = std::max(top, s[j]);
  float lanes[16] = {};
  for (int64_t j = 0; j < Lp; ++j) {
    const float e = j < L ? exp1(s[j] - top) : 0.f;
    if (j < L) s[j] = e;
    lanes[j % 16] += e;
  }
  const float inv = 1.f / tree16(lanes);
  for (int64_t c = 0; c < D; ++c) {
    float acc = 0.f;
    for (int64_t j = 0; j < L; ++j) acc = std::fma(s[j], f32(v[slot(j) * krow + c]), acc);
    out[c] = at::BFloat16(acc * inv);
  }
}

void attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const int64_t* pos, const int64_t* anc,
            int64_t T, at::Tensor& y, float scale) {
  const int64_t H = q.size(1), M = q.size(2), D = q.size(3), G = k.size(1), S = k.size(2), krow = k.stride(2);
  const int64_t r = H / G;
  const auto* qp = reinterpret_cast<const uint16_t*>(q.data_ptr());
  const auto* kp = reinterpret_cast<const uint16_t*>(k.data_ptr());
  const auto* vp = reinterpret_cast<const uint16_t*>(v.data_ptr());
  auto* yp = y.data_ptr<at::BFloat16>();
  at::parallel_for(0, H * M, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> s;
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t head = t / M, i = t % M, g = head / r;
      with_keys(i, pos[i], S, anc, T, [&](int64_t L, auto slot) {
        s.resize((L + 15) / 16 * 16);
        attend_row(qp + head * q.stride(1) + i * q.stride(2), kp + g * k.stride(1), vp + g * v.stride(1), krow, L,
                   slot, D, scale, s.data(), static_cast<int64_t>(s.size()), yp + (head * M + i) * D);
      });
    }
  });
}

void norm(const uint16_t* xp, const uint16_t* wp, uint16_t* yp, int64_t rows, int64_t E, float eps) {
  at::parallel_for(0, rows, 256, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const uint16_t* xr = xp + r * E;
      float acc[16] = {};
      for (int64_t k = 0; k < E; ++k) acc[k % 16] = std::fma(f32(xr[k]), f32(xr[k]), acc[k % 16]);
      const float inv = 1.f / std::sqrt(tree16(acc) / float(E) + eps);
      for (int64_t k = 0; k < E; ++k)
        yp[r * E + k] = at::BFloat16(f32(wp[k]) * bf16_round(f32(xr[k]) * inv)).x;
    }
  });
}

}  // namespace portable

at::Tensor bf16_rows_mm(const at::Tensor& x_in, const at::Tensor& w, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.device().is_cpu() && x_in.scalar_type() == at::kBFloat16,
              "bf16_rows: x must be a 2-D bf16 CPU tensor [M, K]");
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16 && w.is_contiguous() && w.device().is_cpu(),
              "bf16_rows: w must be a contiguous bf16 CPU tensor [N, K]");
  TORCH_CHECK(w.size(1) == x_in.size(1), "bf16_rows: x has ", x_in.size(1), " columns, w has ", w.size(1));
  const at::Tensor x = x_in.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  at::Tensor b;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == N, "bf16_rows: bias has ", bias->numel(), " values for ", N, " outputs");
    b = bias->to(at::kFloat).contiguous();
  }
  at::Tensor y = at::empty({M, N}, x.options());
  const auto* wp = reinterpret_cast<const uint16_t*>(w.data_ptr());
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr());
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  at::BFloat16* yp = y.data_ptr<at::BFloat16>();
#if PB_BF16
  if ((M + MB_WIDE - 1) / MB_WIDE < (M + MB - 1) / MB) all_blocks<MB_WIDE>(wp, xp, bp, yp, M, N, K);
  else all_blocks<MB>(wp, xp, bp, yp, M, N, K);
#else
  portable::mm(wp, xp, bp, yp, M, N, K);
#endif
  return y;
}

#if PB_BF16
// e^x for x <= 0: n = round(x / ln 2), r = x - n ln 2, e^r by Cephes' expf
// polynomial, scaled by 2^n (vscalefps). A few ulp; the same bits for the same x wherever it runs.
inline __m512 exp_ps(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-104.f));  // e^-104 underflows to 0 after scaling
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504089f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_scalef_ps(p, n);
}

inline __m512 widen(__m256i h) {  // 16 bf16 -> 16 fp32, exactly
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

inline __m512 bf16x16_to_ps(const uint16_t* p) { return widen(_mm256_loadu_si256((const __m256i*)p)); }

// One query row of the r query heads sharing kv head g: out[h] = softmax(q[h] . k[0..L) * scale) @ v[0..L), key
// position j in cache row slot(j). D is a multiple of 32, at most 256. s is scratch of r * Lp floats (Lp = L
// rounded up to 16).
template <int r, class Slot>
void attend_row(const uint16_t* const* q, const uint16_t* k, const uint16_t* v, int64_t krow, int64_t L, Slot slot,
                int64_t D, float scale, float* s, int64_t Lp, at::BFloat16* const* out) {
  const int64_t C = D / 32;
  __m512bh qv[r][8];
  for (int h = 0; h < r; ++h)
    for (int64_t c = 0; c < C; ++c) qv[h][c] = (__m512bh)_mm512_loadu_si512(q[h] + 32 * c);
  for (int64_t j = 0; j < L; ++j) {  // scores, one key row at a time: each of the r heads reads it
    const uint16_t* kj = k + slot(j) * krow;
    __m512 acc[r];
    for (int h = 0; h < r; ++h) acc[h] = _mm512_setzero_ps();
    for (int64_t c = 0; c < C; ++c) {
      const __m512bh kv = (__m512bh)_mm512_loadu_si512(kj + 32 * c);
      for (int h = 0; h < r; ++h) acc[h] = _mm512_dpbf16_ps(acc[h], qv[h][c], kv);
    }
    for (int h = 0; h < r; ++h) s[h * Lp + j] = hsum16(acc[h]) * scale;
  }
  float inv[r];
  for (int h = 0; h < r; ++h) {  // softmax in fp32: max, e^(s - max) in place, sum (16 lanes, then one sum)
    float* sh = s + h * Lp;
    for (int64_t j = L; j < Lp; ++j) sh[j] = -INFINITY;
    __m512 mx = _mm512_set1_ps(-INFINITY);
    for (int64_t j = 0; j < Lp; j += 16) mx = _mm512_max_ps(mx, _mm512_loadu_ps(sh + j));
    const __m512 top = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
    __m512 sum = _mm512_setzero_ps();
    for (int64_t j = 0; j < Lp; j += 16) {
      __m512 e = exp_ps(_mm512_sub_ps(_mm512_loadu_ps(sh + j), top));
      if (j + 16 > L) e = _mm512_maskz_mov_ps(static_cast<__mmask16>((1u << (L - j)) - 1), e);  // 0 past L
      _mm512_storeu_ps(sh + j, e);
      sum = _mm512_add_ps(sum, e);
    }
    inv[h] = 1.f / hsum16(sum);
  }
  for (int64_t c = 0; c < D / 16; c += 8) {  // weighted sum of v, 128 columns (8 vectors) per head a sweep
    const int64_t w = std::min<int64_t>(8, D / 16 - c);
    __m512 acc[r][8];
    for (int h = 0; h < r; ++h)
      for (int64_t u = 0; u < 8; ++u) acc[h][u] = _mm512_setzero_ps();
    for (int64_t j = 0; j < L; ++j) {
      const uint16_t* vj = v + slot(j) * krow + 16 * c;
      for (int64_t u = 0; u < w; ++u) {
        const __m512 x = bf16x16_to_ps(vj + 16 * u);
        for (int h = 0; h < r; ++h) acc[h][u] = _mm512_fmadd_ps(_mm512_set1_ps(s[h * Lp + j]), x, acc[h][u]);
      }
    }
    for (int h = 0; h < r; ++h)
      for (int64_t u = 0; u < w; ++u)
        _mm256_storeu_si256((__m256i*)(out[h] + 16 * (c + u)),
                            (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(acc[h][u], _mm512_set1_ps(inv[h]))));
  }
}

template <int r>
void attend_rows_r(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const int64_t* pos,
                   const int64_t* anc, int64_t T, at::Tensor& y, float scale) {
  const int64_t H = q.size(1), M = q.size(2), D = q.size(3), G = k.size(1);
  const int64_t S = k.size(2), krow = k.stride(2);
  const auto* qp = reinterpret_cast<const uint16_t*>(q.data_ptr());
  const auto* kp = reinterpret_cast<const uint16_t*>(k.data_ptr());
  const auto* vp = reinterpret_cast<const uint16_t*>(v.data_ptr());
  auto* yp = y.data_ptr<at::BFloat16>();
  at::parallel_for(0, G * M, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> s;
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t g = t / M, i = t % M;
      const uint16_t* qh[r];
      at::BFloat16* oh[r];
      for (int h = 0; h < r; ++h) {
        const int64_t head = g * r + h;
        qh[h] = qp + head * q.stride(1) + i * q.stride(2);
        oh[h] = yp + (head * M + i) * D;
      }
      with_keys(i, pos[i], S, anc, T, [&](int64_t L, auto slot) {
        const int64_t Lp = (L + 15) / 16 * 16;
        s.resize(r * Lp);
        attend_row<r>(qh, kp + g * k.stride(1), vp + g * v.stride(1), krow, L, slot, D, scale, s.data(), Lp, oh);
      });
    }
  });
}

template <int r>
void attend_dispatch(int heads, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const int64_t* pos,
                     const int64_t* anc, int64_t T, at::Tensor& y, float scale) {
  if constexpr (r > 0) {
    if (heads == r) attend_rows_r<r>(q, k, v, pos, anc, T, y, scale);
    else attend_dispatch<r - 1>(heads, q, k, v, pos, anc, T, y, scale);
  }
}
#endif

// Attention of M query rows in bf16, each row computed alone: q [1, H, M, D], k and v [1, G, S, D] (rows of
// stride D * any; a cache or a slice of one), pos [M] int64: row i sees key rows 0..pos[i] -> y [1, H, M, D].
// Scores are vdpbf16ps dot products summed like bf16_rows_mm's (16 lanes in order, one horizontal sum),
// times D^-0.5; softmax and the weighted sum of v in fp32, key rows in order; one rounding to bf16. A row's
// bits depend on its own q, pos and keys alone, not on M or the other rows, so a verification's rows
// equal one-token steps'. Token trees: anc [M, T] int64 (optional) puts row i's last T key positions j >= lo =
// pos[i] - T + 1 in cache rows anc[i][j - lo] (its ancestors' and its own slots; j < lo: row j), so a tree node's
// row gets the bits of a one-token step over those keys gathered in order (entries for j < 0 unused).
at::Tensor bf16_rows_attend(const at::Tensor& q_in, const at::Tensor& k, const at::Tensor& v, const at::Tensor& pos_in,
                            const c10::optional<at::Tensor>& anc_in) {
  TORCH_CHECK(q_in.dim() == 4 && k.dim() == 4 && v.dim() == 4 && q_in.size(0) == 1 && k.size(0) == 1 &&
              v.sizes() == k.sizes(), "bf16_rows.attend: q [1, H, M, D], k and v [1, G, S, D]");
  TORCH_CHECK(q_in.scalar_type() == at::kBFloat16 && k.scalar_type() == at::kBFloat16 &&
              v.scalar_type() == at::kBFloat16 && q_in.device().is_cpu() && k.device().is_cpu(),
              "bf16_rows.attend: bf16 CPU tensors");
  const int64_t H = q_in.size(1), M = q_in.size(2), D = q_in.size(3), G = k.size(1);
  TORCH_CHECK(k.size(3) == D && D % 32 == 0 && D <= 256 && H % G == 0 && H / G <= 8,
              "bf16_rows.attend: head size ", D, " (a multiple of 32 up to 256), ", H, " query heads over ", G,
              " kv heads (at most 8 per kv head)");
  TORCH_CHECK(k.stride(3) == 1 && v.stride(3) == 1 && k.strides() == v.strides(),
              "bf16_rows.attend: k and v rows must be contiguous, with the same strides");
  const at::Tensor q = q_in.contiguous();
  const at::Tensor pos = pos_in.to(at::kLong).contiguous();
  TORCH_CHECK(pos.numel() == M, "bf16_rows.attend: ", pos.numel(), " positions for ", M, " rows");
  const int64_t* pp = pos.data_ptr<int64_t>();
  TORCH_CHECK(std::all_of(pp, pp + M, [](int64_t p) { return p >= 0; }), "bf16_rows.attend: a negative position");
  at::Tensor anc;
  const int64_t* ap = nullptr;
  int64_t T = 0;
  if (anc_in.has_value() && anc_in->defined()) {
    TORCH_CHECK(anc_in->dim() == 2 && anc_in->size(0) == M && anc_in->size(1) >= 1 && anc_in->device().is_cpu() &&
                at::isIntegralType(anc_in->scalar_type(), /*includeBool=*/false),
                "bf16_rows.attend: anc must be an integer CPU tensor [M, T] with T >= 1 (M = ", M, "), not ",
                anc_in->scalar_type(), " ", anc_in->sizes());
    anc = anc_in->to(at::kLong).contiguous();
    ap = anc.data_ptr<int64_t>();
    T = anc.size(1);
    const int64_t S = k.size(2);
    for (int64_t i = 0; i < M; ++i) {  // every cache row a row reads: 0..lo-1, then anc[i][t] for lo + t >= 0
      const int64_t lo = pp[i] - T + 1;
      TORCH_CHECK(lo <= S, "bf16_rows.attend: row ", i, " at position ", pp[i], " reads rows 0..", lo - 1,
                  " of a cache of ", S, " (anc has ", T, " slots a row)");
      for (int64_t t = std::max<int64_t>(0, -lo); t < T; ++t)
        TORCH_CHECK(ap[i * T + t] >= 0 && ap[i * T + t] < S, "bf16_rows.attend: anc[", i, "][", t, "] = ",
                    ap[i * T + t], " is not a slot of a cache of ", S, " rows");
    }
  }
  at::Tensor y = at::empty({1, H, M, D}, q.options());
#if PB_BF16
  attend_dispatch<8>(static_cast<int>(H / G), q, k, v, pp, ap, T, y, 1.f / std::sqrt(float(D)));
#else
  portable::attend(q, k, v, pp, ap, T, y, 1.f / std::sqrt(float(D)));
#endif
  return y;
}

// RMSNorm of bf16 rows: x [..., E] bf16, w [E] bf16 -> y = bf16(w * bf16(x * (sum(x^2) / E + eps)^-1/2)), the
// rounding of `w * rms_norm(x.float()).to(bf16)`. The sum of squares is 16 fp32 lanes over x[0:E] in order (a
// masked last step), then one horizontal sum; so a row's bits depend on that row alone, whatever the row count.
// One row is a few hundred nanoseconds of work, so the rows are split across cores only in long calls.
at::Tensor bf16_rows_norm(const at::Tensor& x_in, const at::Tensor& w, double eps) {
  TORCH_CHECK(x_in.dim() >= 1 && x_in.device().is_cpu() && x_in.scalar_type() == at::kBFloat16,
              "bf16_rows.norm: x must be a bf16 CPU tensor [..., E]");
  const int64_t E = x_in.size(-1);
  TORCH_CHECK(w.dim() == 1 && w.numel() == E && w.scalar_type() == at::kBFloat16 && w.is_contiguous() &&
              w.device().is_cpu(), "bf16_rows.norm: w must be a contiguous bf16 CPU tensor of x's last size, ", E);
  const at::Tensor x = x_in.contiguous();
  at::Tensor y = at::empty_like(x);
  const int64_t rows = E ? x.numel() / E : 0;
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr());
  const auto* wp = reinterpret_cast<const uint16_t*>(w.data_ptr());
  auto* yp = reinterpret_cast<uint16_t*>(y.data_ptr());
#if PB_BF16
  const int64_t full = E / 16 * 16;
  const __mmask16 tail = static_cast<__mmask16>((1u << (E - full)) - 1);
  auto load = [&](const uint16_t* p, int64_t k) {  // 16 bf16 (fewer at the tail, zeros after) -> fp32, exactly
    return k < full ? bf16x16_to_ps(p + k) : widen(_mm256_maskz_loadu_epi16(tail, p + k));
  };
  auto round = [](__m512 v) { return widen((__m256i)_mm512_cvtneps_pbh(v)); };  // to bf16 (nearest even) and back
  at::parallel_for(0, rows, 256, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const uint16_t* xr = xp + r * E;
      __m512 acc = _mm512_setzero_ps();
      for (int64_t k = 0; k < E; k += 16) {
        const __m512 v = load(xr, k);
        acc = _mm512_fmadd_ps(v, v, acc);
      }
      const __m512 inv = _mm512_set1_ps(1.f / std::sqrt(hsum16(acc) / float(E) + float(eps)));
      for (int64_t k = 0; k < E; k += 16) {
        const __m256i out = (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(load(wp, k), round(_mm512_mul_ps(load(xr, k), inv))));
        if (k < full) _mm256_storeu_si256((__m256i*)(yp + r * E + k), out);
        else _mm256_mask_storeu_epi16(yp + r * E + k, tail, out);
      }
    }
  });
#else
  portable::norm(xp, wp, yp, rows, E, static_cast<float>(eps));
#endif
  return y;
}

bool bf16_rows_native() { return PB_BF16; }

}  // namespace

TORCH_LIBRARY(polybasic_bf16_rows, m) {
  m.def("mm(Tensor x, Tensor w, Tensor? bias) -> Tensor");
  m.def("attend(Tensor q, Tensor k, Tensor v, Tensor pos, Tensor? anc=None) -> Tensor");
  m.def("norm(Tensor x, Tensor w, float eps) -> Tensor");
  m.def("native() -> bool", &bf16_rows_native);
}

TORCH_LIBRARY_IMPL(polybasic_bf16_rows, CPU, m) {
  m.impl("mm", &bf16_rows_mm);
  m.impl("attend", &bf16_rows_attend);
  m.impl("norm", &bf16_rows_norm);
}
