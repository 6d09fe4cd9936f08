// The portable GEMM of x86-64: SSE2, which every x86-64 CPU has, so it needs no cpuid check
// and is what a CPU without AVX2 runs. `pmaddwd` multiplies 8 int16 pairs and adds them in
// pairs into int32, exact for u8 activations (x + 128) and s8 weights alike, 8 multiply-adds
// per instruction against the scalar loop's one.
//
// Same structure as the AVX2 path, 128 bits wide: 4 columns of the packed B are widened to
// int16 once per panel of rows ([kq][4][4]: two registers per 4 k, columns 0-1 and 2-3);
// tiles of up to 4 rows x 4 columns keep 8 accumulators (two partial sums per column) in
// registers; the epilogue is epilogue_one's arithmetic, 4 lanes at a time (SSE2 has no
// round instruction: cvtps2dq rounds to nearest even, as nearbyintf does, on values first
// clamped to +-2^22, beyond which a float is an integer already and the clamp to int8
// decides alone).
#if defined(__SSE2__) && defined(__x86_64__)
#include <emmintrin.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>

#include "qt_kernels.h"

namespace qt {
namespace {

// Rows of uint8 (stride lda) -> int16 with each group of 4 k written twice ([a0..a3 a0..a3]):
// a tile then loads the broadcast it multiplies, where SSE2 would need a shuffle per row.
void widen_rows_dup(const uint8_t* A, int64_t M, int64_t Kp, int64_t lda, int16_t* out) {
    const __m128i zero = _mm_setzero_si128();
    for (int64_t r = 0; r < M; ++r) {
        const uint8_t* src = A + r * lda;
        int16_t* dst = out + r * 2 * Kp;
        for (int64_t k = 0; k < Kp; k += 4) {
            uint32_t four;
            std::memcpy(&four, src + k, 4);
            const __m128i v = _mm_unpacklo_epi8(_mm_cvtsi32_si128(static_cast<int>(four)), zero);
            _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 2 * k), _mm_unpacklo_epi64(v, v));
        }
    }
}

// Columns 4 n4 .. 4 n4 + 3 of the packed B -> bw [kq][4][4] int16.
void widen_panel(const int8_t* B, int64_t kq, int64_t n4, int16_t* bw) {
    const int8_t* src = B + (n4 >> 2) * kq * 64 + (n4 & 3) * 16;
    for (int64_t k = 0; k < kq; ++k) {
        const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 64 * k));
        // sign extension: interleave with the sign mask
        const __m128i s = _mm_cmpgt_epi8(_mm_setzero_si128(), v);
        _mm_store_si128(reinterpret_cast<__m128i*>(bw + 16 * k), _mm_unpacklo_epi8(v, s));
        _mm_store_si128(reinterpret_cast<__m128i*>(bw + 16 * k + 8), _mm_unpackhi_epi8(v, s));
    }
}

// Two partial sums per column, columns 0-1 (p) and 2-3 (q) -> the 4 column sums in order.
inline __m128i fold(__m128i p, __m128i q) {
    const __m128 a = _mm_castsi128_ps(p), b = _mm_castsi128_ps(q);
    return _mm_add_epi32(_mm_castps_si128(_mm_shuffle_ps(a, b, 0x88)),
                         _mm_castps_si128(_mm_shuffle_ps(a, b, 0xDD)));
}

// MR (1..4) duplicated rows a[i] against a widened panel: the 4 column sums of row i in s[i].
template <int MR>
void tile4(const int16_t* const* a, const int16_t* bw, int64_t kq, __m128i* s) {
    static_assert(MR <= 4, "8 accumulators: more spill (SSE2 has 16 registers, two-operand)");
    __m128i x0 = _mm_setzero_si128(), x1 = x0, x2 = x0, x3 = x0, x4 = x0, x5 = x0;
    __m128i x6 = x0, x7 = x0;
    const int16_t* p0 = a[0];
    const int16_t* p1 = a[MR > 1 ? 1 : 0];
    const int16_t* p2 = a[MR > 2 ? 2 : 0];
    const int16_t* p3 = a[MR > 3 ? 3 : 0];
    for (int64_t k = 0; k < kq; ++k) {
        const __m128i b0 = _mm_load_si128(reinterpret_cast<const __m128i*>(bw + 16 * k));
        const __m128i b1 = _mm_load_si128(reinterpret_cast<const __m128i*>(bw + 16 * k + 8));
#define QT_ROW(i, p, u, v)                                                                 \
    if constexpr (MR > i) {                                                                \
        const __m128i av = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8 * k)); \
        u = _mm_add_epi32(u, _mm_madd_epi16(av, b0));                                      \
        v = _mm_add_epi32(v, _mm_madd_epi16(av, b1));                                      \
    }
        QT_ROW(0, p0, x0, x1)
        QT_ROW(1, p1, x2, x3)
        QT_ROW(2, p2, x4, x5)
        QT_ROW(3, p3, x6, x7)
#undef QT_ROW
    }
    s[0] = fold(x0, x1);
    if constexpr (MR > 1) s[1] = fold(x2, x3);
    if constexpr (MR > 2) s[2] = fold(x4, x5);
    if constexpr (MR > 3) s[3] = fold(x6, x7);
}

void tile4_n(int n, const int16_t* const* a, const int16_t* bw, int64_t kq, __m128i* s) {
    switch (n) {
        case 4: tile4<4>(a, bw, kq, s); break;
        case 3: tile4<3>(a, bw, kq, s); break;
        case 2: tile4<2>(a, bw, kq, s); break;
        default: tile4<1>(a, bw, kq, s); break;
    }
}

// round(v) for |v| < 2^22 exactly as nearbyintf; larger |v| come out as +-2^22, which the
// int8 clamp maps where v itself would go.
inline __m128 round4(__m128 v) {
    const __m128 big = _mm_set1_ps(4194304.0f);
    v = _mm_min_ps(_mm_max_ps(v, _mm_sub_ps(_mm_setzero_ps(), big)), big);
    return _mm_cvtepi32_ps(_mm_cvtps_epi32(v));
}

inline void store4_bytes(int8_t* p, __m128 q, int64_t cnt) {
    const __m128i w = _mm_packs_epi32(_mm_cvttps_epi32(q), _mm_setzero_si128());
    const int32_t b = _mm_cvtsi128_si32(_mm_packs_epi16(w, w));
    std::memcpy(p, &b, static_cast<size_t>(cnt));
}

// epilogue_one for columns n0 .. n0 + cnt - 1 (cnt <= 4) of one row, 4 lanes at a time.
void epilogue4(const Epilogue& ep, int64_t row, int64_t n0, int64_t cnt, __m128i acc,
               const __m128i* lo) {
    if (cnt < 4) {
        alignas(16) int32_t a[4], b[4] = {};
        _mm_store_si128(reinterpret_cast<__m128i*>(a), acc);
        if (lo) _mm_store_si128(reinterpret_cast<__m128i*>(b), *lo);
        for (int64_t i = 0; i < cnt; ++i) epilogue_one(ep, row, n0 + i, a[i], b[i], lo != nullptr);
        return;
    }
    if (ep.row_off) acc = _mm_add_epi32(acc, _mm_set1_epi32(ep.row_off[row]));
    __m128 v = _mm_cvtepi32_ps(
        _mm_add_epi32(acc, _mm_loadu_si128(reinterpret_cast<const __m128i*>(ep.off + n0))));
    if (lo) v = _mm_add_ps(_mm_mul_ps(v, _mm_set1_ps(256.0f)), _mm_cvtepi32_ps(*lo));
    const __m128 qmin = _mm_set1_ps(ep.qmin), qmax = _mm_set1_ps(ep.qmax);
    if (ep.mult) {  // mul then add, as the reference rounds
        __m128 q = _mm_add_ps(_mm_mul_ps(v, _mm_loadu_ps(ep.mult + n0)), _mm_loadu_ps(ep.add + n0));
        q = _mm_add_ps(round4(q), _mm_set1_ps(ep.zero_point));
        store4_bytes(ep.out_q + row * ep.ldc + n0, _mm_min_ps(_mm_max_ps(q, qmin), qmax), 4);
        return;
    }
    __m128 y = _mm_mul_ps(v, _mm_loadu_ps(ep.scale + n0));
    if (ep.bias) y = _mm_add_ps(y, _mm_loadu_ps(ep.bias + n0));
    if (ep.out_f) {
        float* dst = ep.out_f + row * ep.ldc + n0;
        if (ep.accumulate) y = _mm_add_ps(_mm_loadu_ps(dst), y);
        _mm_storeu_ps(dst, y);
        return;
    }
    __m128 q = round4(_mm_mul_ps(y, _mm_set1_ps(ep.inv_scale)));
    q = _mm_add_ps(q, _mm_set1_ps(ep.zero_point));
    store4_bytes(ep.out_q + row * ep.ldc + n0, _mm_min_ps(_mm_max_ps(q, qmin), qmax), 4);
}

}  // namespace

void gemm_sse2(int64_t M, int64_t N, int64_t Kp, const uint8_t* A, int64_t lda, const int8_t* B,
               const Epilogue& ep, const uint8_t* A_lo) {
    const int64_t kq = Kp / 4;
    const bool dual = A_lo != nullptr;
    const size_t plane = static_cast<size_t>(M * Kp * 2);  // a duplicated row is 2 Kp
    int16_t* rows = static_cast<int16_t*>(std::malloc((dual ? 2 : 1) * plane * 2 + 16));
    int16_t* bw = static_cast<int16_t*>(std::aligned_alloc(16, static_cast<size_t>(kq) * 32 + 16));
    if (!rows || !bw) {  // caught at the entry point (QT_CATCH)
        std::free(rows);
        std::free(bw);
        throw std::bad_alloc();
    }
    widen_rows_dup(A, M, Kp, lda, rows);
    if (dual) widen_rows_dup(A_lo, M, Kp, lda, rows + plane);
    // Panels of rows whose operands stay in L2 while every panel of columns passes over them.
    const int64_t panel = std::max<int64_t>(4, (256 * 1024) / (8 * Kp) / 4 * 4);
    const int64_t step = dual ? 2 : 4;  // dual: 2 rows of each plane per tile
    for (int64_t r0 = 0; r0 < M; r0 += panel) {
        const int64_t r1 = r0 + panel < M ? r0 + panel : M;
        for (int64_t n0 = 0; n0 < N; n0 += 4) {
            widen_panel(B, kq, n0 / 4, bw);
            const int64_t cnt = N - n0 < 4 ? N - n0 : 4;
            for (int64_t r = r0; r < r1; r += step) {
                const int m = static_cast<int>(r1 - r < step ? r1 - r : step);
                const int16_t* a[4];
                for (int i = 0; i < m; ++i) {
                    a[i] = rows + (r + i) * 2 * Kp;
                    if (dual) a[m + i] = a[i] + plane;
                }
                __m128i s[4];
                tile4_n(dual ? 2 * m : m, a, bw, kq, s);
                for (int i = 0; i < m; ++i) epilogue4(ep, r + i, n0, cnt, s[i], dual ? &s[m + i] : nullptr);
            }
        }
    }
    std::free(bw);
    std::free(rows);
}

}  // namespace qt
#endif
