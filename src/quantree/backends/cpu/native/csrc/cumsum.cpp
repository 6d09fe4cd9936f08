// int8 cumulative sum along one dimension, requantized: a running total (a length-normalised
// pooling, a cumulative attention mask, a position count) computed on the int8 codes.
//
// The reference dequantizes the input, takes the float cumulative sum and quantizes each
// total. Here the codes are summed exactly in int32 (K below 2^23 cannot overflow it) and only
// the totals go through float: y_k = (sum_{j <= k} x_j - (k + 1) * zp) * s, then the output
// grid. The reference's float sum rounds at each addition, so a total can differ from it by
// one code where y * (1 / s_out) lies within rounding of a half.
#include <cstdint>
#include <vector>

#include "qt_kernels.h"

extern "C" {

// x int8 contiguous [outer, K, inner]; out int8 of the same shape, contiguous.
void qt_cumsum(const int8_t* x, int64_t outer, int64_t K, int64_t inner, float x_scale,
               int64_t x_zp, float inv, float zp, int8_t* out) try {
    if (outer <= 0 || inner <= 0) return;
    std::vector<int32_t> acc(static_cast<size_t>(inner));
    for (int64_t o = 0; o < outer; ++o) {
        for (int64_t i = 0; i < inner; ++i) acc[i] = 0;
        for (int64_t k = 0; k < K; ++k) {  // rows of inner codes, added to inner running totals
            const int8_t* row = x + (o * K + k) * inner;
            int8_t* dst = out + (o * K + k) * inner;
            const int64_t centre = (k + 1) * x_zp;
            for (int64_t i = 0; i < inner; ++i) {
                acc[i] += row[i];
                const float y = static_cast<float>(acc[i] - centre) * x_scale;
                dst[i] = static_cast<int8_t>(qt::quantize_value(y, inv, zp, -128.0f, 127.0f));
            }
        }
    }
} QT_CATCH

}  // extern "C"
