// AVX2 path of qt_attention (attention.cpp), for x86 CPUs without AVX-512 (AMD Zen 2/3, Intel
// before Ice Lake): the AVX-512 path's blocking (attention_avx512.cpp) at 8 lanes. Per
// (batch, head), k is transposed once into a [D][Sk rounded up to 8] panel; blocks of up to
// four query rows take their scores from it (four rows by three vectors of keys: 12
// accumulators of the 16 registers), their softmax in place, and their outputs as the sum
// of v's rows weighted by p (four rows by up to three vectors of v's columns). The portable
// loop (one row, one key at a time, a scalar dot product) took 2.7 ms of a 128-token,
// 2-head block where this takes a tenth (benchmarks/README.md, branch h-bert26).
#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <new>

#include "qt_kernels.h"
#include "qt_x86_256.h"

namespace qt {

namespace {

using x86_256::load8;
using x86_256::store8;

// s[r][j0 + 8c ...] = q_r . kt[:, j0 + 8c ...] for R rows and NV vectors of keys
template <int R, int NV>
inline void scores(const float* q, int64_t qs, const float* kt, int64_t Skp, int64_t D,
                   int64_t j0, float* s) {
    __m256 acc[R][NV];
    _Pragma("GCC unroll 16")
    for (int r = 0; r < R; ++r)
        _Pragma("GCC unroll 16")
        for (int c = 0; c < NV; ++c) acc[r][c] = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; ++d) {
        const float* kr = kt + d * Skp + j0;
        __m256 b[NV];
        _Pragma("GCC unroll 16")
        for (int c = 0; c < NV; ++c) b[c] = _mm256_loadu_ps(kr + 8 * c);
        _Pragma("GCC unroll 16")
        for (int r = 0; r < R; ++r) {
            const __m256 a = _mm256_set1_ps(q[r * qs + d]);
            _Pragma("GCC unroll 16")
            for (int c = 0; c < NV; ++c) acc[r][c] = _mm256_fmadd_ps(a, b[c], acc[r][c]);
        }
    }
    _Pragma("GCC unroll 16")
    for (int r = 0; r < R; ++r)
        _Pragma("GCC unroll 16")
        for (int c = 0; c < NV; ++c) _mm256_storeu_ps(s + r * Skp + j0 + 8 * c, acc[r][c]);
}

// o_r[d0 + 8c ...] = sum_j p[r][j] v[j][d0 + 8c ...] for R rows and NV vectors of v
template <int R, int NV>
inline void weighted(const float* p, int64_t Skp, const float* v, int64_t vs, int64_t Sk,
                     int64_t d0, int64_t Dv, float* o, int64_t os) {
    __m256 acc[R][NV];
    int64_t cnt[NV];
    _Pragma("GCC unroll 16")
    for (int c = 0; c < NV; ++c) cnt[c] = Dv - d0 - 8 * c;
    _Pragma("GCC unroll 16")
    for (int r = 0; r < R; ++r)
        _Pragma("GCC unroll 16")
        for (int c = 0; c < NV; ++c) acc[r][c] = _mm256_setzero_ps();
    for (int64_t j = 0; j < Sk; ++j) {
        const float* vr = v + j * vs + d0;
        __m256 b[NV];
        _Pragma("GCC unroll 16")
        for (int c = 0; c < NV; ++c) b[c] = load8(vr + 8 * c, cnt[c]);
        _Pragma("GCC unroll 16")
        for (int r = 0; r < R; ++r) {
            const __m256 a = _mm256_set1_ps(p[r * Skp + j]);
            _Pragma("GCC unroll 16")
            for (int c = 0; c < NV; ++c) acc[r][c] = _mm256_fmadd_ps(a, b[c], acc[r][c]);
        }
    }
    _Pragma("GCC unroll 16")
    for (int r = 0; r < R; ++r)
        _Pragma("GCC unroll 16")
        for (int c = 0; c < NV; ++c) store8(o + r * os + d0 + 8 * c, acc[r][c], cnt[c]);
}

template <int R>
void scores_rows(const float* q, int64_t qs, const float* kt, int64_t Skp, int64_t D, float* s) {
    int64_t j = 0;
    for (; j + 24 <= Skp; j += 24) scores<R, 3>(q, qs, kt, Skp, D, j, s);
    switch ((Skp - j) / 8) {
        case 2: scores<R, 2>(q, qs, kt, Skp, D, j, s); break;
        case 1: scores<R, 1>(q, qs, kt, Skp, D, j, s); break;
        default: break;
    }
}

template <int R>
void weighted_rows(const float* p, int64_t Skp, const float* v, int64_t vs, int64_t Sk,
                   int64_t Dv, float* o, int64_t os) {
    int64_t d = 0;
    for (; d + 24 <= Dv; d += 24) weighted<R, 3>(p, Skp, v, vs, Sk, d, Dv, o, os);
    switch ((Dv - d + 7) / 8) {
        case 2: weighted<R, 2>(p, Skp, v, vs, Sk, d, Dv, o, os); break;
        case 1: weighted<R, 1>(p, Skp, v, vs, Sk, d, Dv, o, os); break;
        default: break;
    }
}

inline float hmax(__m256 x) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
    return _mm_cvtss_f32(m);
}

inline float hsum(__m256 x) {
    __m128 m = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    m = _mm_add_ps(m, _mm_movehl_ps(m, m));
    m = _mm_add_ss(m, _mm_shuffle_ps(m, m, 1));
    return _mm_cvtss_f32(m);
}

// scale, mask and softmax of one row of scores in place; the padding lanes end at 0.
// Returns false when every score is -inf (the row's output is then NaN, as softmax's is).
bool softmax_row(float* s, int64_t Sk, int64_t Skp, const float* m, float scale) {
    if (Sk == 0) return true;  // no keys: p v sums nothing, the output is 0
    const __m256 sc = _mm256_set1_ps(scale);
    const __m256 ninf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
    __m256 top = ninf;
    for (int64_t j = 0; j < Skp; j += 8) {
        const __m256 live = _mm256_castsi256_ps(x86_256::lane_mask(Sk - j));
        __m256 x = _mm256_mul_ps(_mm256_loadu_ps(s + j), sc);
        if (m) x = _mm256_add_ps(x, load8(m + j, Sk - j));
        x = _mm256_blendv_ps(ninf, x, live);
        _mm256_storeu_ps(s + j, x);
        top = _mm256_max_ps(top, x);
    }
    const float t = hmax(top);
    if (t == -std::numeric_limits<float>::infinity()) return false;
    const __m256 tv = _mm256_set1_ps(t);
    const __m256 floor = _mm256_set1_ps(-87.0f);  // below: exp under float's normal range
    __m256 sum = _mm256_setzero_ps();
    for (int64_t j = 0; j < Skp; j += 8) {
        const __m256 x = _mm256_sub_ps(_mm256_loadu_ps(s + j), tv);
        const __m256 live = _mm256_cmp_ps(x, floor, _CMP_GE_OQ);
        const __m256 e = _mm256_and_ps(live, x86_256::vexp(x));
        _mm256_storeu_ps(s + j, e);
        sum = _mm256_add_ps(sum, e);
    }
    const __m256 inv = _mm256_set1_ps(1.0f / hsum(sum));
    for (int64_t j = 0; j < Skp; j += 8)
        _mm256_storeu_ps(s + j, _mm256_mul_ps(_mm256_loadu_ps(s + j), inv));
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

// A grown-only float buffer of internal linkage (no std::vector in an ISA file: its weak
// members compiled for AVX2 could be taken for the portable objects').
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

void attention_avx2(const AttentionArgs& a) {
    const int64_t Skp = (a.Sk + 7) / 8 * 8;
    thread_local Work work;
    float* kt = work.get(static_cast<size_t>(a.D * Skp + 4 * Skp + 8));
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
            for (; i + 4 <= a.Sq; i += 4)
                block<4>(a, q + i * a.qs[2], kt, Skp, v, m ? m + i * a.ms[2] : nullptr,
                         o + i * a.os[2], s);
            const float* mi = m ? m + i * a.ms[2] : nullptr;
            switch (a.Sq - i) {
                case 3: block<3>(a, q + i * a.qs[2], kt, Skp, v, mi, o + i * a.os[2], s); break;
                case 2: block<2>(a, q + i * a.qs[2], kt, Skp, v, mi, o + i * a.os[2], s); break;
                case 1: block<1>(a, q + i * a.qs[2], kt, Skp, v, mi, o + i * a.os[2], s); break;
                default: break;
            }
        }
}

}  // namespace qt
