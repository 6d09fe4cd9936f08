// AVX2 path (x86-64-v3: AVX2 + FMA): GEMM micro-kernels, recurrent gate math and float
// activations, 8 lanes wide. Compiled with -march=x86-64-v3 whatever the rest of the
// library's flags; only reached through qt::kernels when the CPU has AVX2 and FMA.
//
// u8 x s8 products: `vpmaddubsw` adds pairs into int16 and saturates (255 * 127 * 2 >
// 32767), which would break bit equality with the other paths. Instead both operands are
// widened to int16 and `vpmaddwd` adds pairs into int32, exact for every input (a -128
// weight included). Per 32 multiply-adds that is 2 `vpmaddwd` + 2 `vpaddd`, against
// fbgemm's saturating 3 (`vpmaddubsw`, `vpmaddwd` by ones, `vpaddd`) and the exact sign
// trick's 4 (`vpsignb` first), with the same 2 multiplies; measured on Zen 4 the int16 pair
// is the fastest of the three per multiply-add (0.34 / 0.40 / 0.55 ns per 32). What decides
// the speed is then keeping the multiply ports fed: B is widened once per panel of rows
// (not per tile), so the inner loop has no shuffle, and 6 rows x 8 columns keep 12
// accumulators in registers.
//
// Two GEMMs, chosen by the weights: this one for any int8 weight, and isa_avx2_w7.cpp's for
// weights proven within [-63, 63] (Int8Quantizer(reduce_range=True); qt::within7 on the
// packed bytes, Kernels::gemm_w7). For those 7-bit weights `vpmaddubsw` cannot saturate
// (2 x 255 x 63 < 2^15), so fbgemm's 3 instructions are exact there: the same 2 multiplies
// per 32 multiply-adds as here, but both operands read as the packed bytes, with no int16
// copy of A per call nor int16 panels of B (half the bytes through the loads and the cache,
// and no widening pass). Full-range weights never reach it: one `vpmaddubsw` pair would
// saturate and the sums would differ (the kernel check's witness). Figures: benchmarks/
// README.md, "h-u8s8".
#include <immintrin.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>

#include "qt_kernels.h"
#include "qt_x86_256.h"

namespace qt {

using x86_256::epilogue8;
using x86_256::PanelEpilogue;

namespace {

// The 4 activations a[0..3], already int16, repeated 4 times: a load-port broadcast.
inline __m256i bcast4(const int16_t* a) {
    int64_t four;
    std::memcpy(&four, a, 8);
    return _mm256_set1_epi64x(four);
}

// Rows of uint8 (stride lda) -> int16 (stride Kp), once per GEMM call.
void widen_rows(const uint8_t* A, int64_t M, int64_t Kp, int64_t lda, int16_t* out) {
    for (int64_t r = 0; r < M; ++r) {
        int64_t k = 0;
        for (; k + 16 <= Kp; k += 16)
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + r * Kp + k),
                                _mm256_cvtepu8_epi16(_mm_loadu_si128(
                                    reinterpret_cast<const __m128i*>(A + r * lda + k))));
        // the tail in 4s (Kp is a multiple of 4): a short row (a first convolution's K = 28)
        // is mostly tail
        for (; k < Kp; k += 4) {
            int32_t four;
            std::memcpy(&four, A + r * lda + k, 4);
            _mm_storel_epi64(reinterpret_cast<__m128i*>(out + r * Kp + k),
                             _mm_cvtepu8_epi16(_mm_cvtsi32_si128(four)));
        }
    }
}

// acc += madd(a, b). Inline asm keeps each accumulator in its register: with intrinsics,
// GCC 12 moves most of them through the stack every iteration.
inline void madd2(__m256i& acc, __m256i a, __m256i b) {
    __m256i t;
    asm("vpmaddwd %3, %2, %1\n\tvpaddd %1, %0, %0" : "+x"(acc), "=&x"(t) : "x"(a), "x"(b));
}

// Two partial sums per column for columns 0-3 (p) and 4-7 (q) -> the 8 column sums in order.
inline __m256i fold(__m256i p, __m256i q) {
    return _mm256_permute4x64_epi64(_mm256_hadd_epi32(p, q), 0xD8);
}

// The same for a widened panel's accumulators: p holds columns 0, 1, 4, 5 and q 2, 3, 6, 7
// (widen_panel), so the in-lane hadd already gives 0 .. 7.
inline __m256i fold_panel(__m256i p, __m256i q) { return _mm256_hadd_epi32(p, q); }

// ---- the 16-bit operand joined into one -------------------------------------------------
//
// For a 16-bit operand split in two planes (hi, lo) the planes are joined back into
// h = 256 (hi - 128) + lo, one pass instead of two: the exact int32 sum S = sum h w is then
// handed to the epilogue as (S >> 8, S & 255), whose float result is what the two planes
// give whenever both of their sums are exact floats (Kp <= 512, see gemm_avx2);
// |S| < 2^31 needs w > -128 (panels with -128 take the two planes).

// Rows of the two planes -> h = 256 * (hi - 128) + lo (int16), stride Kp.
void join_rows(const uint8_t* hi, const uint8_t* lo, int64_t M, int64_t Kp, int64_t lda,
               int16_t* out) {
    for (int64_t r = 0; r < M; ++r)
        for (int64_t k = 0; k < Kp; ++k)
            out[r * Kp + k] = static_cast<int16_t>(
                (static_cast<int32_t>(hi[r * lda + k]) - 128) * 256 + lo[r * lda + k]);
}

// The epilogue of 8 columns from an int32 sum: plain, or (w128, 128 sum_k w of these
// columns, given) the joined operand: 256 (S >> 8 + 128 sum w) + (S & 255) is
// 256 sum hi w + sum lo w, the two planes' total, split so that both parts are exact floats.
inline void finish16(const Epilogue& ep, int64_t row, int64_t n0, int64_t N, __m256i sum,
                     const __m256i* w128) {
    if (n0 >= N) return;
    const int64_t cnt = N - n0 < 8 ? N - n0 : 8;
    if (!w128) {
        epilogue8(ep, row, n0, cnt, sum, nullptr);
        return;
    }
    const __m256i lo = _mm256_and_si256(sum, _mm256_set1_epi32(255));
    epilogue8(ep, row, n0, cnt, _mm256_add_epi32(_mm256_srai_epi32(sum, 8), *w128), &lo);
}

// ---- GEMV tiles (at most 2 rows): B widened on the fly ----------------------------------
//
// 16 bytes of a packed block (4 columns x 4 k) widen to one register, multiplied by the
// row's 4 activations repeated: two partial sums per column, folded once at the end. With
// SUMS (the joined operand, no pass over B beforehand), 128 sum_k w is accumulated here from
// the widened weights.
template <int MR, bool SUMS = false>
void micro16(const int16_t* A, int64_t lda, const int8_t* B, int64_t kq, int64_t row0,
             int64_t nb, int64_t N, const Epilogue& ep) {
    static_assert(MR <= 2, "a GEMV tile");
    __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;  // row 0, columns by 4
    __m256i b0 = a0, b1 = a0, b2 = a0, b3 = a0;                      // row 1
    __m256i c0 = a0, c1 = a0, c2 = a0, c3 = a0;                      // the column sums
    const __m256i ones = _mm256_set1_epi16(1);
    const int8_t* b = B + nb * kq * 64;
    const int16_t* r0 = A + row0 * lda;
    for (int64_t k = 0; k < kq; ++k) {
        const int8_t* bk = b + k * 64;
#define QT_W16(q) \
    _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bk + 16 * (q))))
#define QT_ROWS(q, x, y, z)                                           \
    {                                                                 \
        const __m256i w = QT_W16(q);                                  \
        madd2(x, bcast4(r0 + 4 * k), w);                              \
        if constexpr (MR >= 2) madd2(y, bcast4(r0 + lda + 4 * k), w); \
        if constexpr (SUMS) madd2(z, ones, w);                        \
    }
        QT_ROWS(0, a0, b0, c0)
        QT_ROWS(1, a1, b1, c1)
        QT_ROWS(2, a2, b2, c2)
        QT_ROWS(3, a3, b3, c3)
#undef QT_ROWS
#undef QT_W16
    }
    __m256i own[2];
    const __m256i* w128 = nullptr;
    if constexpr (SUMS) {
        own[0] = _mm256_slli_epi32(fold(c0, c1), 7);
        own[1] = _mm256_slli_epi32(fold(c2, c3), 7);
        w128 = own;
    }
    const int64_t n0 = nb * 16;
    const __m256i* u = w128 ? w128 + 1 : nullptr;
    finish16(ep, row0, n0, N, fold(a0, a1), w128);
    finish16(ep, row0, n0 + 8, N, fold(a2, a3), u);
    if constexpr (MR >= 2) {
        finish16(ep, row0 + 1, n0, N, fold(b0, b1), w128);
        finish16(ep, row0 + 1, n0 + 8, N, fold(b2, b3), u);
    }
}

// ---- GEMM tiles: up to 6 rows x 8 columns of a widened weight panel --------------------
//
// A panel is 8 columns of B widened to int16 once per pass over the rows ([kq][8][4], two
// registers per 4 k: columns 0, 1, 4, 5 and 2, 3, 6, 7), so the inner loop has no shuffle at
// all: per 4 k, 2 loads of B, one broadcast of 4 activations per row, and 2 `vpmaddwd` + 2
// `vpaddd` per row into 12 accumulators (2 partial sums per column). That column order makes
// one `vphaddd` (which adds within 128-bit lanes) leave the 8 column sums in order: no
// permute per row (fold_panel).

// Facts about one widened panel that the 16-bit operand needs (see gemm_avx2).
struct PanelInfo {
    __m256i w128;     // 128 sum_k w per column
    int32_t abs_max;  // largest sum_k |w| over its columns
    bool has_min;     // holds a -128
};

// Columns 8 * n8 .. 8 * n8 + 7 of the packed B -> bw [kq][8][4] int16; with info, its facts.
void widen_panel(const int8_t* B, int64_t kq, int64_t n8, int16_t* bw, PanelInfo* info) {
    const int8_t* src = B + (n8 >> 1) * kq * 64 + (n8 & 1) * 32;
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i s0 = _mm256_setzero_si256(), s1 = s0, t0 = s0, t1 = s0, lo = s0;
    for (int64_t k = 0; k < kq; ++k) {
        // 4 bytes of k per column: (0, 1, 2, 3, 4, 5, 6, 7) -> (0, 1, 4, 5, 2, 3, 6, 7)
        const __m256i v = _mm256_permute4x64_epi64(
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + 64 * k)), 0xD8);
        const __m256i w0 = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(v));
        const __m256i w1 = _mm256_cvtepi8_epi16(_mm256_extracti128_si256(v, 1));
        _mm256_store_si256(reinterpret_cast<__m256i*>(bw + 32 * k), w0);
        _mm256_store_si256(reinterpret_cast<__m256i*>(bw + 32 * k + 16), w1);
        if (info) {
            lo = _mm256_min_epi8(lo, v);
            s0 = _mm256_add_epi32(s0, _mm256_madd_epi16(w0, ones));
            s1 = _mm256_add_epi32(s1, _mm256_madd_epi16(w1, ones));
            t0 = _mm256_add_epi32(t0, _mm256_madd_epi16(_mm256_abs_epi16(w0), ones));
            t1 = _mm256_add_epi32(t1, _mm256_madd_epi16(_mm256_abs_epi16(w1), ones));
        }
    }
    if (!info) return;
    info->w128 = _mm256_slli_epi32(fold_panel(s0, s1), 7);
    alignas(32) int32_t v[8];
    _mm256_store_si256(reinterpret_cast<__m256i*>(v), fold_panel(t0, t1));
    info->abs_max = *std::max_element(v, v + 8);
    const __m256i bad = _mm256_cmpeq_epi8(lo, _mm256_set1_epi8(-128));
    info->has_min = !_mm256_testz_si256(bad, bad);
}

// MR (1..6) rows a[i] (int16, 4 k per step) against a widened panel: the 8 column sums of
// each row in s[i]. Accumulators in named variables: held in an array, GCC 12 keeps them
// on the stack.
template <int MR>
void tile8(const int16_t* const* a, const int16_t* bw, int64_t kq, __m256i* s) {
    __m256i x0 = _mm256_setzero_si256(), x1 = x0, x2 = x0, x3 = x0, x4 = x0, x5 = x0;
    __m256i x6 = x0, x7 = x0, x8 = x0, x9 = x0;
    const int16_t* p0 = a[0];
    const int16_t* p1 = a[MR > 1 ? 1 : 0];
    const int16_t* p2 = a[MR > 2 ? 2 : 0];
    const int16_t* p3 = a[MR > 3 ? 3 : 0];
    const int16_t* p4 = a[MR > 4 ? 4 : 0];
    if constexpr (MR == 6) {
        // 12 accumulators, 2 weight registers, a broadcast and a product: all 16 registers.
        // GCC 12 spills two accumulators of the intrinsic version (a store-load chain per
        // step), and an asm statement takes at most 30 operands, so the whole loop is one
        // asm block: ymm0-11 accumulate and their folds are stored to s, ymm12-15 are scratch. Rows
        // 0-2 are p0 + i ld, rows 3-5 p3 + i ld (bytes).
        // The first step writes the accumulators (no zeroing, no add), and the column sums
        // are folded (fold_panel's `vphaddd`) before leaving: with 7 steps per tile (a first
        // convolution's K = 28) the zeroing, 12 stores and reloads and the adds of the
        // first step were a tenth of the tile.
        const int64_t ld = (p1 - p0) * 2;
        int64_t n = kq;
        const int16_t* b = bw;
        const int16_t* q0 = p0;
        const int16_t* q3 = p3;
#define QT_ROW6(addr, u, v)                      \
    "vpbroadcastq " addr ", %%ymm14\n\t"         \
    "vpmaddwd %%ymm12, %%ymm14, %%ymm15\n\t"     \
    "vpaddd %%ymm15, %%ymm" u ", %%ymm" u "\n\t" \
    "vpmaddwd %%ymm13, %%ymm14, %%ymm15\n\t"     \
    "vpaddd %%ymm15, %%ymm" v ", %%ymm" v "\n\t"
#define QT_FIRST6(addr, u, v)                \
    "vpbroadcastq " addr ", %%ymm14\n\t"     \
    "vpmaddwd %%ymm12, %%ymm14, %%ymm" u "\n\t" \
    "vpmaddwd %%ymm13, %%ymm14, %%ymm" v "\n\t"
        asm volatile(
            "test %[n], %[n]\n\t"
            "jle 3f\n\t"
            "vmovdqa (%[b]), %%ymm12\n\t"
            "vmovdqa 32(%[b]), %%ymm13\n\t"
            QT_FIRST6("(%[q0])", "0", "1") QT_FIRST6("(%[q0],%[ld],1)", "2", "3")
            QT_FIRST6("(%[q0],%[ld],2)", "4", "5") QT_FIRST6("(%[q3])", "6", "7")
            QT_FIRST6("(%[q3],%[ld],1)", "8", "9") QT_FIRST6("(%[q3],%[ld],2)", "10", "11")
            "add $64, %[b]\n\t"
            "add $8, %[q0]\n\t"
            "add $8, %[q3]\n\t"
            "dec %[n]\n\t"
            "jz 2f\n\t"
            "1:\n\t"
            "vmovdqa (%[b]), %%ymm12\n\t"
            "vmovdqa 32(%[b]), %%ymm13\n\t"
            QT_ROW6("(%[q0])", "0", "1") QT_ROW6("(%[q0],%[ld],1)", "2", "3")
            QT_ROW6("(%[q0],%[ld],2)", "4", "5") QT_ROW6("(%[q3])", "6", "7")
            QT_ROW6("(%[q3],%[ld],1)", "8", "9") QT_ROW6("(%[q3],%[ld],2)", "10", "11")
            "add $64, %[b]\n\t"
            "add $8, %[q0]\n\t"
            "add $8, %[q3]\n\t"
            "dec %[n]\n\t"
            "jnz 1b\n\t"
            "jmp 2f\n\t"
            "3:\n\t"
            "vpxor %%xmm0, %%xmm0, %%xmm0\n\t"
            "vmovdqa %%ymm0, %%ymm1\n\tvmovdqa %%ymm0, %%ymm2\n\tvmovdqa %%ymm0, %%ymm3\n\t"
            "vmovdqa %%ymm0, %%ymm4\n\tvmovdqa %%ymm0, %%ymm5\n\tvmovdqa %%ymm0, %%ymm6\n\t"
            "vmovdqa %%ymm0, %%ymm7\n\tvmovdqa %%ymm0, %%ymm8\n\tvmovdqa %%ymm0, %%ymm9\n\t"
            "vmovdqa %%ymm0, %%ymm10\n\tvmovdqa %%ymm0, %%ymm11\n\t"
            "2:\n\t"
            "vphaddd %%ymm1, %%ymm0, %%ymm0\n\tvphaddd %%ymm3, %%ymm2, %%ymm2\n\t"
            "vphaddd %%ymm5, %%ymm4, %%ymm4\n\tvphaddd %%ymm7, %%ymm6, %%ymm6\n\t"
            "vphaddd %%ymm9, %%ymm8, %%ymm8\n\tvphaddd %%ymm11, %%ymm10, %%ymm10\n\t"
            "vmovdqu %%ymm0, (%[s])\n\tvmovdqu %%ymm2, 32(%[s])\n\t"
            "vmovdqu %%ymm4, 64(%[s])\n\tvmovdqu %%ymm6, 96(%[s])\n\t"
            "vmovdqu %%ymm8, 128(%[s])\n\tvmovdqu %%ymm10, 160(%[s])\n\t"
            : [b] "+r"(b), [q0] "+r"(q0), [q3] "+r"(q3), [n] "+r"(n)
            : [ld] "r"(ld), [s] "r"(s)
            : "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9",
              "xmm10", "xmm11", "xmm12", "xmm13", "xmm14", "xmm15", "memory", "cc");
#undef QT_FIRST6
#undef QT_ROW6
        return;
    } else {
        for (int64_t k = 0; k < kq; ++k) {
            const __m256i b0 = _mm256_load_si256(reinterpret_cast<const __m256i*>(bw + 32 * k));
            const __m256i b1 =
                _mm256_load_si256(reinterpret_cast<const __m256i*>(bw + 32 * k + 16));
#define QT_ROW(i, p, u, v)                     \
    if constexpr (MR > i) {                    \
        const __m256i av = bcast4(p + 4 * k); \
        madd2(u, av, b0);                      \
        madd2(v, av, b1);                      \
    }
            QT_ROW(0, p0, x0, x1)
            QT_ROW(1, p1, x2, x3)
            QT_ROW(2, p2, x4, x5)
            QT_ROW(3, p3, x6, x7)
            QT_ROW(4, p4, x8, x9)
#undef QT_ROW
        }
    }
    s[0] = fold_panel(x0, x1);
    if constexpr (MR > 1) s[1] = fold_panel(x2, x3);
    if constexpr (MR > 2) s[2] = fold_panel(x4, x5);
    if constexpr (MR > 3) s[3] = fold_panel(x6, x7);
    if constexpr (MR > 4) s[4] = fold_panel(x8, x9);
}

void tile8_n(int n, const int16_t* const* a, const int16_t* bw, int64_t kq, __m256i* s) {
    switch (n) {
        case 6: tile8<6>(a, bw, kq, s); break;
        case 5: tile8<5>(a, bw, kq, s); break;
        case 4: tile8<4>(a, bw, kq, s); break;
        case 3: tile8<3>(a, bw, kq, s); break;
        case 2: tile8<2>(a, bw, kq, s); break;
        default: tile8<1>(a, bw, kq, s); break;
    }
}

// How a panel's rows are multiplied: int16 rows of the operand (PLAIN), the joined 16-bit
// operand (JOINED), or its two planes side by side, 3 rows of each per tile (PLANES).
enum PanelMode { PLAIN, JOINED, PLANES };

// Rows r0 .. r1 - 1 against the widened panel of columns n0 .. n0 + 7.
void panel_rows(PanelMode mode, const int16_t* A, const int16_t* A2, int64_t lda,
                const int16_t* bw, int64_t kq, int64_t r0, int64_t r1, int64_t n0, int64_t N,
                const Epilogue& ep, const __m256i* w128) {
    const int64_t step = mode == PLANES ? 3 : 6, cnt = N - n0 < 8 ? N - n0 : 8;
    const PanelEpilogue pe(ep, n0, cnt);
    for (int64_t r = r0, m = 0; r < r1; r += m) {
        // 6 rows at a time, but 7 or 8 left are 4 + 3 or 4 + 4: a tile of 1 or 2 rows loads
        // B for few products
        const int64_t left = r1 - r;
        m = left < step ? left : (step == 6 && (left == 7 || left == 8) ? 4 : step);
        const int16_t* rows[6];
        for (int i = 0; i < m; ++i) {
            rows[i] = A + (r + i) * lda;
            if (mode == PLANES) rows[m + i] = A2 + (r + i) * lda;
        }
        __m256i s[6];
        tile8_n(static_cast<int>(mode == PLANES ? 2 * m : m), rows, bw, kq, s);
        if (pe.kind != PanelEpilogue::GENERAL) {
            for (int i = 0; i < m; ++i) {
                if (mode == PLANES) {
                    pe.row(r + i, s[i], &s[m + i]);
                } else if (mode == JOINED) {
                    const __m256i lo = _mm256_and_si256(s[i], _mm256_set1_epi32(255));
                    pe.row(r + i, _mm256_add_epi32(_mm256_srai_epi32(s[i], 8), *w128), &lo);
                } else {
                    pe.row(r + i, s[i], nullptr);
                }
            }
            continue;
        }
        for (int i = 0; i < m; ++i) {
            if (mode == PLANES)
                epilogue8(ep, r + i, n0, cnt, s[i], &s[m + i]);
            else
                finish16(ep, r + i, n0, N, s[i], mode == JOINED ? w128 : nullptr);
        }
    }
}

// A prepared B (prepare_avx2): every panel widened, each followed by its PanelInfo.
int64_t prepared_panel_bytes(int64_t kq) {
    return kq * 64 + static_cast<int64_t>(sizeof(PanelInfo));
}

void gemm_impl(int64_t M, int64_t N, int64_t Kp, const uint8_t* A_u8, int64_t lda_u8,
               const int8_t* B, const Epilogue& ep, const uint8_t* A_lo_u8,
               const void* prepared) {
    const int64_t nblocks = (N + 15) / 16, kq = Kp / 4;
    const bool dual = A_lo_u8 != nullptr;
    const size_t plane = static_cast<size_t>(M * Kp);
    // joined: |256 sum |w| + off + row_off| stays below 2^24 - 2^17, so both splits of the
    // total (the planes' and the joined one, at most 128 Kp + 1 apart) are exact floats
    bool joined = dual && Kp <= 512;
    int64_t slack = 0;
    if (joined) {
        int64_t big = 0;
        for (int64_t n = 0; n < N; ++n) big = std::max<int64_t>(big, std::llabs(ep.off[n]));
        if (ep.row_off) {
            int64_t rbig = 0;
            for (int64_t r = 0; r < M; ++r) rbig = std::max<int64_t>(rbig, std::llabs(ep.row_off[r]));
            big += rbig;
        }
        slack = (int64_t{1} << 24) - (int64_t{1} << 17) - big;
        joined = slack > 0;
    }
    // Every buffer is made on first need.
    int16_t *wide = nullptr, *joint = nullptr;
    auto int16_rows = [&]() {
        if (!wide) {
            wide = static_cast<int16_t*>(std::malloc(plane * (dual ? 4 : 2) + 32));
            if (!wide) {  // caught at the entry point (QT_CATCH)
                std::free(joint);
                throw std::bad_alloc();
            }
            widen_rows(A_u8, M, Kp, lda_u8, wide);
            if (dual) widen_rows(A_lo_u8, M, Kp, lda_u8, wide + plane);
        }
        return wide;
    };
    auto joint_rows = [&]() {
        if (!joint) {
            joint = static_cast<int16_t*>(std::malloc(plane * 2 + 32));
            if (!joint) {
                std::free(wide);
                throw std::bad_alloc();
            }
            join_rows(A_u8, A_lo_u8, M, Kp, lda_u8, joint);
        }
        return joint;
    };
    // At most 2 rows: B widened on the fly (a panel would be read back once only). Plain
    // rows are exact for any weight; the joined operand is, with Kp <= 256, whatever the
    // weights (256 * 128 * Kp stays within the slack).
    if (M <= 2 && (!dual || (joined && 256 * 128 * Kp < slack))) {
        const int16_t* a = dual ? joint_rows() : int16_rows();
        for (int64_t nb = 0; nb < nblocks; ++nb) {
            if (M == 2)
                dual ? micro16<2, true>(a, Kp, B, kq, 0, nb, N, ep)
                     : micro16<2>(a, Kp, B, kq, 0, nb, N, ep);
            else
                dual ? micro16<1, true>(a, Kp, B, kq, 0, nb, N, ep)
                     : micro16<1>(a, Kp, B, kq, 0, nb, N, ep);
        }
        std::free(joint);
        std::free(wide);
        return;
    }
    int16_t* bw = nullptr;
    if (!prepared) {
        bw = static_cast<int16_t*>(std::aligned_alloc(32, static_cast<size_t>(kq) * 64 + 32));
        if (!bw) throw std::bad_alloc();  // nothing else held yet; QT_CATCH
    }
    // Panels of rows whose int16 operands (up to 2 planes) stay in L2 while every panel of
    // columns passes over them; a multiple of the tiles' 6 (and 3) rows.
    // (Kp at least 4: a K = 0 product divided by zero here, SIGFPE)
    const int64_t panel = std::max<int64_t>(6, (256 * 1024) / (4 * std::max<int64_t>(Kp, 4)) / 6 * 6);
    for (int64_t r0 = 0; r0 < M; r0 += panel) {
        const int64_t r1 = r0 + panel < M ? r0 + panel : M;
        for (int64_t n8 = 0; n8 < (N + 7) / 8; ++n8) {
            PanelInfo info;
            const int16_t* pw = bw;
            if (prepared) {
                const char* at =
                    static_cast<const char*>(prepared) + n8 * prepared_panel_bytes(kq);
                pw = reinterpret_cast<const int16_t*>(at);
                std::memcpy(&info, at + kq * 64, sizeof info);
            } else {
                widen_panel(B, kq, n8, bw, dual ? &info : nullptr);
            }
            PanelMode mode = PLAIN;
            if (dual)
                mode = joined && !info.has_min && 256 * int64_t{info.abs_max} < slack ? JOINED
                                                                                      : PLANES;
            const int16_t* a = mode == JOINED ? joint_rows() : int16_rows();
            panel_rows(mode, a, mode == PLANES ? a + plane : nullptr, Kp, pw, kq, r0, r1, 8 * n8, N, ep,
                       &info.w128);
        }
    }
    std::free(bw);
    std::free(joint);
    std::free(wide);
}

}  // namespace

void gemm_avx2(int64_t M, int64_t N, int64_t Kp, const uint8_t* A_u8, int64_t lda_u8,
               const int8_t* B, const Epilogue& ep, const uint8_t* A_lo_u8) {
    gemm_impl(M, N, Kp, A_u8, lda_u8, B, ep, A_lo_u8, nullptr);
}

void gemm_avx2_prepared(int64_t M, int64_t N, int64_t Kp, const uint8_t* A_u8, int64_t lda_u8,
                        const int8_t* B, const Epilogue& ep, const uint8_t* A_lo_u8,
                        const void* prepared) {
    gemm_impl(M, N, Kp, A_u8, lda_u8, B, ep, A_lo_u8, prepared);
}

// Every panel of B widened once, with its facts, for products of more than 2 rows (GEMVs
// widen on the fly: the int16 copy, twice the bytes, would only be read back once per call).
int64_t prepare_avx2(const int8_t* B, int64_t N, int64_t Kp, int64_t rows, void* out) {
    const int64_t kq = Kp / 4, panels = (N + 7) / 8;
    if (rows <= 2) return 0;
    if (out) {
        for (int64_t n8 = 0; n8 < panels; ++n8) {
            char* at = static_cast<char*>(out) + n8 * prepared_panel_bytes(kq);
            PanelInfo info;
            widen_panel(B, kq, n8, reinterpret_cast<int16_t*>(at), &info);
            std::memcpy(at + kq * 64, &info, sizeof info);
        }
    }
    return panels * prepared_panel_bytes(kq);
}

using x86_256::load8;
using x86_256::round8;
using x86_256::store8;
using x86_256::store8_bytes;
using x86_256::vsig;
using x86_256::vsig_n;
using x86_256::vtanh;

static inline __m256i vquant(__m256 h, float inv, float zp) {
    __m256 q = _mm256_add_ps(round8(_mm256_mul_ps(h, _mm256_set1_ps(inv))), _mm256_set1_ps(zp));
    return _mm256_cvtps_epi32(x86_256::clamp8(q, -128.0f, 127.0f));
}

// h (8 lanes, m of them real) of one batch row written where the step wants it: the float
// state, the feedback operand (int8, or int16 as two uint8 planes) and the output.
static inline void emit8(const RnnStep& s, __m256 hv, int64_t j, int64_t m, float* h,
                         uint8_t* hu8, int8_t* y, float* yf) {
    store8(h + j, hv, m);
    if (s.lo_offset) {
        __m256 q = round8(_mm256_mul_ps(hv, _mm256_set1_ps(s.h_inv)));
        const __m256i qi = _mm256_cvtps_epi32(x86_256::clamp8(q, -32768.0f, 32767.0f));
        const __m256i hi = _mm256_add_epi32(_mm256_srai_epi32(qi, 8), _mm256_set1_epi32(128));
        const __m256i lo = _mm256_and_si256(qi, _mm256_set1_epi32(255));
        store8_bytes(hu8 + j, hi, m, false);
        store8_bytes(hu8 + s.lo_offset + j, lo, m, false);
    } else {
        const __m256i hq = _mm256_add_epi32(vquant(hv, s.h_inv, s.h_zp), _mm256_set1_epi32(128));
        store8_bytes(hu8 + j, hq, m, false);
    }
    if (yf)
        store8(yf + j, hv, m);
    else
        store8_bytes(y + j, vquant(hv, s.y_inv, s.y_zp), m, true);
}

// The LSTM's gate math in two passes over blocks of 64 columns: first the four gates, then
// the cell and hidden state. Written as one pass, each 8 columns are a chain of three
// dependent transcendentals (gates, then tanh(c)) longer than the reorder window can overlap
// with the next 8; the gates of a block are independent of each other, and so are the
// blocks' tanh(c). Within each pass the sigmoids go 4 at a time through vsig_n, their
// instructions interleaved: 26.3 -> 18.4 us per step of 32 x 256 (C level, min of 30, one
// core; 8 at a time spill and were slower). Same arithmetic, same bits.
static void lstm_avx2(const RnnStep& s, const float* gx, const float* gh, float* h, float* c,
                      uint8_t* hu8, int8_t* y, float* yf, float* raw) {
    const int64_t H = s.H;
    const __m256 one = _mm256_set1_ps(1.0f);
    alignas(32) float gate[4][64];
    alignas(32) float tc[64];  // tanh(c) of the block
    for (int64_t j0 = 0; j0 < H; j0 += 64) {
        const int64_t w = H - j0 < 64 ? H - j0 : 64;
        for (int64_t j = 0; j < w; j += 8) {
            const int64_t m = w - j < 8 ? w - j : 8;
            auto pre = [&](int64_t g) {
                const int64_t at = g * H + j0 + j;
                return _mm256_add_ps(load8(gx + at, m), load8(gh + at, m));
            };
            __m256 v[4] = {pre(0), pre(1), pre(2), pre(3)};
            v[2] = _mm256_add_ps(v[2], v[2]);  // tanh(g) = 2 sigmoid(2 g) - 1
            vsig_n<4>(v);
            _mm256_store_ps(gate[0] + j, v[0]);
            _mm256_store_ps(gate[1] + j, v[1]);
            _mm256_store_ps(gate[2] + j, _mm256_sub_ps(_mm256_add_ps(v[2], v[2]), one));
            _mm256_store_ps(gate[3] + j, v[3]);
        }
        for (int64_t j = 0; j < w; j += 32) {  // c, then tanh(c) of 4 x 8 columns at once
            __m256 v[4];
            for (int q = 0; q < 4; ++q) {
                const int64_t jj = j + 8 * q, m = w - jj < 8 ? w - jj : 8, at = j0 + jj;
                if (m <= 0) {
                    v[q] = _mm256_setzero_ps();
                    continue;
                }
                const __m256 cv =
                    _mm256_fmadd_ps(_mm256_load_ps(gate[1] + jj), load8(c + at, m),
                                    _mm256_mul_ps(_mm256_load_ps(gate[0] + jj),
                                                  _mm256_load_ps(gate[2] + jj)));
                store8(c + at, cv, m);
                v[q] = _mm256_add_ps(cv, cv);
            }
            vsig_n<4>(v);
            for (int q = 0; q < 4; ++q)
                _mm256_store_ps(tc + j + 8 * q, _mm256_sub_ps(_mm256_add_ps(v[q], v[q]), one));
        }
        for (int64_t j = 0; j < w; j += 8) {
            const int64_t m = w - j < 8 ? w - j : 8, at = j0 + j;
            const __m256 hv = _mm256_mul_ps(_mm256_load_ps(gate[3] + j), _mm256_load_ps(tc + j));
            if (raw)
                store8(raw + at, hv, m);
            else
                emit8(s, hv, at, m, h, hu8, y, yf);
        }
    }
}

// Gate math of one batch row (qt::CellFn), the AVX-512 path's arithmetic 8 lanes at a time.
void cell_avx2(const RnnStep& s, const float* gx, const float* gh, float* h, float* c,
               uint8_t* hu8, int8_t* y, float* yf, float* raw) {
    if (s.kind == LSTM) {
        lstm_avx2(s, gx, gh, h, c, hu8, y, yf, raw);
        return;
    }
    const int64_t H = s.H;
    for (int64_t j = 0; j < H; j += 8) {
        const int64_t m = H - j < 8 ? H - j : 8;
        auto pre = [&](int64_t g) {
            return _mm256_add_ps(load8(gx + g * H + j, m), load8(gh + g * H + j, m));
        };
        __m256 hv;
        if (s.kind == GRU) {
            const __m256 r = vsig(pre(0)), z = vsig(pre(1));
            const __m256 n =
                vtanh(_mm256_fmadd_ps(r, load8(gh + 2 * H + j, m), load8(gx + 2 * H + j, m)));
            hv = _mm256_fmadd_ps(z, _mm256_sub_ps(load8(h + j, m), n), n);
        } else if (s.kind == RNN_TANH) {
            hv = vtanh(pre(0));
        } else {
            hv = _mm256_max_ps(pre(0), _mm256_setzero_ps());
        }
        emit8(s, hv, j, m, h, hu8, y, yf);
    }
}

// Sigmoid or tanh of n floats, 4 vectors at a time through vsig_n (see lstm_avx2).
void activation_avx2(int kind, const float* a, float* out, int64_t n) {
    const __m256 one = _mm256_set1_ps(1.0f);
    int64_t j = 0;
    for (; j + 32 <= n; j += 32) {
        __m256 v[4];
        for (int q = 0; q < 4; ++q) {
            v[q] = _mm256_loadu_ps(a + j + 8 * q);
            if (kind != 0) v[q] = _mm256_add_ps(v[q], v[q]);
        }
        vsig_n<4>(v);
        for (int q = 0; q < 4; ++q)
            _mm256_storeu_ps(out + j + 8 * q,
                             kind == 0 ? v[q] : _mm256_sub_ps(_mm256_add_ps(v[q], v[q]), one));
    }
    for (; j < n; j += 8) {
        const int64_t m = n - j < 8 ? n - j : 8;
        const __m256 x = load8(a + j, m);
        store8(out + j, kind == 0 ? vsig(x) : vtanh(x), m);
    }
}

// out[i] = table[x[i] + 128], 32 bytes at a time: the table as 16 rows of 16 bytes, each
// row a `vpshufb` by the index's low nibble, kept where the high nibble names that row. 3
// vector instructions per row and 32 bytes against the scalar loop's 2 loads and a store per
// byte: 0.34 -> 0.17-0.20 ns per byte (C level, one core). Exact: a table read either way.
void lookup_avx2(const int8_t* table, const int8_t* x, int8_t* out, int64_t n) {
    __m256i t[16];
    for (int i = 0; i < 16; ++i)
        t[i] = _mm256_broadcastsi128_si256(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(table + 16 * i)));
    const __m256i nibble = _mm256_set1_epi8(0x0F), flip = _mm256_set1_epi8(-128);
    int64_t j = 0;
    for (; j + 32 <= n; j += 32) {
        const __m256i v = _mm256_xor_si256(
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + j)), flip);  // x + 128
        const __m256i lo = _mm256_and_si256(v, nibble);
        const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble);
        __m256i r = _mm256_shuffle_epi8(t[0], lo);
        for (int i = 1; i < 16; ++i)
            r = _mm256_blendv_epi8(r, _mm256_shuffle_epi8(t[i], lo),
                                   _mm256_cmpeq_epi8(hi, _mm256_set1_epi8(static_cast<char>(i))));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + j), r);
    }
    for (; j < n; ++j) out[j] = table[static_cast<int>(x[j]) + 128];
}

}  // namespace qt
