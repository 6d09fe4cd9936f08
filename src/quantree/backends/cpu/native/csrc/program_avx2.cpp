// AVX2 + FMA rows of the same two region-program instructions as program_avx512.cpp
// (qt_program.h): LAYER_NORM and the erf / tanh GELUs of FLOAT_UNARY, 8 lanes. Without them
// an AVX2 CPU left a transformer's large layer norms and gelus to ATen (the scalar loops lose
// to its vector kernels there), so a BERT layer's residual adds, layer norms and gelus cost
// one dispatch each between its programs; with them the AVX2 path forms the programs the
// AVX-512 path does.
//
// Semantics and constants are program_avx512.cpp's: the layer norm's biased variance by two
// passes summed in float (here over 2 x 8 lanes, so sums differ from the AVX-512 rows' and
// ATen's by rounding only), the gelu x / 2 (1 + erf(x / sqrt 2)) with the same rational erf
// (within 4e-7), the tanh gelu through qt_x86_256.h's vtanh (the AVX2 recurrent kernels').
#include <immintrin.h>

#include <cmath>
#include <cstdint>

#include "qt_x86_256.h"

namespace qt::prog {

namespace {

using x86_256::load8;
using x86_256::store8;

float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

using x86_256::verf;

__m256 vgelu(__m256 x) {
    const __m256 e = verf(_mm256_mul_ps(x, _mm256_set1_ps(0.70710678118654752f)));
    return _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(0.5f), x),
                         _mm256_add_ps(_mm256_set1_ps(1.0f), e));
}

__m256 vgelu_tanh(__m256 x) {
    const __m256 x3 = _mm256_mul_ps(_mm256_mul_ps(x, x), x);
    const __m256 inner = _mm256_mul_ps(
        _mm256_set1_ps(0.79788456080286536f),
        _mm256_fmadd_ps(_mm256_set1_ps(0.044715f), x3, x));
    return _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(0.5f), x),
                         _mm256_add_ps(_mm256_set1_ps(1.0f), x86_256::vtanh(inner)));
}

}  // namespace

void layer_norm_rows_avx2(const float* a, int64_t lda, float* out, int64_t ldo, int64_t rows,
                          int64_t n, const float* w, const float* b, float eps) {
    const __m256 zero = _mm256_setzero_ps();
    for (int64_t r = 0; r < rows; ++r) {
        const float* x = a + r * lda;
        float* y = out + r * ldo;
        __m256 s0 = zero, s1 = zero;
        int64_t j = 0;
        for (; j + 16 <= n; j += 16) {
            s0 = _mm256_add_ps(s0, _mm256_loadu_ps(x + j));
            s1 = _mm256_add_ps(s1, _mm256_loadu_ps(x + j + 8));
        }
        for (; j < n; j += 8) s0 = _mm256_add_ps(s0, load8(x + j, n - j));  // masked: zeros
        const float mean = hsum8(_mm256_add_ps(s0, s1)) / static_cast<float>(n);
        const __m256 m = _mm256_set1_ps(mean);
        s0 = zero;
        s1 = zero;
        for (j = 0; j + 16 <= n; j += 16) {
            const __m256 d0 = _mm256_sub_ps(_mm256_loadu_ps(x + j), m);
            const __m256 d1 = _mm256_sub_ps(_mm256_loadu_ps(x + j + 8), m);
            s0 = _mm256_fmadd_ps(d0, d0, s0);
            s1 = _mm256_fmadd_ps(d1, d1, s1);
        }
        for (; j < n; j += 8) {  // the tail's masked lanes: (0 - mean) zeroed before squaring
            const __m256 keep = _mm256_castsi256_ps(x86_256::lane_mask(n - j));
            const __m256 d = _mm256_and_ps(_mm256_sub_ps(load8(x + j, n - j), m), keep);
            s0 = _mm256_fmadd_ps(d, d, s0);
        }
        const float var = hsum8(_mm256_add_ps(s0, s1)) / static_cast<float>(n);
        const __m256 rstd = _mm256_set1_ps(1.0f / std::sqrt(var + eps));
        for (j = 0; j < n; j += 8) {
            const int64_t k = n - j;
            __m256 v = _mm256_mul_ps(_mm256_sub_ps(load8(x + j, k), m), rstd);
            if (w) v = _mm256_mul_ps(v, load8(w + j, k));
            if (b) v = _mm256_add_ps(v, load8(b + j, k));
            store8(y + j, v, k);
        }
    }
}

void gelu_rows_avx2(int64_t kind, const float* a, int64_t lda, float* out, int64_t ldo,
                    int64_t rows, int64_t n) {
    for (int64_t r = 0; r < rows; ++r) {
        const float* x = a + r * lda;
        float* y = out + r * ldo;
        for (int64_t j = 0; j < n; j += 8) {
            const __m256 v = load8(x + j, n - j);
            store8(y + j, kind == 3 ? vgelu(v) : vgelu_tanh(v), n - j);
        }
    }
}

}  // namespace qt::prog
