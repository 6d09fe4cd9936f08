// The 256-bit VNNI GEMM (`vpdpbusd` on ymm: 32 u8 x s8 products per instruction), included
// once per encoding: VEX for AVX-VNNI CPUs (isa_avxvnni.cpp, QT_VNNI256_VEX defined) and
// EVEX in the AVX-512 file, so that the AVX-VNNI path can run (and be tested) on AVX-512
// VNNI CPUs too. Define QT_VNNI256_NAME, the function's name, before including.
//
// With QT_VNNI256_AVX2 defined instead (isa_avx2_w7.cpp), each `vpdpbusd` is AVX2's three
// instructions: `vpmaddubsw` (u8 x s8 pairs into int16, saturating), `vpmaddwd` by ones
// (pairs of those into int32) and `vpaddd`. That is exact only for weights within
// [-63, 63] (2 x 255 x 63 < 2^15): the AVX2 path reaches it through Kernels::gemm_w7 for
// such weights alone (qt::within7), never for a full int8 weight.
//
// A packed block (16 columns x 4 k, 64 bytes) is two registers of 8 columns each, so every
// accumulator lane is one output column: no folding at the end.
#include <algorithm>

#include "qt_x86_256.h"

namespace qt {
namespace {

inline void dpbusd256(__m256i& acc, __m256i a, __m256i b) {
    // inline asm keeps each accumulator in its register (see isa_avx512.cpp)
#if defined(QT_VNNI256_AVX2)
    __m256i t;
    asm("vpmaddubsw %3, %2, %1\n\t"
        "vpmaddwd %4, %1, %1\n\t"
        "vpaddd %1, %0, %0"
        : "+x"(acc), "=&x"(t)
        : "x"(a), "x"(b), "x"(_mm256_set1_epi16(1)));
#elif defined(QT_VNNI256_VEX)
    asm("%{vex%} vpdpbusd %2, %1, %0" : "+x"(acc) : "x"(a), "x"(b));
#else
    asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b));
#endif
}

inline __m256i bcast4(const uint8_t* p) {
    int32_t four;
    std::memcpy(&four, p, 4);
    return _mm256_set1_epi32(four);
}

// GEMV tiles (at most 2 rows, or one row of a dual operand): NR blocks per pass over the
// row, so that a single row still keeps 2 NR accumulator chains in flight.
template <int MR, int NR, bool DUAL>
void micro256(const uint8_t* A, const uint8_t* A2, int64_t lda, const int8_t* B, int64_t kq,
              int64_t row0, int64_t nb0, int64_t N, const Epilogue& ep) {
    __m256i acc[MR][NR][2], acc2[DUAL ? MR : 1][DUAL ? NR : 1][2];
    for (int i = 0; i < MR; ++i)
        for (int j = 0; j < NR; ++j) acc[i][j][0] = acc[i][j][1] = _mm256_setzero_si256();
    if constexpr (DUAL) {
        for (int i = 0; i < MR; ++i)
            for (int j = 0; j < NR; ++j) acc2[i][j][0] = acc2[i][j][1] = _mm256_setzero_si256();
    }
    const int8_t* b = B + nb0 * kq * 64;
    const uint8_t* a0 = A + row0 * lda;
    const uint8_t* a2 = DUAL ? A2 + row0 * lda : nullptr;
    for (int64_t k = 0; k < kq; ++k) {
        __m256i bv[NR][2];
        for (int j = 0; j < NR; ++j) {
            const int8_t* bk = b + (j * kq + k) * 64;
            bv[j][0] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bk));
            bv[j][1] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bk + 32));
        }
        for (int i = 0; i < MR; ++i) {
            const __m256i a = bcast4(a0 + i * lda + 4 * k);
            for (int j = 0; j < NR; ++j) {
                dpbusd256(acc[i][j][0], a, bv[j][0]);
                dpbusd256(acc[i][j][1], a, bv[j][1]);
            }
            if constexpr (DUAL) {
                const __m256i c = bcast4(a2 + i * lda + 4 * k);
                for (int j = 0; j < NR; ++j) {
                    dpbusd256(acc2[i][j][0], c, bv[j][0]);
                    dpbusd256(acc2[i][j][1], c, bv[j][1]);
                }
            }
        }
    }
    for (int i = 0; i < MR; ++i) {
        for (int j = 0; j < NR; ++j) {
            for (int h = 0; h < 2; ++h) {
                const int64_t n0 = (nb0 + j) * 16 + 8 * h;
                if (n0 >= N) continue;
                x86_256::epilogue8(ep, row0 + i, n0, N - n0 < 8 ? N - n0 : 8, acc[i][j][h],
                                   DUAL ? &acc2[DUAL ? i : 0][DUAL ? j : 0][h] : nullptr);
            }
        }
    }
}

// MR (1..6) rows a[i] (uint8, 4 k per step) against one packed block of 16 columns: row i's
// sums of columns 0-7 in s[2 i], of columns 8-15 in s[2 i + 1]. The block is used as packed
// (two registers per 4 k), so unlike the AVX2 path nothing is widened first.
template <int MR>
void tile16(const uint8_t* const* a, const int8_t* b, int64_t kq, __m256i* s) {
    if constexpr (MR == 6) {
        // 12 accumulators (12 independent `vpdpbusd` chains, enough to cover its latency at
        // two per cycle), 2 weight registers and a broadcast, in one asm block as in the
        // AVX2 path (GCC spills accumulators of the intrinsic version). Rows 0-2 are
        // a[0] + i ld, rows 3-5 a[3] + i ld.
        const int64_t ld = a[1] - a[0];
        int64_t n = kq;
        const int8_t* bp = b;
        const uint8_t* q0 = a[0];
        const uint8_t* q3 = a[3];
#if defined(QT_VNNI256_AVX2)
        // 12 accumulators, 2 weight registers, the broadcast and one product take all 16
        // registers: the ones of `vpmaddwd` are read from memory (an L1 load, not a port
        // the multiplies need).
        alignas(32) static const int16_t ones16[16] = {1, 1, 1, 1, 1, 1, 1, 1,
                                                       1, 1, 1, 1, 1, 1, 1, 1};
        const int16_t* ones = ones16;
#define QT_ROW6(addr, u, v)                                  \
    "vpbroadcastd " addr ", %%ymm14\n\t"                     \
    "vpmaddubsw %%ymm12, %%ymm14, %%ymm15\n\t"               \
    "vpmaddwd (%[ones]), %%ymm15, %%ymm15\n\t"               \
    "vpaddd %%ymm15, %%ymm" u ", %%ymm" u "\n\t"             \
    "vpmaddubsw %%ymm13, %%ymm14, %%ymm15\n\t"               \
    "vpmaddwd (%[ones]), %%ymm15, %%ymm15\n\t"               \
    "vpaddd %%ymm15, %%ymm" v ", %%ymm" v "\n\t"
#else
#if defined(QT_VNNI256_VEX)
#define QT_DP "%{vex%} vpdpbusd "
#else
#define QT_DP "vpdpbusd "
#endif
#define QT_ROW6(addr, u, v)                            \
    "vpbroadcastd " addr ", %%ymm14\n\t"               \
    QT_DP "%%ymm12, %%ymm14, %%ymm" u "\n\t"           \
    QT_DP "%%ymm13, %%ymm14, %%ymm" v "\n\t"
#endif
        asm volatile(
            "vpxor %%xmm0, %%xmm0, %%xmm0\n\t"
            "vmovdqa %%ymm0, %%ymm1\n\tvmovdqa %%ymm0, %%ymm2\n\tvmovdqa %%ymm0, %%ymm3\n\t"
            "vmovdqa %%ymm0, %%ymm4\n\tvmovdqa %%ymm0, %%ymm5\n\tvmovdqa %%ymm0, %%ymm6\n\t"
            "vmovdqa %%ymm0, %%ymm7\n\tvmovdqa %%ymm0, %%ymm8\n\tvmovdqa %%ymm0, %%ymm9\n\t"
            "vmovdqa %%ymm0, %%ymm10\n\tvmovdqa %%ymm0, %%ymm11\n\t"
            "test %[n], %[n]\n\t"
            "jle 2f\n\t"
            "1:\n\t"
            "vmovdqu (%[b]), %%ymm12\n\t"
            "vmovdqu 32(%[b]), %%ymm13\n\t"
            QT_ROW6("(%[q0])", "0", "1") QT_ROW6("(%[q0],%[ld],1)", "2", "3")
            QT_ROW6("(%[q0],%[ld],2)", "4", "5") QT_ROW6("(%[q3])", "6", "7")
            QT_ROW6("(%[q3],%[ld],1)", "8", "9") QT_ROW6("(%[q3],%[ld],2)", "10", "11")
            "add $64, %[b]\n\t"
            "add $4, %[q0]\n\t"
            "add $4, %[q3]\n\t"
            "dec %[n]\n\t"
            "jnz 1b\n\t"
            "2:\n\t"
            "vmovdqu %%ymm0, (%[s])\n\tvmovdqu %%ymm1, 32(%[s])\n\t"
            "vmovdqu %%ymm2, 64(%[s])\n\tvmovdqu %%ymm3, 96(%[s])\n\t"
            "vmovdqu %%ymm4, 128(%[s])\n\tvmovdqu %%ymm5, 160(%[s])\n\t"
            "vmovdqu %%ymm6, 192(%[s])\n\tvmovdqu %%ymm7, 224(%[s])\n\t"
            "vmovdqu %%ymm8, 256(%[s])\n\tvmovdqu %%ymm9, 288(%[s])\n\t"
            "vmovdqu %%ymm10, 320(%[s])\n\tvmovdqu %%ymm11, 352(%[s])\n\t"
            : [b] "+r"(bp), [q0] "+r"(q0), [q3] "+r"(q3), [n] "+r"(n)
            : [ld] "r"(ld), [s] "r"(s)
#if defined(QT_VNNI256_AVX2)
              , [ones] "r"(ones)
#endif
            : "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9",
              "xmm10", "xmm11", "xmm12", "xmm13", "xmm14", "xmm15", "memory", "cc");
#undef QT_ROW6
#undef QT_DP
    } else {
        __m256i acc[MR][2];
        for (int i = 0; i < MR; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_si256();
        for (int64_t k = 0; k < kq; ++k) {
            const __m256i b0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 64 * k));
            const __m256i b1 =
                _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 64 * k + 32));
            for (int i = 0; i < MR; ++i) {
                const __m256i av = bcast4(a[i] + 4 * k);
                dpbusd256(acc[i][0], av, b0);
                dpbusd256(acc[i][1], av, b1);
            }
        }
        for (int i = 0; i < MR; ++i) s[2 * i] = acc[i][0], s[2 * i + 1] = acc[i][1];
    }
}

void tile16_n(int n, const uint8_t* const* a, const int8_t* b, int64_t kq, __m256i* s) {
    switch (n) {
        case 6: tile16<6>(a, b, kq, s); break;
        case 5: tile16<5>(a, b, kq, s); break;
        case 4: tile16<4>(a, b, kq, s); break;
        case 3: tile16<3>(a, b, kq, s); break;
        case 2: tile16<2>(a, b, kq, s); break;
        default: tile16<1>(a, b, kq, s); break;
    }
}

}  // namespace

// Beyond 2 rows: tiles of 6 rows x 16 columns (a dual operand: 3 rows of each plane), the
// AVX2 path's shape. They replaced tiles of 2 rows x 32 columns (8 accumulators, 6 loads
// per 8 `vpdpbusd`), which measured 61-64 GMAC/s, below the AVX2 path's 76-86.
void QT_VNNI256_NAME(int64_t M, int64_t N, int64_t Kp, const uint8_t* A, int64_t lda,
                     const int8_t* B, const Epilogue& ep, const uint8_t* A_lo) {
    const int64_t nblocks = (N + 15) / 16, kq = Kp / 4;
    if (M <= 2) {  // GEMV: a row against 4 blocks (2 with a low plane) at a time
        for (int64_t r = 0; r < M; ++r) {
            int64_t nb = 0;
            if (A_lo) {
                for (; nb + 2 <= nblocks; nb += 2)
                    micro256<1, 2, true>(A, A_lo, lda, B, kq, r, nb, N, ep);
                if (nb < nblocks) micro256<1, 1, true>(A, A_lo, lda, B, kq, r, nb, N, ep);
            } else {
                for (; nb + 4 <= nblocks; nb += 4)
                    micro256<1, 4, false>(A, A_lo, lda, B, kq, r, nb, N, ep);
                for (; nb < nblocks; ++nb) micro256<1, 1, false>(A, A_lo, lda, B, kq, r, nb, N, ep);
            }
        }
        return;
    }
    const int64_t step = A_lo ? 3 : 6;
    // Panels of rows that stay in L2 while every block of columns passes over them.
    const int64_t panel = std::max<int64_t>(6, (256 * 1024) / (2 * Kp) / 6 * 6);
    for (int64_t r0 = 0; r0 < M; r0 += panel) {
        const int64_t r1 = r0 + panel < M ? r0 + panel : M;
        for (int64_t nb = 0; nb < nblocks; ++nb) {
            const int8_t* b = B + nb * kq * 64;
#if defined(QT_VNNI256_AVX2)
            // the column constants loaded once per block (isa_avx2.cpp's panel epilogue): at
            // a first convolution's K = 28 the general epilogue cost a fifth of the call
            const x86_256::PanelEpilogue pe[2] = {
                {ep, nb * 16, N - nb * 16 < 8 ? N - nb * 16 : 8},
                {ep, nb * 16 + 8, N - nb * 16 - 8 < 8 ? N - nb * 16 - 8 : 8}};
            const bool fast = !A_lo && pe[0].kind != x86_256::PanelEpilogue::GENERAL &&
                              (nb * 16 + 8 >= N || pe[1].kind != x86_256::PanelEpilogue::GENERAL);
#endif
            for (int64_t r = r0, m = 0; r < r1; r += m) {
                // 7 or 8 rows left are 4 + 3 or 4 + 4, as in the AVX2 path
                const int64_t left = r1 - r;
                m = left < step ? left : (step == 6 && (left == 7 || left == 8) ? 4 : step);
                const uint8_t* rows[6];
                for (int i = 0; i < m; ++i) {
                    rows[i] = A + (r + i) * lda;
                    if (A_lo) rows[m + i] = A_lo + (r + i) * lda;
                }
                alignas(32) __m256i s[12];
                tile16_n(static_cast<int>(A_lo ? 2 * m : m), rows, b, kq, s);
#if defined(QT_VNNI256_AVX2)
                if (fast) {
                    for (int i = 0; i < m; ++i) {
                        pe[0].row(r + i, s[2 * i], nullptr);
                        if (nb * 16 + 8 < N) pe[1].row(r + i, s[2 * i + 1], nullptr);
                    }
                    continue;
                }
#endif
                for (int i = 0; i < m; ++i) {
                    for (int h = 0; h < 2; ++h) {
                        const int64_t n0 = nb * 16 + 8 * h;
                        if (n0 >= N) break;
                        x86_256::epilogue8(ep, r + i, n0, N - n0 < 8 ? N - n0 : 8,
                                           s[2 * i + h], A_lo ? &s[2 * (m + i) + h] : nullptr);
                    }
                }
            }
        }
    }
}

}  // namespace qt
