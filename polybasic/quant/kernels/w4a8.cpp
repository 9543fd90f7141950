// W4A8 GEMV/GEMM for CPUs with AVX-512 VNNI: 4-bit (or 6-bit) weight codes x int8 activations, the CPU
// kernel 'w4a8' (polybasic/quant/w4a8.py builds it on first use and packs the layout;
// experiments/w4a8_kernel.py measures it).
//
// y[m, n] = sum_g ( s[n,g] * a[m,g] * sum_{k in g} u[n,k] * xq[m,k]  +  o[n,g] * xsum[m,g] )
// u: the weight's codes (w = s * u + o), in [0, 15] in groups g of 32 input columns (4-bit tiles), or in
// [0, 63] in groups of 16 (6-bit tiles: llama.cpp's Q6_K, whose scales are per 16 columns, holds exactly
// as u = q, o = -32 s). The scales and offsets are 8-bit per group times an fp16 factor per row and
// super-block of 256 columns (8 groups of 32 or 16 of 16), as in llama.cpp's Q4_K and Q6_K: s = ds * s8,
// o = dof * o8 (exact in fp32). Activations are quantized per group (32 or 16) at every call:
// a = max|x| / 127, xq = round(x * 127 / max|x|); xsum is the sum of x in fp32, in a fixed order (tree_sum16).
// Every output row is computed by the same code in the same order whatever the number of rows
// (row-invariant), so a model's one-token steps and its verifications of several rows give the same bits.
//
// Layout, [N/16, bytes per tile]: row tile t (rows 16t..16t+15) is one stream of super-blocks, each
// 64 bytes of header (16 fp16 ds, then 16 fp16 dof: one per row) and then, per group of the super-block
// (fewer in the last), the codes (256 bytes in 4-bit tiles, 192 in 6-bit ones), 16 int8 s8 and 16 int8 o8
// (one per row): 4.625 bits a weight in 4-bit tiles, 7.25 in 6-bit ones. In 4-bit codes, load L (0..3) is
// 64 bytes whose byte 4i+c holds u[16t+i, 32g+4L+c] in its low nibble and u[16t+i, 32g+16+4L+c] in its high
// one: split into nibbles, one load gives each row (a 32-bit lane) 4 + 4 consecutive codes, what vpdpbusd
// multiplies with 4 activation bytes broadcast to every lane. In 6-bit codes, word L (0..3) of a row is
// u[16t+i, 16g+4L..4L+3]: byte 4i+c of nibble load P (0, 1) holds the low 4 bits of word P's code c in its
// low nibble and of word P+2's in its high one, and byte 4i+c of the third load holds the top 2 bits of word
// L's code c at bits 2L and 2L+1. The op takes the width as an argument (the two widths' tiles can have
// the same bytes for different K).
// x may be fp32, bf16 or fp16; y comes back in x's dtype (converted once, at the store).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#include <immintrin.h>
#define PB_VNNI 1
#else
#define PB_VNNI 0
#endif

namespace {

// a layout of codes W bits wide (4 or 6): G columns per group (weights and activations), SB groups per
// super-block of 256 columns, CODES bytes of codes and BLOCK bytes in all (+ 16 of s8, 16 of o8) per (tile, group)
template <int W>
struct Width {
  static_assert(W == 4 || W == 6);
  static constexpr int64_t G = W == 4 ? 32 : 16;
  static constexpr int64_t SB = 256 / G;
  static constexpr int64_t CODES = W == 4 ? 256 : 192;
  static constexpr int64_t BLOCK = CODES + 32;
};
constexpr int64_t TN = 16;           // rows per tile
constexpr int64_t HEAD = 64;         // bytes per (tile, super-block) header: 16 fp16 ds, 16 fp16 dof
constexpr int64_t PREFETCH = 16384;  // bytes ahead (2-core AMD EPYC, Qwen 1.5B linears: 30.2 -> 22.7 ms a pass at 2 rows)

template <int W>
int64_t tile_bytes(int64_t K) {
  const int64_t ng = K / Width<W>::G;
  return (ng + Width<W>::SB - 1) / Width<W>::SB * HEAD + ng * Width<W>::BLOCK;
}

// x [M, K] -> xq [M, K] int8, a [M, K/G], xsum [M, K/G]. A group's sum is taken in one fixed order, lanes
// j and j + 16 first (32-column groups), then halves 8, 4, 2, 1 apart: AVX-512's reduction, and the plain
// loop below adds in the same order, so both give the same bits.
float tree_sum16(float* p) {  // p[16], overwritten
  for (int64_t half = 8; half >= 1; half /= 2)
    for (int64_t j = 0; j < half; ++j) p[j] += p[j + half];
  return p[0];
}

template <int64_t G, typename T>
void quantize_group(const T* x, int8_t* xq, float* a, float* xsum) {
  float v[G], p[16];
  float amax = 0.f;
  for (int64_t k = 0; k < G; ++k) {
    v[k] = static_cast<float>(x[k]);
    amax = std::fmax(amax, std::fabs(v[k]));
  }
  for (int64_t j = 0; j < 16; ++j) {
    if constexpr (G == 32) p[j] = v[j] + v[j + 16];
    else p[j] = v[j];
  }
  const float inv = amax > 0.f ? 127.f / amax : 0.f;
  for (int64_t k = 0; k < G; ++k) xq[k] = static_cast<int8_t>(std::nearbyint(v[k] * inv));
  *a = amax / 127.f;
  *xsum = tree_sum16(p);
}

#if PB_VNNI
template <typename T>
__m512 load16_ps(const T* x) {  // 16 values of x -> fp32 (exact)
  if constexpr (std::is_same_v<T, float>) return _mm512_loadu_ps(x);
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
  if constexpr (std::is_same_v<T, at::Half>) return _mm512_cvtph_ps(h);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));  // bf16: the top 16 bits
}

float hsum16(__m512 v) {  // tree_sum16's order
  const __m256 h8 = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
  const __m128 h4 = _mm_add_ps(_mm256_castps256_ps128(h8), _mm256_extractf128_ps(h8, 1));
  const __m128 h2 = _mm_add_ps(h4, _mm_movehl_ps(h4, h4));
  return _mm_cvtss_f32(_mm_add_ss(h2, _mm_movehdup_ps(h2)));
}

template <int64_t G, typename T>
void quantize_group_vnni(const T* x, int8_t* xq, float* a, float* xsum) {
  const __m512 sign = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff));
  const __m512 v0 = load16_ps(x), v1 = G == 32 ? load16_ps(x + 16) : _mm512_setzero_ps();
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_and_ps(v0, sign), _mm512_and_ps(v1, sign)));
  const __m512 inv = _mm512_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
  // round to nearest even (the default MXCSR mode, as nearbyint), then narrow: |values| <= 127
  _mm_storeu_si128(reinterpret_cast<__m128i*>(xq), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(v0, inv))));
  if constexpr (G == 32)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(xq + 16), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(v1, inv))));
  *a = amax / 127.f;
  *xsum = hsum16(G == 32 ? _mm512_add_ps(v0, v1) : v0);
}
#endif

template <int64_t G, typename T>
void quantize_rows(const T* x, int64_t M, int64_t K, int8_t* xq, float* a, float* xsum, bool plain) {
  const int64_t ng = K / G;
  // rows on every thread once there are enough of them (a prompt's: ~10% of its time on one thread); each row's
  // values do not depend on which thread computes them
  at::parallel_for(0, M, std::max<int64_t>(1, (1 << 16) / K), [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m)
      for (int64_t g = 0; g < ng; ++g) {
        const int64_t at = m * K + g * G, i = m * ng + g;
#if PB_VNNI
        if (!plain) {
          quantize_group_vnni<G>(x + at, xq + at, a + i, xsum + i);
          continue;
        }
#endif
        quantize_group<G>(x + at, xq + at, a + i, xsum + i);
      }
  });
}

float fp16_at(const uint8_t* p, int64_t i) { return static_cast<float>(reinterpret_cast<const at::Half*>(p)[i]); }

template <typename T>
void store_row(T* y, const float* v) {  // 16 values, rounded once to y's dtype
  for (int64_t i = 0; i < TN; ++i) y[i] = static_cast<T>(v[i]);
}

// the code of row i, activation column j (0..G-1) of a group's code bytes (layout above)
template <int W>
int32_t code_at(const uint8_t* codes, int64_t i, int64_t j) {
  if constexpr (W == 6) {
    const int64_t L = j / 4, c = 4 * i + j % 4;
    const int32_t low = (codes[(L % 2) * 64 + c] >> (4 * (L / 2))) & 15;
    return low | (((codes[128 + c] >> (2 * L)) & 3) << 4);
  }
  const uint8_t b = codes[((j % 16) / 4) * 64 + 4 * i + j % 4];
  return j < 16 ? (b & 15) : (b >> 4);
}

// Any CPU: the same arithmetic in plain loops (integer dots exact, then the same float terms).
template <int W, typename T>
void tiles_plain(const uint8_t* w, const int8_t* xq, const float* a, const float* xsum, T* y,
                 int64_t M, int64_t N, int64_t K, int64_t t0, int64_t t1) {
  constexpr int64_t G = Width<W>::G, SB = Width<W>::SB, CODES = Width<W>::CODES;
  const int64_t ng = K / G, tb = tile_bytes<W>(K);
  for (int64_t t = t0; t < t1; ++t)
    for (int64_t m = 0; m < M; ++m) {
      float res[TN] = {0};
      const uint8_t* blk = w + t * tb;
      const uint8_t* head = blk;
      for (int64_t g = 0; g < ng; ++g) {
        if (g % SB == 0) { head = blk; blk += HEAD; }
        const int8_t* xg = xq + m * K + g * G;
        const int8_t* s8 = reinterpret_cast<const int8_t*>(blk + CODES);
        for (int64_t i = 0; i < TN; ++i) {
          int32_t dot = 0;
          for (int64_t j = 0; j < G; ++j) dot += code_at<W>(blk, i, j) * xg[j];
          const float s = fp16_at(head, i) * float(s8[i]), o = fp16_at(head + 32, i) * float(s8[TN + i]);
          res[i] += float(dot) * (s * a[m * ng + g]) + o * xsum[m * ng + g];
        }
        blk += Width<W>::BLOCK;
      }
      store_row(y + m * N + t * TN, res);
    }
}

#if PB_VNNI
__m512 int8_to_ps(const uint8_t* p) {  // 16 int8 -> 16 fp32
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

// 16 fp32 values rounded once to y's dtype, as store_row rounds them: bf16 by c10's round to nearest even (a NaN
// becomes 0x7FC0; subnormals kept, where vcvtneps2bf16 would flush them), in vector registers
template <typename T>
void store_row_vnni(T* y, __m512 v) {
  if constexpr (std::is_same_v<T, float>) {
    _mm512_storeu_ps(y, v);
  } else if constexpr (std::is_same_v<T, at::BFloat16>) {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i bias = _mm512_add_epi32(_mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1)),
                                          _mm512_set1_epi32(0x7FFF));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, bias), 16);
    r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y), _mm512_cvtepi32_epi16(r));
  } else {
    alignas(64) float f[TN];
    _mm512_store_ps(f, v);
    store_row(y, f);
  }
}

// MB activation rows at once (up to MB_MAX): a group's unpacked code registers (8 for 4-bit codes, 4 for
// 6-bit ones) serve every row.
template <int W, int MB, typename T>
void tiles_vnni(const uint8_t* w, const int8_t* xq, const float* a, const float* xsum, T* y,
                int64_t N, int64_t K, int64_t t0, int64_t t1) {
  constexpr int64_t G = Width<W>::G, SB = Width<W>::SB, CODES = Width<W>::CODES, BLOCK = Width<W>::BLOCK;
  constexpr int NC = W == 4 ? 8 : 4;  // code registers per group: activation words 0..NC-1 multiply them
  const int64_t ng = K / G, tb = tile_bytes<W>(K);
  const __m512i nib = _mm512_set1_epi8(0x0F), top = _mm512_set1_epi8(0x30);
  for (int64_t t = t0; t < t1; ++t) {
    __m512 res[MB];
    for (int r = 0; r < MB; ++r) res[r] = _mm512_setzero_ps();
    const uint8_t* blk = w + t * tb;
    __m512 ds = _mm512_setzero_ps(), dof = _mm512_setzero_ps();
    for (int64_t g = 0; g < ng; ++g, blk += BLOCK) {
      if (g % SB == 0) {
        ds = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk)));
        dof = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 32)));
        blk += HEAD;
      }
      for (int L = 0; L < (BLOCK + 63) / 64; ++L)
        _mm_prefetch(reinterpret_cast<const char*>(blk + PREFETCH + 64 * L), _MM_HINT_T0);
      __m512i c[NC];  // c[j] pairs with activation word j (4 consecutive columns)
      if constexpr (W == 4) {
        for (int L = 0; L < 4; ++L) {
          const __m512i v = _mm512_loadu_si512(blk + 64 * L);
          c[L] = _mm512_and_si512(v, nib);
          c[4 + L] = _mm512_and_si512(_mm512_srli_epi16(v, 4), nib);
        }
      } else {  // the top 2 bits of word L at bits 2L, 2L+1 of the third load, moved to bits 4, 5 (16-bit
        // shifts: what crosses from the neighbouring byte is masked off)
        const __m512i v0 = _mm512_loadu_si512(blk), v1 = _mm512_loadu_si512(blk + 64);
        const __m512i h = _mm512_loadu_si512(blk + 128);
        c[0] = _mm512_or_si512(_mm512_and_si512(v0, nib), _mm512_and_si512(_mm512_slli_epi16(h, 4), top));
        c[1] = _mm512_or_si512(_mm512_and_si512(v1, nib), _mm512_and_si512(_mm512_slli_epi16(h, 2), top));
        c[2] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(v0, 4), nib), _mm512_and_si512(h, top));
        c[3] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(v1, 4), nib),
                               _mm512_and_si512(_mm512_srli_epi16(h, 2), top));
      }
      const __m512 sv = _mm512_mul_ps(ds, int8_to_ps(blk + CODES));
      const __m512 ov = _mm512_mul_ps(dof, int8_to_ps(blk + CODES + 16));
      for (int r = 0; r < MB; ++r) {
        const int32_t* xg = reinterpret_cast<const int32_t*>(xq + r * K + g * G);
        // two chains of NC / 2 products, half the latency of one (integer sums: exact in any order)
        __m512i d0 = _mm512_setzero_si512(), d1 = _mm512_setzero_si512();
        for (int i = 0; i < NC; i += 2) {
          d0 = _mm512_dpbusd_epi32(d0, c[i], _mm512_set1_epi32(xg[i]));
          d1 = _mm512_dpbusd_epi32(d1, c[i + 1], _mm512_set1_epi32(xg[i + 1]));
        }
        const __m512i dot = _mm512_add_epi32(d0, d1);
        res[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(sv, _mm512_set1_ps(a[r * ng + g])), res[r]);
        res[r] = _mm512_fmadd_ps(ov, _mm512_set1_ps(xsum[r * ng + g]), res[r]);
      }
    }
    for (int r = 0; r < MB; ++r) store_row_vnni(y + r * N + t * TN, res[r]);
  }
}

// tiles_vnni<W, mb> for mb in 1..MB_MAX: a verification of up to 8 rows reads the weights once
// (8 accumulators, 8 code registers and the scale terms fit AVX-512's 32 registers)
constexpr int MB_MAX = 8;
constexpr int64_t BLOCK_BYTES = 1 << 18;  // weight bytes per block of tiles a long call reuses (a quarter of Zen 4's L2)
template <int W, typename T, int MB = 1>
void rows_dispatch(int mb, const uint8_t* w, const int8_t* xq, const float* a, const float* xsum, T* y,
                   int64_t N, int64_t K, int64_t t0, int64_t t1) {
  if constexpr (MB < MB_MAX) {
    if (mb != MB) return rows_dispatch<W, T, MB + 1>(mb, w, xq, a, xsum, y, N, K, t0, t1);
  }
  tiles_vnni<W, MB, T>(w, xq, a, xsum, y, N, K, t0, t1);
}
#endif

template <int W, typename T>
void run(const at::Tensor& x, const at::Tensor& packed, at::Tensor& y, bool plain) {
  constexpr int64_t G = Width<W>::G;
  const int64_t M = x.size(0), K = x.size(1), nt = packed.size(0), N = nt * TN, ng = K / G;
  at::Tensor xq = at::empty({M, K}, x.options().dtype(at::kChar));
  at::Tensor a = at::empty({M, ng}, x.options().dtype(at::kFloat)), xsum = at::empty({M, ng}, a.options());
  quantize_rows<G>(x.data_ptr<T>(), M, K, xq.data_ptr<int8_t>(), a.data_ptr<float>(), xsum.data_ptr<float>(), plain);
  const uint8_t* w = packed.data_ptr<uint8_t>();
  const int8_t* q = xq.data_ptr<int8_t>();
  const float *ap = a.data_ptr<float>(), *sp = xsum.data_ptr<float>();
  T* yp = y.data_ptr<T>();
  at::parallel_for(0, nt, 4, [&](int64_t t0, int64_t t1) {  // needs -fopenmp, or it runs on one thread
#if PB_VNNI
    if (!plain) {  // more than MB_MAX rows (prompts): each block of tiles, read from memory once, serves every
      // row from the cache
      const int64_t block = std::max<int64_t>(1, BLOCK_BYTES / tile_bytes<W>(K));
      for (int64_t b0 = t0; b0 < t1; b0 += block)
        for (int64_t m = 0; m < M; m += MB_MAX) {
          const int64_t mb = std::min<int64_t>(MB_MAX, M - m);
          rows_dispatch<W, T>(static_cast<int>(mb), w, q + m * K, ap + m * ng, sp + m * ng, yp + m * N, N, K, b0,
                              std::min(b0 + block, t1));
        }
      return;
    }
#endif
    tiles_plain<W>(w, q, ap, sp, yp, M, N, K, t0, t1);
  });
}

template <int W>
void run_in(const at::Tensor& x, const at::Tensor& packed, at::Tensor& y, bool plain) {
  if (x.scalar_type() == at::kBFloat16) run<W, at::BFloat16>(x, packed, y, plain);
  else if (x.scalar_type() == at::kHalf) run<W, at::Half>(x, packed, y, plain);
  else run<W, float>(x, packed, y, plain);
}

at::Tensor w4a8_mm(const at::Tensor& x_in, const at::Tensor& packed, bool plain, int64_t bits) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.device().is_cpu() && x_in.is_floating_point(),
              "w4a8_mm: x must be a 2-D floating-point CPU tensor [M, K]");
  TORCH_CHECK(packed.dim() == 2 && packed.scalar_type() == at::kByte && packed.is_contiguous(),
              "w4a8_mm: packed must be contiguous uint8 [N/16, bytes per tile]");
  TORCH_CHECK(bits == 4 || bits == 6, "w4a8_mm: bits must be 4 or 6, got ", bits);
  const int64_t K = x_in.size(1), G = bits == 4 ? 32 : 16, tb = bits == 4 ? tile_bytes<4>(K) : tile_bytes<6>(K);
  TORCH_CHECK(K % G == 0, "w4a8_mm: x has ", K, " columns, not a multiple of ", G, " (", bits, "-bit codes)");
  TORCH_CHECK(packed.size(1) == tb, "w4a8_mm: x has ", K, " columns, the weight's tiles hold ", packed.size(1),
              " bytes (", tb, " for x's in ", bits, "-bit codes)");
  const bool four = bits == 4;
  const auto st = x_in.scalar_type();
  const bool native = st == at::kFloat || st == at::kBFloat16 || st == at::kHalf;
  const at::Tensor x = (native ? x_in : x_in.to(at::kFloat)).contiguous();
  at::Tensor y = at::empty({x.size(0), packed.size(0) * TN}, x.options());
  if (four) run_in<4>(x, packed, y, plain);
  else run_in<6>(x, packed, y, plain);
  return native ? y : y.to(st);
}

bool w4a8_vnni() { return PB_VNNI; }

}  // namespace

TORCH_LIBRARY(polybasic_w4a8, m) {
  // an op whose schema changes takes a new name ("mm" had no `bits`): compiled code cached on disk by inductor
  // calls ops by name, and inductor's cache key does not see an op's schema
  m.def("gemm(Tensor x, Tensor packed, bool plain=False, int bits=4) -> Tensor");
  m.def("vnni() -> bool", &w4a8_vnni);
}

TORCH_LIBRARY_IMPL(polybasic_w4a8, CPU, m) { m.impl("gemm", &w4a8_mm); }
