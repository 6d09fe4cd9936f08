// int8 max pooling on channels-last (NHWC) tensors: ATen has no channels-last int8 kernel,
// and its contiguous one is scalar. Max commutes with the monotone int8 grid, so pooling the
// integers is exactly the reference's dequantize -> max_pool2d -> quantize on one grid.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "qt_kernels.h"

extern "C" {

// Out-of-input taps (padding, ceil_mode's last window) are skipped, as -inf padding is.
void qt_max_pool2d(const int8_t* x, int64_t batch, int64_t C, int64_t H, int64_t W, int64_t KH,
                   int64_t KW, int64_t sh, int64_t sw, int64_t ph, int64_t pw, int64_t dh,
                   int64_t dw, int64_t OH, int64_t OW, int8_t* out) try {
    for (int64_t n = 0; n < batch; ++n) {
        for (int64_t oh = 0; oh < OH; ++oh) {
            for (int64_t ow = 0; ow < OW; ++ow) {
                int8_t* dst = out + ((n * OH + oh) * OW + ow) * C;
                std::memset(dst, 0x80, static_cast<size_t>(C));  // -128
                for (int64_t i = 0; i < KH; ++i) {
                    const int64_t ih = oh * sh - ph + i * dh;
                    if (ih < 0 || ih >= H) continue;
                    for (int64_t j = 0; j < KW; ++j) {
                        const int64_t iw = ow * sw - pw + j * dw;
                        if (iw < 0 || iw >= W) continue;
                        const int8_t* __restrict src = x + ((n * H + ih) * W + iw) * C;
                        for (int64_t c = 0; c < C; ++c) dst[c] = std::max(dst[c], src[c]);
                    }
                }
            }
        }
    }
} QT_CATCH

// Average pooling between two int8 grids, channels-last in and out. ATen's int8 path
// (dequantize, float avg_pool2d, quantize) makes a float copy of the map; here each window's
// codes are summed exactly in int32 and only the sum goes through float:
// y = (sum - taps * x_zp) * x_scale / divisor, then the output grid. The divisor follows
// ATen's avg_pool2d: the window clipped to the padded input (count_include_pad), or to the
// input alone, or divisor_override when it is > 0. The reference's float sum rounds at each
// addition, so a result can differ from it by one code where it lies within rounding of a half.
void qt_avg_pool2d(const int8_t* x, int64_t batch, int64_t C, int64_t H, int64_t W, int64_t KH,
                   int64_t KW, int64_t sh, int64_t sw, int64_t ph, int64_t pw, int64_t OH,
                   int64_t OW, int64_t count_include_pad, int64_t divisor_override,
                   float x_scale, int64_t x_zp, float inv, float zp, int8_t* out) try {
    if (batch <= 0 || C <= 0) return;
    std::vector<int32_t> acc(static_cast<size_t>(C));
    for (int64_t n = 0; n < batch; ++n) {
        for (int64_t oh = 0; oh < OH; ++oh) {
            const int64_t h0 = oh * sh - ph, h1 = std::min(h0 + KH, H + ph);
            const int64_t hs = std::max<int64_t>(h0, 0), he = std::min(h1, H);
            for (int64_t ow = 0; ow < OW; ++ow) {
                const int64_t w0 = ow * sw - pw, w1 = std::min(w0 + KW, W + pw);
                const int64_t ws = std::max<int64_t>(w0, 0), we = std::min(w1, W);
                std::fill(acc.begin(), acc.end(), 0);
                for (int64_t ih = hs; ih < he; ++ih) {
                    for (int64_t iw = ws; iw < we; ++iw) {
                        const int8_t* __restrict src = x + ((n * H + ih) * W + iw) * C;
                        int32_t* __restrict a = acc.data();
                        for (int64_t c = 0; c < C; ++c) a[c] += src[c];
                    }
                }
                const int64_t taps = std::max<int64_t>(he - hs, 0) * std::max<int64_t>(we - ws, 0);
                const int64_t divisor = divisor_override > 0 ? divisor_override
                                        : count_include_pad ? (h1 - h0) * (w1 - w0)
                                                            : taps;
                int8_t* dst = out + ((n * OH + oh) * OW + ow) * C;
                const float factor = x_scale / static_cast<float>(divisor > 0 ? divisor : 1);
                for (int64_t c = 0; c < C; ++c) {
                    const float centred = static_cast<float>(acc[c] - taps * x_zp);
                    dst[c] = static_cast<int8_t>(
                        qt::quantize_value(centred * factor, inv, zp, -128.0f, 127.0f));
                }
            }
        }
    }
} QT_CATCH

}  // extern "C"
