// The 256-bit VNNI GEMM (`vpdpbusd` on ymm: 32 u8 x s8 products per instruction), included
// once per encoding: VEX for AVX-VNNI CPUs (isa_avxvnni.cpp, QT_VNNI256_VEX defined) and
// EVEX in the AVX-512 file, so that the AVX-VNNI path can run (and be tested) on AVX-512
// VNNI CPUs too. Define QT_VNNI256_NAME, the function's name, before including.
//
// A packed block (16 columns x 4 k, 64 bytes) is two registers of 8 columns each, so every
// accumulator lane is one output column: no folding at the end.
#include "qt_x86_256.h"

namespace qt {
namespace {

inline void dpbusd256(__m256i& acc, __m256i a, __m256i b) {
    // inline asm keeps each accumulator in its register (see isa_avx512.cpp)
#if defined(QT_VNNI256_VEX)
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

}  // namespace

void QT_VNNI256_NAME(int64_t M, int64_t N, int64_t Kp, const uint8_t* A, int64_t lda,
                     const int8_t* B, const Epilogue& ep, const uint8_t* A_lo) {
    const int64_t nblocks = (N + 15) / 16, kq = Kp / 4;
    if (A_lo) {
        for (int64_t r = 0; r < M; ++r) {
            int64_t nb = 0;
            for (; nb + 2 <= nblocks; nb += 2) micro256<1, 2, true>(A, A_lo, lda, B, kq, r, nb, N, ep);
            if (nb < nblocks) micro256<1, 1, true>(A, A_lo, lda, B, kq, r, nb, N, ep);
        }
        return;
    }
    if (M < 2) {  // GEMV: four blocks (8 accumulator chains) per pass over the row
        for (int64_t r = 0; r < M; ++r) {
            int64_t nb = 0;
            for (; nb + 4 <= nblocks; nb += 4) micro256<1, 4, false>(A, A_lo, lda, B, kq, r, nb, N, ep);
            for (; nb < nblocks; ++nb) micro256<1, 1, false>(A, A_lo, lda, B, kq, r, nb, N, ep);
        }
        return;
    }
    const int64_t panel = 64;
    for (int64_t r0 = 0; r0 < M; r0 += panel) {
        const int64_t r1 = r0 + panel < M ? r0 + panel : M;
        for (int64_t nb = 0; nb < nblocks; nb += 2) {
            const bool two = nb + 2 <= nblocks;
            int64_t r = r0;
            for (; r + 2 <= r1; r += 2) {
                if (two) micro256<2, 2, false>(A, A_lo, lda, B, kq, r, nb, N, ep);
                else micro256<2, 1, false>(A, A_lo, lda, B, kq, r, nb, N, ep);
            }
            for (; r < r1; ++r) {
                if (two) micro256<1, 2, false>(A, A_lo, lda, B, kq, r, nb, N, ep);
                else micro256<1, 1, false>(A, A_lo, lda, B, kq, r, nb, N, ep);
            }
        }
    }
}

}  // namespace qt
