// AVX2 path (x86-64-v3: AVX2 + FMA): GEMM micro-kernels, recurrent gate math and float
// activations, 8 lanes wide. Compiled with -march=x86-64-v3 whatever the rest of the
// library's flags; only reached through qt::kernels when the CPU has AVX2 and FMA.
//
// u8 x s8 products: `vpmaddubsw` adds pairs into int16 and saturates (255 * 127 * 2 >
// 32767), which would break bit equality with the other paths. Instead both operands are
// widened to int16 and `vpmaddwd` adds pairs into int32, exact for every input: 16 bytes of
// a packed block (4 columns x 4 k) widen to one register, multiplied by the row's 4
// activations repeated, giving two partial sums per column, folded once at the end.
#include <immintrin.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>

#include "qt_kernels.h"
#include "qt_x86_256.h"

namespace qt {

using x86_256::epilogue8;

namespace {

// The 4 activations a[0..3], already int16, repeated 4 times: a load-port broadcast (the
// shuffle port is busy widening B).
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
        for (; k < Kp; ++k) out[r * Kp + k] = A[r * lda + k];
    }
}

// acc += madd(a, b). Inline asm keeps each accumulator in its register: with intrinsics,
// GCC 12 moves most of them through the stack every iteration.
inline void madd_acc(__m256i& acc, __m256i a, __m256i b) {
    __m256i t;
    asm("vpmaddwd %3, %2, %1\n\tvpaddd %1, %0, %0" : "+x"(acc), "=&x"(t) : "x"(a), "x"(b));
}

// Two partial sums per column for columns 0-3 (p) and 4-7 (q) -> the 8 column sums in order.
inline __m256i fold(__m256i p, __m256i q) {
    return _mm256_permute4x64_epi64(_mm256_hadd_epi32(p, q), 0xD8);
}

// MR rows x NR blocks of 16 columns; DUAL also multiplies the rows of the low-byte plane A2
// (see gemm_u8s8 in qt_kernels.h).
template <int MR, int NR, bool DUAL>
void micro(const int16_t* A, const int16_t* A2, int64_t lda, const int8_t* B, int64_t kq,
           int64_t row0, int64_t nb0, int64_t N, const Epilogue& ep) {
    __m256i acc[MR][NR][4], acc2[DUAL ? MR : 1][DUAL ? NR : 1][4];
    for (int i = 0; i < MR; ++i)
        for (int j = 0; j < NR; ++j)
            for (int q = 0; q < 4; ++q) acc[i][j][q] = _mm256_setzero_si256();
    if constexpr (DUAL) {
        for (int i = 0; i < MR; ++i)
            for (int j = 0; j < NR; ++j)
                for (int q = 0; q < 4; ++q) acc2[i][j][q] = _mm256_setzero_si256();
    }
    const int8_t* b = B + nb0 * kq * 64;
    const int16_t* a0 = A + row0 * lda;
    const int16_t* a2 = DUAL ? A2 + row0 * lda : nullptr;
    for (int64_t k = 0; k < kq; ++k) {
#pragma GCC unroll 4
        for (int j = 0; j < NR; ++j) {
            const int8_t* bk = b + (j * kq + k) * 64;
#pragma GCC unroll 4
            for (int q = 0; q < 4; ++q) {
                const __m256i bw = _mm256_cvtepi8_epi16(
                    _mm_loadu_si128(reinterpret_cast<const __m128i*>(bk + 16 * q)));
#pragma GCC unroll 4
                for (int i = 0; i < MR; ++i) {
                    const __m256i av = bcast4(a0 + i * lda + 4 * k);
                    madd_acc(acc[i][j][q], av, bw);
                    if constexpr (DUAL) madd_acc(acc2[i][j][q], bcast4(a2 + i * lda + 4 * k), bw);
                }
            }
        }
    }
    for (int i = 0; i < MR; ++i) {
        for (int j = 0; j < NR; ++j) {
            for (int h = 0; h < 2; ++h) {
                const int64_t n0 = (nb0 + j) * 16 + 8 * h;
                if (n0 >= N) continue;
                const __m256i s = fold(acc[i][j][2 * h], acc[i][j][2 * h + 1]);
                __m256i s2;
                if constexpr (DUAL) s2 = fold(acc2[i][j][2 * h], acc2[i][j][2 * h + 1]);
                epilogue8(ep, row0 + i, n0, N - n0 < 8 ? N - n0 : 8, s, DUAL ? &s2 : nullptr);
            }
        }
    }
}

// ---- the sign trick: `vpmaddubsw` without saturation ----------------------------------
//
// `vpmaddubsw` multiplies u8 x s8 and adds pairs into int16 with saturation; with the
// activation x + 128 in [0, 255] a pair reaches 2 * 255 * 128 > 32767. Instead the signed
// activation x in [-128, 127] is split into |x| (u8, at most 128) and its sign, moved onto
// the weight: x * w = |x| * (sign(x) w), one `vpsignb`. With w in [-127, 127] (every
// symmetric weight spec) a pair is at most 2 * 128 * 127 = 32512: never saturates, so the
// int16 pair sums are exact, and `vpmaddwd` by ones adds them into int32 lanes, one per
// output column (a packed block is two registers of 8 columns x 4 k). The result is
// sum (x + 128) w - 128 sum w: the kernel adds 128 * sum w back, computed from the packed
// block once per tile. A tile whose weights hold a -128 (sign(x) * -128 does not fit int8)
// is recomputed by the int16 kernel above, which is exact for every input.

// acc += madd(maddubs(ax, sign(b, sx)), ones): 64 products of one row and 8 columns.
inline void sdot(__m256i& acc, __m256i ax, __m256i sx, __m256i b, __m256i ones) {
    __m256i t;
    asm("vpsignb %3, %4, %1\n\t"
        "vpmaddubsw %1, %2, %1\n\t"
        "vpmaddwd %5, %1, %1\n\t"
        "vpaddd %1, %0, %0"
        : "+x"(acc), "=&x"(t)
        : "x"(ax), "x"(sx), "x"(b), "x"(ones));
}

inline __m256i bcast4u(const uint8_t* p) {
    int32_t four;
    std::memcpy(&four, p, 4);
    return _mm256_set1_epi32(four);
}

// Rows of uint8 activations (x + 128) -> |x| and x (int8), each plane of stride Kp.
void split_sign(const uint8_t* A, int64_t M, int64_t Kp, int64_t lda, uint8_t* ax, int8_t* sx) {
    const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
    for (int64_t r = 0; r < M; ++r) {
        int64_t k = 0;
        for (; k + 32 <= Kp; k += 32) {
            const __m256i x = _mm256_xor_si256(
                _mm256_loadu_si256(reinterpret_cast<const __m256i*>(A + r * lda + k)), flip);
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(sx + r * Kp + k), x);
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(ax + r * Kp + k), _mm256_abs_epi8(x));
        }
        for (; k < Kp; ++k) {
            const int8_t x = static_cast<int8_t>(A[r * lda + k] ^ 0x80);
            sx[r * Kp + k] = x;
            ax[r * Kp + k] = static_cast<uint8_t>(x < 0 ? -x : x);
        }
    }
}

// 128 * sum_k w for the 16 columns of one packed block (two registers of 8), and whether
// the block holds a -128.
inline bool block_sums(const int8_t* b, int64_t kq, __m256i sum[2]) {
    const __m256i ones8 = _mm256_set1_epi8(1), ones = _mm256_set1_epi16(1);
    __m256i s0 = _mm256_setzero_si256(), s1 = s0, lo = s0;
    for (int64_t k = 0; k < kq; ++k) {
        const __m256i b0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 64 * k));
        const __m256i b1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 64 * k + 32));
        lo = _mm256_min_epi8(lo, _mm256_min_epi8(b0, b1));
        s0 = _mm256_add_epi32(s0, _mm256_madd_epi16(_mm256_maddubs_epi16(ones8, b0), ones));
        s1 = _mm256_add_epi32(s1, _mm256_madd_epi16(_mm256_maddubs_epi16(ones8, b1), ones));
    }
    sum[0] = _mm256_slli_epi32(s0, 7);
    sum[1] = _mm256_slli_epi32(s1, 7);
    const __m256i bad = _mm256_cmpeq_epi8(lo, _mm256_set1_epi8(-128));
    return !_mm256_testz_si256(bad, bad);
}

// MR rows x NR blocks of 16 columns, the sign trick. DUAL: rows of the low-byte plane too
// (its bytes are unsigned without offset: split as (lo - 128) + 128, the same way). Up to 8
// accumulators, in named variables: held in an array, GCC 12 keeps them on the stack.
// Tiles: 4x1, 2x1, 1x1, 1x2 (GEMV), DUAL 2x1 and 1x1.
template <int MR, int NR, bool DUAL>
void micro_sign(const uint8_t* ax, const int8_t* sx, const uint8_t* ax2, const int8_t* sx2,
                int64_t lda, const int8_t* B, int64_t kq, int64_t row0, int64_t nb0, int64_t N,
                const __m256i (*sums)[2], const Epilogue& ep) {
    static_assert(MR * NR * (DUAL ? 2 : 1) <= 4 && (NR == 1 || MR == 1), "tile too large");
    // slot of (row i, block j): i * NR + j; DUAL: the low plane of row i is slot 2 + i
    __m256i c0 = sums[0][0], c1 = sums[0][1];
    __m256i c2 = NR == 2 ? sums[1][0] : sums[0][0], c3 = NR == 2 ? sums[1][1] : sums[0][1];
    __m256i c4 = sums[0][0], c5 = sums[0][1], c6 = sums[0][0], c7 = sums[0][1];
    const __m256i ones = _mm256_set1_epi16(1);
    const int8_t* b = B + nb0 * kq * 64;
    const uint8_t* pa = ax + row0 * lda;
    const uint8_t* ps = reinterpret_cast<const uint8_t*>(sx + row0 * lda);
    const uint8_t* pa2 = DUAL ? ax2 + row0 * lda : nullptr;
    const uint8_t* ps2 = DUAL ? reinterpret_cast<const uint8_t*>(sx2 + row0 * lda) : nullptr;
    for (int64_t k = 0; k < kq; ++k) {
        const int8_t* bk = b + k * 64;
        const __m256i b0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bk));
        const __m256i b1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bk + 32));
        {
            const __m256i a = bcast4u(pa + 4 * k), s = bcast4u(ps + 4 * k);
            sdot(c0, a, s, b0, ones);
            sdot(c1, a, s, b1, ones);
            if constexpr (NR == 2) {
                const int8_t* bj = bk + kq * 64;
                const __m256i b2 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bj));
                const __m256i b3 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bj + 32));
                sdot(c2, a, s, b2, ones);
                sdot(c3, a, s, b3, ones);
            }
        }
        if constexpr (DUAL) {
            const __m256i a = bcast4u(pa2 + 4 * k), s = bcast4u(ps2 + 4 * k);
            sdot(c4, a, s, b0, ones);
            sdot(c5, a, s, b1, ones);
        }
        if constexpr (MR >= 2) {
            const __m256i a = bcast4u(pa + lda + 4 * k), s = bcast4u(ps + lda + 4 * k);
            sdot(c2, a, s, b0, ones);
            sdot(c3, a, s, b1, ones);
            if constexpr (DUAL) {
                const __m256i a2 = bcast4u(pa2 + lda + 4 * k), s2 = bcast4u(ps2 + lda + 4 * k);
                sdot(c6, a2, s2, b0, ones);
                sdot(c7, a2, s2, b1, ones);
            }
        }
        if constexpr (MR == 4) {
            const __m256i a = bcast4u(pa + 2 * lda + 4 * k), s = bcast4u(ps + 2 * lda + 4 * k);
            sdot(c4, a, s, b0, ones);
            sdot(c5, a, s, b1, ones);
            const __m256i a3 = bcast4u(pa + 3 * lda + 4 * k), s3 = bcast4u(ps + 3 * lda + 4 * k);
            sdot(c6, a3, s3, b0, ones);
            sdot(c7, a3, s3, b1, ones);
        }
    }
    const __m256i acc[8] = {c0, c1, c2, c3, c4, c5, c6, c7};
    for (int i = 0; i < MR; ++i) {
        for (int j = 0; j < NR; ++j) {
            const int slot = i * NR + j;
            for (int h = 0; h < 2; ++h) {
                const int64_t n0 = (nb0 + j) * 16 + 8 * h;
                if (n0 >= N) continue;
                const int64_t cnt = N - n0 < 8 ? N - n0 : 8;
                const __m256i* lo = DUAL ? &acc[2 * (2 + i) + h] : nullptr;
                epilogue8(ep, row0 + i, n0, cnt, acc[2 * slot + h], lo);
            }
        }
    }
}

// ---- int16 tiles of 3 rows, the combined 16-bit operand ---------------------------------
//
// One `vpmaddwd` multiplies 16 int16 pairs: per 32 products it costs 2 multiplies against
// the sign trick's 3 (`vpsignb`, `vpmaddubsw`, `vpmaddwd`), with the widening of B (a shuffle)
// shared by the rows of a tile. For a 16-bit operand split in two planes (hi, lo) the planes
// are joined back into h = 256 (hi - 128) + lo, one pass instead of two: the exact int32 sum
// S = sum h w is then handed to the epilogue as (S >> 8, S & 255), whose float result
// round(S) is what the two planes give whenever both of their sums are exact floats
// (Kp <= 512, see gemm_avx2); |S| < 2^31 needs w > -128 (blocks with -128 go elsewhere).

// Rows of the two planes -> h = 256 * (hi - 128) + lo (int16), stride Kp.
void join_rows(const uint8_t* hi, const uint8_t* lo, int64_t M, int64_t Kp, int64_t lda,
               int16_t* out) {
    for (int64_t r = 0; r < M; ++r)
        for (int64_t k = 0; k < Kp; ++k)
            out[r * Kp + k] = static_cast<int16_t>(
                (static_cast<int32_t>(hi[r * lda + k]) - 128) * 256 + lo[r * lda + k]);
}

inline void madd2(__m256i& acc, __m256i a, __m256i b) {
    __m256i t;
    asm("vpmaddwd %3, %2, %1\n\tvpaddd %1, %0, %0" : "+x"(acc), "=&x"(t) : "x"(a), "x"(b));
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

// MR (1..3) rows x one block of 16 columns, int16 activations (stride lda). With SUMS
// (the joined operand of at most 2 rows, no pass over B beforehand), 128 sum_k w is
// accumulated here from the widened weights instead of read from w128.
template <int MR, bool SUMS = false>
void micro16(const int16_t* A, int64_t lda, const int8_t* B, int64_t kq, int64_t row0,
             int64_t nb, int64_t N, const Epilogue& ep, const __m256i* w128) {
    static_assert(!SUMS || MR <= 2, "too many accumulators");
    __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;  // row 0, columns by 4
    __m256i b0 = a0, b1 = a0, b2 = a0, b3 = a0;                      // row 1
    __m256i c0 = a0, c1 = a0, c2 = a0, c3 = a0;                      // row 2, or the sums
    const __m256i ones = _mm256_set1_epi16(1);
    const int8_t* b = B + nb * kq * 64;
    const int16_t* r0 = A + row0 * lda;
    for (int64_t k = 0; k < kq; ++k) {
        const int8_t* bk = b + k * 64;
#define QT_W16(q) \
    _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bk + 16 * (q))))
#define QT_ROWS(q, x, y, z)                                                  \
    {                                                                        \
        const __m256i w = QT_W16(q);                                         \
        madd2(x, bcast4(r0 + 4 * k), w);                                     \
        if constexpr (MR >= 2) madd2(y, bcast4(r0 + lda + 4 * k), w);        \
        if constexpr (MR >= 3) madd2(z, bcast4(r0 + 2 * lda + 4 * k), w);    \
        if constexpr (SUMS) madd2(z, ones, w);                               \
    }
        QT_ROWS(0, a0, b0, c0)
        QT_ROWS(1, a1, b1, c1)
        QT_ROWS(2, a2, b2, c2)
        QT_ROWS(3, a3, b3, c3)
#undef QT_ROWS
#undef QT_W16
    }
    __m256i own[2];
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
    if constexpr (MR >= 3 && !SUMS) {
        finish16(ep, row0 + 2, n0, N, fold(c0, c1), w128);
        finish16(ep, row0 + 2, n0 + 8, N, fold(c2, c3), u);
    }
}

void rows16(const int16_t* A, int64_t lda, const int8_t* B, int64_t kq, int64_t r0, int64_t r1,
            int64_t nb, int64_t N, const Epilogue& ep, const __m256i* w128) {
    int64_t r = r0;
    for (; r + 3 <= r1; r += 3) micro16<3>(A, lda, B, kq, r, nb, N, ep, w128);
    if (r + 2 <= r1) micro16<2>(A, lda, B, kq, r, nb, N, ep, w128);
    else if (r < r1) micro16<1>(A, lda, B, kq, r, nb, N, ep, w128);
}

// Largest sum_k |w| over the columns of a block (bounds the joined operand's sums).
inline int32_t block_abs(const int8_t* b, int64_t kq) {
    const __m256i ones8 = _mm256_set1_epi8(1), ones = _mm256_set1_epi16(1);
    __m256i s0 = _mm256_setzero_si256(), s1 = s0;
    for (int64_t k = 0; k < kq; ++k) {
        const __m256i b0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 64 * k));
        const __m256i b1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 64 * k + 32));
        s0 = _mm256_add_epi32(s0, _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(b0), ones8), ones));
        s1 = _mm256_add_epi32(s1, _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(b1), ones8), ones));
    }
    alignas(32) int32_t v[8];
    _mm256_store_si256(reinterpret_cast<__m256i*>(v), _mm256_max_epi32(s0, s1));
    int32_t m = 0;
    for (int32_t x : v) m = x > m ? x : m;
    return m;
}

// Rows r0 .. r1 - 1 against blocks nb .. nb + NR - 1 (all free of -128), the sign trick.
template <int NR, bool DUAL>
void rows_sign(const uint8_t* ax, const int8_t* sx, const uint8_t* ax2, const int8_t* sx2,
               int64_t lda, const int8_t* B, int64_t kq, int64_t r0, int64_t r1, int64_t nb,
               int64_t N, const __m256i (*sums)[2], const Epilogue& ep) {
    constexpr int MR = DUAL ? 2 : (NR == 1 ? 4 : 1);
    int64_t r = r0;
    for (; r + MR <= r1; r += MR)
        micro_sign<MR, NR, DUAL>(ax, sx, ax2, sx2, lda, B, kq, r, nb, N, sums, ep);
    if constexpr (MR == 4) {
        if (r + 2 <= r1) {  // then at most one row
            micro_sign<2, NR, DUAL>(ax, sx, ax2, sx2, lda, B, kq, r, nb, N, sums, ep);
            r += 2;
        }
    }
    for (; r < r1; ++r) micro_sign<1, NR, DUAL>(ax, sx, ax2, sx2, lda, B, kq, r, nb, N, sums, ep);
}

// The int16 kernel over rows r0 .. r1 - 1 and block nb (a block holding a -128).
void rows_int16(const int16_t* A, const int16_t* A2, int64_t lda, const int8_t* B, int64_t kq,
                int64_t r0, int64_t r1, int64_t nb, int64_t N, const Epilogue& ep) {
    for (int64_t r = r0; r < r1; ++r) {
        if (A2)
            micro<1, 1, true>(A, A2, lda, B, kq, r, nb, N, ep);
        else
            micro<1, 1, false>(A, A2, lda, B, kq, r, nb, N, ep);
    }
}

}  // namespace

void gemm_avx2(int64_t M, int64_t N, int64_t Kp, const uint8_t* A_u8, int64_t lda_u8,
               const int8_t* B, const Epilogue& ep, const uint8_t* A_lo_u8) {
    const int64_t nblocks = (N + 15) / 16, kq = Kp / 4;
    const bool dual = A_lo_u8 != nullptr;
    const size_t plane = static_cast<size_t>(M * Kp);
    // The path of each block: the sign trick (|x|, x planes), int16 tiles of the joined
    // planes, or int16 tiles of plain rows (a block holding -128; and any product of at most
    // 2 rows, which then needs no pass over B first). Every buffer is made on first need.
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
    uint8_t* signs = nullptr;
    int16_t *wide = nullptr, *joint = nullptr;
    auto sign_planes = [&]() {
        if (!signs) {
            signs = static_cast<uint8_t*>(std::malloc(plane * (dual ? 4 : 2) + 32));
            if (!signs) std::abort();  // as operator new would, without its exception
            split_sign(A_u8, M, Kp, lda_u8, signs, reinterpret_cast<int8_t*>(signs + plane));
            if (dual)
                split_sign(A_lo_u8, M, Kp, lda_u8, signs + 2 * plane,
                           reinterpret_cast<int8_t*>(signs + 3 * plane));
        }
        return signs;
    };
    auto int16_rows = [&]() {
        if (!wide) {
            wide = static_cast<int16_t*>(std::malloc(plane * (dual ? 4 : 2) + 32));
            if (!wide) std::abort();
            widen_rows(A_u8, M, Kp, lda_u8, wide);
            if (dual) widen_rows(A_lo_u8, M, Kp, lda_u8, wide + plane);
        }
        return wide;
    };
    auto joint_rows = [&]() {
        if (!joint) {
            joint = static_cast<int16_t*>(std::malloc(plane * 2 + 32));
            if (!joint) std::abort();
            join_rows(A_u8, A_lo_u8, M, Kp, lda_u8, joint);
        }
        return joint;
    };
    // At most 2 rows: int16 tiles straight away, no pass over B first (it would cost as much
    // as the product). Plain rows are exact for any weight; the joined operand is, with
    // Kp <= 256, whatever the weights (256 * 128 * Kp stays within the slack).
    if (M <= 2 && (!dual || (joined && 256 * 128 * Kp < slack))) {
        if (!dual) {
            const int16_t* a = int16_rows();
            for (int64_t nb = 0; nb < nblocks; ++nb) rows16(a, Kp, B, kq, 0, M, nb, N, ep, nullptr);
        } else {
            const int16_t* a = joint_rows();
            for (int64_t nb = 0; nb < nblocks; ++nb) {
                if (M == 2)
                    micro16<2, true>(a, Kp, B, kq, 0, nb, N, ep, nullptr);
                else
                    micro16<1, true>(a, Kp, B, kq, 0, nb, N, ep, nullptr);
            }
        }
        std::free(joint);
        std::free(wide);
        return;
    }
    // Per block: 128 sum w, whether it holds -128, whether the joined operand may be used.
    __m256i* sums = static_cast<__m256i*>(std::aligned_alloc(32, 64 * (nblocks + 1)));
    uint8_t* kind = static_cast<uint8_t*>(std::malloc(nblocks + 1));  // 0 sign, 1 -128, 2 join
    if (!sums || !kind) std::abort();
    for (int64_t nb = 0; nb < nblocks; ++nb) {
        const int8_t* b = B + nb * kq * 64;
        kind[nb] = block_sums(b, kq, sums + 2 * nb) ? 1 : 0;
        if (!kind[nb] && joined && 256 * int64_t{block_abs(b, kq)} < slack) kind[nb] = 2;
    }
    // Panels of rows whose operands stay in L1 (16 KB) while every block passes over them;
    // a multiple of the tiles' 3 and 4 rows. A sign-trick GEMV takes blocks in pairs.
    const int64_t panel = std::max<int64_t>(12, 16384 / (2 * Kp) / 12 * 12);
    for (int64_t r0 = 0; r0 < M; r0 += panel) {
        const int64_t r1 = r0 + panel < M ? r0 + panel : M;
        for (int64_t nb = 0; nb < nblocks;) {
            const __m256i(*sj)[2] = reinterpret_cast<const __m256i(*)[2]>(sums + 2 * nb);
            if (kind[nb] == 1) {
                const int16_t* w = int16_rows();
                if (dual)
                    rows_int16(w, w + plane, Kp, B, kq, r0, r1, nb, N, ep);
                else
                    rows16(w, Kp, B, kq, r0, r1, nb, N, ep, nullptr);
                ++nb;
                continue;
            }
            if (kind[nb] == 2) {
                rows16(joint_rows(), Kp, B, kq, r0, r1, nb, N, ep, sums + 2 * nb);
                ++nb;
                continue;
            }
            const uint8_t* ax = sign_planes();
            const int8_t* sx = reinterpret_cast<const int8_t*>(ax + plane);
            const uint8_t* ax2 = dual ? ax + 2 * plane : nullptr;
            const int8_t* sx2 = dual ? reinterpret_cast<const int8_t*>(ax + 3 * plane) : nullptr;
            if (dual) {
                rows_sign<1, true>(ax, sx, ax2, sx2, Kp, B, kq, r0, r1, nb, N, sj, ep);
                ++nb;
            } else if (M < 2 && nb + 1 < nblocks && kind[nb + 1] == 0) {
                rows_sign<2, false>(ax, sx, ax2, sx2, Kp, B, kq, r0, r1, nb, N, sj, ep);
                nb += 2;
            } else {
                rows_sign<1, false>(ax, sx, ax2, sx2, Kp, B, kq, r0, r1, nb, N, sj, ep);
                ++nb;
            }
        }
    }
    std::free(kind);
    std::free(sums);
    std::free(joint);
    std::free(wide);
    std::free(signs);
}

using x86_256::load8;
using x86_256::round8;
using x86_256::store8;
using x86_256::store8_bytes;
using x86_256::vsig;
using x86_256::vtanh;

static inline __m256i vquant(__m256 h, float inv, float zp) {
    __m256 q = _mm256_add_ps(round8(_mm256_mul_ps(h, _mm256_set1_ps(inv))), _mm256_set1_ps(zp));
    return _mm256_cvtps_epi32(x86_256::clamp8(q, -128.0f, 127.0f));
}

// Gate math of one batch row (qt::CellFn), the AVX-512 path's arithmetic 8 lanes at a time.
void cell_avx2(const RnnStep& s, const float* gx, const float* gh, float* h, float* c,
               uint8_t* hu8, int8_t* y, float* yf, float* raw) {
    const int64_t H = s.H;
    for (int64_t j = 0; j < H; j += 8) {
        const int64_t m = H - j < 8 ? H - j : 8;
        auto pre = [&](int64_t g) {
            return _mm256_add_ps(load8(gx + g * H + j, m), load8(gh + g * H + j, m));
        };
        __m256 hv;
        if (s.kind == LSTM) {
            const __m256 i = vsig(pre(0)), f = vsig(pre(1)), g = vtanh(pre(2)), o = vsig(pre(3));
            const __m256 cv = _mm256_fmadd_ps(f, load8(c + j, m), _mm256_mul_ps(i, g));
            store8(c + j, cv, m);
            hv = _mm256_mul_ps(o, vtanh(cv));
            if (raw) {
                store8(raw + j, hv, m);
                continue;
            }
        } else if (s.kind == GRU) {
            const __m256 r = vsig(pre(0)), z = vsig(pre(1));
            const __m256 n =
                vtanh(_mm256_fmadd_ps(r, load8(gh + 2 * H + j, m), load8(gx + 2 * H + j, m)));
            hv = _mm256_fmadd_ps(z, _mm256_sub_ps(load8(h + j, m), n), n);
        } else if (s.kind == RNN_TANH) {
            hv = vtanh(pre(0));
        } else {
            hv = _mm256_max_ps(pre(0), _mm256_setzero_ps());
        }
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
}

void activation_avx2(int kind, const float* a, float* out, int64_t n) {
    for (int64_t j = 0; j < n; j += 8) {
        const int64_t m = n - j < 8 ? n - j : 8;
        const __m256 x = load8(a + j, m);
        store8(out + j, kind == 0 ? vsig(x) : vtanh(x), m);
    }
}

}  // namespace qt
