// W4A8 GEMV/GEMM for CPUs with AVX-512 VNNI: 4-bit weight codes x int8 activations, the CPU kernel 'w4a8'
// (polybasic/quant/w4a8.py builds it on first use and packs the layout; experiments/w4a8_kernel.py measures it).
//
// y[m, n] = sum_g ( s[n,g] * a[m,g] * sum_{k in g} u[n,k] * xq[m,k]  +  o[n,g] * xsum[m,g] )
// u: the weight's codes in [0, 15] (w = s * u + o), groups g of 32 input columns. Activations are
// quantized per group of 32 at every call: a = max|x| / 127, xq = round(x / a); xsum is their exact sum.
//
// Layout, [N/16, K/32, 320] bytes: for row tile t (rows 16t..16t+15) and group g, 256 bytes of codes, then
// 16 fp16 scales and 16 fp16 offsets (one per row). In the codes, load L (0..3) is 64 bytes whose byte
// 4i+c holds u[16t+i, 32g+4L+c] in its low nibble and u[16t+i, 32g+16+4L+c] in its high one: split into
// nibbles, one load gives each row (a 32-bit lane) 4 + 4 consecutive codes, what vpdpbusd multiplies
// with 4 activation bytes broadcast to every lane. One stream per thread: codes, scales, offsets.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#include <immintrin.h>
#define PB_VNNI 1
#else
#define PB_VNNI 0
#endif

namespace {

constexpr int64_t G = 32;            // group size, weights and activations
constexpr int64_t TN = 16;           // rows per tile
constexpr int64_t BLOCK = 320;       // bytes per (tile, group): 256 of codes, 32 of scales, 32 of offsets
constexpr int64_t PREFETCH = 16384;  // bytes ahead (2-core AMD EPYC, Qwen 1.5B linears: 30.2 -> 22.7 ms a pass at 2 rows)

// x [M, K] fp32 -> xq [M, K] int8, a [M, K/32], xsum [M, K/32]
void quantize_rows(const float* x, int64_t M, int64_t K, int8_t* xq, float* a, float* xsum) {
  const int64_t ng = K / G;
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < ng; ++g) {
      const float* v = x + m * K + g * G;
      float amax = 0.f, sum = 0.f;
      for (int64_t k = 0; k < G; ++k) { amax = std::fmax(amax, std::fabs(v[k])); sum += v[k]; }
      const float inv = amax > 0.f ? 127.f / amax : 0.f;
      for (int64_t k = 0; k < G; ++k) xq[m * K + g * G + k] = static_cast<int8_t>(std::nearbyint(v[k] * inv));
      a[m * ng + g] = amax / 127.f;
      xsum[m * ng + g] = sum;
    }
}

float fp16_at(const uint8_t* p, int64_t i) { return static_cast<float>(reinterpret_cast<const at::Half*>(p)[i]); }

// Any CPU: the same arithmetic in plain loops (integer dots exact, then the same float terms).
void tiles_plain(const uint8_t* w, const int8_t* xq, const float* a, const float* xsum, float* y,
                 int64_t M, int64_t N, int64_t K, int64_t t0, int64_t t1) {
  const int64_t ng = K / G;
  for (int64_t t = t0; t < t1; ++t)
    for (int64_t m = 0; m < M; ++m) {
      float res[TN] = {0};
      for (int64_t g = 0; g < ng; ++g) {
        const uint8_t* blk = w + (t * ng + g) * BLOCK;
        const int8_t* xg = xq + m * K + g * G;
        for (int64_t i = 0; i < TN; ++i) {
          int32_t dot = 0;
          for (int64_t L = 0; L < 4; ++L)
            for (int64_t c = 0; c < 4; ++c) {
              const uint8_t b = blk[L * 64 + 4 * i + c];
              dot += int32_t(b & 15) * xg[4 * L + c] + int32_t(b >> 4) * xg[16 + 4 * L + c];
            }
          res[i] += float(dot) * (fp16_at(blk + 256, i) * a[m * ng + g]) + fp16_at(blk + 288, i) * xsum[m * ng + g];
        }
      }
      for (int64_t i = 0; i < TN; ++i) y[m * N + t * TN + i] = res[i];
    }
}

#if PB_VNNI
// MB activation rows at once: a group's 8 unpacked code registers serve every row.
template <int MB>
void tiles_vnni(const uint8_t* w, const int8_t* xq, const float* a, const float* xsum, float* y,
                int64_t N, int64_t K, int64_t t0, int64_t t1) {
  const int64_t ng = K / G;
  const __m512i nib = _mm512_set1_epi8(0x0F);
  for (int64_t t = t0; t < t1; ++t) {
    __m512 res[MB];
    for (int r = 0; r < MB; ++r) res[r] = _mm512_setzero_ps();
    const uint8_t* blk = w + t * ng * BLOCK;
    for (int64_t g = 0; g < ng; ++g, blk += BLOCK) {
      for (int L = 0; L < 5; ++L) _mm_prefetch(reinterpret_cast<const char*>(blk + PREFETCH + 64 * L), _MM_HINT_T0);
      __m512i lo[4], hi[4];
      for (int L = 0; L < 4; ++L) {
        const __m512i v = _mm512_loadu_si512(blk + 64 * L);
        lo[L] = _mm512_and_si512(v, nib);
        hi[L] = _mm512_and_si512(_mm512_srli_epi16(v, 4), nib);
      }
      const __m512 sv = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 256)));
      const __m512 ov = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 288)));
      for (int r = 0; r < MB; ++r) {
        const int32_t* xg = reinterpret_cast<const int32_t*>(xq + r * K + g * G);
        __m512i dot = _mm512_setzero_si512();
        for (int L = 0; L < 4; ++L) {
          dot = _mm512_dpbusd_epi32(dot, lo[L], _mm512_set1_epi32(xg[L]));
          dot = _mm512_dpbusd_epi32(dot, hi[L], _mm512_set1_epi32(xg[4 + L]));
        }
        res[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(sv, _mm512_set1_ps(a[r * ng + g])), res[r]);
        res[r] = _mm512_fmadd_ps(ov, _mm512_set1_ps(xsum[r * ng + g]), res[r]);
      }
    }
    for (int r = 0; r < MB; ++r) _mm512_storeu_ps(y + r * N + t * TN, res[r]);
  }
}
#endif

at::Tensor w4a8_mm(const at::Tensor& x, const at::Tensor& packed, bool plain) {
  TORCH_CHECK(x.dim() == 2 && x.device().is_cpu(), "w4a8_mm: x must be a 2-D CPU tensor [M, K]");
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kByte && packed.size(2) == BLOCK && packed.is_contiguous(),
              "w4a8_mm: packed must be contiguous uint8 [N/16, K/32, 320]");
  TORCH_CHECK(packed.size(1) * G == x.size(1), "w4a8_mm: x has ", x.size(1), " columns, the weight ", packed.size(1) * G);
  const int64_t M = x.size(0), K = x.size(1), T = packed.size(0), N = T * TN, ng = K / G;
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  at::Tensor xq = at::empty({M, K}, xf.options().dtype(at::kChar));
  at::Tensor a = at::empty({M, ng}, xf.options()), xsum = at::empty({M, ng}, xf.options());
  at::Tensor y = at::empty({M, N}, xf.options());
  quantize_rows(xf.data_ptr<float>(), M, K, xq.data_ptr<int8_t>(), a.data_ptr<float>(), xsum.data_ptr<float>());
  const uint8_t* w = packed.data_ptr<uint8_t>();
  const int8_t* q = xq.data_ptr<int8_t>();
  const float *ap = a.data_ptr<float>(), *sp = xsum.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, T, 4, [&](int64_t t0, int64_t t1) {  // needs -fopenmp, or it runs on one thread
#if PB_VNNI
    if (!plain) {
      for (int64_t m = 0; m < M; m += 4) {
        const int64_t mb = std::min<int64_t>(4, M - m);
        auto run = [&](auto kernel) { kernel(w, q + m * K, ap + m * ng, sp + m * ng, yp + m * N, N, K, t0, t1); };
        if (mb == 1) run(tiles_vnni<1>); else if (mb == 2) run(tiles_vnni<2>);
        else if (mb == 3) run(tiles_vnni<3>); else run(tiles_vnni<4>);
      }
      return;
    }
#endif
    tiles_plain(w, q, ap, sp, yp, M, N, K, t0, t1);
  });
  return y.to(x.scalar_type());
}

bool w4a8_vnni() { return PB_VNNI; }

}  // namespace

TORCH_LIBRARY(polybasic_w4a8, m) {
  m.def("mm(Tensor x, Tensor packed, bool plain=False) -> Tensor");
  m.def("vnni() -> bool", &w4a8_vnni);
}

TORCH_LIBRARY_IMPL(polybasic_w4a8, CPU, m) { m.impl("mm", &w4a8_mm); }
