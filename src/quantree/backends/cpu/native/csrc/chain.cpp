// A chain of lowered layers run in one native call: quantize, convolutions, max pooling,
// table lookups, residual adds, layout copies, linears, dequantize, each step the very entry point its own
// op calls, with the arguments that op would pass (native/chains.py records them).
//
// Why it stays: at batch 1 a small CNN's layers compute less than the interpreter, argument
// parsing and tensor allocation around each of their calls cost; one call per chain leaves
// only the arithmetic (ExecuTorch runs such a model as one XNNPACK delegate call). The
// results are the per-op path's bits: the same kernels read the same values.
#include <cstdint>
#include <cstring>
#include <memory>

#include "qt_kernels.h"

extern "C" {
void qt_quantize(const float* x, int64_t n, float inv, float zp, int8_t* out);
void qt_dequantize(const int8_t* q, int64_t n, float scale, float zp, float* out);
void qt_lookup(const int8_t* x, int64_t n, const int8_t* table, int8_t* out);
void qt_binary(int op, const int8_t* a, const int8_t* b, int64_t n, float sa, float za, float sb,
               float zb, float inv, float zp, int8_t* out);
void qt_linear(const int8_t* x, int64_t M, int64_t K, int64_t N, int64_t Kp, const int8_t* w,
               const int32_t* off, const float* scale, const float* bias, int8_t* out_q,
               float* out_f, float inv, float zp, int relu);
void qt_conv2d_grouped(const int8_t* x, int64_t batch, int64_t C, int64_t H, int64_t W,
                       int64_t x_zp, int64_t OC, int64_t groups, int64_t KH, int64_t KW,
                       int64_t sh, int64_t sw, int64_t ph, int64_t pw, int64_t dh, int64_t dw,
                       int64_t OH, int64_t OW, int64_t Kp, const int8_t* w, const int32_t* off,
                       const float* scale, const float* bias, int8_t* out_q, float* out_f,
                       float inv, float zp, int relu);
void qt_conv2d_depthwise(const int8_t* x, int64_t batch, int64_t C, int64_t H, int64_t W,
                         int64_t x_zp, int64_t KH, int64_t KW, int64_t sh, int64_t sw,
                         int64_t ph, int64_t pw, int64_t dh, int64_t dw, int64_t OH, int64_t OW,
                         const int8_t* w, const int32_t* off, const float* scale,
                         const float* bias, int8_t* out_q, float* out_f, float inv, float zp,
                         int relu);
void qt_max_pool2d(const int8_t* x, int64_t batch, int64_t C, int64_t H, int64_t W, int64_t KH,
                   int64_t KW, int64_t sh, int64_t sw, int64_t ph, int64_t pw, int64_t dh,
                   int64_t dw, int64_t OH, int64_t OW, int8_t* out);
}

namespace {

// Step kinds (native/chains.py): each step is WIDTH int64 fields, [kind, input buffer,
// output buffer, arguments...], and FLOATS floats (an output scale's inverse or a scale, a
// zero point; a binary op's six).
enum Kind : int64_t {
    QUANTIZE = 0,
    DEQUANTIZE = 1,
    TO_CHANNELS_LAST = 2,
    TO_CONTIGUOUS = 3,
    CONV = 4,
    CONV_DEPTHWISE = 5,
    LINEAR = 6,
    MAX_POOL = 7,
    LOOKUP = 8,
    BINARY = 9,
};
constexpr int64_t WIDTH = 32, FLOATS = 6;

template <typename T>
T* at(int64_t p) {
    return reinterpret_cast<T*>(static_cast<intptr_t>(p));
}

// [n, c, h, w] in NCHW order -> NHWC order (or back), int8.
void to_channels_last(const int8_t* x, int64_t n, int64_t c, int64_t hw, int8_t* out) {
    for (int64_t b = 0; b < n; ++b)
        for (int64_t ch = 0; ch < c; ++ch) {
            const int8_t* src = x + (b * c + ch) * hw;
            int8_t* dst = out + b * c * hw + ch;
            for (int64_t p = 0; p < hw; ++p) dst[p * c] = src[p];
        }
}

void to_contiguous(const int8_t* x, int64_t n, int64_t c, int64_t hw, int8_t* out) {
    for (int64_t b = 0; b < n; ++b)
        for (int64_t ch = 0; ch < c; ++ch) {
            const int8_t* src = x + b * c * hw + ch;
            int8_t* dst = out + (b * c + ch) * hw;
            for (int64_t p = 0; p < hw; ++p) dst[p] = src[p * c];
        }
}

// This thread's workspace for the intermediate tensors, kept between calls.
struct Arena {
    std::unique_ptr<uint8_t[]> data;
    int64_t size = 0;
    uint8_t* take(int64_t bytes) {
        if (bytes > size) {
            data.reset(new uint8_t[static_cast<size_t>(bytes + 64)]);
            size = bytes;
        }
        const uintptr_t p = reinterpret_cast<uintptr_t>(data.get());
        return reinterpret_cast<uint8_t*>((p + 63) / 64 * 64);
    }
};

}  // namespace

extern "C" {

// Runs ``n_steps`` steps (``steps``: WIDTH int64 each; ``fsteps``: FLOATS floats each).
// Buffers 0 .. n_inputs - 1 are ``inputs``, n_inputs is ``output``, a later buffer b is the
// workspace at ``offsets[b]`` (64-byte aligned, ``workspace`` bytes in all). Stops at the
// first step whose kernel recorded an error (left for the caller to take).
void qt_chain_run(const int64_t* steps, const float* fsteps, int64_t n_steps,
                  const int64_t* offsets, int64_t n_buffers, int64_t workspace,
                  void* const* inputs, int64_t n_inputs, void* output) try {
    static thread_local Arena arena;
    uint8_t* base = workspace > 0 ? arena.take(workspace) : nullptr;
    auto buffer = [&](int64_t b) -> uint8_t* {
        if (b < 0 || b >= n_buffers) throw std::out_of_range("chain buffer");
        if (b < n_inputs) return static_cast<uint8_t*>(inputs[b]);
        if (b == n_inputs) return static_cast<uint8_t*>(output);
        return base + offsets[b];
    };
    for (int64_t s = 0; s < n_steps; ++s) {
        const int64_t* i = steps + s * WIDTH;
        const float* f = fsteps + s * FLOATS;
        const float f0 = f[0], f1 = f[1];
        uint8_t* in = buffer(i[1]);
        uint8_t* out = buffer(i[2]);
        const int64_t* a = i + 3;
        switch (i[0]) {
            case QUANTIZE:
                qt_quantize(reinterpret_cast<const float*>(in), a[0], f0, f1,
                            reinterpret_cast<int8_t*>(out));
                break;
            case DEQUANTIZE:
                qt_dequantize(reinterpret_cast<const int8_t*>(in), a[0], f0, f1,
                              reinterpret_cast<float*>(out));
                break;
            case TO_CHANNELS_LAST:
                to_channels_last(reinterpret_cast<const int8_t*>(in), a[0], a[1], a[2],
                                 reinterpret_cast<int8_t*>(out));
                break;
            case TO_CONTIGUOUS:
                to_contiguous(reinterpret_cast<const int8_t*>(in), a[0], a[1], a[2],
                              reinterpret_cast<int8_t*>(out));
                break;
            case CONV: {  // a[0..17] geometry, a[18..21] pointers, a[22] int8 out, a[23] relu
                int8_t* q = a[22] ? reinterpret_cast<int8_t*>(out) : nullptr;
                float* fl = a[22] ? nullptr : reinterpret_cast<float*>(out);
                qt_conv2d_grouped(reinterpret_cast<const int8_t*>(in), a[0], a[1], a[2], a[3],
                                  a[4], a[5], a[6], a[7], a[8], a[9], a[10], a[11], a[12],
                                  a[13], a[14], a[15], a[16], a[17], at<const int8_t>(a[18]),
                                  at<const int32_t>(a[19]), at<const float>(a[20]),
                                  at<const float>(a[21]), q, fl, f0, f1,
                                  static_cast<int>(a[23]));
                break;
            }
            case CONV_DEPTHWISE: {  // a[0..14] geometry, a[15..18] pointers, a[19], a[20]
                int8_t* q = a[19] ? reinterpret_cast<int8_t*>(out) : nullptr;
                float* fl = a[19] ? nullptr : reinterpret_cast<float*>(out);
                qt_conv2d_depthwise(reinterpret_cast<const int8_t*>(in), a[0], a[1], a[2], a[3],
                                    a[4], a[5], a[6], a[7], a[8], a[9], a[10], a[11], a[12],
                                    a[13], a[14], at<const int8_t>(a[15]),
                                    at<const int32_t>(a[16]), at<const float>(a[17]),
                                    at<const float>(a[18]), q, fl, f0, f1,
                                    static_cast<int>(a[20]));
                break;
            }
            case LINEAR: {  // a[0..3] rows, K, N, Kp; a[4..7] pointers; a[8] int8 out, a[9]
                int8_t* q = a[8] ? reinterpret_cast<int8_t*>(out) : nullptr;
                float* fl = a[8] ? nullptr : reinterpret_cast<float*>(out);
                qt_linear(reinterpret_cast<const int8_t*>(in), a[0], a[1], a[2], a[3],
                          at<const int8_t>(a[4]), at<const int32_t>(a[5]),
                          at<const float>(a[6]), at<const float>(a[7]), q, fl, f0, f1,
                          static_cast<int>(a[9]));
                break;
            }
            case MAX_POOL:
                qt_max_pool2d(reinterpret_cast<const int8_t*>(in), a[0], a[1], a[2], a[3], a[4],
                              a[5], a[6], a[7], a[8], a[9], a[10], a[11], a[12], a[13],
                              reinterpret_cast<int8_t*>(out));
                break;
            case LOOKUP:
                qt_lookup(reinterpret_cast<const int8_t*>(in), a[0], at<const int8_t>(a[1]),
                          reinterpret_cast<int8_t*>(out));
                break;
            case BINARY:  // a[0] n, a[1] the second operand's buffer, a[2] the op
                qt_binary(static_cast<int>(a[2]), reinterpret_cast<const int8_t*>(in),
                          reinterpret_cast<const int8_t*>(buffer(a[1])), a[0], f[0], f[1], f[2],
                          f[3], f[4], f[5], reinterpret_cast<int8_t*>(out));
                break;
            default:
                throw std::invalid_argument("chain step kind");
        }
        if (qt::last_error() != qt::NO_ERROR) return;  // the step's error, for the caller
    }
} QT_CATCH

}  // extern "C"
