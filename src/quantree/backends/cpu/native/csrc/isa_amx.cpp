// AMX path of the GEMM for many rows (a recurrent layer's input projection: all the time
// steps of a chunk at once). One `tdpbusd` multiplies a 16 x 64 tile of uint8 rows by a
// 64 x 16 tile of int8 weights: 16K multiply-adds, about 13x what the AVX-512 VNNI kernel
// reaches on this core (benchmarks/README.md, branch `lstmb1`). The packed weight layout is
// already what a B tile reads: one block of 16 columns is [Kp/4][16][4] int8, so 16 rows of
// 64 bytes (64 values of k for 16 columns) are one tile, loaded with stride 64.
//
// Integer sums are exact and the float epilogue is the VNNI kernel's, in its order: the same
// bits as every other path. Shapes or epilogues this file does not cover go to the
// current path's GEMM. No compiler vectorizes to AMX, and no library in the stack exposes it
// for this layout (oneDNN's qlinear reads uint8 activations of its own packing), so it is
// written here.
#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "qt_kernels.h"

namespace qt {

namespace {

struct alignas(64) TileConfig {
    uint8_t palette = 1, start_row = 0;
    uint8_t reserved[14] = {};
    uint16_t colsb[16] = {};
    uint8_t rows[16] = {};
};

// tiles 0-3: int32 accumulators (16 x 16); 4, 5: uint8 rows (16 x 64); 6, 7: weights
void configure() {
    TileConfig cfg;
    for (int t = 0; t < 8; ++t) {
        cfg.rows[t] = 16;
        cfg.colsb[t] = 64;
    }
    _tile_loadconfig(&cfg);
}

// acc (+ 256 * acc + lo when dual) of 16 rows x 16 columns to the float epilogue, as the
// VNNI kernel's whole-block store computes it (isa_avx512.cpp, micro's fast path).
inline void store(const Epilogue& ep, int64_t row0, int64_t n0, const int32_t* acc,
                  const int32_t* lo) {
    const __m512i off = _mm512_loadu_si512(ep.off + n0);
    const __m512 sc = _mm512_loadu_ps(ep.scale + n0);
    const bool has_bias = ep.bias != nullptr;
    const __m512 bi = has_bias ? _mm512_loadu_ps(ep.bias + n0) : _mm512_setzero_ps();
    for (int i = 0; i < 16; ++i) {
        __m512 v = _mm512_cvtepi32_ps(_mm512_add_epi32(_mm512_load_si512(acc + 16 * i), off));
        if (lo)
            v = _mm512_fmadd_ps(v, _mm512_set1_ps(256.0f),
                                _mm512_cvtepi32_ps(_mm512_load_si512(lo + 16 * i)));
        __m512 y = _mm512_mul_ps(v, sc);
        if (has_bias) y = _mm512_add_ps(y, bi);
        _mm512_storeu_ps(ep.out_f + (row0 + i) * ep.ldc + n0, y);
    }
}

// 16 rows from row0 against column blocks nb (and nb + 1 when two), every k.
template <bool DUAL, bool TWO>
void panel(const uint8_t* A, const uint8_t* A_lo, int64_t lda, const int8_t* B, int64_t kq,
           int64_t row0, int64_t nb, const Epilogue& ep) {
    alignas(64) int32_t acc[4][256];
    _tile_zero(0);
    if (TWO) _tile_zero(1);
    if (DUAL) _tile_zero(2);
    if (DUAL && TWO) _tile_zero(3);
    const int8_t* b0 = B + nb * kq * 64;
    const int8_t* b1 = b0 + kq * 64;
    const uint8_t* a = A + row0 * lda;
    const uint8_t* a2 = DUAL ? A_lo + row0 * lda : nullptr;
    for (int64_t k = 0; k < kq; k += 16) {  // 64 values of k a tile
        _tile_loadd(4, a + 4 * k, lda);
        _tile_loadd(6, b0 + k * 64, 64);
        if (TWO) _tile_loadd(7, b1 + k * 64, 64);
        _tile_dpbusd(0, 4, 6);
        if (TWO) _tile_dpbusd(1, 4, 7);
        if (DUAL) {
            _tile_loadd(5, a2 + 4 * k, lda);
            _tile_dpbusd(2, 5, 6);
            if (TWO) _tile_dpbusd(3, 5, 7);
        }
    }
    _tile_stored(0, acc[0], 64);
    if (TWO) _tile_stored(1, acc[1], 64);
    if (DUAL) _tile_stored(2, acc[2], 64);
    if (DUAL && TWO) _tile_stored(3, acc[3], 64);
    store(ep, row0, nb * 16, acc[0], DUAL ? acc[2] : nullptr);
    if (TWO) store(ep, row0, nb * 16 + 16, acc[1], DUAL ? acc[3] : nullptr);
}

template <bool DUAL>
void panels(int64_t M16, int64_t N, int64_t kq, const uint8_t* A, int64_t lda, const int8_t* B,
            const Epilogue& ep, const uint8_t* A_lo) {
    const int64_t nblocks = N / 16;
    for (int64_t nb = 0; nb < nblocks; nb += 2) {
        const bool two = nb + 1 < nblocks;
        for (int64_t r = 0; r < M16; r += 16) {
            if (two)
                panel<DUAL, true>(A, A_lo, lda, B, kq, r, nb, ep);
            else
                panel<DUAL, false>(A, A_lo, lda, B, kq, r, nb, ep);
        }
    }
}

}  // namespace

// C = epilogue(A x B) as gemm_u8s8 without a prepared B: whole 16-row panels on AMX when
// the shape and the epilogue are the plain float ones (K a multiple of 64, N of 16, float
// output written, not accumulated), every other row or case through `fallback`.
void gemm_amx(int64_t M, int64_t N, int64_t Kp, const uint8_t* A, int64_t lda, const int8_t* B,
              const Epilogue& ep, const uint8_t* A_lo, GemmFn fallback) {
    const bool plain = ep.out_f && !ep.mult && !ep.row_off && !ep.accumulate;
    const int64_t M16 = M / 16 * 16;
    if (!plain || M16 == 0 || Kp % 64 != 0 || N % 16 != 0 || lda % 4 != 0) {
        fallback(M, N, Kp, A, lda, B, ep, A_lo);
        return;
    }
    configure();
    if (A_lo)
        panels<true>(M16, N, Kp / 4, A, lda, B, ep, A_lo);
    else
        panels<false>(M16, N, Kp / 4, A, lda, B, ep, A_lo);
    _tile_release();
    if (M16 < M) {
        Epilogue rest = ep;
        rest.out_f = ep.out_f + M16 * ep.ldc;
        fallback(M - M16, N, Kp, A + M16 * lda, lda, B, rest, A_lo ? A_lo + M16 * lda : nullptr);
    }
}

}  // namespace qt
