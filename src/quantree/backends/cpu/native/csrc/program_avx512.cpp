// AVX-512 rows of two region-program instructions (qt_program.h): LAYER_NORM and the erf /
// tanh GELUs of FLOAT_UNARY. Their portable loops are scalar (the layer norm sums in double,
// the gelu calls libm's erf per element), so a transformer's 128 x 128 layer norms and
// 128 x 512 gelus were left to ATen's vector kernels and every residual add, layer norm and
// gelu of a BERT layer cost one dispatch each. Here they run at ATen's speed inside one call.
//
// Semantics are the portable loops': the layer norm's biased variance by two passes (the mean,
// then the squared deviations), summed in float over 16 lanes (ATen's vectorized float sums
// differ from either by rounding only); the gelu is x / 2 (1 + erf(x / sqrt 2)) with erf a
// rational approximation within 4e-7 (below), and the tanh gelu through qt_vmath.h's tanh
// (absolute error near 1e-7, what the recurrent kernels use).
#include <immintrin.h>

#include <cmath>
#include <cstdint>

#include "qt_vmath.h"

namespace qt::prog {

namespace {

inline __mmask16 lanes(int64_t n) {  // the first min(n, 16) lanes
    return n >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << n) - 1u);
}

// erf(x), float: the rational approximation Eigen and XLA use for float erf, x clamped to
// [-4, 4] (erf is 1 - 1.5e-8 there), an odd polynomial of degree 13 over an even one of
// degree 8; within 4e-7 of erf everywhere (checked against double erf over [-12, 12]).
// Written with intrinsics because the compiler does not vectorize libm's erff; about half
// the operations of an exp-based erff (measured: 16 against 32 us for 65536 gelus).
// A NaN x leaves erf at 1 (the clamp), and the gelu NaN through its factor x.
inline __m512 verf(__m512 x) {
    x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(4.0f)), _mm512_set1_ps(-4.0f));
    const __m512 x2 = _mm512_mul_ps(x, x);
    __m512 p = _mm512_set1_ps(-2.72614225801306e-10f);
    p = _mm512_fmadd_ps(p, x2, _mm512_set1_ps(2.77068142495902e-08f));
    p = _mm512_fmadd_ps(p, x2, _mm512_set1_ps(-2.10102402082508e-06f));
    p = _mm512_fmadd_ps(p, x2, _mm512_set1_ps(-5.69250639462346e-05f));
    p = _mm512_fmadd_ps(p, x2, _mm512_set1_ps(-7.34990630326855e-04f));
    p = _mm512_fmadd_ps(p, x2, _mm512_set1_ps(-2.95459980854025e-03f));
    p = _mm512_fmadd_ps(p, x2, _mm512_set1_ps(-1.60960333262415e-02f));
    p = _mm512_mul_ps(p, x);
    __m512 q = _mm512_set1_ps(-1.45660718464996e-05f);
    q = _mm512_fmadd_ps(q, x2, _mm512_set1_ps(-2.13374055278905e-04f));
    q = _mm512_fmadd_ps(q, x2, _mm512_set1_ps(-1.68282697438203e-03f));
    q = _mm512_fmadd_ps(q, x2, _mm512_set1_ps(-7.37332916720468e-03f));
    q = _mm512_fmadd_ps(q, x2, _mm512_set1_ps(-1.42647390514189e-02f));
    return _mm512_div_ps(p, q);
}

inline __m512 vgelu(__m512 x) {
    const __m512 e = verf(_mm512_mul_ps(x, _mm512_set1_ps(0.70710678118654752f)));
    return _mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(0.5f), x),
                         _mm512_add_ps(_mm512_set1_ps(1.0f), e));
}

inline __m512 vgelu_tanh(__m512 x) {
    const __m512 x3 = _mm512_mul_ps(_mm512_mul_ps(x, x), x);
    const __m512 inner = _mm512_mul_ps(
        _mm512_set1_ps(0.79788456080286536f),
        _mm512_fmadd_ps(_mm512_set1_ps(0.044715f), x3, x));
    return _mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(0.5f), x),
                         _mm512_add_ps(_mm512_set1_ps(1.0f), qt::vtanh(inner)));
}

}  // namespace

void layer_norm_rows_avx512(const float* a, int64_t lda, float* out, int64_t ldo, int64_t rows,
                            int64_t n, const float* w, const float* b, float eps) {
    const __m512 zero = _mm512_setzero_ps();
    for (int64_t r = 0; r < rows; ++r) {
        const float* x = a + r * lda;
        float* y = out + r * ldo;
        __m512 s0 = zero, s1 = zero;
        int64_t j = 0;
        for (; j + 32 <= n; j += 32) {
            s0 = _mm512_add_ps(s0, _mm512_loadu_ps(x + j));
            s1 = _mm512_add_ps(s1, _mm512_loadu_ps(x + j + 16));
        }
        for (; j < n; j += 16) s0 = _mm512_add_ps(s0, _mm512_maskz_loadu_ps(lanes(n - j), x + j));
        const float mean = _mm512_reduce_add_ps(_mm512_add_ps(s0, s1)) / static_cast<float>(n);
        const __m512 m = _mm512_set1_ps(mean);
        s0 = zero;
        s1 = zero;
        for (j = 0; j + 32 <= n; j += 32) {
            const __m512 d0 = _mm512_sub_ps(_mm512_loadu_ps(x + j), m);
            const __m512 d1 = _mm512_sub_ps(_mm512_loadu_ps(x + j + 16), m);
            s0 = _mm512_fmadd_ps(d0, d0, s0);
            s1 = _mm512_fmadd_ps(d1, d1, s1);
        }
        for (; j < n; j += 16) {
            const __mmask16 k = lanes(n - j);
            const __m512 d = _mm512_maskz_sub_ps(k, _mm512_maskz_loadu_ps(k, x + j), m);
            s0 = _mm512_fmadd_ps(d, d, s0);
        }
        const float var = _mm512_reduce_add_ps(_mm512_add_ps(s0, s1)) / static_cast<float>(n);
        const __m512 rstd = _mm512_set1_ps(1.0f / std::sqrt(var + eps));
        for (j = 0; j < n; j += 16) {
            const __mmask16 k = lanes(n - j);
            __m512 v = _mm512_mul_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, x + j), m), rstd);
            if (w) v = _mm512_mul_ps(v, _mm512_maskz_loadu_ps(k, w + j));
            if (b) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(k, b + j));
            _mm512_mask_storeu_ps(y + j, k, v);
        }
    }
}

void gelu_rows_avx512(int64_t kind, const float* a, int64_t lda, float* out, int64_t ldo,
                      int64_t rows, int64_t n) {
    for (int64_t r = 0; r < rows; ++r) {
        const float* x = a + r * lda;
        float* y = out + r * ldo;
        for (int64_t j = 0; j < n; j += 16) {
            const __mmask16 k = lanes(n - j);
            const __m512 v = _mm512_maskz_loadu_ps(k, x + j);
            _mm512_mask_storeu_ps(y + j, k, kind == 3 ? vgelu(v) : vgelu_tanh(v));
        }
    }
}

}  // namespace qt::prog
