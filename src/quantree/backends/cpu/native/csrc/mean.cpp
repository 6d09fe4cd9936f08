// int8 mean over the spatial dims of [N, C, H, W] (global average pooling, the squeeze of a
// squeeze-excite block), requantized: one pass over the int8 input in its own layout.
//
// The reference dequantizes the whole input to float, averages, quantizes the [N, C] result:
// two passes and a float copy of the tensor for C values. Here each channel's codes are summed
// exactly in int32 (a 4-d tensor below 2^23 elements a channel cannot overflow it) and only
// the sums go through float: y = (sum - HW * zp) * s / HW, then the output grid. The
// reference's float sum rounds at each addition, so a result can differ from it by one code
// where y * (1 / s_out) lies within rounding of a half.
#include <cstdint>
#include <vector>

#include "qt_kernels.h"

extern "C" {

// x int8 with element strides (sn, sc, sh, sw); out int8 [N, C] contiguous.
void qt_mean_hw(const int8_t* x, int64_t N, int64_t C, int64_t H, int64_t W, int64_t sn,
                int64_t sc, int64_t sh, int64_t sw, float x_scale, int64_t x_zp, float inv,
                float zp, int8_t* out) try {
    const int64_t HW = H * W;
    if (N <= 0 || C <= 0) return;
    std::vector<int32_t> acc(static_cast<size_t>(C));
    for (int64_t n = 0; n < N; ++n) {
        for (int64_t c = 0; c < C; ++c) acc[c] = 0;
        const int8_t* xn = x + n * sn;
        if (sc == 1) {  // channels-last: rows of C codes, summed into C lanes
            for (int64_t h = 0; h < H; ++h)
                for (int64_t w = 0; w < W; ++w) {
                    const int8_t* row = xn + h * sh + w * sw;
                    for (int64_t c = 0; c < C; ++c) acc[c] += row[c];
                }
        } else if (sw == 1 && sh == W) {  // contiguous planes: one run of HW codes a channel
            for (int64_t c = 0; c < C; ++c) {
                const int8_t* plane = xn + c * sc;
                int32_t s = 0;
                for (int64_t i = 0; i < HW; ++i) s += plane[i];
                acc[c] = s;
            }
        } else {
            for (int64_t c = 0; c < C; ++c)
                for (int64_t h = 0; h < H; ++h)
                    for (int64_t w = 0; w < W; ++w) acc[c] += xn[c * sc + h * sh + w * sw];
        }
        const float count = static_cast<float>(HW);
        for (int64_t c = 0; c < C; ++c) {
            const float centred = static_cast<float>(acc[c] - HW * x_zp);  // exact below 2^24
            const float y = centred * x_scale / count;
            out[n * C + c] = static_cast<int8_t>(qt::quantize_value(y, inv, zp, -128.0f, 127.0f));
        }
    }
} QT_CATCH

}  // extern "C"
