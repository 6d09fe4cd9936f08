// int8 per-channel affine map between two int8 grids: a batch norm nothing could be folded
// into (DenseNet's pre-activation norms read a concatenation, not a convolution's output).
//
// The reference dequantizes the whole map, runs the float batch norm and quantizes again:
// three passes and a float copy. Here each code is mapped in one pass, with the reference's
// float steps: v = (q - zp) * s (dequantize), y = v * alpha[c] + beta[c] (ATen's eval batch
// norm: alpha = w / sqrt(var + eps), beta = b - mean * alpha), then the output grid (clamped
// below at its zero point when a relu follows). Where ATen contracts its multiply-add into an
// FMA, a result can differ from the reference by one code at a rounding tie.
#include <cstdint>

#include "qt_kernels.h"

extern "C" {

// x, out int8 [outer][C][inner] (channels-last maps: inner = 1, outer = N * H * W).
void qt_channel_affine(const int8_t* x, int64_t outer, int64_t C, int64_t inner, float x_scale,
                       float x_zp, const float* alpha, const float* beta, float inv, float zp,
                       float qmin, int8_t* out) try {
    for (int64_t o = 0; o < outer; ++o) {
        const int8_t* src = x + o * C * inner;
        int8_t* dst = out + o * C * inner;
        if (inner == 1) {  // channels innermost: one vector pass over the row
            for (int64_t c = 0; c < C; ++c) {
                const float v = (static_cast<float>(src[c]) - x_zp) * x_scale;
                const float y = v * alpha[c] + beta[c];
                dst[c] = static_cast<int8_t>(qt::quantize_value(y, inv, zp, qmin, 127.0f));
            }
            continue;
        }
        for (int64_t c = 0; c < C; ++c) {
            const float a = alpha[c], b = beta[c];
            for (int64_t i = 0; i < inner; ++i) {
                const float v = (static_cast<float>(src[c * inner + i]) - x_zp) * x_scale;
                dst[c * inner + i] =
                    static_cast<int8_t>(qt::quantize_value(v * a + b, inv, zp, qmin, 127.0f));
            }
        }
    }
} QT_CATCH

}  // extern "C"
