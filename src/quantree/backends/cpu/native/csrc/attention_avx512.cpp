// AVX-512 path of qt_attention (attention.cpp): per (batch, head), k is transposed once into
// a [D][Sk rounded up to 16] panel; then blocks of up to six query rows take their scores
// from it (six rows by four vectors of keys: 24 accumulators, one broadcast of q per row and
// four loads per step of d), their softmax in place, and their outputs as the sum of v's
// rows weighted by p (six rows by up to four vectors of v's columns). A compiler does not
// find this blocking from the plain loops, so it is written with intrinsics.
#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <new>

#include "qt_kernels.h"
#include "qt_vmath.h"

namespace qt {

namespace {

inline __mmask16 lanes(int64_t n) {  // the first min(n, 16) lanes
    return n >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << n) - 1u);
}

// s[r][j0 + 16c ...] = q_r . kt[:, j0 + 16c ...] for R rows and NV vectors of keys
template <int R, int NV>
inline void scores(const float* q, int64_t qs, const float* kt, int64_t Skp, int64_t D,
                   int64_t j0, float* s) {
    __m512 acc[R][NV];
    _Pragma("GCC unroll 16")
    for (int r = 0; r < R; ++r)
        _Pragma("GCC unroll 16")
        for (int c = 0; c < NV; ++c) acc[r][c] = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; ++d) {
        const float* kr = kt + d * Skp + j0;
        __m512 b[NV];
        _Pragma("GCC unroll 16")
        for (int c = 0; c < NV; ++c) b[c] = _mm512_loadu_ps(kr + 16 * c);
        _Pragma("GCC unroll 16")
        for (int r = 0; r < R; ++r) {
            const __m512 a = _mm512_set1_ps(q[r * qs + d]);
            _Pragma("GCC unroll 16")
            for (int c = 0; c < NV; ++c) acc[r][c] = _mm512_fmadd_ps(a, b[c], acc[r][c]);
        }
    }
    _Pragma("GCC unroll 16")
    for (int r = 0; r < R; ++r)
        _Pragma("GCC unroll 16")
        for (int c = 0; c < NV; ++c) _mm512_storeu_ps(s + r * Skp + j0 + 16 * c, acc[r][c]);
}

// o_r[d0 + 16c ...] = sum_j p[r][j] v[j][d0 + 16c ...] for R rows and NV vectors of v
template <int R, int NV, bool full>
inline void weighted(const float* p, int64_t Skp, const float* v, int64_t vs, int64_t Sk,
                     int64_t d0, int64_t Dv, float* o, int64_t os) {
    __m512 acc[R][NV];
    __mmask16 mk[NV];
    _Pragma("GCC unroll 16")
    for (int c = 0; c < NV; ++c) mk[c] = lanes(Dv - d0 - 16 * c);
    _Pragma("GCC unroll 16")
    for (int r = 0; r < R; ++r)
        _Pragma("GCC unroll 16")
        for (int c = 0; c < NV; ++c) acc[r][c] = _mm512_setzero_ps();
    for (int64_t j = 0; j < Sk; ++j) {
        const float* vr = v + j * vs + d0;
        __m512 b[NV];
        _Pragma("GCC unroll 16")
        for (int c = 0; c < NV; ++c)
            b[c] = full ? _mm512_loadu_ps(vr + 16 * c) : _mm512_maskz_loadu_ps(mk[c], vr + 16 * c);
        _Pragma("GCC unroll 16")
        for (int r = 0; r < R; ++r) {
            const __m512 a = _mm512_set1_ps(p[r * Skp + j]);
            _Pragma("GCC unroll 16")
            for (int c = 0; c < NV; ++c) acc[r][c] = _mm512_fmadd_ps(a, b[c], acc[r][c]);
        }
    }
    _Pragma("GCC unroll 16")
    for (int r = 0; r < R; ++r)
        _Pragma("GCC unroll 16")
        for (int c = 0; c < NV; ++c)
            _mm512_mask_storeu_ps(o + r * os + d0 + 16 * c, mk[c], acc[r][c]);
}

template <int R>
void scores_rows(const float* q, int64_t qs, const float* kt, int64_t Skp, int64_t D, float* s) {
    int64_t j = 0;
    for (; j + 64 <= Skp; j += 64) scores<R, 4>(q, qs, kt, Skp, D, j, s);
    switch ((Skp - j) / 16) {
        case 3: scores<R, 3>(q, qs, kt, Skp, D, j, s); break;
        case 2: scores<R, 2>(q, qs, kt, Skp, D, j, s); break;
        case 1: scores<R, 1>(q, qs, kt, Skp, D, j, s); break;
        default: break;
    }
}

template <int R>
void weighted_rows(const float* p, int64_t Skp, const float* v, int64_t vs, int64_t Sk,
                   int64_t Dv, float* o, int64_t os) {
    int64_t d = 0;
    for (; d + 64 <= Dv; d += 64) weighted<R, 4, true>(p, Skp, v, vs, Sk, d, Dv, o, os);
    switch ((Dv - d + 15) / 16) {
        case 3: weighted<R, 3, false>(p, Skp, v, vs, Sk, d, Dv, o, os); break;
        case 2: weighted<R, 2, false>(p, Skp, v, vs, Sk, d, Dv, o, os); break;
        case 1: weighted<R, 1, false>(p, Skp, v, vs, Sk, d, Dv, o, os); break;
        default: break;
    }
}

// scale, mask and softmax of one row of scores in place; the padding lanes end at 0.
// Returns false when every score is -inf (the row's output is then NaN, as softmax's is).
bool softmax_row(float* s, int64_t Sk, int64_t Skp, const float* m, float scale) {
    if (Sk == 0) return true;  // no keys: p v sums nothing, the output is 0
    const __m512 sc = _mm512_set1_ps(scale);
    const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    __m512 top = ninf;
    for (int64_t j = 0; j < Skp; j += 16) {
        const __mmask16 k = lanes(Sk - j);
        __m512 x = _mm512_mul_ps(_mm512_loadu_ps(s + j), sc);
        if (m) x = _mm512_add_ps(x, _mm512_maskz_loadu_ps(k, m + j));
        x = _mm512_mask_blend_ps(k, ninf, x);
        _mm512_storeu_ps(s + j, x);
        top = _mm512_max_ps(top, x);
    }
    const float t = _mm512_reduce_max_ps(top);
    if (t == -std::numeric_limits<float>::infinity()) return false;
    const __m512 tv = _mm512_set1_ps(t);
    const __m512 floor = _mm512_set1_ps(-87.0f);  // below: exp under float's normal range
    __m512 sum = _mm512_setzero_ps();
    for (int64_t j = 0; j < Skp; j += 16) {
        const __m512 x = _mm512_sub_ps(_mm512_loadu_ps(s + j), tv);
        const __mmask16 live = _mm512_cmp_ps_mask(x, floor, _CMP_GE_OQ);
        const __m512 e = _mm512_maskz_mov_ps(live, vexp(x));
        _mm512_storeu_ps(s + j, e);
        sum = _mm512_add_ps(sum, e);
    }
    const __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(sum));
    for (int64_t j = 0; j < Skp; j += 16)
        _mm512_storeu_ps(s + j, _mm512_mul_ps(_mm512_loadu_ps(s + j), inv));
    return true;
}

template <int R>
void block(const AttentionArgs& a, const float* q, const float* kt, int64_t Skp, const float* v,
           const float* m, float* o, float* s) {
    scores_rows<R>(q, a.qs[2], kt, Skp, a.D, s);
    bool dead[R];
    _Pragma("GCC unroll 16")
    for (int r = 0; r < R; ++r)
        dead[r] = !softmax_row(s + r * Skp, a.Sk, Skp, m ? m + r * a.ms[2] : nullptr, a.scale);
    weighted_rows<R>(s, Skp, v, a.vs[2], a.Sk, a.Dv, o, a.os[2]);
    _Pragma("GCC unroll 16")
    for (int r = 0; r < R; ++r)
        if (dead[r])
            for (int64_t d = 0; d < a.Dv; ++d)
                o[r * a.os[2] + d] = std::numeric_limits<float>::quiet_NaN();
}

// A grown-only float buffer of internal linkage: a std::vector<float> here would emit weak
// (COMDAT) copies of its members compiled for AVX-512, which the linker may pick for the
// portable objects that use the same members (test_kernel_check.py refuses any shared).
struct Work {
    float* data = nullptr;
    size_t size = 0;
    Work() = default;
    Work(const Work&) = delete;
    Work& operator=(const Work&) = delete;
    ~Work() { std::free(data); }
    float* get(size_t need) {
        if (size < need) {
            float* grown = static_cast<float*>(std::malloc(need * sizeof(float)));
            if (!grown) throw std::bad_alloc();  // caught at the entry point (QT_CATCH)
            std::free(data);
            data = grown;
            size = need;
        }
        return data;
    }
};

}  // namespace

void attention_avx512(const AttentionArgs& a) {
    const int64_t Skp = (a.Sk + 15) / 16 * 16;
    thread_local Work work;
    float* kt = work.get(static_cast<size_t>(a.D * Skp + 6 * Skp + 16));
    float* s = kt + a.D * Skp;
    for (int64_t b = 0; b < a.B; ++b)
        for (int64_t h = 0; h < a.H; ++h) {
            const float* k = a.k + b * a.ks[0] + h * a.ks[1];
            for (int64_t d = 0; d < a.D; ++d) {
                float* row = kt + d * Skp;
                for (int64_t j = 0; j < a.Sk; ++j) row[j] = k[j * a.ks[2] + d];
                for (int64_t j = a.Sk; j < Skp; ++j) row[j] = 0.0f;
            }
            const float* q = a.q + b * a.qs[0] + h * a.qs[1];
            const float* v = a.v + b * a.vs[0] + h * a.vs[1];
            const float* m = a.mask ? a.mask + b * a.ms[0] + h * a.ms[1] : nullptr;
            float* o = a.out + b * a.os[0] + h * a.os[1];
            int64_t i = 0;
            for (; i + 6 <= a.Sq; i += 6)
                block<6>(a, q + i * a.qs[2], kt, Skp, v, m ? m + i * a.ms[2] : nullptr,
                         o + i * a.os[2], s);
            const float* mi = m ? m + i * a.ms[2] : nullptr;
            switch (a.Sq - i) {
                case 5: block<5>(a, q + i * a.qs[2], kt, Skp, v, mi, o + i * a.os[2], s); break;
                case 4: block<4>(a, q + i * a.qs[2], kt, Skp, v, mi, o + i * a.os[2], s); break;
                case 3: block<3>(a, q + i * a.qs[2], kt, Skp, v, mi, o + i * a.os[2], s); break;
                case 2: block<2>(a, q + i * a.qs[2], kt, Skp, v, mi, o + i * a.os[2], s); break;
                case 1: block<1>(a, q + i * a.qs[2], kt, Skp, v, mi, o + i * a.os[2], s); break;
                default: break;
            }
        }
}

}  // namespace qt
