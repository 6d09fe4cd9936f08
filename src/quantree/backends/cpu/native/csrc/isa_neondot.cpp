// aarch64 path with the dot-product extension (-march=armv8.2-a+dotprod: Cortex-A55/A76 and
// later, Apple M1+, Graviton 2+): `sdot` adds 4 int8 x int8 products into each int32 lane,
// one lane per output column. Only reached through qt::kernels when HWCAP_ASIMDDP is set.
#if defined(__aarch64__)
#include "qt_neon.h"

namespace qt {
namespace {

struct Sdot {
    template <int MR>
    static void rows(const int8_t* X, int64_t lda, const int8_t* b, int64_t kq,
                     int32_t (*acc)[16]) {
        int32x4_t c[MR][4];
        for (int i = 0; i < MR; ++i)
            for (int q = 0; q < 4; ++q) c[i][q] = vdupq_n_s32(0);
        for (int64_t k = 0; k < kq; ++k) {
            int8x16_t bv[4];
            for (int q = 0; q < 4; ++q) bv[q] = vld1q_s8(b + k * 64 + 16 * q);
            for (int i = 0; i < MR; ++i) {
                int32_t four;
                __builtin_memcpy(&four, X + i * lda + 4 * k, 4);
                const int8x16_t a = vreinterpretq_s8_s32(vdupq_n_s32(four));
                for (int q = 0; q < 4; ++q) c[i][q] = vdotq_s32(c[i][q], bv[q], a);
            }
        }
        for (int i = 0; i < MR; ++i)
            for (int q = 0; q < 4; ++q) vst1q_s32(acc[i] + 4 * q, c[i][q]);
    }
};

}  // namespace

void gemm_neondot(int64_t M, int64_t N, int64_t Kp, const uint8_t* A, int64_t lda,
                  const int8_t* B, const Epilogue& ep, const uint8_t* A_lo) {
    gemm_neon_any<Sdot>(M, N, Kp, A, lda, B, ep, A_lo);
}

}  // namespace qt
#endif
