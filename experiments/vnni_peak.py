"""The CPU's AVX-512 VNNI ceilings, from registers alone, against which the `w4a8` kernel's many-row rate is read:

    python -m experiments.vnni_peak

Two loops, compiled here with g++ -O3 -march=native and run on 1 and on 2 threads (no memory traffic):
- `vpdpbusd` alone: 12 independent accumulators, so nothing waits on a latency: the instruction's throughput;
- the kernel's mix per (row, group of 32 columns) of a 4-bit tile (polybasic/quant/kernels/w4a8.cpp): 8 `vpdpbusd`
  with broadcast activation words in two chains, then the group's float terms (int -> float, the scale times the
  activation scale, two fused multiply-adds), for 8 rows at once as a verification of 8 rows runs them; and the same
  with each activation word as `vpdpbusd`'s broadcast memory operand ({1to16}, which gcc does not form itself).
Prints GMAC/s (one `vpdpbusd` is 64 multiply-adds). The kernel's own rate over a model's linears comes from
experiments.w4a8_kernel (M >= 8: compute-bound).
"""
from __future__ import annotations

import argparse
import subprocess
import tempfile
from pathlib import Path

SOURCE = r"""
#include <immintrin.h>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <thread>
#include <vector>

double bare(long n) {  // 12 independent chains of vpdpbusd (named: an array's would go through memory) -> GMAC/s
  __m512i a0 = _mm512_set1_epi32(0), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0, a8 = a0, a9 = a0,
          a10 = a0, a11 = a0;
  const __m512i x = _mm512_set1_epi8(3), y = _mm512_set1_epi8(5);
  auto t0 = std::chrono::steady_clock::now();
  for (long k = 0; k < n; ++k) {
#define DP(r) r = _mm512_dpbusd_epi32(r, x, y);
    DP(a0) DP(a1) DP(a2) DP(a3) DP(a4) DP(a5) DP(a6) DP(a7) DP(a8) DP(a9) DP(a10) DP(a11)
  }
  double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const __m512i t = _mm512_add_epi32(_mm512_add_epi32(_mm512_add_epi32(a0, a1), _mm512_add_epi32(a2, a3)),
                                     _mm512_add_epi32(_mm512_add_epi32(a4, a5), _mm512_add_epi32(a6, a7)));
  volatile int sink = _mm512_reduce_add_epi32(_mm512_add_epi32(t, _mm512_add_epi32(_mm512_add_epi32(a8, a9),
                                                                                  _mm512_add_epi32(a10, a11))));
  (void)sink;
  return n * 12 * 64.0 / s / 1e9;
}

template <bool EMBED>
double mix(long n) {  // the kernel's per (row, group) work for 8 rows, register-resident -> GMAC/s
  alignas(64) int32_t xq[64];
  alignas(64) float a[8], xs[8];
  for (int i = 0; i < 64; ++i) xq[i] = 0x01020304 + i;
  for (int i = 0; i < 8; ++i) { a[i] = 1.0f + i * 1e-3f; xs[i] = 0.5f; }
  __m512i c[8];
  for (int j = 0; j < 8; ++j) c[j] = _mm512_set1_epi8(j + 1);
  __m512 res[8];
  for (int r = 0; r < 8; ++r) res[r] = _mm512_setzero_ps();
  const __m512 sv = _mm512_set1_ps(1e-6f), ov = _mm512_set1_ps(-1e-6f);
  auto t0 = std::chrono::steady_clock::now();
  for (long k = 0; k < n; ++k) {
    asm volatile("" : "+v"(c[0]), "+v"(c[1]), "+v"(c[2]), "+v"(c[3]));  // a new group's codes, as far as gcc knows
    for (int r = 0; r < 8; ++r) {
      __m512i d0 = _mm512_setzero_si512(), d1 = _mm512_setzero_si512();
      for (int j = 0; j < 8; j += 2) {
        if constexpr (EMBED) {  // the activation word as vpdpbusd's broadcast memory operand
          asm("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(d0) : "v"(c[j]), "m"(xq[8 * r + j]));
          asm("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(d1) : "v"(c[j + 1]), "m"(xq[8 * r + j + 1]));
        } else {  // as the kernel's source writes it (gcc: a separate broadcast, then vpdpbusd)
          d0 = _mm512_dpbusd_epi32(d0, c[j], _mm512_set1_epi32(xq[8 * r + j]));
          d1 = _mm512_dpbusd_epi32(d1, c[j + 1], _mm512_set1_epi32(xq[8 * r + j + 1]));
        }
      }
      res[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(d0, d1)), _mm512_mul_ps(sv, _mm512_set1_ps(a[r])), res[r]);
      res[r] = _mm512_fmadd_ps(ov, _mm512_set1_ps(xs[r]), res[r]);
    }
  }
  double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  float out = 0;
  for (int r = 0; r < 8; ++r) out += _mm512_reduce_add_ps(res[r]);
  volatile float sink = out;
  (void)sink;
  return n * 8 * 512.0 / s / 1e9;
}

int main(int argc, char** argv) {
  const long n = std::atol(argv[1]);
  for (auto [name, f] : {std::pair{"vpdpbusd alone", &bare}, std::pair{"the kernel's mix, 8 rows", &mix<false>},
                         std::pair{"the same, broadcasts inside vpdpbusd", &mix<true>}}) {
    const long reps = f == &bare ? n : n / 4;
    double one = f(reps);
    std::vector<double> r(2);
    std::thread p([&] { r[0] = f(reps); }), q([&] { r[1] = f(reps); });
    p.join();
    q.join();
    std::printf("| %s | %.0f | %.0f |\n", name, one, r[0] + r[1]);
  }
}
"""


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--iters", type=int, default=20_000_000, help="loop trips of the bare loop (the mix runs a quarter)")
    a = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        src, exe = Path(tmp) / "peak.cpp", Path(tmp) / "peak"
        src.write_text(SOURCE)
        subprocess.run(["g++", "-O3", "-march=native", "-std=c++20", "-pthread", str(src), "-o", str(exe)], check=True)
        print("| loop | GMAC/s, 1 thread | GMAC/s, 2 threads |\n|---|---|---|", flush=True)
        subprocess.run([str(exe), str(a.iters)], check=True)


if __name__ == "__main__":
    main()
