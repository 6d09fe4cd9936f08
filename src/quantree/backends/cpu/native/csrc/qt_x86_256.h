// 256-bit helpers shared by the AVX2 and AVX-VNNI paths (and the EVEX twin of the latter):
// the GEMM epilogue of 8 columns and the float exp / sigmoid / tanh of 8 lanes. Every
// function is static: each ISA file gets its own copy, compiled with its own flags.
//
// The arithmetic is step for step that of the AVX-512 path (qt_vmath.h, isa_avx512.cpp)
// and of qt::epilogue_one, so all paths give the same bits.
#pragma once
#include <immintrin.h>

#include <cstring>

#include "qt_kernels.h"

namespace qt {
namespace x86_256 {

static inline __m256i lane_mask(int64_t cnt) {
    const __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(cnt)), idx);
}
static inline __m256 load8(const float* p, int64_t cnt) {
    return cnt >= 8 ? _mm256_loadu_ps(p) : _mm256_maskload_ps(p, lane_mask(cnt));
}
static inline void store8(float* p, __m256 v, int64_t cnt) {
    if (cnt >= 8)
        _mm256_storeu_ps(p, v);
    else
        _mm256_maskstore_ps(p, lane_mask(cnt), v);
}
// 8 int32 lanes already in [0, 255] (unsigned) or [-128, 127] (signed) -> bytes.
static inline void store8_bytes(void* p, __m256i v, int64_t cnt, bool is_signed) {
    const __m128i lo = _mm256_castsi256_si128(v), hi = _mm256_extracti128_si256(v, 1);
    const __m128i w = is_signed ? _mm_packs_epi32(lo, hi) : _mm_packus_epi32(lo, hi);
    const __m128i b = is_signed ? _mm_packs_epi16(w, w) : _mm_packus_epi16(w, w);
    if (cnt >= 8) {
        _mm_storel_epi64(static_cast<__m128i*>(p), b);
    } else {
        alignas(16) uint8_t tmp[16];
        _mm_store_si128(reinterpret_cast<__m128i*>(tmp), b);
        std::memcpy(p, tmp, static_cast<size_t>(cnt));
    }
}
static inline __m256 round8(__m256 v) {
    return _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
static inline __m256 clamp8(__m256 v, float lo, float hi) {
    return _mm256_min_ps(_mm256_max_ps(v, _mm256_set1_ps(lo)), _mm256_set1_ps(hi));
}

// Columns n0 .. n0 + cnt - 1 of one row: acc (and acc2, the low plane, when lo is set) are
// the int32 dot products. A partial group of columns goes through the scalar epilogue.
static inline void epilogue8(const Epilogue& ep, int64_t row, int64_t n0, int64_t cnt,
                             __m256i acc, const __m256i* lo) {
    if (cnt < 8) {
        alignas(32) int32_t a[8], b[8] = {};
        _mm256_store_si256(reinterpret_cast<__m256i*>(a), acc);
        if (lo) _mm256_store_si256(reinterpret_cast<__m256i*>(b), *lo);
        for (int64_t i = 0; i < cnt; ++i) epilogue_one(ep, row, n0 + i, a[i], b[i], lo != nullptr);
        return;
    }
    if (ep.row_off) acc = _mm256_add_epi32(acc, _mm256_set1_epi32(ep.row_off[row]));
    __m256 v = _mm256_cvtepi32_ps(_mm256_add_epi32(
        acc, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ep.off + n0))));
    if (lo) v = _mm256_fmadd_ps(v, _mm256_set1_ps(256.0f), _mm256_cvtepi32_ps(*lo));
    if (ep.mult) {  // mul then add, as the reference rounds
        __m256 q = _mm256_add_ps(_mm256_mul_ps(v, _mm256_loadu_ps(ep.mult + n0)),
                                 _mm256_loadu_ps(ep.add + n0));
        q = _mm256_add_ps(round8(q), _mm256_set1_ps(ep.zero_point));
        q = clamp8(q, ep.qmin, ep.qmax);
        store8_bytes(ep.out_q + row * ep.ldc + n0, _mm256_cvtps_epi32(q), 8, true);
        return;
    }
    __m256 y = _mm256_mul_ps(v, _mm256_loadu_ps(ep.scale + n0));
    if (ep.bias) y = _mm256_add_ps(y, _mm256_loadu_ps(ep.bias + n0));
    if (ep.out_f) {
        float* dst = ep.out_f + row * ep.ldc + n0;
        if (ep.accumulate) y = _mm256_add_ps(y, _mm256_loadu_ps(dst));
        _mm256_storeu_ps(dst, y);
        return;
    }
    __m256 q = round8(_mm256_mul_ps(y, _mm256_set1_ps(ep.inv_scale)));
    q = clamp8(_mm256_add_ps(q, _mm256_set1_ps(ep.zero_point)), ep.qmin, ep.qmax);
    store8_bytes(ep.out_q + row * ep.ldc + n0, _mm256_cvtps_epi32(q), 8, true);
}

// exp as in qt_vmath.h, for vsig / vtanh only. scalef(p, n) is p * 2^n rounded once, and so
// is p times 2^n built in the exponent bits, which needs n >= -126: the low clamp is -87
// (n >= -126), not -88. Below -87 exp is < 2^-125, so 1 + exp(x), all that vsig reads, is 1
// either way: sigmoid and tanh keep their bits (checked on every float with |x| in [32, 256)
// and every 16th below, 189 M inputs), with 5 instructions fewer per call than the two-factor
// scaling this replaced (10% of an LSTM step's gate math).
static inline __m256 vexp(__m256 x) {
    x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(88.0f)), _mm256_set1_ps(-87.0f));
    const __m256 n = round8(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896f)));
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428606765330187045e-06f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i ni = _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127));
    return _mm256_mul_ps(p, _mm256_castsi256_ps(_mm256_slli_epi32(ni, 23)));
}
static inline __m256 vsig(__m256 x) {
    const __m256 one = _mm256_set1_ps(1.0f);
    return _mm256_div_ps(one, _mm256_add_ps(one, vexp(_mm256_sub_ps(_mm256_setzero_ps(), x))));
}
static inline __m256 vtanh(__m256 x) {
    const __m256 s = vsig(_mm256_add_ps(x, x));
    return _mm256_sub_ps(_mm256_add_ps(s, s), _mm256_set1_ps(1.0f));
}

// N sigmoids in place, each with exactly vsig's instructions (so the same bits), the N
// chains interleaved step by step. One sigmoid is a chain of ~25 dependent instructions
// (~70 cycles); written one after another, the waiting instructions of one or two chains
// fill the FP scheduler and the core runs at about one instruction per cycle (the LSTM gate
// math: ~90 cycles per 8 cells for ~130 instructions). Interleaved, N chains advance
// together. vtanh(x) is 2 vsig(2x) - 1: the caller doubles and finishes.
template <int N>
static inline void vsig_n(__m256* v) {
    const __m256 one = _mm256_set1_ps(1.0f);
    __m256 r[N], p[N], e[N];
    for (int i = 0; i < N; ++i)
        r[i] = _mm256_max_ps(_mm256_min_ps(_mm256_sub_ps(_mm256_setzero_ps(), v[i]),
                                           _mm256_set1_ps(88.0f)),
                             _mm256_set1_ps(-87.0f));
    for (int i = 0; i < N; ++i) {
        p[i] = round8(_mm256_mul_ps(r[i], _mm256_set1_ps(1.44269504088896f)));  // n
        e[i] = _mm256_castsi256_ps(_mm256_slli_epi32(
            _mm256_add_epi32(_mm256_cvtps_epi32(p[i]), _mm256_set1_epi32(127)), 23));
    }
    for (int i = 0; i < N; ++i) r[i] = _mm256_fnmadd_ps(p[i], _mm256_set1_ps(0.693145751953125f), r[i]);
    for (int i = 0; i < N; ++i)
        r[i] = _mm256_fnmadd_ps(p[i], _mm256_set1_ps(1.428606765330187045e-06f), r[i]);
    for (int i = 0; i < N; ++i)
        p[i] = _mm256_fmadd_ps(_mm256_set1_ps(1.9875691500e-4f), r[i], _mm256_set1_ps(1.3981999507e-3f));
    for (int i = 0; i < N; ++i) p[i] = _mm256_fmadd_ps(p[i], r[i], _mm256_set1_ps(8.3334519073e-3f));
    for (int i = 0; i < N; ++i) p[i] = _mm256_fmadd_ps(p[i], r[i], _mm256_set1_ps(4.1665795894e-2f));
    for (int i = 0; i < N; ++i) p[i] = _mm256_fmadd_ps(p[i], r[i], _mm256_set1_ps(1.6666665459e-1f));
    for (int i = 0; i < N; ++i) p[i] = _mm256_fmadd_ps(p[i], r[i], _mm256_set1_ps(5.0000001201e-1f));
    for (int i = 0; i < N; ++i)
        p[i] = _mm256_fmadd_ps(p[i], _mm256_mul_ps(r[i], r[i]), _mm256_add_ps(r[i], one));
    for (int i = 0; i < N; ++i) v[i] = _mm256_div_ps(one, _mm256_add_ps(one, _mm256_mul_ps(p[i], e[i])));
}

// In an unnamed namespace: each ISA file its own copy (see the header), as `static` does for
// the functions.
namespace {

// The epilogue of a full panel (8 columns) with what depends on the column alone loaded once
// per panel, not once per row, and nothing left to decide per row: the common cases, a float
// output (gx / gh of a recurrent step) and an int8 output through mult / add (linear and
// conv). Per row that leaves the arithmetic of epilogue8, in its order, so the same bits; at
// K = 256 the per-row branches and reloads of the general epilogue cost about as much as the
// arithmetic (the GEMM's "rest" in perf). Other cases (row offsets, accumulating, a partial
// panel, int8 through scale) keep epilogue8.
struct PanelEpilogue {
    enum Kind { GENERAL, FLOAT, INT8 } kind = GENERAL;
    __m256i off;
    __m256 a, b;  // scale and bias (FLOAT), mult and add (INT8)
    __m256 zp, qmin, qmax;  // INT8
    bool bias = false;
    // The outputs of row 0 and the row stride: copies, because a store through an int8
    // pointer may alias ep, so the compiler reloaded ep's fields for every row.
    float* out_f = nullptr;
    int8_t* out_q = nullptr;
    int64_t ldc = 0;

    PanelEpilogue(const Epilogue& ep, int64_t n0, int64_t cnt) {
        if (cnt < 8 || ep.row_off || ep.accumulate) return;
        if (!ep.out_f && !ep.mult) return;
        off = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ep.off + n0));
        ldc = ep.ldc;
        if (ep.out_f) {
            kind = FLOAT;
            out_f = ep.out_f + n0;
            a = _mm256_loadu_ps(ep.scale + n0);
            bias = ep.bias != nullptr;
            b = bias ? _mm256_loadu_ps(ep.bias + n0) : _mm256_setzero_ps();
        } else {
            kind = INT8;
            out_q = ep.out_q + n0;
            a = _mm256_loadu_ps(ep.mult + n0);
            b = _mm256_loadu_ps(ep.add + n0);
            zp = _mm256_set1_ps(ep.zero_point);
            qmin = _mm256_set1_ps(ep.qmin);
            qmax = _mm256_set1_ps(ep.qmax);
        }
    }

    // sum: the int32 column sums (joined: already (S >> 8) + 128 sum w); lo: the low plane's
    inline void row(int64_t r, __m256i sum, const __m256i* lo) const {
        __m256 v = _mm256_cvtepi32_ps(_mm256_add_epi32(sum, off));
        if (lo) v = _mm256_fmadd_ps(v, _mm256_set1_ps(256.0f), _mm256_cvtepi32_ps(*lo));
        if (kind == FLOAT) {
            __m256 y = _mm256_mul_ps(v, a);
            if (bias) y = _mm256_add_ps(y, b);
            _mm256_storeu_ps(out_f + r * ldc, y);
            return;
        }
        __m256 q = _mm256_add_ps(_mm256_mul_ps(v, a), b);  // mul then add, as the reference
        q = _mm256_add_ps(round8(q), zp);
        q = _mm256_min_ps(_mm256_max_ps(q, qmin), qmax);  // clamp8
        store8_bytes(out_q + r * ldc, _mm256_cvtps_epi32(q), 8, true);
    }
};

}  // namespace

// erf(x) of 8 lanes: program_avx512.cpp's approximation, constant for constant (the AVX2
// programs' GELU and the norm blocks' read the same).
static inline __m256 verf(__m256 x) {
    x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(4.0f)), _mm256_set1_ps(-4.0f));
    const __m256 x2 = _mm256_mul_ps(x, x);
    __m256 p = _mm256_set1_ps(-2.72614225801306e-10f);
    p = _mm256_fmadd_ps(p, x2, _mm256_set1_ps(2.77068142495902e-08f));
    p = _mm256_fmadd_ps(p, x2, _mm256_set1_ps(-2.10102402082508e-06f));
    p = _mm256_fmadd_ps(p, x2, _mm256_set1_ps(-5.69250639462346e-05f));
    p = _mm256_fmadd_ps(p, x2, _mm256_set1_ps(-7.34990630326855e-04f));
    p = _mm256_fmadd_ps(p, x2, _mm256_set1_ps(-2.95459980854025e-03f));
    p = _mm256_fmadd_ps(p, x2, _mm256_set1_ps(-1.60960333262415e-02f));
    p = _mm256_mul_ps(p, x);
    __m256 q = _mm256_set1_ps(-1.45660718464996e-05f);
    q = _mm256_fmadd_ps(q, x2, _mm256_set1_ps(-2.13374055278905e-04f));
    q = _mm256_fmadd_ps(q, x2, _mm256_set1_ps(-1.68282697438203e-03f));
    q = _mm256_fmadd_ps(q, x2, _mm256_set1_ps(-7.37332916720468e-03f));
    q = _mm256_fmadd_ps(q, x2, _mm256_set1_ps(-1.42647390514189e-02f));
    return _mm256_div_ps(p, q);
}

}  // namespace x86_256
}  // namespace qt
