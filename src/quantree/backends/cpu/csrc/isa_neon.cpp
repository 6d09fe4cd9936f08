// aarch64 NEON path without the dot-product extension (-march=armv8-a): int8 x int8
// products widened to int16 (`smull`, exact: at most 128 * 128), pairs added into int32
// (`sadalp`). Only reached through qt::kernels on aarch64.
#if defined(__aarch64__)
#include "qt_neon.h"

namespace qt {
namespace {

struct WideningDot {
    // acc[i][c] = sum_k x[i][k] w[c][k] over one block (16 columns = 4 registers of 4 x 4).
    template <int MR>
    static void rows(const int8_t* X, int64_t lda, const int8_t* b, int64_t kq,
                     int32_t (*acc)[16]) {
        int32x4_t lo[MR][4], hi[MR][4];
        for (int i = 0; i < MR; ++i)
            for (int q = 0; q < 4; ++q) lo[i][q] = hi[i][q] = vdupq_n_s32(0);
        for (int64_t k = 0; k < kq; ++k) {
            int8x16_t bv[4];
            for (int q = 0; q < 4; ++q) bv[q] = vld1q_s8(b + k * 64 + 16 * q);
            for (int i = 0; i < MR; ++i) {
                int32_t four;
                __builtin_memcpy(&four, X + i * lda + 4 * k, 4);
                const int8x8_t a = vreinterpret_s8_s32(vdup_n_s32(four));
                for (int q = 0; q < 4; ++q) {
                    lo[i][q] = vpadalq_s16(lo[i][q], vmull_s8(vget_low_s8(bv[q]), a));
                    hi[i][q] = vpadalq_s16(hi[i][q], vmull_s8(vget_high_s8(bv[q]), a));
                }
            }
        }
        // lo: lanes (c0 k01, c0 k23, c1 k01, c1 k23); hi: the same for c2, c3
        for (int i = 0; i < MR; ++i)
            for (int q = 0; q < 4; ++q)
                vst1q_s32(acc[i] + 4 * q, vpaddq_s32(lo[i][q], hi[i][q]));
    }
};

}  // namespace

void gemm_neon(int64_t M, int64_t N, int64_t Kp, const uint8_t* A, int64_t lda,
               const int8_t* B, const Epilogue& ep, const uint8_t* A_lo) {
    gemm_neon_any<WideningDot>(M, N, Kp, A, lda, B, ep, A_lo);
}

}  // namespace qt
#endif
