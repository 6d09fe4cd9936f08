// The int16-weight 1-d convolution's AVX2 panel (conv1d_w16.cpp), compiled with
// -march=x86-64-v3: per 8 output positions and up to 4 output channels, vpmaddwd of each
// input plane's pairs with the broadcast weight pair, summed in int32 over blocks of 128 pairs
// (exact: a pair is under 2^24), then 256 * hi + lo in double, exact as the portable sum.
#include <immintrin.h>

#include <cstring>

#include "qt_kernels.h"

namespace qt {

namespace {

constexpr int64_t BLOCK = 128;  // pairs summed in int32 before the sums move to double

inline __m256i weight_pair(const int16_t* w) {
    int32_t pair;
    std::memcpy(&pair, w, 4);
    return _mm256_set1_epi32(pair);
}

// 256 * hi + lo of 8 int32 lanes, as two vectors of 4 doubles, stored or added to d.
inline void flush(__m256i hi, __m256i lo, double* d, bool first) {
    const __m256d k = _mm256_set1_pd(256.0);
    const __m256d a = _mm256_add_pd(_mm256_mul_pd(_mm256_cvtepi32_pd(_mm256_castsi256_si128(hi)), k),
                                    _mm256_cvtepi32_pd(_mm256_castsi256_si128(lo)));
    const __m256d b =
        _mm256_add_pd(_mm256_mul_pd(_mm256_cvtepi32_pd(_mm256_extracti128_si256(hi, 1)), k),
                      _mm256_cvtepi32_pd(_mm256_extracti128_si256(lo, 1)));
    if (first) {
        _mm256_storeu_pd(d, a);
        _mm256_storeu_pd(d + 4, b);
    } else {
        _mm256_storeu_pd(d, _mm256_add_pd(_mm256_loadu_pd(d), a));
        _mm256_storeu_pd(d + 4, _mm256_add_pd(_mm256_loadu_pd(d + 4), b));
    }
}

template <int NO>
void tile(const int16_t* colh, const int16_t* coll, int64_t R2, int64_t P8, const int16_t* w,
          int64_t Rp, int64_t p, double* dsum) {
    for (int64_t j0 = 0; j0 < R2; j0 += BLOCK) {
        const int64_t j1 = R2 - j0 < BLOCK ? R2 : j0 + BLOCK;
        __m256i ah[NO], al[NO];
        for (int i = 0; i < NO; ++i) ah[i] = al[i] = _mm256_setzero_si256();
        for (int64_t j = j0; j < j1; ++j) {
            const __m256i xh =
                _mm256_loadu_si256(reinterpret_cast<const __m256i*>(colh + (j * P8 + p) * 2));
            const __m256i xl =
                _mm256_loadu_si256(reinterpret_cast<const __m256i*>(coll + (j * P8 + p) * 2));
            for (int i = 0; i < NO; ++i) {
                const __m256i b = weight_pair(w + i * Rp + 2 * j);
                ah[i] = _mm256_add_epi32(ah[i], _mm256_madd_epi16(xh, b));
                al[i] = _mm256_add_epi32(al[i], _mm256_madd_epi16(xl, b));
            }
        }
        for (int i = 0; i < NO; ++i) flush(ah[i], al[i], dsum + i * P8 + p, j0 == 0);
    }
}

}  // namespace

void w16_panel_avx2(const int16_t* colh, const int16_t* coll, int64_t R2, int64_t P8,
                    const int16_t* w, int64_t Rp, int64_t nO, double* dsum) {
    if (R2 <= 0) {
        for (int64_t i = 0; i < nO * P8; ++i) dsum[i] = 0.0;
        return;
    }
    for (int64_t o = 0; o < nO; o += 4) {
        const int64_t left = nO - o;
        const int16_t* wo = w + o * Rp;
        double* d = dsum + o * P8;
        for (int64_t p = 0; p < P8; p += 8) {
            if (left >= 4)
                tile<4>(colh, coll, R2, P8, wo, Rp, p, d);
            else if (left == 3)
                tile<3>(colh, coll, R2, P8, wo, Rp, p, d);
            else if (left == 2)
                tile<2>(colh, coll, R2, P8, wo, Rp, p, d);
            else
                tile<1>(colh, coll, R2, P8, wo, Rp, p, d);
        }
    }
}

}  // namespace qt
