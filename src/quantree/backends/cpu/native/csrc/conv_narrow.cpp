// Grouped convolutions with fewer than 16 output channels a group (ResNeXt's 4 and 8,
// RegNet's 8): the portable path and the weight layout every path starts from.
//
// The GEMM path runs one product per group, whose 16 output lanes such a group fills only in
// part, and pays a product's set-up per group and panel: it measured 0.9-1.4x the float conv
// at 4-8 channels a group, so these convolutions were left in float. Here the products of
// all groups of a panel of im2col rows are written into one int32 buffer, each group's
// output channels as the lanes of one vector (a path's narrow kernel), then one epilogue
// runs over whole output rows. The integer sums are exact, and the epilogue is the GEMM's
// (epilogue_one's float operations in its order), so every path gives the GEMM route's bits.
#include <cstring>

#include "qt_kernels.h"

namespace qt {

// Per group, blocks of 8 output channels (lanes past OCg zero); per block, Kp / 4 rows of
// [8 lanes][4 k] int8: what one 256-bit vpdpbusd reads, and what the portable loop reads.
int64_t narrow_prepare_portable(const int8_t* B, int64_t groups, int64_t OCg, int64_t Kp,
                                int64_t group_stride, void* out) {
    const int64_t blocks = (OCg + 7) / 8, kq = Kp / 4;
    const int64_t bytes = groups * blocks * kq * 32;
    if (!out) return bytes;
    int8_t* w = static_cast<int8_t*>(out);
    std::memset(w, 0, static_cast<size_t>(bytes));
    for (int64_t g = 0; g < groups; ++g)
        for (int64_t o = 0; o < OCg; ++o)
            for (int64_t k = 0; k < Kp; ++k)
                w[((g * blocks + o / 8) * kq + k / 4) * 32 + (o % 8) * 4 + k % 4] =
                    B[g * group_stride + (k / 4) * 64 + o * 4 + k % 4];
    return bytes;
}

void narrow_portable(const void* prepared, int64_t rows, int64_t groups, int64_t OCg, int64_t Kp,
                     const uint8_t* col, int64_t lda, int32_t* acc) {
    const int8_t* w = static_cast<const int8_t*>(prepared);
    const int64_t blocks = (OCg + 7) / 8, kq = Kp / 4, N = groups * OCg;
    for (int64_t r = 0; r < rows; ++r)
        for (int64_t g = 0; g < groups; ++g) {
            const uint8_t* a = col + r * lda + g * Kp;
            for (int64_t b = 0; b < blocks; ++b) {
                const int8_t* wb = w + (g * blocks + b) * kq * 32;
                int32_t sums[8] = {};
                for (int64_t k = 0; k < kq; ++k)
                    for (int u = 0; u < 4; ++u) {
                        const int32_t x = a[4 * k + u];
                        for (int l = 0; l < 8; ++l) sums[l] += x * wb[k * 32 + l * 4 + u];
                    }
                const int64_t lanes = OCg - b * 8 < 8 ? OCg - b * 8 : 8;
                for (int64_t l = 0; l < lanes; ++l) acc[r * N + g * OCg + b * 8 + l] = sums[l];
            }
        }
}

void rows_epilogue_portable(const Epilogue& ep, const int32_t* acc, int64_t rows, int64_t N) {
    for (int64_t r = 0; r < rows; ++r)
        for (int64_t n = 0; n < N; ++n) epilogue_one(ep, r, n, acc[r * N + n], 0, false);
}

}  // namespace qt
