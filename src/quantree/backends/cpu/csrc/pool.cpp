// int8 max pooling on channels-last (NHWC) tensors: ATen has no channels-last int8 kernel,
// and its contiguous one is scalar. Max commutes with the monotone int8 grid, so pooling the
// integers is exactly the reference's dequantize -> max_pool2d -> quantize on one grid.
#include <algorithm>
#include <cstdint>
#include <cstring>

extern "C" {

// Out-of-input taps (padding, ceil_mode's last window) are skipped, as -inf padding is.
void qt_max_pool2d(const int8_t* x, int64_t batch, int64_t C, int64_t H, int64_t W, int64_t KH,
                   int64_t KW, int64_t sh, int64_t sw, int64_t ph, int64_t pw, int64_t dh,
                   int64_t dw, int64_t OH, int64_t OW, int8_t* out) {
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
}

}  // extern "C"
