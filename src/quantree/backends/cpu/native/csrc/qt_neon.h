// aarch64 GEMM shared by the NEON paths (isa_neon.cpp: plain ASIMD, widening multiplies;
// isa_neondot.cpp: the dot-product extension, `sdot`). Included once per path, each file
// compiled with its own -march; every function is static or in an anonymous namespace.
//
// Activations arrive as x + 128 (uint8); both paths multiply the signed x = (x + 128) ^ 0x80
// by the int8 weights, exactly in int32, then add 128 * sum_k w (computed once per block of
// 16 columns) so that the accumulator is sum (x + 128) w, what every path computes. The low
// plane of a 16-bit operand (unsigned bytes, no offset) is read the same way: lo - 128 + 128.
// The epilogue is qt::epilogue_one, the reference itself.
#pragma once
#include <arm_neon.h>

#include <cstdlib>

#include "qt_kernels.h"

namespace qt {
namespace {

// Rows of uint8 (stride lda) -> int8 (u ^ 0x80), stride Kp.
inline void to_signed(const uint8_t* A, int64_t M, int64_t Kp, int64_t lda, int8_t* out) {
    const uint8x16_t flip = vdupq_n_u8(0x80);
    for (int64_t r = 0; r < M; ++r) {
        int64_t k = 0;
        for (; k + 16 <= Kp; k += 16)
            vst1q_s8(out + r * Kp + k, vreinterpretq_s8_u8(veorq_u8(vld1q_u8(A + r * lda + k), flip)));
        for (; k < Kp; ++k) out[r * Kp + k] = static_cast<int8_t>(A[r * lda + k] ^ 0x80);
    }
}

// 128 * sum_k w of the 16 columns of one packed block.
inline void block_sums(const int8_t* b, int64_t kq, int32_t sums[16]) {
    for (int c = 0; c < 16; ++c) sums[c] = 0;
    for (int64_t k = 0; k < kq; ++k)
        for (int c = 0; c < 16; ++c)
            for (int u = 0; u < 4; ++u) sums[c] += b[k * 64 + c * 4 + u];
    for (int c = 0; c < 16; ++c) sums[c] *= 128;
}

// Columns of one block for rows row0 .. row0 + MR - 1: dot(rows, block) + sums, then the
// epilogue. Dot::rows(MR) fills acc[MR][16] (int32) with sum x w over k.
template <int MR, typename Dot>
inline void tile(const int8_t* X, const int8_t* X2, int64_t lda, const int8_t* b, int64_t kq,
                 int64_t row0, int64_t nb, int64_t N, const int32_t sums[16],
                 const Epilogue& ep) {
    alignas(16) int32_t acc[MR][16], acc2[MR][16];
    Dot::template rows<MR>(X + row0 * lda, lda, b, kq, acc);
    if (X2) Dot::template rows<MR>(X2 + row0 * lda, lda, b, kq, acc2);
    for (int i = 0; i < MR; ++i) {
        for (int c = 0; c < 16; ++c) {
            const int64_t n = nb * 16 + c;
            if (n >= N) break;
            epilogue_one(ep, row0 + i, n, acc[i][c] + sums[c], X2 ? acc2[i][c] + sums[c] : 0,
                         X2 != nullptr);
        }
    }
}

template <typename Dot>
void gemm_neon_any(int64_t M, int64_t N, int64_t Kp, const uint8_t* A, int64_t lda,
                   const int8_t* B, const Epilogue& ep, const uint8_t* A_lo) {
    const int64_t nblocks = (N + 15) / 16, kq = Kp / 4;
    const size_t plane = static_cast<size_t>(M * Kp);
    int8_t* X = static_cast<int8_t*>(std::malloc(plane * (A_lo ? 2 : 1) + 16));
    if (!X) throw std::bad_alloc();  // caught at the entry point (QT_CATCH)
    to_signed(A, M, Kp, lda, X);
    int8_t* X2 = nullptr;
    if (A_lo) {
        X2 = X + plane;
        to_signed(A_lo, M, Kp, lda, X2);
    }
    int32_t sums[16];
    for (int64_t nb = 0; nb < nblocks; ++nb) {
        const int8_t* b = B + nb * kq * 64;
        block_sums(b, kq, sums);
        int64_t r = 0;
        for (; r + 4 <= M; r += 4) tile<4, Dot>(X, X2, Kp, b, kq, r, nb, N, sums, ep);
        for (; r < M; ++r) tile<1, Dot>(X, X2, Kp, b, kq, r, nb, N, sums, ep);
    }
    std::free(X);
}

}  // namespace
}  // namespace qt
