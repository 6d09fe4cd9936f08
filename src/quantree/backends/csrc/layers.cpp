// C entry points for linear and conv2d on int8 activations and packed int8 weights.
#include <cstdlib>
#include <vector>

#include "qt_kernels.h"

using qt::Epilogue;

static Epilogue make_epilogue(const int32_t* off, const float* scale, const float* bias,
                              float* out_f, int8_t* out_q, int64_t ldc, float inv, float zp,
                              int relu) {
    Epilogue ep{off, scale, bias, out_f, out_q, ldc, inv, zp, -128.0f, 127.0f};
    if (relu) ep.qmin = zp > -128.0f ? zp : -128.0f;
    return ep;
}

extern "C" {

// y[M, N] = x[M, K] (int8) . W^T; int8 output when out_f is null, else float.
void qt_linear(const int8_t* x, int64_t M, int64_t K, int64_t N, int64_t Kp, const int8_t* w,
               const int32_t* off, const float* scale, const float* bias, int8_t* out_q,
               float* out_f, float inv, float zp, int relu) {
    std::vector<uint8_t> a(static_cast<size_t>(M * Kp));
    qt::to_u8(x, M, K, K, a.data(), Kp);
    const Epilogue ep = make_epilogue(off, scale, bias, out_f, out_q, N, inv, zp, relu);
    qt::gemm_u8s8(M, N, Kp, a.data(), Kp, w, ep);
}

// NCHW int8 conv (groups = 1) as im2col + GEMM; padding reads the input zero point.
void qt_conv2d(const int8_t* x, int64_t batch, int64_t C, int64_t H, int64_t W, int64_t x_zp,
               int64_t OC, int64_t KH, int64_t KW, int64_t sh, int64_t sw, int64_t ph,
               int64_t pw, int64_t dh, int64_t dw, int64_t OH, int64_t OW, int64_t Kp,
               const int8_t* w, const int32_t* off, const float* scale, const float* bias,
               int8_t* out_q, float* out_f, float inv, float zp, int relu) {
    const int64_t P = OH * OW, K = C * KH * KW;
    const uint8_t pad = static_cast<uint8_t>(x_zp + 128);
    std::vector<uint8_t> col(static_cast<size_t>(P * Kp));
    std::vector<int8_t> tq(out_q ? static_cast<size_t>(P * OC) : 0);
    std::vector<float> tf(out_f ? static_cast<size_t>(P * OC) : 0);
    for (int64_t n = 0; n < batch; ++n) {
        const int8_t* img = x + n * C * H * W;
        for (int64_t oh = 0; oh < OH; ++oh) {
            for (int64_t ow = 0; ow < OW; ++ow) {
                uint8_t* dst = col.data() + (oh * OW + ow) * Kp;
                int64_t k = 0;
                for (int64_t c = 0; c < C; ++c) {
                    for (int64_t i = 0; i < KH; ++i) {
                        const int64_t ih = oh * sh - ph + i * dh;
                        for (int64_t j = 0; j < KW; ++j, ++k) {
                            const int64_t iw = ow * sw - pw + j * dw;
                            const bool in = ih >= 0 && ih < H && iw >= 0 && iw < W;
                            dst[k] = in ? static_cast<uint8_t>(img[(c * H + ih) * W + iw] ^ 0x80)
                                        : pad;
                        }
                    }
                }
                for (; k < Kp; ++k) dst[k] = 0;
            }
        }
        const Epilogue ep = make_epilogue(off, scale, bias, out_f ? tf.data() : nullptr,
                                          out_q ? tq.data() : nullptr, OC, inv, zp, relu);
        qt::gemm_u8s8(P, OC, Kp, col.data(), Kp, w, ep);
        for (int64_t p = 0; p < P; ++p) {  // [P, OC] -> [OC, P]
            for (int64_t o = 0; o < OC; ++o) {
                if (out_q) out_q[(n * OC + o) * P + p] = tq[p * OC + o];
                else out_f[(n * OC + o) * P + p] = tf[p * OC + o];
            }
        }
    }
    (void)K;
}

}  // extern "C"
