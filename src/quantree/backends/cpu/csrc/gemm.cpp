// int8 GEMM on packed weights: AVX-512 VNNI micro-kernels with a scalar fallback.
#include <cstring>

#include "qt_kernels.h"
#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
#include <immintrin.h>
#define QT_VNNI 1
#endif

namespace qt {

void to_u8(const int8_t* x, int64_t M, int64_t K, int64_t ldx, uint8_t* out, int64_t Kp) {
    for (int64_t m = 0; m < M; ++m) {
        const int8_t* src = x + m * ldx;
        uint8_t* dst = out + m * Kp;
        for (int64_t k = 0; k < K; ++k) dst[k] = static_cast<uint8_t>(src[k] ^ 0x80);
        for (int64_t k = K; k < Kp; ++k) dst[k] = 0;
    }
}

#ifdef QT_VNNI

static inline void store_block(const Epilogue& ep, int64_t row, int64_t n0, int64_t N,
                               __m512i acc, const __m512i* lo) {
    const int64_t rem = N - n0;
    const __mmask16 m = rem >= 16 ? static_cast<__mmask16>(0xFFFF)
                                  : static_cast<__mmask16>((1u << rem) - 1u);
    if (ep.row_off) acc = _mm512_add_epi32(acc, _mm512_set1_epi32(ep.row_off[row]));
    __m512 v = _mm512_cvtepi32_ps(_mm512_add_epi32(acc, _mm512_maskz_loadu_epi32(m, ep.off + n0)));
    if (lo) v = _mm512_fmadd_ps(v, _mm512_set1_ps(256.0f), _mm512_cvtepi32_ps(*lo));
    if (ep.mult) {
        // mul then add (not an FMA): with power-of-two scales this rounds exactly like
        // the reference's (acc * scale + bias) / out_scale
        __m512 q = _mm512_add_ps(_mm512_mul_ps(v, _mm512_maskz_loadu_ps(m, ep.mult + n0)),
                                 _mm512_maskz_loadu_ps(m, ep.add + n0));
        q = _mm512_roundscale_ps(q, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        q = _mm512_add_ps(q, _mm512_set1_ps(ep.zero_point));  // after rounding: ties to even
        q = _mm512_min_ps(_mm512_max_ps(q, _mm512_set1_ps(ep.qmin)), _mm512_set1_ps(ep.qmax));
        _mm512_mask_cvtsepi32_storeu_epi8(ep.out_q + row * ep.ldc + n0, m,
                                          _mm512_cvtps_epi32(q));
        return;
    }
    __m512 y = _mm512_mul_ps(v, _mm512_maskz_loadu_ps(m, ep.scale + n0));
    if (ep.bias) y = _mm512_add_ps(y, _mm512_maskz_loadu_ps(m, ep.bias + n0));
    if (ep.out_f) {
        float* dst = ep.out_f + row * ep.ldc + n0;
        if (ep.accumulate) y = _mm512_add_ps(y, _mm512_maskz_loadu_ps(m, dst));
        _mm512_mask_storeu_ps(dst, m, y);
        return;
    }
    __m512 q = _mm512_roundscale_ps(_mm512_mul_ps(y, _mm512_set1_ps(ep.inv_scale)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    q = _mm512_add_ps(q, _mm512_set1_ps(ep.zero_point));
    q = _mm512_min_ps(_mm512_max_ps(q, _mm512_set1_ps(ep.qmin)), _mm512_set1_ps(ep.qmax));
    _mm512_mask_cvtsepi32_storeu_epi8(ep.out_q + row * ep.ldc + n0, m, _mm512_cvtps_epi32(q));
}

static inline __m512i broadcast4(const uint8_t* p) {
    int32_t four;
    std::memcpy(&four, p, 4);
    return _mm512_set1_epi32(four);
}

// acc += a . b (u8 x s8, 4 products per lane). Inline asm keeps each accumulator in one
// register: with the intrinsic, GCC 12 copies every accumulator each iteration.
static inline void dpbusd(__m512i& acc, __m512i a, __m512i b) {
    asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b));
}

// MR rows x NR blocks of 16 columns; DUAL also multiplies the rows of a second (low byte)
// plane A2 and combines 256 * (acc + off) + acc2.
template <int MR, int NR, bool DUAL>
static void micro(const uint8_t* A, const uint8_t* A2, int64_t lda, const int8_t* B,
                  int64_t kq, int64_t row0, int64_t nb0, int64_t N, const Epilogue& ep) {
    __m512i acc[MR * NR], acc2[DUAL ? MR * NR : 1];
#pragma GCC unroll 32
    for (int i = 0; i < MR * NR; ++i) acc[i] = _mm512_setzero_si512();
    if constexpr (DUAL) {
#pragma GCC unroll 32
        for (int i = 0; i < MR * NR; ++i) acc2[i] = _mm512_setzero_si512();
    }
    const int8_t* b = B + nb0 * kq * 64;
    const uint8_t* a0 = A + row0 * lda;
    const uint8_t* a2 = DUAL ? A2 + row0 * lda : nullptr;
    for (int64_t k = 0; k < kq; ++k) {
        __m512i bv[NR];
#pragma GCC unroll 8
        for (int j = 0; j < NR; ++j) bv[j] = _mm512_loadu_si512(b + (j * kq + k) * 64);
#pragma GCC unroll 4
        for (int i = 0; i < MR; ++i) {
            const __m512i a = broadcast4(a0 + i * lda + 4 * k);
#pragma GCC unroll 8
            for (int j = 0; j < NR; ++j) dpbusd(acc[i * NR + j], a, bv[j]);
            if constexpr (DUAL) {
                const __m512i c = broadcast4(a2 + i * lda + 4 * k);
#pragma GCC unroll 8
                for (int j = 0; j < NR; ++j) dpbusd(acc2[i * NR + j], c, bv[j]);
            }
        }
    }
#pragma GCC unroll 4
    for (int i = 0; i < MR; ++i) {
#pragma GCC unroll 8
        for (int j = 0; j < NR; ++j) {
            store_block(ep, row0 + i, (nb0 + j) * 16, N, acc[i * NR + j],
                        DUAL ? &acc2[DUAL ? i * NR + j : 0] : nullptr);
        }
    }
}

using Micro = void (*)(const uint8_t*, const uint8_t*, int64_t, const int8_t*, int64_t,
                       int64_t, int64_t, int64_t, const Epilogue&);

static Micro pick(int mr, int nr, bool dual) {
    static const Micro single[4][4] = {
        {micro<1, 1, false>, micro<1, 2, false>, micro<1, 3, false>, micro<1, 4, false>},
        {micro<2, 1, false>, micro<2, 2, false>, micro<2, 3, false>, micro<2, 4, false>},
        {micro<3, 1, false>, micro<3, 2, false>, micro<3, 3, false>, micro<3, 4, false>},
        {micro<4, 1, false>, micro<4, 2, false>, micro<4, 3, false>, micro<4, 4, false>},
    };
    static const Micro two[2][4] = {
        {micro<1, 1, true>, micro<1, 2, true>, micro<1, 3, true>, micro<1, 4, true>},
        {micro<2, 1, true>, micro<2, 2, true>, micro<2, 3, true>, micro<2, 4, true>},
    };
    return dual ? two[mr - 1][nr - 1] : single[mr - 1][nr - 1];
}

void gemm_u8s8(int64_t M, int64_t N, int64_t Kp, const uint8_t* A, int64_t lda,
               const int8_t* B, const Epilogue& ep, const uint8_t* A_lo) {
    const int64_t nblocks = (N + 15) / 16, kq = Kp / 4;
    const bool dual = A_lo != nullptr;
    const int mr_max = dual ? 2 : 4;
    if (M < mr_max) {  // GEMV-like: eight independent accumulator chains per row
        for (int64_t r = 0; r < M; ++r) {
            int64_t nb = 0;
            for (; nb + 8 <= nblocks; nb += 8) {
                if (dual) micro<1, 8, true>(A, A_lo, lda, B, kq, r, nb, N, ep);
                else micro<1, 8, false>(A, A_lo, lda, B, kq, r, nb, N, ep);
            }
            for (; nb < nblocks; nb += 4) {
                const int nr = static_cast<int>(nblocks - nb < 4 ? nblocks - nb : 4);
                pick(1, nr, dual)(A, A_lo, lda, B, kq, r, nb, N, ep);
            }
        }
        return;
    }
    // Row panels sized for L1/L2, then column blocks, then rows within the panel.
    const int64_t panel = 64;
    for (int64_t r0 = 0; r0 < M; r0 += panel) {
        const int64_t r1 = r0 + panel < M ? r0 + panel : M;
        for (int64_t nb = 0; nb < nblocks; nb += 4) {
            const int nr = static_cast<int>(nblocks - nb < 4 ? nblocks - nb : 4);
            int64_t r = r0;
            for (; r + mr_max <= r1; r += mr_max) pick(mr_max, nr, dual)(A, A_lo, lda, B, kq, r, nb, N, ep);
            for (; r < r1; ++r) pick(1, nr, dual)(A, A_lo, lda, B, kq, r, nb, N, ep);
        }
    }
}

#else  // portable fallback: same packed layout, same arithmetic

void gemm_u8s8(int64_t M, int64_t N, int64_t Kp, const uint8_t* A, int64_t lda,
               const int8_t* B, const Epilogue& ep, const uint8_t* A_lo) {
    const int64_t kq = Kp / 4;
    for (int64_t r = 0; r < M; ++r) {
        for (int64_t n = 0; n < N; ++n) {
            const int8_t* b = B + (n / 16) * kq * 64 + (n % 16) * 4;
            int32_t acc = 0, acc2 = 0;
            for (int64_t k = 0; k < kq; ++k) {
                for (int u = 0; u < 4; ++u) {
                    acc += static_cast<int32_t>(A[r * lda + 4 * k + u]) * b[k * 64 + u];
                    if (A_lo) acc2 += static_cast<int32_t>(A_lo[r * lda + 4 * k + u]) * b[k * 64 + u];
                }
            }
            if (ep.row_off) acc += ep.row_off[r];
            float v = static_cast<float>(acc + ep.off[n]);
            if (A_lo) v = v * 256.0f + static_cast<float>(acc2);
            if (ep.mult) {
                float q = __builtin_nearbyintf(v * ep.mult[n] + ep.add[n]) + ep.zero_point;
                q = q < ep.qmin ? ep.qmin : (q > ep.qmax ? ep.qmax : q);
                ep.out_q[r * ep.ldc + n] = static_cast<int8_t>(q);
                continue;
            }
            float y = v * ep.scale[n];
            if (ep.bias) y += ep.bias[n];
            if (ep.out_f) {
                ep.out_f[r * ep.ldc + n] = ep.accumulate ? ep.out_f[r * ep.ldc + n] + y : y;
            } else {
                ep.out_q[r * ep.ldc + n] = static_cast<int8_t>(
                    quantize_value(y, ep.inv_scale, ep.zero_point, ep.qmin, ep.qmax));
            }
        }
    }
}

#endif

}  // namespace qt
