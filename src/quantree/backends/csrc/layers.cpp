// C entry points for linear and conv2d on int8 activations and packed int8 weights.
#include <cstdlib>
#include <cstring>
#include <vector>

#include "qt_kernels.h"

using qt::Epilogue;

// Per-channel requantization of an int8 output: mult = scale / out_scale and
// add = bias / out_scale (the zero point is added after rounding, as the reference does).
struct Requant {
    std::vector<float> mult, add;
    Requant(const float* scale, const float* bias, int64_t N, float inv)
        : mult(static_cast<size_t>(N)), add(static_cast<size_t>(N)) {
        for (int64_t n = 0; n < N; ++n) {
            mult[n] = scale[n] * inv;
            add[n] = bias ? bias[n] * inv : 0.0f;
        }
    }
};

static Epilogue make_epilogue(const int32_t* off, const float* scale, const float* bias,
                              float* out_f, int8_t* out_q, int64_t ldc, float inv, float zp,
                              int relu, const Requant* rq) {
    Epilogue ep{off, scale, bias, out_f, out_q, ldc, inv, zp, -128.0f, 127.0f};
    if (relu) ep.qmin = zp > -128.0f ? zp : -128.0f;
    if (out_q && rq) {
        ep.mult = rq->mult.data();
        ep.add = rq->add.data();
    }
    return ep;
}

extern "C" {

// y[M, N] = x[M, K] (int8) . W^T; int8 output when out_f is null, else float.
void qt_linear(const int8_t* x, int64_t M, int64_t K, int64_t N, int64_t Kp, const int8_t* w,
               const int32_t* off, const float* scale, const float* bias, int8_t* out_q,
               float* out_f, float inv, float zp, int relu) {
    std::vector<uint8_t> a(static_cast<size_t>(M * Kp));
    qt::to_u8(x, M, K, K, a.data(), Kp);
    const Requant rq(scale, bias, N, inv);
    const Epilogue ep = make_epilogue(off, scale, bias, out_f, out_q, N, inv, zp, relu, &rq);
    qt::gemm_u8s8(M, N, Kp, a.data(), Kp, w, ep);
}

// int8 conv (groups = 1) on NHWC (channels-last) tensors: im2col of a panel of output
// pixels, then one GEMM whose rows are those pixels, written straight into NHWC output.
// Weights are packed with K ordered (kh, kw, c); padding reads the input zero point.
void qt_conv2d(const int8_t* x, int64_t batch, int64_t C, int64_t H, int64_t W, int64_t x_zp,
               int64_t OC, int64_t KH, int64_t KW, int64_t sh, int64_t sw, int64_t ph,
               int64_t pw, int64_t dh, int64_t dw, int64_t OH, int64_t OW, int64_t Kp,
               const int8_t* w, const int32_t* off, const float* scale, const float* bias,
               int8_t* out_q, float* out_f, float inv, float zp, int relu) {
    const int64_t P = batch * OH * OW, K = KH * KW * C, panel = 256;
    const uint8_t pad = static_cast<uint8_t>(x_zp + 128);
    const int8_t* x_end = x + batch * H * W * C;
    std::vector<uint8_t> col(static_cast<size_t>((P < panel ? P : panel) * Kp + 4));
    const Requant rq(scale, bias, OC, inv);
    for (int64_t p0 = 0; p0 < P; p0 += panel) {
        const int64_t rows = P - p0 < panel ? P - p0 : panel;
        for (int64_t r = 0; r < rows; ++r) {
            const int64_t p = p0 + r, n = p / (OH * OW), oh = (p / OW) % OH, ow = p % OW;
            uint8_t* dst = col.data() + r * Kp;
            for (int64_t i = 0; i < KH; ++i) {
                const int64_t ih = oh * sh - ph + i * dh;
                for (int64_t j = 0; j < KW; ++j, dst += C) {
                    const int64_t iw = ow * sw - pw + j * dw;
                    if (ih < 0 || ih >= H || iw < 0 || iw >= W) {
                        std::memset(dst, pad, static_cast<size_t>(C));
                        continue;
                    }
                    const int8_t* src = x + ((n * H + ih) * W + iw) * C;
                    if (C <= 4 && src + 4 <= x_end) {  // one word; the spill is rewritten next
                        uint32_t word;
                        std::memcpy(&word, src, 4);
                        word ^= 0x80808080u;
                        std::memcpy(dst, &word, 4);
                        continue;
                    }
                    for (int64_t c = 0; c < C; ++c) dst[c] = static_cast<uint8_t>(src[c] ^ 0x80);
                }
            }
            std::memset(col.data() + r * Kp + K, 0, static_cast<size_t>(Kp - K));
        }
        const Epilogue ep = make_epilogue(off, scale, bias, out_f ? out_f + p0 * OC : nullptr,
                                          out_q ? out_q + p0 * OC : nullptr, OC, inv, zp, relu,
                                          &rq);
        qt::gemm_u8s8(rows, OC, Kp, col.data(), Kp, w, ep);
    }
}

// Batched int8 activation x activation matmul: c[b] = (a[b] - za) . (w[b] - zb), both
// operands dynamic. Each b[b] ([K, N]) is packed on the fly; the zero point of b becomes a
// per-row correction -zb * sum_k (a - za).
void qt_matmul(const int8_t* a, const int8_t* bmat, int64_t batch, int64_t M, int64_t K,
               int64_t N, float za, float zb, float scale, int8_t* out_q, float* out_f,
               float inv, float zp) {
    const int64_t Kp = (K + 3) / 4 * 4, NB = (N + 15) / 16;
    std::vector<uint8_t> au(static_cast<size_t>(M * Kp));
    std::vector<int8_t> packed(static_cast<size_t>(NB * Kp * 16), 0);
    std::vector<int32_t> off(static_cast<size_t>(N)), row(static_cast<size_t>(M));
    const std::vector<float> scales(static_cast<size_t>(N), scale);
    const Requant rq(scales.data(), nullptr, N, inv);
    const int32_t ia = static_cast<int32_t>(za), ib = static_cast<int32_t>(zb);
    for (int64_t t = 0; t < batch; ++t) {
        const int8_t* at = a + t * M * K;
        const int8_t* bt = bmat + t * K * N;
        qt::to_u8(at, M, K, K, au.data(), Kp);
        for (int64_t m = 0; m < M; ++m) {
            int32_t s = 0;
            for (int64_t k = 0; k < K; ++k) s += at[m * K + k] - ia;
            row[m] = -ib * s;
        }
        for (int64_t n = 0; n < N; ++n) {
            int32_t s = 0;
            for (int64_t k = 0; k < K; ++k) s += bt[k * N + n];
            off[n] = -(ia + 128) * s;
        }
        for (int64_t k = 0; k < K; ++k)
            for (int64_t n = 0; n < N; ++n)
                packed[((n / 16) * (Kp / 4) + k / 4) * 64 + (n % 16) * 4 + k % 4] = bt[k * N + n];
        Epilogue ep = make_epilogue(off.data(), scales.data(), nullptr,
                                    out_f ? out_f + t * M * N : nullptr,
                                    out_q ? out_q + t * M * N : nullptr, N, inv, zp, 0, &rq);
        ep.row_off = row.data();
        qt::gemm_u8s8(M, N, Kp, au.data(), Kp, packed.data(), ep);
    }
}

// quantize_per_tensor / dequantize_per_tensor of quantized_decomposed, int8 [-128, 127]:
// q = clamp(round_half_even(x * inv) + zp), x = (q - zp) * scale, in float32.
void qt_quantize(const float* x, int64_t n, float inv, float zp, int8_t* out) {
    for (int64_t i = 0; i < n; ++i)
        out[i] = static_cast<int8_t>(qt::quantize_value(x[i], inv, zp, -128.0f, 127.0f));
}

void qt_dequantize(const int8_t* q, int64_t n, float scale, float zp, float* out) {
    for (int64_t i = 0; i < n; ++i) out[i] = (static_cast<float>(q[i]) - zp) * scale;
}

// Elementwise add (op 0), mul (op 1) or sub (op 2) of two int8 tensors, each dequantized exactly as the
// reference does, combined in float, requantized: one pass instead of four ATen chains.
void qt_binary(int op, const int8_t* a, const int8_t* b, int64_t n, float sa, float za, float sb,
               float zb, float inv, float zp, int8_t* out) {
    for (int64_t i = 0; i < n; ++i) {
        const float x = (static_cast<float>(a[i]) - za) * sa;
        const float y = (static_cast<float>(b[i]) - zb) * sb;
        const float r = op == 0 ? x + y : (op == 1 ? x * y : x - y);
        out[i] = static_cast<int8_t>(qt::quantize_value(r, inv, zp, -128.0f, 127.0f));
    }
}

// out[i] = table[x[i] + 128]: any pointwise int8 -> int8 function, tabulated at lowering.
void qt_lookup(const int8_t* x, int64_t n, const int8_t* table, int8_t* out) {
    for (int64_t i = 0; i < n; ++i) out[i] = table[static_cast<int>(x[i]) + 128];
}

}  // extern "C"
