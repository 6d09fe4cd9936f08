// int8 sum over one dimension, requantized: the float sum the default recipe quantizes on both
// sides (MobileViT's separable attention sums its context vector over the tokens).
//
// The reference dequantizes the whole input, sums in float and quantizes the result. Here the
// codes of each output element are summed exactly in int32 (K below 2^23 cannot overflow it)
// and only the sums go through float: y = (sum - K * zp) * s, then the output grid. The
// reference's float sum rounds at each addition, so a result can differ from it by one code
// where y * (1 / s_out) lies within rounding of a half.
#include <cstdint>
#include <vector>

#include "qt_kernels.h"

extern "C" {

// x int8 contiguous [outer, K, inner]; out int8 [outer, inner] contiguous.
void qt_sum_dim(const int8_t* x, int64_t outer, int64_t K, int64_t inner, float x_scale,
                int64_t x_zp, float inv, float zp, int8_t* out) {
    if (outer <= 0 || inner <= 0) return;
    std::vector<int32_t> acc(static_cast<size_t>(inner));
    for (int64_t o = 0; o < outer; ++o) {
        for (int64_t i = 0; i < inner; ++i) acc[i] = 0;
        const int8_t* xo = x + o * K * inner;
        for (int64_t k = 0; k < K; ++k) {  // rows of inner codes, summed into inner lanes
            const int8_t* row = xo + k * inner;
            for (int64_t i = 0; i < inner; ++i) acc[i] += row[i];
        }
        for (int64_t i = 0; i < inner; ++i) {
            const float y = static_cast<float>(acc[i] - K * x_zp) * x_scale;
            out[o * inner + i] = static_cast<int8_t>(qt::quantize_value(y, inv, zp, -128.0f, 127.0f));
        }
    }
}

}  // extern "C"
