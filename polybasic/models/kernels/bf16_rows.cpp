// Row-invariant bf16 linear for CPUs with AVX-512 BF16: y = x @ w^T (+ b), the kernel 'bf16_rows'
// (polybasic/models/bf16_rows.py builds it on first use; experiments/bf16_rows_kernel.py measures it).
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
#include <cstdint>
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define PB_BF16 1
#else
#define PB_BF16 0
#endif

namespace {

constexpr int NB = 4;              // weight rows per block
constexpr int MB = 6;              // x rows per pass: NB * MB = 24 of the 32 vector registers accumulate
constexpr int MB_WIDE = 7;         // 28 accumulators (x then read per product), where it saves a pass (7, 13-14 rows)

#if PB_BF16
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
    for (int n = 0; n < nb; ++n) out[m * nb + n] = _mm512_reduce_add_ps(acc[m][n]);
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

at::Tensor bf16_rows_mm(const at::Tensor& x_in, const at::Tensor& w, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(PB_BF16, "bf16_rows: built for a CPU without AVX-512 BF16");
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
#if PB_BF16
  const auto* wp = reinterpret_cast<const uint16_t*>(w.data_ptr());
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr());
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  at::BFloat16* yp = y.data_ptr<at::BFloat16>();
  if ((M + MB_WIDE - 1) / MB_WIDE < (M + MB - 1) / MB) all_blocks<MB_WIDE>(wp, xp, bp, yp, M, N, K);
  else all_blocks<MB>(wp, xp, bp, yp, M, N, K);
#endif
  return y;
}

bool bf16_rows_native() { return PB_BF16; }

}  // namespace

TORCH_LIBRARY(polybasic_bf16_rows, m) {
  m.def("mm(Tensor x, Tensor w, Tensor? bias) -> Tensor");
  m.def("native() -> bool", &bf16_rows_native);
}

TORCH_LIBRARY_IMPL(polybasic_bf16_rows, CPU, m) { m.impl("mm", &bf16_rows_mm); }
