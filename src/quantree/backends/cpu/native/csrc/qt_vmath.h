// Vectorized float exp / sigmoid / tanh shared by the recurrent kernels (AVX-512 only).
//
// exp is a degree-6 polynomial on a Cody-Waite reduced argument (about 1 ulp on the range
// the gates use); tanh is 2 sigmoid(2x) - 1, so its absolute error stays near 1e-7.
#pragma once
#if defined(__AVX512F__)
#include <immintrin.h>

namespace qt {

static inline __m512 vexp(__m512 x) {
    x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.0f)), _mm512_set1_ps(-88.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187045e-06f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, n);
}
static inline __m512 vsig(__m512 x) {
    const __m512 one = _mm512_set1_ps(1.0f);
    return _mm512_div_ps(one, _mm512_add_ps(one, vexp(_mm512_sub_ps(_mm512_setzero_ps(), x))));
}
static inline __m512 vtanh(__m512 x) {
    const __m512 s = vsig(_mm512_add_ps(x, x));
    return _mm512_sub_ps(_mm512_add_ps(s, s), _mm512_set1_ps(1.0f));
}

}  // namespace qt
#endif
