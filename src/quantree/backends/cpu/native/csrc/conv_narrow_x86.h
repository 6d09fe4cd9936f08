// The x86 narrow-group convolution (conv_narrow.cpp), included by the AVX2 file (vpmaddwd on
// int16 pairs) and the AVX-512 VNNI file (256-bit vpdpbusd, QT_NARROW_VNNI). One output
// block of 8 channels is one ymm accumulator; four im2col rows run together (four
// independent chains). No standard library templates: see isa_avx512.cpp.
#include <immintrin.h>

#include <cstring>

#include "qt_kernels.h"

namespace qt {

static inline int32_t narrow_word(const void* p) {
    int32_t v;
    std::memcpy(&v, p, 4);
    return v;
}

// Lanes [0, n) of 8 as a maskstore mask.
static inline __m256i narrow_mask(int64_t n) {
    const __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)), idx);
}

#if defined(QT_NARROW_VNNI)

int64_t narrow_prepare_vnni(const int8_t* B, int64_t groups, int64_t OCg, int64_t Kp,
                            int64_t group_stride, void* out) {
    return narrow_prepare_portable(B, groups, OCg, Kp, group_stride, out);
}

void narrow_vnni(const void* prepared, int64_t rows, int64_t groups, int64_t OCg, int64_t Kp,
                 const uint8_t* col, int64_t lda, int32_t* acc) {
    const int8_t* w = static_cast<const int8_t*>(prepared);
    const int64_t blocks = (OCg + 7) / 8, kq = Kp / 4, N = groups * OCg;
    for (int64_t g = 0; g < groups; ++g)
        for (int64_t b = 0; b < blocks; ++b) {
            const int8_t* wb = w + (g * blocks + b) * kq * 32;
            const int64_t lanes = OCg - b * 8 < 8 ? OCg - b * 8 : 8;
            const __m256i mask = narrow_mask(lanes);
            for (int64_t r0 = 0; r0 < rows; r0 += 4) {
                const int64_t nr = rows - r0 < 4 ? rows - r0 : 4;
                const uint8_t* p[4];
                for (int64_t i = 0; i < 4; ++i)
                    p[i] = col + (r0 + (i < nr ? i : 0)) * lda + g * Kp;
                __m256i s0 = _mm256_setzero_si256(), s1 = s0, s2 = s0, s3 = s0;
                for (int64_t k = 0; k < kq; ++k) {
                    const __m256i wk =
                        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + k * 32));
                    s0 = _mm256_dpbusd_epi32(s0, _mm256_set1_epi32(narrow_word(p[0] + 4 * k)), wk);
                    s1 = _mm256_dpbusd_epi32(s1, _mm256_set1_epi32(narrow_word(p[1] + 4 * k)), wk);
                    s2 = _mm256_dpbusd_epi32(s2, _mm256_set1_epi32(narrow_word(p[2] + 4 * k)), wk);
                    s3 = _mm256_dpbusd_epi32(s3, _mm256_set1_epi32(narrow_word(p[3] + 4 * k)), wk);
                }
                const __m256i s[4] = {s0, s1, s2, s3};
                for (int64_t i = 0; i < nr; ++i)
                    _mm256_maskstore_epi32(acc + (r0 + i) * N + g * OCg + b * 8, mask, s[i]);
            }
        }
}

#else

// Per group and block of 8 channels, Kp / 2 rows of [8 lanes][2 k] int16: what vpmaddwd
// multiplies with a broadcast pair of inputs.
int64_t narrow_prepare_avx2(const int8_t* B, int64_t groups, int64_t OCg, int64_t Kp,
                            int64_t group_stride, void* out) {
    const int64_t blocks = (OCg + 7) / 8, k2 = Kp / 2;
    const int64_t bytes = groups * blocks * k2 * 16 * 2;
    if (!out) return bytes;
    int16_t* w = static_cast<int16_t*>(out);
    std::memset(w, 0, static_cast<size_t>(bytes));
    for (int64_t g = 0; g < groups; ++g)
        for (int64_t o = 0; o < OCg; ++o)
            for (int64_t k = 0; k < Kp; ++k)
                w[((g * blocks + o / 8) * k2 + k / 2) * 16 + (o % 8) * 2 + k % 2] =
                    B[g * group_stride + (k / 4) * 64 + o * 4 + k % 4];
    return bytes;
}

void narrow_avx2(const void* prepared, int64_t rows, int64_t groups, int64_t OCg, int64_t Kp,
                 const uint8_t* col, int64_t lda, int32_t* acc) {
    const int16_t* w = static_cast<const int16_t*>(prepared);
    const int64_t blocks = (OCg + 7) / 8, k2 = Kp / 2, N = groups * OCg;
    // four rows of one group's Kp inputs widened to int16 (Kp <= 2^16 in practice; chunks)
    int16_t wide[4][512];
    for (int64_t g = 0; g < groups; ++g)
        for (int64_t r0 = 0; r0 < rows; r0 += 4) {
            const int64_t nr = rows - r0 < 4 ? rows - r0 : 4;
            for (int64_t b = 0; b < blocks; ++b) {
                const int16_t* wb = w + (g * blocks + b) * k2 * 16;
                const __m256i mask = narrow_mask(OCg - b * 8 < 8 ? OCg - b * 8 : 8);
                __m256i s[4] = {_mm256_setzero_si256(), _mm256_setzero_si256(),
                                _mm256_setzero_si256(), _mm256_setzero_si256()};
                for (int64_t c0 = 0; c0 < Kp; c0 += 512) {  // Kp is a multiple of 4
                    const int64_t len = Kp - c0 < 512 ? Kp - c0 : 512;
                    for (int64_t i = 0; i < 4; ++i) {
                        const uint8_t* a = col + (r0 + (i < nr ? i : 0)) * lda + g * Kp + c0;
                        int64_t k = 0;
                        for (; k + 16 <= len; k += 16)
                            _mm256_storeu_si256(
                                reinterpret_cast<__m256i*>(wide[i] + k),
                                _mm256_cvtepu8_epi16(
                                    _mm_loadu_si128(reinterpret_cast<const __m128i*>(a + k))));
                        for (; k < len; ++k) wide[i][k] = a[k];
                    }
                    const int16_t* wc = wb + c0 / 2 * 16;
                    for (int64_t k = 0; k < len / 2; ++k) {
                        const __m256i wk =
                            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wc + k * 16));
                        for (int i = 0; i < 4; ++i)
                            s[i] = _mm256_add_epi32(
                                s[i], _mm256_madd_epi16(
                                          _mm256_set1_epi32(narrow_word(wide[i] + 2 * k)), wk));
                    }
                }
                for (int64_t i = 0; i < nr; ++i)
                    _mm256_maskstore_epi32(acc + (r0 + i) * N + g * OCg + b * 8, mask, s[i]);
            }
        }
}

// epilogue_one over whole rows, 8 channels at a time: the same float operations in the same
// order (mul then add, round to nearest even, zero point, clamp).
void rows_epilogue_avx2(const Epilogue& ep, const int32_t* acc, int64_t rows, int64_t N) {
    if (ep.row_off || ep.accumulate) {
        rows_epilogue_portable(ep, acc, rows, N);
        return;
    }
    for (int64_t r = 0; r < rows; ++r) {
        int64_t n = 0;
        for (; n + 8 <= N; n += 8) {
            const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(acc + r * N + n));
            const __m256i o = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ep.off + n));
            const __m256 v = _mm256_cvtepi32_ps(_mm256_add_epi32(a, o));
            if (ep.mult) {
                __m256 q = _mm256_add_ps(_mm256_mul_ps(v, _mm256_loadu_ps(ep.mult + n)),
                                         _mm256_loadu_ps(ep.add + n));
                q = _mm256_round_ps(q, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
                q = _mm256_add_ps(q, _mm256_set1_ps(ep.zero_point));
                q = _mm256_min_ps(_mm256_max_ps(q, _mm256_set1_ps(ep.qmin)),
                                  _mm256_set1_ps(ep.qmax));
                const __m256i i32 = _mm256_cvtps_epi32(q);
                const __m128i i16 = _mm_packs_epi32(_mm256_castsi256_si128(i32),
                                                    _mm256_extracti128_si256(i32, 1));
                _mm_storel_epi64(reinterpret_cast<__m128i*>(ep.out_q + r * ep.ldc + n),
                                 _mm_packs_epi16(i16, i16));
                continue;
            }
            __m256 y = _mm256_mul_ps(v, _mm256_loadu_ps(ep.scale + n));
            if (ep.bias) y = _mm256_add_ps(y, _mm256_loadu_ps(ep.bias + n));
            if (ep.out_f) {
                _mm256_storeu_ps(ep.out_f + r * ep.ldc + n, y);
                continue;
            }
            for (int64_t l = 0; l < 8; ++l)  // int8 out without mult: as epilogue_one
                epilogue_one(ep, r, n + l, acc[r * N + n + l], 0, false);
        }
        for (; n < N; ++n) epilogue_one(ep, r, n, acc[r * N + n], 0, false);
    }
}

#endif

}  // namespace qt
