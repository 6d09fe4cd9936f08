// AVX2 + FMA rows of norm_block.cpp's epilogue (qt_norm_block.h), 8 lanes: the gelu's erf
// is program_avx2.cpp's rational approximation (within 4e-7 of erf), the glu's sigmoid
// qt_x86_256.h's vsig (the recurrent kernels'), so a norm and its activation cost one
// vector pass, as ATen's vector kernels do, instead of a libm call per element.
#include <immintrin.h>

#include <cstdint>

#include "qt_norm_block.h"
#include "qt_x86_256.h"

namespace qt::norm_block {

namespace {

using x86_256::load8;
using x86_256::store8;
using x86_256::verf;


template <int64_t act>
void rows(const Sample& w) {
    const __m256 half = _mm256_set1_ps(0.5f), one = _mm256_set1_ps(1.0f);
    const int64_t n = w.S;
    for (int64_t c = 0; c < w.co; ++c) {
        const float* x = w.x + c * n;
        const float* xg = w.x + (c + w.co) * n;
        const float* r = w.r ? w.r + c * n : nullptr;
        float* out = w.out + c * n;
        const __m256 a = _mm256_set1_ps(w.a[c]), b = _mm256_set1_ps(w.b[c]);
        const int64_t cg = act == GLU ? c + w.co : c;
        const __m256 ag = _mm256_set1_ps(w.a[cg]), bg = _mm256_set1_ps(w.b[cg]);
        const __m256 s = _mm256_set1_ps(w.s ? w.s[c] : 1.0f);
        for (int64_t i = 0; i < n; i += 8) {
            const int64_t k = n - i;
            // x * a + b as two roundings, as the portable loop (built with -ffp-contract=off)
            __m256 v = _mm256_add_ps(_mm256_mul_ps(load8(x + i, k), a), b);
            if constexpr (act == GELU) {
                const __m256 e = verf(_mm256_mul_ps(v, _mm256_set1_ps(0.70710678118654752f)));
                v = _mm256_mul_ps(_mm256_mul_ps(half, v), _mm256_add_ps(one, e));
            } else if constexpr (act == GLU) {
                const __m256 g = _mm256_add_ps(_mm256_mul_ps(load8(xg + i, k), ag), bg);
                v = _mm256_mul_ps(v, x86_256::vsig(g));
            }
            if (w.s) v = _mm256_mul_ps(s, v);
            if (r) v = _mm256_add_ps(load8(r + i, k), v);
            store8(out + i, v, k);
        }
    }
}

}  // namespace

void rows_avx2(int64_t act, const Sample& w) {
    if (act == GELU)
        rows<GELU>(w);
    else if (act == GLU)
        rows<GLU>(w);
    else
        rows<NONE>(w);
}

}  // namespace qt::norm_block
