// AVX-512 VNNI path: the GEMM micro-kernels (one `vpdpbusd` multiplies 64 u8 x s8 pairs),
// the recurrent gate math and the float activations, 16 lanes wide. Compiled with
// -march=x86-64-v4 -mavx512vnni whatever the rest of the library's flags; only reached
// through qt::kernels when the CPU reports these extensions. No standard library templates
// here: a copy instantiated with AVX-512 flags could be the one the portable code links to.
#include <immintrin.h>

#include <cstring>

#include "qt_kernels.h"
#include "qt_vmath.h"

namespace qt {

static inline void store_block(const Epilogue& ep, int64_t row, int64_t n0, int64_t N,
                               __m512i acc, const __m512i* lo) {
    const int64_t rem = N - n0;
    const __mmask16 m = rem >= 16 ? static_cast<__mmask16>(0xFFFF)
                                  : static_cast<__mmask16>((1u << rem) - 1u);
    if (ep.row_off) acc = _mm512_add_epi32(acc, _mm512_set1_epi32(ep.row_off[row]));
    __m512 v = _mm512_cvtepi32_ps(_mm512_add_epi32(acc, _mm512_maskz_loadu_epi32(m, ep.off + n0)));
    if (lo) v = _mm512_fmadd_ps(v, _mm512_set1_ps(256.0f), _mm512_cvtepi32_ps(*lo));
    if (ep.mult) {
        // mul then add (not an FMA): with power-of-two scales this rounds exactly like
        // the reference's (acc * scale + bias) / out_scale
        __m512 q = _mm512_add_ps(_mm512_mul_ps(v, _mm512_maskz_loadu_ps(m, ep.mult + n0)),
                                 _mm512_maskz_loadu_ps(m, ep.add + n0));
        q = _mm512_roundscale_ps(q, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        q = _mm512_add_ps(q, _mm512_set1_ps(ep.zero_point));  // after rounding: ties to even
        q = _mm512_min_ps(_mm512_max_ps(q, _mm512_set1_ps(ep.qmin)), _mm512_set1_ps(ep.qmax));
        _mm512_mask_cvtsepi32_storeu_epi8(ep.out_q + row * ep.ldc + n0, m,
                                          _mm512_cvtps_epi32(q));
        return;
    }
    __m512 y = _mm512_mul_ps(v, _mm512_maskz_loadu_ps(m, ep.scale + n0));
    if (ep.bias) y = _mm512_add_ps(y, _mm512_maskz_loadu_ps(m, ep.bias + n0));
    if (ep.out_f) {
        float* dst = ep.out_f + row * ep.ldc + n0;
        if (ep.accumulate) y = _mm512_add_ps(y, _mm512_maskz_loadu_ps(m, dst));
        _mm512_mask_storeu_ps(dst, m, y);
        return;
    }
    __m512 q = _mm512_roundscale_ps(_mm512_mul_ps(y, _mm512_set1_ps(ep.inv_scale)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    q = _mm512_add_ps(q, _mm512_set1_ps(ep.zero_point));
    q = _mm512_min_ps(_mm512_max_ps(q, _mm512_set1_ps(ep.qmin)), _mm512_set1_ps(ep.qmax));
    _mm512_mask_cvtsepi32_storeu_epi8(ep.out_q + row * ep.ldc + n0, m, _mm512_cvtps_epi32(q));
}

static inline __m512i broadcast4(const uint8_t* p) {
    int32_t four;
    std::memcpy(&four, p, 4);
    return _mm512_set1_epi32(four);
}

// acc += a . b (u8 x s8, 4 products per lane). Inline asm keeps each accumulator in one
// register: with the intrinsic, GCC 12 copies every accumulator each iteration.
static inline void dpbusd(__m512i& acc, __m512i a, __m512i b) {
    asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b));
}

// MR rows x NR blocks of 16 columns; DUAL also multiplies the rows of a second (low byte)
// plane A2 and combines 256 * (acc + off) + acc2.
template <int MR, int NR, bool DUAL>
static void micro(const uint8_t* A, const uint8_t* A2, int64_t lda, const int8_t* B,
                  int64_t kq, int64_t row0, int64_t nb0, int64_t N, const Epilogue& ep) {
    __m512i acc[MR * NR], acc2[DUAL ? MR * NR : 1];
#pragma GCC unroll 32
    for (int i = 0; i < MR * NR; ++i) acc[i] = _mm512_setzero_si512();
    if constexpr (DUAL) {
#pragma GCC unroll 32
        for (int i = 0; i < MR * NR; ++i) acc2[i] = _mm512_setzero_si512();
    }
    const int8_t* b = B + nb0 * kq * 64;
    const uint8_t* a0 = A + row0 * lda;
    const uint8_t* a2 = DUAL ? A2 + row0 * lda : nullptr;
    for (int64_t k = 0; k < kq; ++k) {
        __m512i bv[NR];
#pragma GCC unroll 8
        for (int j = 0; j < NR; ++j) bv[j] = _mm512_loadu_si512(b + (j * kq + k) * 64);
#pragma GCC unroll 4
        for (int i = 0; i < MR; ++i) {
            const __m512i a = broadcast4(a0 + i * lda + 4 * k);
#pragma GCC unroll 8
            for (int j = 0; j < NR; ++j) dpbusd(acc[i * NR + j], a, bv[j]);
            if constexpr (DUAL) {
                const __m512i c = broadcast4(a2 + i * lda + 4 * k);
#pragma GCC unroll 8
                for (int j = 0; j < NR; ++j) dpbusd(acc2[i * NR + j], c, bv[j]);
            }
        }
    }
    // A float output of whole blocks (the recurrent layers' gx / gh): each block's offset,
    // scale and bias loaded once for the MR rows and nothing decided per row; the arithmetic
    // of store_block in its order, so the same bits. (Its stores may alias ep's floats, so
    // the compiler reloaded them, and re-tested ep's fields, for every row and block.)
    if (ep.out_f && !ep.mult && !ep.row_off && !ep.accumulate && (nb0 + NR) * 16 <= N) {
        float* out = ep.out_f + row0 * ep.ldc + nb0 * 16;
        const int64_t ldc = ep.ldc;
        const bool has_bias = ep.bias != nullptr;
#pragma GCC unroll 8
        for (int j = 0; j < NR; ++j) {
            const int64_t n0 = (nb0 + j) * 16;
            const __m512i off = _mm512_loadu_si512(ep.off + n0);
            const __m512 sc = _mm512_loadu_ps(ep.scale + n0);
            const __m512 bi = has_bias ? _mm512_loadu_ps(ep.bias + n0) : _mm512_setzero_ps();
#pragma GCC unroll 4
            for (int i = 0; i < MR; ++i) {
                __m512 v = _mm512_cvtepi32_ps(_mm512_add_epi32(acc[i * NR + j], off));
                if constexpr (DUAL)
                    v = _mm512_fmadd_ps(v, _mm512_set1_ps(256.0f),
                                        _mm512_cvtepi32_ps(acc2[DUAL ? i * NR + j : 0]));
                __m512 y = _mm512_mul_ps(v, sc);
                if (has_bias) y = _mm512_add_ps(y, bi);
                _mm512_storeu_ps(out + i * ldc + j * 16, y);
            }
        }
        return;
    }
#pragma GCC unroll 4
    for (int i = 0; i < MR; ++i) {
#pragma GCC unroll 8
        for (int j = 0; j < NR; ++j) {
            store_block(ep, row0 + i, (nb0 + j) * 16, N, acc[i * NR + j],
                        DUAL ? &acc2[DUAL ? i * NR + j : 0] : nullptr);
        }
    }
}

using Micro = void (*)(const uint8_t*, const uint8_t*, int64_t, const int8_t*, int64_t,
                       int64_t, int64_t, int64_t, const Epilogue&);

static Micro pick(int mr, int nr, bool dual) {
    static const Micro single[4][4] = {
        {micro<1, 1, false>, micro<1, 2, false>, micro<1, 3, false>, micro<1, 4, false>},
        {micro<2, 1, false>, micro<2, 2, false>, micro<2, 3, false>, micro<2, 4, false>},
        {micro<3, 1, false>, micro<3, 2, false>, micro<3, 3, false>, micro<3, 4, false>},
        {micro<4, 1, false>, micro<4, 2, false>, micro<4, 3, false>, micro<4, 4, false>},
    };
    static const Micro two[2][4] = {
        {micro<1, 1, true>, micro<1, 2, true>, micro<1, 3, true>, micro<1, 4, true>},
        {micro<2, 1, true>, micro<2, 2, true>, micro<2, 3, true>, micro<2, 4, true>},
    };
    return dual ? two[mr - 1][nr - 1] : single[mr - 1][nr - 1];
}

// One row against NR blocks of 16 columns, for products of one to three rows (the recurrent
// step at batch 1): there the weights stream from L2 and the loads, not the multiply-adds,
// set the pace. Few blocks at a time means few concurrent streams (eight streams one block
// apart, 4 KiB each for K = 256, alias in L1's sets); the k loop is split in two phases
// (even and odd k, summed at the end: int32 sums wrap exactly, so the result is the same
// bits) to keep enough independent multiply-adds in flight.
template <int NR, bool DUAL>
static void gemv_blocks(const uint8_t* a, const uint8_t* a2, const int8_t* B, int64_t kq,
                        int64_t row, int64_t nb0, int64_t N, const Epilogue& ep) {
    __m512i acc[NR][2], acc2[DUAL ? NR : 1][2];
#pragma GCC unroll 8
    for (int j = 0; j < NR; ++j) acc[j][0] = acc[j][1] = _mm512_setzero_si512();
    if constexpr (DUAL) {
#pragma GCC unroll 8
        for (int j = 0; j < NR; ++j) acc2[j][0] = acc2[j][1] = _mm512_setzero_si512();
    }
    const int8_t* b = B + nb0 * kq * 64;
    int64_t k = 0;
    for (; k + 2 <= kq; k += 2) {
        const __m512i x0 = broadcast4(a + 4 * k), x1 = broadcast4(a + 4 * k + 4);
        __m512i y0 = x0, y1 = x1;
        if constexpr (DUAL) {
            y0 = broadcast4(a2 + 4 * k);
            y1 = broadcast4(a2 + 4 * k + 4);
        }
#pragma GCC unroll 8
        for (int j = 0; j < NR; ++j) {
            const __m512i w0 = _mm512_loadu_si512(b + (j * kq + k) * 64);
            const __m512i w1 = _mm512_loadu_si512(b + (j * kq + k + 1) * 64);
            dpbusd(acc[j][0], x0, w0);
            dpbusd(acc[j][1], x1, w1);
            if constexpr (DUAL) {
                dpbusd(acc2[j][0], y0, w0);
                dpbusd(acc2[j][1], y1, w1);
            }
        }
    }
    if (k < kq) {
        const __m512i x0 = broadcast4(a + 4 * k);
        __m512i y0 = x0;
        if constexpr (DUAL) y0 = broadcast4(a2 + 4 * k);
#pragma GCC unroll 8
        for (int j = 0; j < NR; ++j) {
            const __m512i w0 = _mm512_loadu_si512(b + (j * kq + k) * 64);
            dpbusd(acc[j][0], x0, w0);
            if constexpr (DUAL) dpbusd(acc2[j][0], y0, w0);
        }
    }
#pragma GCC unroll 8
    for (int j = 0; j < NR; ++j) {
        __m512i lo = _mm512_setzero_si512();
        if constexpr (DUAL) lo = _mm512_add_epi32(acc2[j][0], acc2[j][1]);
        store_block(ep, row, (nb0 + j) * 16, N, _mm512_add_epi32(acc[j][0], acc[j][1]),
                    DUAL ? &lo : nullptr);
    }
}

template <bool DUAL>
static void gemv_tail(int nr, const uint8_t* a, const uint8_t* a2, const int8_t* B,
                      int64_t kq, int64_t row, int64_t nb0, int64_t N, const Epilogue& ep) {
    if (nr == 1) gemv_blocks<1, DUAL>(a, a2, B, kq, row, nb0, N, ep);
    if (nr == 2) gemv_blocks<2, DUAL>(a, a2, B, kq, row, nb0, N, ep);
    if (nr == 3) gemv_blocks<3, DUAL>(a, a2, B, kq, row, nb0, N, ep);
}

// Rows one at a time, the column blocks in groups of four, walked forwards and backwards on
// alternate calls: a recurrent layer calls this once per time step on the same weights, and
// a walk that starts where the last one ended finds those blocks still in L2 (with W_hh
// about the size of L2, a walk always in the same direction evicts each block just before
// it is read again). The order of the blocks does not change any result.
template <bool DUAL>
static void gemv_rows(int64_t M, int64_t N, int64_t kq, const uint8_t* A, int64_t lda,
                      const int8_t* B, const Epilogue& ep, const uint8_t* A_lo) {
    static thread_local bool backwards = false;
    const int64_t nblocks = (N + 15) / 16, full = nblocks / 4 * 4;
    const int tail = static_cast<int>(nblocks - full);
    for (int64_t r = 0; r < M; ++r) {
        const uint8_t* a = A + r * lda;
        const uint8_t* a2 = DUAL ? A_lo + r * lda : nullptr;
        backwards = !backwards;
        if (!backwards) {
            for (int64_t nb = 0; nb < full; nb += 4) gemv_blocks<4, DUAL>(a, a2, B, kq, r, nb, N, ep);
            gemv_tail<DUAL>(tail, a, a2, B, kq, r, full, N, ep);
        } else {
            gemv_tail<DUAL>(tail, a, a2, B, kq, r, full, N, ep);
            for (int64_t nb = full - 4; nb >= 0; nb -= 4) gemv_blocks<4, DUAL>(a, a2, B, kq, r, nb, N, ep);
        }
    }
}


// ---- AMX (Sapphire Rapids and later): the same products on 16 x 64-byte tiles ---------------
//
// Why a hand-written kernel: no well-kept library in the installed stack runs an int8 GEMM on
// AMX with quantree's packed weights and epilogue. XNNPACK's qs8 convolutions (ExecuTorch)
// stop at AVX-512 VNNI, and oneDNN's int8 primitives (torch.ops.onednn) take uint8
// activations and their own opaque weight (benchmarks/README.md, "oneDNN's int8 ops"). The
// packed weight layout ([blocks of 16 columns][Kp/4][16][4]) is already AMX's B-tile layout:
// 16 consecutive k-quads of one block are one 16 x 64-byte tile, read in place. One
// `tdpbusd` does 16 x 16 x 64 u8 x s8 products (int32 sums that wrap as vpdpbusd's do), so
// the results are the VNNI path's bits; the epilogue is store_block's arithmetic (store_rows).
// The one AMX GEMM: a second one (isa_amx.cpp, column blocks outermost, float epilogue
// only) was as fast or slower at every shape from 2 M multiply-adds and went (branch
// `h-amx26` in benchmarks/README.md).

struct TileConfig {
    uint8_t palette, start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

// TR row tiles x TC column tiles of C (at most 2 x 2: 4 accumulators, 2 A and 2 B tiles fill
// the 8 tile registers). A rows at a (stride lda) for the kfull whole 64-byte k tiles, then
// the k tail from at (stride 64, zero padded); B blocks from b (tail from bt, zero padded).
// The second row tile reads a1 (the next 16 rows of A, or the same rows' low-byte plane).
template <int TR, int TC>
__attribute__((target("amx-tile,amx-int8"))) static void amx_block(
    const uint8_t* a, const uint8_t* a1, int64_t lda, const uint8_t* at, const int8_t* b,
    int64_t kq, const int8_t* bt, int64_t kfull, int32_t* c) {
    _tile_zero(0);
    if (TC > 1) _tile_zero(1);
    if (TR > 1) _tile_zero(2);
    if (TR > 1 && TC > 1) _tile_zero(3);
    for (int64_t k = 0; k < kfull; ++k) {
        _tile_loadd(4, a + k * 64, lda);
        _tile_loadd(6, b + k * 1024, 64);
        if (TC > 1) _tile_loadd(7, b + kq * 64 + k * 1024, 64);
        _tile_dpbusd(0, 4, 6);
        if (TC > 1) _tile_dpbusd(1, 4, 7);
        if (TR > 1) {
            _tile_loadd(5, a1 + k * 64, lda);
            _tile_dpbusd(2, 5, 6);
            if (TC > 1) _tile_dpbusd(3, 5, 7);
        }
    }
    if (at) {
        _tile_loadd(4, at, 64);
        _tile_loadd(6, bt, 64);
        if (TC > 1) _tile_loadd(7, bt + 1024, 64);
        _tile_dpbusd(0, 4, 6);
        if (TC > 1) _tile_dpbusd(1, 4, 7);
        if (TR > 1) {
            _tile_loadd(5, at + 1024, 64);
            _tile_dpbusd(2, 5, 6);
            if (TC > 1) _tile_dpbusd(3, 5, 7);
        }
    }
    _tile_stored(0, c, 128);
    if (TC > 1) _tile_stored(1, c + 16, 128);
    if (TR > 1) _tile_stored(2, c + 512, 128);
    if (TR > 1 && TC > 1) _tile_stored(3, c + 528, 128);
}

__attribute__((target("amx-tile,amx-int8"))) static void amx_config() {
    alignas(64) TileConfig cfg;
    std::memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; ++t) {
        cfg.colsb[t] = 64;
        cfg.rows[t] = 16;
    }
    // inline asm, not _tile_loadconfig: GCC 12 does not see that builtin read the
    // configuration and dropped the stores filling it (every tile then faulted as unconfigured)
    asm volatile("ldtilecfg %0" : : "m"(cfg));
}

__attribute__((target("amx-tile"))) static void amx_release() { _tile_release(); }

// store_block for rows r0 .. r0 + m - 1 of one block of 16 columns, the accumulators at c
// (and the low plane's at lo) with a row stride of 32: the column constants loaded once for
// the block rather than once a row. The same operations in the same order: the same bits.
static void store_rows(const Epilogue& ep, int64_t r0, int64_t m, int64_t n0, int64_t N,
                       const int32_t* c, const int32_t* lo) {
    const int64_t rem = N - n0;
    const __mmask16 k = rem >= 16 ? static_cast<__mmask16>(0xFFFF)
                                  : static_cast<__mmask16>((1u << rem) - 1u);
    const __m512i off = _mm512_maskz_loadu_epi32(k, ep.off + n0);
    const __m512 zp = _mm512_set1_ps(ep.zero_point), qmin = _mm512_set1_ps(ep.qmin),
                 qmax = _mm512_set1_ps(ep.qmax), two8 = _mm512_set1_ps(256.0f);
    auto value = [&](int64_t i) {
        __m512i acc = _mm512_load_si512(c + i * 32);
        if (ep.row_off) acc = _mm512_add_epi32(acc, _mm512_set1_epi32(ep.row_off[r0 + i]));
        __m512 v = _mm512_cvtepi32_ps(_mm512_add_epi32(acc, off));
        if (lo) v = _mm512_fmadd_ps(v, two8, _mm512_cvtepi32_ps(_mm512_load_si512(lo + i * 32)));
        return v;
    };
    auto store_q = [&](int64_t i, __m512 q) {
        q = _mm512_roundscale_ps(q, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        q = _mm512_add_ps(q, zp);
        q = _mm512_min_ps(_mm512_max_ps(q, qmin), qmax);
        _mm512_mask_cvtsepi32_storeu_epi8(ep.out_q + (r0 + i) * ep.ldc + n0, k,
                                          _mm512_cvtps_epi32(q));
    };
    if (ep.mult) {
        const __m512 mu = _mm512_maskz_loadu_ps(k, ep.mult + n0), ad = _mm512_maskz_loadu_ps(k, ep.add + n0);
        for (int64_t i = 0; i < m; ++i) store_q(i, _mm512_add_ps(_mm512_mul_ps(value(i), mu), ad));
        return;
    }
    const __m512 sc = _mm512_maskz_loadu_ps(k, ep.scale + n0);
    const __m512 bi = ep.bias ? _mm512_maskz_loadu_ps(k, ep.bias + n0) : _mm512_setzero_ps();
    for (int64_t i = 0; i < m; ++i) {
        __m512 y = _mm512_mul_ps(value(i), sc);
        if (ep.bias) y = _mm512_add_ps(y, bi);
        if (ep.out_f) {
            float* dst = ep.out_f + (r0 + i) * ep.ldc + n0;
            if (ep.accumulate) y = _mm512_add_ps(y, _mm512_maskz_loadu_ps(k, dst));
            _mm512_mask_storeu_ps(dst, k, y);
        } else {
            store_q(i, _mm512_mul_ps(y, _mm512_set1_ps(ep.inv_scale)));
        }
    }
}

// The AMX GEMM's scratch, one per thread, kept between calls: allocating and freeing it on
// every call was an eighth of a small product's time (glibc consolidating the freed chunk).
struct AmxScratch {
    uint8_t* data = nullptr;
    size_t size = 0;
    uint8_t* take(size_t n) {
        if (n > size) {
            std::free(data);
            data = nullptr;
            size = 0;
            const size_t rounded = (n + 4095) / 4096 * 4096;
            data = static_cast<uint8_t*>(std::aligned_alloc(64, rounded));
            if (!data) throw std::bad_alloc();
            size = rounded;
        }
        return data;
    }
    ~AmxScratch() { std::free(data); }
};
static thread_local AmxScratch amx_scratch;

// C = epilogue(A . B) for M >= 16 rows. Rows go in panels of 32 (a panel's A stays in L1/L2
// while every column block passes); with a second plane A_lo, panels of 16 rows whose second
// row tile is that plane (store_block combines the two as the VNNI path does). A panel with
// fewer rows, and every panel's k tail (Kp % 64 bytes), are copied zero padded, and so are
// the B blocks' k tails (the tile would read the next block's, or past the weight's end).
// A last panel of 17-31 rows runs as 16 rows read in place, then the rest; a rest of fewer
// than 8 rows goes to the vector kernels (a padded tile of 16 costs more than they do).
static void gemm_amx(int64_t M, int64_t N, int64_t Kp, const uint8_t* A, int64_t lda,
                     const int8_t* B, const Epilogue& ep, const uint8_t* A_lo) {
    const int64_t kq = Kp / 4, kfull = Kp / 64, tail = Kp - kfull * 64;
    const int64_t nblocks = (N + 15) / 16, K64 = (Kp + 63) / 64 * 64;
    const bool dual = A_lo != nullptr;
    const int64_t step = dual ? 16 : 32;
    // scratch: B tails (nblocks x 1 KiB), A tails (2 KiB), a short panel (32 x K64), C (4 KiB)
    const int64_t bt_bytes = tail ? nblocks * 1024 : 0, short_bytes = 32 * K64;
    uint8_t* scratch = amx_scratch.take(static_cast<size_t>(bt_bytes + 2048 + short_bytes + 4096));
    int8_t* bt = reinterpret_cast<int8_t*>(scratch);
    uint8_t* atail = scratch + bt_bytes;
    uint8_t* panel_copy = atail + 2048;
    int32_t* c = reinterpret_cast<int32_t*>(panel_copy + short_bytes);
    if (tail) {
        std::memset(bt, 0, static_cast<size_t>(bt_bytes));
        for (int64_t j = 0; j < nblocks; ++j)
            std::memcpy(bt + j * 1024, B + (j * kq + kfull * 16) * 64, static_cast<size_t>(tail * 16));
    }
    const int64_t left = M % 16, M_tiles = left && left < 8 ? M - left : M;
    amx_config();
    for (int64_t r0 = 0, m = 0; r0 < M_tiles; r0 += m) {
        m = M_tiles - r0 < step ? M_tiles - r0 : step;
        if (!dual && m > 16 && m < 32) m = 16;  // whole rows in place; the rest next
        const int tr = dual || m > 16 ? 2 : 1;
        // the panel's two row tiles: rows r0.. and r0 + 16.. (or the low plane's rows r0..)
        const uint8_t* a = A + r0 * lda;
        const uint8_t* a1 = dual ? A_lo + r0 * lda : a + 16 * lda;
        int64_t stride = lda;
        if (m < (dual ? 16 : 16 * tr)) {  // a short panel: its rows, zero padded to whole tiles
            std::memset(panel_copy, 0, static_cast<size_t>(short_bytes));
            for (int64_t i = 0; i < m; ++i) {
                std::memcpy(panel_copy + i * K64, a + i * lda, static_cast<size_t>(Kp));
                const uint8_t* second = dual ? a1 + i * lda : a + (16 + i) * lda;
                if (dual || 16 + i < m)
                    std::memcpy(panel_copy + (16 + i) * K64, second, static_cast<size_t>(Kp));
            }
            a = panel_copy;
            a1 = panel_copy + 16 * K64;
            stride = K64;
        }
        const uint8_t* at = nullptr;
        if (tail) {
            std::memset(atail, 0, 2048);
            for (int64_t i = 0; i < 16; ++i) {
                if (i < m)
                    std::memcpy(atail + i * 64, a + i * stride + kfull * 64, static_cast<size_t>(tail));
                if (dual ? i < m : 16 + i < m)
                    std::memcpy(atail + (16 + i) * 64, a1 + i * stride + kfull * 64,
                                static_cast<size_t>(tail));
            }
            at = atail;
        }
        for (int64_t nb = 0; nb < nblocks; nb += 2) {
            const int tc = nblocks - nb > 1 ? 2 : 1;
            const int8_t* b = B + nb * kq * 64;
            const int8_t* btn = bt + nb * 1024;
            if (tr == 2 && tc == 2) amx_block<2, 2>(a, a1, stride, at, b, kq, btn, kfull, c);
            else if (tr == 2) amx_block<2, 1>(a, a1, stride, at, b, kq, btn, kfull, c);
            else if (tc == 2) amx_block<1, 2>(a, a1, stride, at, b, kq, btn, kfull, c);
            else amx_block<1, 1>(a, a1, stride, at, b, kq, btn, kfull, c);
            for (int j = 0; j < tc; ++j)
                store_rows(ep, r0, m, (nb + j) * 16, N, c + j * 16, dual ? c + 512 + j * 16 : nullptr);
        }
    }
    amx_release();
    if (M_tiles < M) {
        Epilogue rest = ep;
        if (ep.out_f) rest.out_f = ep.out_f + M_tiles * ep.ldc;
        if (ep.out_q) rest.out_q = ep.out_q + M_tiles * ep.ldc;
        if (ep.row_off) rest.row_off = ep.row_off + M_tiles;
        gemm_avx512vnni(M - M_tiles, N, Kp, A + M_tiles * lda, lda, B, rest,
                        dual ? A_lo + M_tiles * lda : nullptr);
    }
}

// The AVX-512 VNNI path's GEMM where the CPU and the OS offer AMX (qt_select_isa sets it in
// its place, qt_amx switches): products of 16 rows and more on the tiles, from the size
// where they pay, the rest on the vector micro-kernels. AMX costs about a microsecond a call
// whatever the size (tile set-up, scratch): measured on Sapphire Rapids it pays from about
// 1 M multiply-adds, and not at all below 64 bytes of k, where every row of every panel is a
// zero-padded copy of its k tail (benchmarks/README.md, branches `cnnspeed` and `h-amx26`).
void gemm_avx512amx(int64_t M, int64_t N, int64_t Kp, const uint8_t* A, int64_t lda,
                    const int8_t* B, const Epilogue& ep, const uint8_t* A_lo) {
    if (M >= 16 && Kp >= 64 && M * ((N + 15) / 16 * 16) * Kp >= (int64_t{1} << 20))
        gemm_amx(M, N, Kp, A, lda, B, ep, A_lo);
    else
        gemm_avx512vnni(M, N, Kp, A, lda, B, ep, A_lo);
}

// The same with every product of 16 rows and more on the tiles whatever its size: what the
// checks run (qt_amx(2)), so that small odd shapes reach the tiles' tails too.
void gemm_avx512amx_all(int64_t M, int64_t N, int64_t Kp, const uint8_t* A, int64_t lda,
                        const int8_t* B, const Epilogue& ep, const uint8_t* A_lo) {
    if (M >= 16)
        gemm_amx(M, N, Kp, A, lda, B, ep, A_lo);
    else
        gemm_avx512vnni(M, N, Kp, A, lda, B, ep, A_lo);
}

void gemm_avx512vnni(int64_t M, int64_t N, int64_t Kp, const uint8_t* A, int64_t lda,
               const int8_t* B, const Epilogue& ep, const uint8_t* A_lo) {
    const int64_t nblocks = (N + 15) / 16, kq = Kp / 4;
    const bool dual = A_lo != nullptr;
    const int mr_max = dual ? 2 : 4;
    if (M < mr_max) {  // GEMV-like
        if (dual) gemv_rows<true>(M, N, kq, A, lda, B, ep, A_lo);
        else gemv_rows<false>(M, N, kq, A, lda, B, ep, A_lo);
        return;
    }
    // Row panels sized for L1/L2, then column blocks, then rows within the panel.
    const int64_t panel = 64;
    for (int64_t r0 = 0; r0 < M; r0 += panel) {
        const int64_t r1 = r0 + panel < M ? r0 + panel : M;
        for (int64_t nb = 0; nb < nblocks; nb += 4) {
            const int nr = static_cast<int>(nblocks - nb < 4 ? nblocks - nb : 4);
            int64_t r = r0;
            for (; r + mr_max <= r1; r += mr_max) pick(mr_max, nr, dual)(A, A_lo, lda, B, kq, r, nb, N, ep);
            for (; r < r1; ++r) pick(1, nr, dual)(A, A_lo, lda, B, kq, r, nb, N, ep);
        }
    }
}



static inline __m512i vquant(__m512 h, float inv, float zp) {
    __m512 q = _mm512_roundscale_ps(_mm512_mul_ps(h, _mm512_set1_ps(inv)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    q = _mm512_add_ps(q, _mm512_set1_ps(zp));
    q = _mm512_min_ps(_mm512_max_ps(q, _mm512_set1_ps(-128.0f)), _mm512_set1_ps(127.0f));
    return _mm512_cvtps_epi32(q);
}

// h (16 lanes under mask m) of one batch row written where the step wants it: the float
// state, the feedback operand (int8, or int16 as two uint8 planes) and the output.
static inline void emit16(const RnnStep& s, __m512 hv, int64_t j, __mmask16 m, float* h,
                          uint8_t* hu8, int8_t* y, float* yf) {
    _mm512_mask_storeu_ps(h + j, m, hv);
    if (s.lo_offset) {
        __m512 q = _mm512_roundscale_ps(_mm512_mul_ps(hv, _mm512_set1_ps(s.h_inv)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        q = _mm512_min_ps(_mm512_max_ps(q, _mm512_set1_ps(-32768.0f)), _mm512_set1_ps(32767.0f));
        const __m512i qi = _mm512_cvtps_epi32(q);
        const __m512i hi = _mm512_add_epi32(_mm512_srai_epi32(qi, 8), _mm512_set1_epi32(128));
        const __m512i lo = _mm512_and_si512(qi, _mm512_set1_epi32(255));
        _mm512_mask_cvtusepi32_storeu_epi8(hu8 + j, m, hi);
        _mm512_mask_cvtusepi32_storeu_epi8(hu8 + s.lo_offset + j, m, lo);
    } else {
        const __m512i hq = _mm512_add_epi32(vquant(hv, s.h_inv, s.h_zp), _mm512_set1_epi32(128));
        _mm512_mask_cvtusepi32_storeu_epi8(hu8 + j, m, hq);
    }
    if (yf)
        _mm512_mask_storeu_ps(yf + j, m, hv);
    else
        _mm512_mask_cvtsepi32_storeu_epi8(y + j, m, vquant(hv, s.y_inv, s.y_zp));
}

static inline __mmask16 lanes16(int64_t left) {
    return left >= 16 ? static_cast<__mmask16>(0xFFFF)
                      : static_cast<__mmask16>((1u << left) - 1u);
}

// The LSTM's gate math in two passes over blocks of 64 columns, the four gates first, then
// the cell and hidden state: in one pass each 16 columns were a chain of dependent
// transcendentals (gates, then tanh(c)) longer than the reorder window could overlap (as in
// isa_avx2.cpp's lstm_avx2). Same arithmetic, same bits.
static void lstm_avx512(const RnnStep& s, const float* gx, const float* gh, float* h, float* c,
                        uint8_t* hu8, int8_t* y, float* yf, float* raw) {
    const int64_t H = s.H;
    alignas(64) float gate[4][64];
    for (int64_t j0 = 0; j0 < H; j0 += 64) {
        const int64_t w = H - j0 < 64 ? H - j0 : 64;
        for (int64_t j = 0; j < w; j += 16) {
            const __mmask16 m = lanes16(w - j);
            auto pre = [&](int64_t g) {
                const int64_t at = g * H + j0 + j;
                return _mm512_add_ps(_mm512_maskz_loadu_ps(m, gx + at),
                                     _mm512_maskz_loadu_ps(m, gh + at));
            };
            _mm512_store_ps(gate[0] + j, vsig(pre(0)));
            _mm512_store_ps(gate[1] + j, vsig(pre(1)));
            _mm512_store_ps(gate[2] + j, vtanh(pre(2)));
            _mm512_store_ps(gate[3] + j, vsig(pre(3)));
        }
        for (int64_t j = 0; j < w; j += 16) {
            const __mmask16 m = lanes16(w - j);
            const int64_t at = j0 + j;
            const __m512 cv = _mm512_fmadd_ps(
                _mm512_load_ps(gate[1] + j), _mm512_maskz_loadu_ps(m, c + at),
                _mm512_mul_ps(_mm512_load_ps(gate[0] + j), _mm512_load_ps(gate[2] + j)));
            _mm512_mask_storeu_ps(c + at, m, cv);
            const __m512 hv = _mm512_mul_ps(_mm512_load_ps(gate[3] + j), vtanh(cv));
            if (raw)
                _mm512_mask_storeu_ps(raw + at, m, hv);
            else
                emit16(s, hv, at, m, h, hu8, y, yf);
        }
    }
}

// Gate math of one batch row (qt::CellFn). With a projection (raw != null) the LSTM's
// o * tanh(c) goes to raw, and emit() in rnn.cpp writes
// the projected hidden state once W_hr has been applied to every row.
void cell_avx512(const RnnStep& s, const float* gx, const float* gh, float* h, float* c, uint8_t* hu8,
          int8_t* y, float* yf, float* raw) {
    if (s.kind == LSTM) {
        lstm_avx512(s, gx, gh, h, c, hu8, y, yf, raw);
        return;
    }
    const int64_t H = s.H;
    for (int64_t j = 0; j < H; j += 16) {
        const __mmask16 m = lanes16(H - j);
        auto pre = [&](int64_t g) {
            return _mm512_add_ps(_mm512_maskz_loadu_ps(m, gx + g * H + j),
                                 _mm512_maskz_loadu_ps(m, gh + g * H + j));
        };
        __m512 hv;
        if (s.kind == GRU) {
            const __m512 r = vsig(pre(0)), z = vsig(pre(1));
            const __m512 n = vtanh(_mm512_fmadd_ps(r, _mm512_maskz_loadu_ps(m, gh + 2 * H + j),
                                                   _mm512_maskz_loadu_ps(m, gx + 2 * H + j)));
            const __m512 prev = _mm512_maskz_loadu_ps(m, h + j);
            hv = _mm512_fmadd_ps(z, _mm512_sub_ps(prev, n), n);
        } else if (s.kind == RNN_TANH) {
            hv = vtanh(pre(0));
        } else {
            hv = _mm512_max_ps(pre(0), _mm512_setzero_ps());
        }
        emit16(s, hv, j, m, h, hu8, y, yf);
    }
}

// planes16_portable and round16_portable, 16 lanes at a time: the same arithmetic (round to
// nearest even, then the clamp), the same bits.
void planes16_avx512(const float* x, int64_t M, int64_t K, float inv, uint8_t* hi, uint8_t* lo,
                     int64_t Kp, float qmin) {
    const __m512 vi = _mm512_set1_ps(inv), lo_q = _mm512_set1_ps(qmin);
    const __m512 hi_q = _mm512_set1_ps(32767.0f);
    for (int64_t m = 0; m < M; ++m) {
        for (int64_t k = 0; k < Kp; k += 16) {
            const __mmask16 in = k < K ? lanes16(K - k) : 0, all = lanes16(Kp - k);
            __m512 q = _mm512_roundscale_ps(_mm512_mul_ps(_mm512_maskz_loadu_ps(in, x + m * K + k), vi),
                                            _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            q = _mm512_min_ps(_mm512_max_ps(q, lo_q), hi_q);
            const __m512i qi = _mm512_cvtps_epi32(q);
            // padding (k >= K) is zero in both planes
            const __m512i h = _mm512_maskz_add_epi32(in, _mm512_srai_epi32(qi, 8), _mm512_set1_epi32(128));
            const __m512i l = _mm512_maskz_and_epi32(in, qi, _mm512_set1_epi32(255));
            _mm512_mask_cvtusepi32_storeu_epi8(hi + m * Kp + k, all, h);
            _mm512_mask_cvtusepi32_storeu_epi8(lo + m * Kp + k, all, l);
        }
    }
}

void round16_avx512(float* y, int64_t n, float inv, float scale) {
    const __m512 vi = _mm512_set1_ps(inv), vs = _mm512_set1_ps(scale);
    for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 m = lanes16(n - i);
        __m512 q = _mm512_roundscale_ps(_mm512_mul_ps(_mm512_maskz_loadu_ps(m, y + i), vi),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        q = _mm512_min_ps(_mm512_max_ps(q, _mm512_set1_ps(-32768.0f)), _mm512_set1_ps(32767.0f));
        _mm512_mask_storeu_ps(y + i, m, _mm512_mul_ps(q, vs));
    }
}

void activation_avx512(int kind, const float* a, float* out, int64_t n) {
    for (int64_t j = 0; j < n; j += 16) {
        const __mmask16 m = static_cast<__mmask16>(n - j >= 16 ? 0xFFFF : (1u << (n - j)) - 1);
        const __m512 x = _mm512_maskz_loadu_ps(m, a + j);
        _mm512_mask_storeu_ps(out + j, m, kind == 0 ? vsig(x) : vtanh(x));
    }
}

}  // namespace qt

// The AVX-VNNI GEMM, EVEX-encoded: what the AVX-VNNI path runs on an AVX-512 VNNI CPU.
#define QT_VNNI256_NAME gemm_vnni256_evex
#include "gemm_vnni256.h"
