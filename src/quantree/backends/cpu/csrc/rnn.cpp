// One recurrent layer and direction (LSTM, GRU, RNN tanh/relu) as a single compiled loop.
//
// The input projection of a chunk of time steps is one int8 GEMM; each step then runs an
// int8 GEMM(V) of the hidden state against W_hh and the gate math in float. The hidden state
// fed back is requantized each step, to int8 or (wide) to int16 split into two uint8 planes
// (h = 256 * (hi - 128) + lo), two VNNI passes over the same int8 weights. The cell state
// and the float hidden state never leave the kernel.
#include <algorithm>
#include <cmath>
#include <memory>
#include <type_traits>
#include <vector>

#include "qt_kernels.h"

namespace qt {

static inline float sig(float x) { return 1.0f / (1.0f + std::exp(-x)); }

// Gate math of one batch row (qt::CellFn), one element at a time.
void cell_portable(const RnnStep& s, const float* gx, const float* gh, float* h, float* c, uint8_t* hu8,
          int8_t* y, float* yf, float* raw) {
    const int64_t H = s.H;
    for (int64_t j = 0; j < H; ++j) {
        auto pre = [&](int64_t g) { return gx[g * H + j] + gh[g * H + j]; };
        float hv;
        if (s.kind == LSTM) {
            c[j] = sig(pre(1)) * c[j] + sig(pre(0)) * std::tanh(pre(2));
            hv = sig(pre(3)) * std::tanh(c[j]);
            if (raw) {
                raw[j] = hv;
                continue;
            }
        } else if (s.kind == GRU) {
            const float r = sig(pre(0)), z = sig(pre(1));
            const float n = std::tanh(gx[2 * H + j] + r * gh[2 * H + j]);
            hv = n + z * (h[j] - n);
        } else if (s.kind == RNN_TANH) {
            hv = std::tanh(pre(0));
        } else {
            hv = pre(0) > 0.0f ? pre(0) : 0.0f;
        }
        h[j] = hv;
        if (s.lo_offset) {
            const int32_t q = static_cast<int32_t>(
                quantize_value(hv, s.h_inv, 0.0f, -32768.0f, 32767.0f));
            hu8[j] = static_cast<uint8_t>((q >> 8) + 128);
            hu8[s.lo_offset + j] = static_cast<uint8_t>(q & 255);
        } else {
            hu8[j] = static_cast<uint8_t>(
                quantize_value(hv, s.h_inv, s.h_zp, -128.0f, 127.0f) + 128.0f);
        }
        if (yf)
            yf[j] = hv;
        else
            y[j] = static_cast<int8_t>(quantize_value(hv, s.y_inv, s.y_zp, -128.0f, 127.0f));
    }
}

}  // namespace qt

namespace {

using qt::RnnStep;



// A projected hidden row: the float state, the feedback operand and the output.
void emit(const RnnStep& s, const float* hv, int64_t P, float* h, uint8_t* hu8, int8_t* y,
          float* yf) {
    for (int64_t j = 0; j < P; ++j) {
        h[j] = hv[j];
        if (s.lo_offset) {
            const int32_t q = static_cast<int32_t>(
                qt::quantize_value(hv[j], s.h_inv, 0.0f, -32768.0f, 32767.0f));
            hu8[j] = static_cast<uint8_t>((q >> 8) + 128);
            hu8[s.lo_offset + j] = static_cast<uint8_t>(q & 255);
        } else {
            hu8[j] = static_cast<uint8_t>(
                qt::quantize_value(hv[j], s.h_inv, s.h_zp, -128.0f, 127.0f) + 128.0f);
        }
        if (yf)
            yf[j] = hv[j];
        else
            y[j] = static_cast<int8_t>(
                qt::quantize_value(hv[j], s.y_inv, s.y_zp, -128.0f, 127.0f));
    }
}

}  // namespace

static std::vector<int32_t> offsets(const int32_t* colsum, int64_t N, float zp) {
    std::vector<int32_t> off(static_cast<size_t>(N));
    const int32_t shift = static_cast<int32_t>(zp) + 128;
    for (int64_t n = 0; n < N; ++n) off[n] = -shift * colsum[n];
    return off;
}

static std::vector<float> scales(const float* w_scale, int64_t N, float s) {
    std::vector<float> out(static_cast<size_t>(N));
    for (int64_t n = 0; n < N; ++n) out[n] = s * w_scale[n];
    return out;
}

// int16 rows as two uint8 planes, q = 256 * (hi - 128) + lo, zero padded from K to Kp: one
// dual VNNI pass multiplies both (the layer input of a stacked layer, kept 16-bit).
static void split_planes(const int16_t* x, int64_t M, int64_t K, uint8_t* hi, uint8_t* lo,
                         int64_t Kp) {
    for (int64_t m = 0; m < M; ++m) {
        for (int64_t k = 0; k < K; ++k) {
            const int32_t q = x[m * K + k];
            hi[m * Kp + k] = static_cast<uint8_t>((q >> 8) + 128);
            lo[m * Kp + k] = static_cast<uint8_t>(q & 255);
        }
        for (int64_t k = K; k < Kp; ++k) hi[m * Kp + k] = lo[m * Kp + k] = 0;
    }
}

static void quantize_rows(const float* h, int64_t B, int64_t H, float inv, float zp,
                          uint8_t* out, int64_t ld) {
    for (int64_t b = 0; b < B; ++b)
        for (int64_t j = 0; j < H; ++j)
            out[b * ld + j] = static_cast<uint8_t>(
                qt::quantize_value(h[b * H + j], inv, zp, -128.0f, 127.0f) + 128.0f);
}

extern "C" {

// Symmetric int16 of a float buffer (the output of a layer another layer reads).
void qt_quantize16(const float* __restrict x, int64_t n, float inv, int16_t* __restrict out) {
    for (int64_t i = 0; i < n; ++i)
        out[i] = static_cast<int16_t>(qt::quantize_value(x[i], inv, 0.0f, -32767.0f, 32767.0f));
}

// x: int8 [T*B, K] time-major (scale x_s, zero point x_z); y: int8 rows of stride y_ld
// (or, when yf is given, float rows there instead: a layer whose output another layer reads)
// (already offset to this direction's columns); h/c: float [B, H] initial states,
// overwritten by the final ones. The first step reads h exactly on the state's own int8
// grid (h0_s, h0_z); later steps requantize h to the inner grid: int8 (in_s, in_z), or with
// wide != 0 symmetric int16 with scale in_s (in_z unused).
void qt_rnn_layer(int kind, int64_t T, int64_t B, int64_t K, int64_t H, int reverse,
                  const int8_t* x, float x_s, float x_z, const int8_t* w_ih, int64_t kp_ih,
                  const int32_t* colsum_ih, const float* ws_ih, const float* b_ih,
                  const int8_t* w_hh, int64_t kp_hh, const int32_t* colsum_hh,
                  const float* ws_hh, const float* b_hh, float h0_s, float h0_z, float in_s,
                  float in_z, int wide, int8_t* y, int64_t y_ld, float y_s, float y_z,
                  float* h, float* c, const int8_t* w_hr, int64_t P, const int32_t* colsum_hr,
                  const float* ws_hr, float* yf, const int16_t* x16) {
    if (T <= 0 || B <= 0) return;  // nothing to compute (and no chunk size to derive)
    const int64_t G = kind == 0 ? 4 : (kind == 1 ? 3 : 1), N = G * H;
    // Input projection of a chunk of time steps at once, sized to stay in L2.
    const int64_t chunk = std::max<int64_t>(1, (256 * 1024) / (B * N * 4));
    // scratch every step overwrites in full: left uninitialized (zeroing gx alone is
    // 256 KiB of stores per call)
    const auto scratch = [](int64_t n, auto* type) {
        using T = std::remove_pointer_t<decltype(type)>;
        return std::unique_ptr<T[]>(new T[static_cast<size_t>(n)]);
    };
    const auto xu = scratch(chunk * B * kp_ih, static_cast<uint8_t*>(nullptr));
    const auto xlo = scratch(x16 ? chunk * B * kp_ih : 0, static_cast<uint8_t*>(nullptr));
    const auto gx = scratch(chunk * B * N, static_cast<float*>(nullptr));
    const auto gh = scratch(B * N, static_cast<float*>(nullptr));
    const std::vector<int32_t> off_ih = offsets(colsum_ih, N, x_z);
    const std::vector<float> sc_ih = scales(ws_ih, N, x_s);
    const std::vector<int32_t> off0 = offsets(colsum_hh, N, h0_z);
    const std::vector<float> sc0 = scales(ws_hh, N, h0_s);
    // wide: hi plane is h >> 8 (+128 to make it uint8), lo plane the low byte (no offset):
    // 256 * (hi.W - 128 * colsum) + lo.W, scaled by the int16 step
    const std::vector<int32_t> off_hh = offsets(colsum_hh, N, wide ? 0.0f : in_z);
    const std::vector<float> sc_hh = scales(ws_hh, N, in_s);

    // projection (LSTM proj_size): each row of o * tanh(c) is quantized to int8 on its own
    // symmetric scale and multiplied by W_hr [P, H] in int8; h is then [B, P]
    const int64_t HS = w_hr ? P : H;  // width of the hidden state
    const int64_t kp_hr = (H + 3) / 4 * 4;
    std::vector<float> raw(w_hr ? static_cast<size_t>(B * H) : 0), hp(w_hr ? B * P : 0);
    std::vector<uint8_t> rawu8(w_hr ? static_cast<size_t>(B * kp_hr) : 0, 128);
    const std::vector<int32_t> off_hr = w_hr ? offsets(colsum_hr, P, 0.0f) : std::vector<int32_t>();
    std::vector<float> row_scale(static_cast<size_t>(B));

    // W_hh is multiplied at every step, W_ih once per chunk: prepared once for all of them
    // (where the path has something to prepare; a few chunks are not worth it)
    const qt::PreparedB pw_hh(w_hh, N, kp_hh, T > 1 ? B : 0);
    const qt::PreparedB pw_ih(w_ih, N, kp_ih, T >= 4 * chunk ? chunk * B : 0);
    std::vector<uint8_t> hu8(static_cast<size_t>(2 * B * kp_hh), 0);
    quantize_rows(h, B, HS, 1.0f / h0_s, h0_z, hu8.data(), kp_hh);
    const RnnStep s{kind, H, 1.0f / in_s, in_z, 1.0f / y_s, y_z, wide ? B * kp_hh : 0};
    for (int64_t c0 = 0; c0 < T; c0 += chunk) {
        const int64_t n = std::min(chunk, T - c0);
        const int64_t t0 = reverse ? T - c0 - n : c0;  // first time index of this chunk
        if (x16)
            split_planes(x16 + t0 * B * K, n * B, K, xu.get(), xlo.get(), kp_ih);
        else
            qt::to_u8(x + t0 * B * K, n * B, K, K, xu.get(), kp_ih);
        const qt::Epilogue ex{off_ih.data(), sc_ih.data(), b_ih, gx.get(), nullptr, N,
                              0, 0, 0, 0};
        qt::gemm_u8s8(n * B, N, kp_ih, xu.get(), kp_ih, w_ih, ex, x16 ? xlo.get() : nullptr,
                      &pw_ih);
        for (int64_t i = 0; i < n; ++i) {
            const int64_t local = reverse ? n - 1 - i : i, t = t0 + local;
            const bool first = c0 == 0 && i == 0;
            const qt::Epilogue eh{first ? off0.data() : off_hh.data(),
                                  first ? sc0.data() : sc_hh.data(), b_hh, gh.get(), nullptr,
                                  N, 0, 0, 0, 0};
            const uint8_t* lo = wide && !first ? hu8.data() + B * kp_hh : nullptr;
            qt::gemm_u8s8(B, N, kp_hh, hu8.data(), kp_hh, w_hh, eh, lo, &pw_hh);
            for (int64_t b = 0; b < B; ++b) {
                qt::kernels.cell(s, gx.get() + (local * B + b) * N, gh.get() + b * N, h + b * HS,
                     c ? c + b * H : nullptr, hu8.data() + b * kp_hh,
                     yf ? nullptr : y + (t * B + b) * y_ld, yf ? yf + (t * B + b) * y_ld : nullptr,
                     w_hr ? raw.data() + b * H : nullptr);
            }
            if (w_hr) {
                for (int64_t b = 0; b < B; ++b) {  // symmetric int8, one scale per row
                    const float* r = raw.data() + b * H;
                    float peak = 0.0f;
                    for (int64_t j = 0; j < H; ++j) peak = std::max(peak, std::fabs(r[j]));
                    row_scale[b] = peak > 0.0f ? peak / 127.0f : 1.0f;
                    const float inv = 1.0f / row_scale[b];
                    for (int64_t j = 0; j < H; ++j)
                        rawu8[b * kp_hr + j] = static_cast<uint8_t>(
                            qt::quantize_value(r[j], inv, 0.0f, -127.0f, 127.0f) + 128.0f);
                }
                const qt::Epilogue ep{off_hr.data(), ws_hr, nullptr, hp.data(), nullptr,
                                      P, 0, 0, 0, 0};
                qt::gemm_u8s8(B, P, kp_hr, rawu8.data(), kp_hr, w_hr, ep);
                for (int64_t b = 0; b < B; ++b) {
                    float* row = hp.data() + b * P;
                    for (int64_t j = 0; j < P; ++j) row[j] *= row_scale[b];
                    emit(s, row, P, h + b * P, hu8.data() + b * kp_hh,
                         yf ? nullptr : y + (t * B + b) * y_ld,
                         yf ? yf + (t * B + b) * y_ld : nullptr);
                }
            }
        }
    }
}

}  // extern "C"
