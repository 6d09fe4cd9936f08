// A cells-mode loop (one layer and direction) run natively: a small program, compiled in
// Python from the lowered cell body, executed for every time step in one call.
//
// Values are 2-d [batch, cols] slices (row stride ld) of one workspace laid out per call for
// the batch at hand; a chunk's pieces are views of their source. Instructions are fixed-size records of int64 and float fields.
#include <cmath>
#include <cstring>
#include <vector>

#include "qt_kernels.h"

namespace {

enum Op {
    QUANT = 0,
    DEQUANT = 1,
    LINEAR = 2,
    BINARY = 3,
    LOOKUP = 4,
    COPY = 5,
    FAKE_QUANT = 6,    // float -> float through an integer grid (an int16 point, say)
    FLOAT_BINARY = 7,  // float add / mul / sub
    FLOAT_UNARY = 8,   // float sigmoid / tanh / relu
};
constexpr int NI = 12, NF = 8;  // fields per instruction
constexpr int NS = 5;  // fields per slot: dtype (0 f32, 1 i8), owner slot, byte offset, cols, ld

struct Slot {
    char* base;
    int64_t rows, cols, ld, size;
    float* f(int64_t r) const { return reinterpret_cast<float*>(base) + r * ld; }
    int8_t* q(int64_t r) const { return reinterpret_cast<int8_t*>(base) + r * ld; }
};

// Row kernels with restrict pointers, so that the compiler vectorizes them (the workspace is
// one char buffer: without restrict every int8 store may alias every float load).
void quantize_row(const float* __restrict a, int8_t* __restrict out, int64_t n, float inv,
                  float zp) {
    for (int64_t j = 0; j < n; ++j)
        out[j] = static_cast<int8_t>(qt::quantize_value(a[j], inv, zp, -128.0f, 127.0f));
}

void dequantize_row(const int8_t* __restrict a, float* __restrict out, int64_t n, float scale,
                    float zp) {
    for (int64_t j = 0; j < n; ++j) out[j] = (static_cast<float>(a[j]) - zp) * scale;
}

void binary_row(int64_t kind, const int8_t* __restrict a, const int8_t* __restrict b,
                int8_t* __restrict out, int64_t n, const float* f) {
    const float sa = f[0], za = f[1], sb = f[2], zb = f[3], inv = f[4], zo = f[5];
    if (kind == 0) {
        for (int64_t j = 0; j < n; ++j) {
            const float v = (static_cast<float>(a[j]) - za) * sa + (static_cast<float>(b[j]) - zb) * sb;
            out[j] = static_cast<int8_t>(qt::quantize_value(v, inv, zo, -128.0f, 127.0f));
        }
    } else if (kind == 1) {
        for (int64_t j = 0; j < n; ++j) {
            const float v = ((static_cast<float>(a[j]) - za) * sa) * ((static_cast<float>(b[j]) - zb) * sb);
            out[j] = static_cast<int8_t>(qt::quantize_value(v, inv, zo, -128.0f, 127.0f));
        }
    } else {
        for (int64_t j = 0; j < n; ++j) {
            const float v = (static_cast<float>(a[j]) - za) * sa - (static_cast<float>(b[j]) - zb) * sb;
            out[j] = static_cast<int8_t>(qt::quantize_value(v, inv, zo, -128.0f, 127.0f));
        }
    }
}

// The reference's quantize then dequantize: (clamp(round(a / s) + zp) - zp) * s.
void fake_quant_row(const float* __restrict a, float* __restrict out, int64_t n, const float* f) {
    const float inv = f[0], zp = f[1], lo = f[2], hi = f[3], scale = f[4];
    for (int64_t j = 0; j < n; ++j) out[j] = (qt::quantize_value(a[j], inv, zp, lo, hi) - zp) * scale;
}

void float_binary_row(int64_t kind, const float* a, const float* b, float* out, int64_t n) {
    if (kind == 0) {
        for (int64_t j = 0; j < n; ++j) out[j] = a[j] + b[j];
    } else if (kind == 1) {
        for (int64_t j = 0; j < n; ++j) out[j] = a[j] * b[j];
    } else {
        for (int64_t j = 0; j < n; ++j) out[j] = a[j] - b[j];
    }
}

void float_unary_row(int64_t kind, const float* a, float* out, int64_t n) {
    if (kind < 2) {
        qt::kernels.activation(static_cast<int>(kind), a, out, n);
        return;
    }
    if (kind == 0) {
        for (int64_t j = 0; j < n; ++j) out[j] = 1.0f / (1.0f + std::exp(-a[j]));
    } else if (kind == 1) {
        for (int64_t j = 0; j < n; ++j) out[j] = std::tanh(a[j]);
    } else {
        for (int64_t j = 0; j < n; ++j) out[j] = a[j] > 0.0f ? a[j] : 0.0f;
    }
}

}  // namespace

extern "C" {

// xs: float [T, B, I]; ys: float [T, B, H]; states: float [B, *] each, updated in place.
// slots[NS * s]; code[NI * n], fcode[NF * n]; consts: pointers of the constant tensors.
// Slot 0 is x_t, slots 1..n_states the states read by the body; outs[n_states] the slots
// the body returns as the new states (outs[0] is also y_t).
void qt_cell_loop(const float* xs, float* ys, int64_t T, int reverse, float** states,
                  int64_t n_states, const int64_t* outs, const int64_t* slots, int64_t n_slots,
                  int64_t B, const int64_t* code, const float* fcode,
                  int64_t n_code, void** consts) {
    std::vector<int64_t> start(static_cast<size_t>(n_slots));
    int64_t bytes = 0;
    for (int64_t i = 0; i < n_slots; ++i) {  // owners first: a view follows its source
        const int64_t* d = slots + NS * i;
        if (d[1] == i) {
            start[i] = bytes;
            bytes += (B * d[4] * (d[0] == 0 ? 4 : 1) + 63) / 64 * 64;
        } else {
            start[i] = start[d[1]] + d[2];
        }
    }
    std::vector<char> ws(static_cast<size_t>(bytes) + 64);
    std::vector<Slot> s(static_cast<size_t>(n_slots));
    for (int64_t i = 0; i < n_slots; ++i) {
        const int64_t* d = slots + NS * i;
        s[i] = Slot{ws.data() + start[i], B, d[3], d[4], d[0] == 0 ? 4 : 1};
        (void)s[i].size;
    }
    int64_t scratch_k = 0;
    for (int64_t n = 0; n < n_code; ++n)
        if (code[NI * n] == LINEAR && code[NI * n + 9] > scratch_k) scratch_k = code[NI * n + 9];
    const int64_t I = s[0].cols;
    std::vector<uint8_t> u8(static_cast<size_t>(B * (scratch_k + 4)));
    // per LINEAR: requantization multipliers (int8 output), computed once
    std::vector<std::vector<float>> mult(static_cast<size_t>(n_code)), add(mult.size());
    for (int64_t n = 0; n < n_code; ++n) {
        const int64_t* c = code + NI * n;
        const float* f = fcode + NF * n;
        if (c[0] != LINEAR || f[0] <= 0) continue;
        const float* scale = static_cast<const float*>(consts[c[4]]);
        const float* bias = c[5] >= 0 ? static_cast<const float*>(consts[c[5]]) : nullptr;
        const float inv = 1.0f / f[0];
        for (int64_t j = 0; j < c[8]; ++j) {
            mult[n].push_back(scale[j] * inv);
            add[n].push_back(bias ? bias[j] * inv : 0.0f);
        }
    }
    for (int64_t k = 0; k < n_states; ++k) {  // initial states into their slots
        const Slot& st = s[1 + k];
        for (int64_t r = 0; r < st.rows; ++r)
            std::memcpy(st.f(r), states[k] + r * st.cols, static_cast<size_t>(st.cols) * 4);
    }
    for (int64_t step = 0; step < T; ++step) {
        const int64_t t = reverse ? T - 1 - step : step;
        for (int64_t r = 0; r < B; ++r)
            std::memcpy(s[0].f(r), xs + (t * B + r) * I, static_cast<size_t>(I) * 4);
        for (int64_t n = 0; n < n_code; ++n) {
            const int64_t* c = code + NI * n;
            const float* f = fcode + NF * n;
            const Slot& dst = s[c[1]];
            const Slot& a = s[c[2]];
            switch (c[0]) {
                case QUANT:
                    for (int64_t r = 0; r < dst.rows; ++r)
                        quantize_row(a.f(r), dst.q(r), dst.cols, f[0], f[1]);
                    break;
                case DEQUANT:
                    for (int64_t r = 0; r < dst.rows; ++r)
                        dequantize_row(a.q(r), dst.f(r), dst.cols, f[0], f[1]);
                    break;
                case LINEAR: {
                    const int64_t K = a.cols, N = c[8], Kp = c[9];
                    qt::to_u8(a.q(0), a.rows, K, a.ld, u8.data(), Kp);
                    qt::Epilogue ep{static_cast<const int32_t*>(consts[c[6]]),
                                    static_cast<const float*>(consts[c[4]]),
                                    c[5] >= 0 ? static_cast<const float*>(consts[c[5]]) : nullptr,
                                    f[0] > 0 ? nullptr : dst.f(0),
                                    f[0] > 0 ? dst.q(0) : nullptr,
                                    dst.ld, f[0] > 0 ? 1.0f / f[0] : 0.0f, f[1], -128.0f, 127.0f};
                    if (c[10]) ep.qmin = f[1] > -128.0f ? f[1] : -128.0f;
                    if (f[0] > 0) {
                        ep.mult = mult[n].data();
                        ep.add = add[n].data();
                    }
                    qt::gemm_u8s8(a.rows, N, Kp, u8.data(), Kp,
                                  static_cast<const int8_t*>(consts[c[3]]), ep);
                    break;
                }
                case BINARY: {
                    const Slot& b = s[c[3]];
                    for (int64_t r = 0; r < dst.rows; ++r)
                        binary_row(c[4], a.q(r), b.q(r), dst.q(r), dst.cols, f);
                    break;
                }
                case LOOKUP: {
                    const int8_t* table = static_cast<const int8_t*>(consts[c[3]]);
                    for (int64_t r = 0; r < dst.rows; ++r)
                        for (int64_t j = 0; j < dst.cols; ++j)
                            dst.q(r)[j] = table[static_cast<int>(a.q(r)[j]) + 128];
                    break;
                }
                case FAKE_QUANT:
                    for (int64_t r = 0; r < dst.rows; ++r) fake_quant_row(a.f(r), dst.f(r), dst.cols, f);
                    break;
                case FLOAT_BINARY: {
                    const Slot& b = s[c[3]];
                    for (int64_t r = 0; r < dst.rows; ++r)
                        float_binary_row(c[4], a.f(r), b.f(r), dst.f(r), dst.cols);
                    break;
                }
                case FLOAT_UNARY:
                    for (int64_t r = 0; r < dst.rows; ++r) float_unary_row(c[3], a.f(r), dst.f(r), dst.cols);
                    break;
                default:
                    break;
            }
        }
        const Slot& y = s[outs[0]];
        for (int64_t r = 0; r < B; ++r)
            std::memcpy(ys + (t * B + r) * y.cols, y.f(r), static_cast<size_t>(y.cols) * 4);
        for (int64_t k = 0; k < n_states; ++k) {  // new states become next step's inputs
            const Slot& from = s[outs[k]];
            const Slot& to = s[1 + k];
            for (int64_t r = 0; r < B; ++r)
                std::memcpy(to.f(r), from.f(r), static_cast<size_t>(to.cols) * 4);
        }
    }
    for (int64_t k = 0; k < n_states; ++k) {
        const Slot& st = s[1 + k];
        for (int64_t r = 0; r < st.rows; ++r)
            std::memcpy(states[k] + r * st.cols, st.f(r), static_cast<size_t>(st.cols) * 4);
    }
}

}  // extern "C"
