// One recurrent layer and direction (LSTM, GRU, RNN tanh/relu) as a single compiled loop.
//
// The input projection of a chunk of time steps is one int8 GEMM; each step then runs an
// int8 GEMM(V) of the hidden state against W_hh and the gate math in float. The hidden state
// fed back is requantized each step, to int8 or (wide) to int16 split into two uint8 planes
// (h = 256 * (hi - 128) + lo), two VNNI passes over the same int8 weights. The cell state
// and the float hidden state never leave the kernel.
#include <algorithm>
#include <cstdint>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <vector>

#include "qt_kernels.h"
#include "qt_rnn.h"

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

// 64-byte aligned, uninitialized: the GEMM epilogue and the gate math move 32-byte vectors
// through gx / gh and the states, and the 16-byte alignment that new[] and large mallocs
// give splits every other one across two cache lines (1-3% of the batch-32 LSTM on AVX2,
// interleaved; benchmarks/README.md).
template <class T>
std::unique_ptr<T[], void (*)(void*)> aligned_buffer(int64_t n) {
    const size_t bytes = (static_cast<size_t>(std::max<int64_t>(n, 1)) * sizeof(T) + 63) / 64 * 64;
    void* p = std::aligned_alloc(64, bytes);
    if (!p) throw std::bad_alloc();  // caught at the entry point (QT_CATCH)
    return std::unique_ptr<T[], void (*)(void*)>(static_cast<T*>(p), std::free);
}

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


namespace qt {

// The float output of a layer as the next layer's int16 input, two uint8 planes zero padded
// from K to Kp: quantize16 and split_planes in one pass, a chunk at a time so that the planes
// are read from L2 right after they are written (qt::Planes16Fn).
void planes16_portable(const float* x, int64_t M, int64_t K, float inv, uint8_t* hi,
                       uint8_t* lo, int64_t Kp, float qmin) {
    for (int64_t m = 0; m < M; ++m) {
        for (int64_t k = 0; k < K; ++k) {
            const int32_t q = static_cast<int32_t>(
                qt::quantize_value(x[m * K + k], inv, 0.0f, qmin, 32767.0f));
            hi[m * Kp + k] = static_cast<uint8_t>((q >> 8) + 128);
            lo[m * Kp + k] = static_cast<uint8_t>(q & 255);
        }
        for (int64_t k = K; k < Kp; ++k) hi[m * Kp + k] = lo[m * Kp + k] = 0;
    }
}

void round16_portable(float* y, int64_t n, float inv, float scale) {
    for (int64_t i = 0; i < n; ++i)
        y[i] = quantize_value(y[i], inv, 0.0f, -32768.0f, 32767.0f) * scale;
}

}  // namespace qt

namespace {

// One layer and direction (see qt_rnn_layer); the input is int8 x, int16 x16, or float xf
// quantized to int16 with inverse step xf_inv on the fly (a stacked layer inside qt_rnn).
void layer(int kind, int64_t T, int64_t B, int64_t K, int64_t H, int reverse,
           const int8_t* x, float x_s, float x_z, const int8_t* w_ih, int64_t kp_ih,
           const int32_t* colsum_ih, const float* ws_ih, const float* b_ih,
           const int8_t* w_hh, int64_t kp_hh, const int32_t* colsum_hh,
           const float* ws_hh, const float* b_hh, float h0_s, float h0_z, float in_s,
           float in_z, int wide, int8_t* y, int64_t y_ld, float y_s, float y_z,
           float* h, float* c, const int8_t* w_hr, int64_t P, const int32_t* colsum_hr,
           const float* ws_hr, float* yf, const int16_t* x16, const float* xf, float xf_inv,
           const int64_t* bs = nullptr, const int64_t* first_row = nullptr,
           float xf_min = -32767.0f) {
    if (T <= 0 || B <= 0) return;  // nothing to compute (and no chunk size to derive)
    // Step t's rows: all B at t * B (padded), or, on a packed sequence (bs given, with
    // first_row[t] its prefix sums), the bs[t] sequences still running at first_row[t]. The
    // rows past bs[t] are left alone: a finished sequence keeps its final state (forward),
    // one not yet started still holds its initial state (reverse).
    const auto rows_at = [&](int64_t t) { return bs ? bs[t] : B; };
    const auto row0 = [&](int64_t t) { return bs ? first_row[t] : t * B; };
    const int64_t G = kind == 0 ? 4 : (kind == 1 ? 3 : 1), N = G * H;
    // Input projection of a chunk of time steps at once, sized to stay in L2.
    const int64_t chunk = std::max<int64_t>(1, (256 * 1024) / (B * N * 4));
    // scratch every step overwrites in full: left uninitialized (zeroing gx alone is
    // 256 KiB of stores per call)
    const auto xu = aligned_buffer<uint8_t>(chunk * B * kp_ih);
    const auto xlo = aligned_buffer<uint8_t>(x16 || xf ? chunk * B * kp_ih : 0);
    const auto gx = aligned_buffer<float>(chunk * B * N);
    const auto gh = aligned_buffer<float>(B * N);
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
    int64_t ran = 0;  // rows that ran the step before: they read h on the feedback grid
    for (int64_t c0 = 0; c0 < T; c0 += chunk) {
        const int64_t n = std::min(chunk, T - c0);
        const int64_t t0 = reverse ? T - c0 - n : c0;  // first time index of this chunk
        const int64_t r0 = row0(t0), m = row0(t0 + n) - r0;  // the chunk's rows, contiguous
        if (xf)
            qt::kernels.planes16(xf + r0 * K, m, K, xf_inv, xu.get(), xlo.get(), kp_ih, xf_min);
        else if (x16)
            split_planes(x16 + r0 * K, m, K, xu.get(), xlo.get(), kp_ih);
        else
            qt::to_u8(x + r0 * K, m, K, K, xu.get(), kp_ih);
        const qt::Epilogue ex{off_ih.data(), sc_ih.data(), b_ih, gx.get(), nullptr, N,
                              0, 0, 0, 0};
        qt::gemm_u8s8(m, N, kp_ih, xu.get(), kp_ih, w_ih, ex,
                      x16 || xf ? xlo.get() : nullptr, &pw_ih);
        for (int64_t i = 0; i < n; ++i) {
            const int64_t local = reverse ? n - 1 - i : i, t = t0 + local;
            const int64_t rows = rows_at(t), r = row0(t), g = r - r0;
            // rows [0, cont) continue from the step before; rows [cont, rows) start here and
            // read their initial state on its own grid (all of them at the first step; on a
            // packed sequence run in reverse, also the sequences starting at step t)
            const int64_t cont = std::min(ran, rows);
            const qt::Epilogue eh{off_hh.data(), sc_hh.data(), b_hh, gh.get(), nullptr,
                                  N, 0, 0, 0, 0};
            qt::gemm_u8s8(cont, N, kp_hh, hu8.data(), kp_hh, w_hh, eh,
                          wide ? hu8.data() + B * kp_hh : nullptr, &pw_hh);
            const qt::Epilogue e0{off0.data(), sc0.data(), b_hh, gh.get() + cont * N, nullptr,
                                  N, 0, 0, 0, 0};
            qt::gemm_u8s8(rows - cont, N, kp_hh, hu8.data() + cont * kp_hh, kp_hh, w_hh, e0,
                          nullptr, &pw_hh);
            ran = rows;
            for (int64_t b = 0; b < rows; ++b) {
                qt::kernels.cell(s, gx.get() + (g + b) * N, gh.get() + b * N, h + b * HS,
                     c ? c + b * H : nullptr, hu8.data() + b * kp_hh,
                     yf ? nullptr : y + (r + b) * y_ld, yf ? yf + (r + b) * y_ld : nullptr,
                     w_hr ? raw.data() + b * H : nullptr);
            }
            if (w_hr) {
                for (int64_t b = 0; b < rows; ++b) {  // symmetric int8, one scale per row
                    const float* rw = raw.data() + b * H;
                    float peak = 0.0f;
                    for (int64_t j = 0; j < H; ++j) peak = std::max(peak, std::fabs(rw[j]));
                    row_scale[b] = peak > 0.0f ? peak / 127.0f : 1.0f;
                    const float inv = 1.0f / row_scale[b];
                    for (int64_t j = 0; j < H; ++j)
                        rawu8[b * kp_hr + j] = static_cast<uint8_t>(
                            qt::quantize_value(rw[j], inv, 0.0f, -127.0f, 127.0f) + 128.0f);
                }
                const qt::Epilogue ep{off_hr.data(), ws_hr, nullptr, hp.data(), nullptr,
                                      P, 0, 0, 0, 0};
                qt::gemm_u8s8(rows, P, kp_hr, rawu8.data(), kp_hr, w_hr, ep);
                for (int64_t b = 0; b < rows; ++b) {
                    float* row = hp.data() + b * P;
                    for (int64_t j = 0; j < P; ++j) row[j] *= row_scale[b];
                    emit(s, row, P, h + b * P, hu8.data() + b * kp_hh,
                         yf ? nullptr : y + (r + b) * y_ld,
                         yf ? yf + (r + b) * y_ld : nullptr);
                }
            }
        }
    }
}

}  // namespace

extern "C" {

// Symmetric int16 of a float buffer (the output of a layer another layer reads).
void qt_quantize16(const float* __restrict x, int64_t n, float inv, int16_t* __restrict out) try {
    for (int64_t i = 0; i < n; ++i)
        out[i] = static_cast<int16_t>(qt::quantize_value(x[i], inv, 0.0f, -32767.0f, 32767.0f));
} QT_CATCH

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
                  const float* ws_hr, float* yf, const int16_t* x16) try {
    layer(kind, T, B, K, H, reverse, x, x_s, x_z, w_ih, kp_ih, colsum_ih, ws_ih, b_ih, w_hh,
          kp_hh, colsum_hh, ws_hh, b_hh, h0_s, h0_z, in_s, in_z, wide, y, y_ld, y_s, y_z, h, c,
          w_hr, P, colsum_hr, ws_hr, yf, x16, nullptr, 0.0f);
} QT_CATCH

void qt_quantize(const float* x, int64_t n, float inv, float zp, int8_t* out);
void qt_dequantize(const int8_t* q, int64_t n, float scale, float zp, float* out);

// lo = min and hi = max of x[0..n) as the scan lo = min(lo, x[k]), hi = max(hi, x[k]) from
// x[0] finds them, in 16 lanes the compiler vectorizes (a float min / max reduction is
// otherwise left scalar: 1 ns per element, 2% of the batch-32 LSTM on AVX-512). Each lane
// keeps the scan's rule (a NaN or an equal value never replaces the running one), so a
// lane's result is the scan's over its elements; combined in order, the result differs from
// the scan's at most in the sign of a zero extreme, which the step derived from it ignores
// (max with 1e-8).
static void range(const float* x, int64_t n, float* lo_out, float* hi_out) {
    if (n <= 0) return;
    constexpr int L = 16;
    float lo[L], hi[L];
    for (int j = 0; j < L; ++j) lo[j] = hi[j] = x[0];
    int64_t k = 0;
    for (; k + L <= n; k += L)
        for (int j = 0; j < L; ++j) {
            const float v = x[k + j];
            lo[j] = v < lo[j] ? v : lo[j];
            hi[j] = hi[j] < v ? v : hi[j];
        }
    float a = lo[0], b = hi[0];
    for (int j = 1; j < L; ++j) {
        a = lo[j] < a ? lo[j] : a;
        b = b < hi[j] ? hi[j] : b;
    }
    for (; k < n; ++k) {
        a = x[k] < a ? x[k] : a;
        b = b < x[k] ? x[k] : b;
    }
    *lo_out = a;
    *hi_out = b;
}

}  // extern "C"

namespace {

// qt_rnn, on a padded batch (bs null) or a packed sequence's rows (bs: step t has bs[t]
// rows, non-increasing, bs[0] = B, checked by the caller). inner_steps, when given, are the
// int16 steps of the outputs the layers before the last hand on, instead of the ranges they
// took (for checks: a sequence run alone then sees the steps of the batch it came from).
void rnn_stack(const QtRnnPlan* p, int64_t T, int64_t B, const int64_t* bs,
               const int8_t* x, const float* x_float, float x_inv, const int8_t* h0,
               const int8_t* c0, int8_t* y, float* y_float, int8_t* hn, int8_t* cn,
               const float* inner_steps) {
    const int64_t L = p->layers, D = p->dirs, H = p->H, W = p->P ? p->P : H;
    std::vector<int64_t> first_row(bs ? static_cast<size_t>(T) + 1 : 0, 0);
    for (int64_t t = 0; bs && t < T; ++t) first_row[t + 1] = first_row[t] + bs[t];
    const int64_t per = 8 + (p->P ? 3 : 0), rows = bs ? first_row[T] : T * B, width = D * W;
    // a float input is quantized here as the graph's quantize did (x_inv = 1 / x_s, computed
    // by the caller as that op does), and a float output dequantized here as its dequantize
    // did: two op calls fewer around the kernel, the same bits
    std::unique_ptr<int8_t[]> x_own, y_own;
    // x16: the first layer quantizes x_float itself, to int16 planes chunk by chunk (the
    // graph's symmetric int16 quantize: clamped to [-32768, 32767])
    const bool x16 = p->x16 && x_float, y16 = p->y16 && y_float;
    if (x_float && !x16) {
        x_own.reset(new int8_t[static_cast<size_t>(std::max<int64_t>(1, rows * p->K))]);
        qt_quantize(x_float, rows * p->K, x_inv, p->x_z, x_own.get());
        x = x_own.get();
    }
    if (y_float && !y16) {
        y_own.reset(new int8_t[static_cast<size_t>(std::max<int64_t>(1, rows * width))]);
        y = y_own.get();
    }
    const bool lstm = p->kind == 0;
    const int64_t nh = L * D * B * W, nc = lstm ? L * D * B * H : 0;
    const auto h = aligned_buffer<float>(nh), c = aligned_buffer<float>(nc);
    std::fill(h.get(), h.get() + nh, 0.0f);
    std::fill(c.get(), c.get() + nc, 0.0f);
    // initial states dequantized as the reference's dequantize does (none: zeros)
    if (h0)
        for (int64_t i = 0; i < nh; ++i) h[i] = (static_cast<float>(h0[i]) - p->h_z) * p->h_s;
    if (c0)
        for (int64_t i = 0; i < nc; ++i) c[i] = (static_cast<float>(c0[i]) - p->c_z) * p->c_s;
    // float outputs of the layers before the last: one buffer read while the next is written
    const int64_t inner_size = L > 1 ? rows * width : 0;
    const auto inner0 = aligned_buffer<float>(inner_size);
    const auto inner1 = aligned_buffer<float>(L > 2 ? inner_size : 0);
    float* const inner[2] = {inner0.get(), inner1.get()};
    float in_s = p->x_s, in_z = x16 ? 0.0f : p->x_z, in_inv = x16 ? x_inv : 0.0f;
    const float* xf = x16 ? x_float : nullptr;
    for (int64_t l = 0; l < L; ++l) {
        const bool last = l == L - 1;
        const float grid_s = last ? p->last_s : p->inner_s, grid_z = last ? p->last_z : p->inner_z;
        const float grid_fb = last ? p->last_fb : p->inner_fb;
        // the layers before the last feed back int16 whatever the plan says: their grid is a
        // bound on states never observed, too coarse for int8 where the states are small
        const int layer_wide = p->wide || !last ? 1 : 0;
        const float fb_s = layer_wide ? grid_fb : grid_s, fb_z = layer_wide ? 0.0f : grid_z;
        float* out = last ? (y16 ? y_float : nullptr) : inner[l % 2];
        for (int64_t d = 0; d < D; ++d) {
            const int64_t i = l * D + d;
            const void* const* q = p->params + i * per;
            layer(static_cast<int>(p->kind), T, B, l == 0 ? p->K : width, H, static_cast<int>(d),
                  l == 0 ? x : nullptr, in_s, in_z, static_cast<const int8_t*>(q[0]),
                  p->depth[2 * i], static_cast<const int32_t*>(q[1]),
                  static_cast<const float*>(q[2]), static_cast<const float*>(q[3]),
                  static_cast<const int8_t*>(q[4]), p->depth[2 * i + 1],
                  static_cast<const int32_t*>(q[5]), static_cast<const float*>(q[6]),
                  static_cast<const float*>(q[7]), p->h_s, p->h_z, fb_s, fb_z, layer_wide,
                  last && !y16 ? y + d * W : nullptr, width, p->y_s, p->y_z, h.get() + i * B * W,
                  lstm ? c.get() + i * B * H : nullptr,
                  p->P ? static_cast<const int8_t*>(q[8]) : nullptr, p->P,
                  p->P ? static_cast<const int32_t*>(q[9]) : nullptr,
                  p->P ? static_cast<const float*>(q[10]) : nullptr,
                  out ? out + d * W : nullptr, nullptr, xf,
                  in_inv, bs, bs ? first_row.data() : nullptr,
                  l == 0 ? -32768.0f : -32767.0f);
        }
        if (!last) {  // the next layer's input: symmetric int16 on the range this one took
            float lo = 0.0f, hi = 0.0f;
            range(out, rows * width, &lo, &hi);
            // in double, as the Python wrapper computed it, then rounded to float once
            const double step =
                inner_steps ? static_cast<double>(inner_steps[l])
                            : std::max({-static_cast<double>(lo), static_cast<double>(hi), 1e-8}) / 32767.0;
            in_s = static_cast<float>(step);
            in_z = 0.0f;
            in_inv = static_cast<float>(1.0 / step);
            xf = out;
        }
    }
    if (y16) {  // the graph's quantize and dequantize on the int16 grid, in place
        qt::kernels.round16(y_float, rows * width,
                            static_cast<float>(1.0 / static_cast<double>(p->y_s)), p->y_s);
    } else if (y_float) {
        qt_dequantize(y, rows * width, p->y_s, p->y_z, y_float);
    }
    if (hn)
        for (int64_t i = 0; i < nh; ++i)
            hn[i] = static_cast<int8_t>(qt::quantize_value(h[i], p->hn_inv, p->hn_z, -128.0f, 127.0f));
    if (cn)
        for (int64_t i = 0; i < nc; ++i)
            cn[i] = static_cast<int8_t>(qt::quantize_value(c[i], p->cn_inv, p->cn_z, -128.0f, 127.0f));
}

}  // namespace

extern "C" {

// A whole stacked (bidirectional) LSTM / GRU / RNN: x int8 [T, B, K] time-major (or
// x_float, float), y int8 [T, B, dirs * width] (or y_float, float); h0 / c0 int8 initial states [layers * dirs, B, width / H] on the
// plan's h / c grids, or null for zeros; hn / cn the final states on their own grids (null:
// not wanted). The layers before the last write float, which becomes the next layer's int16
// input on the range it took (two byte planes, quantized chunk by chunk inside the layer),
// exactly as quantize16 of that range did when each layer was its own call.
void qt_rnn(const QtRnnPlan* p, int64_t T, int64_t B, const int8_t* x, const float* x_float,
            float x_inv, const int8_t* h0, const int8_t* c0, int8_t* y, float* y_float,
            int8_t* hn, int8_t* cn) try {
    rnn_stack(p, T, B, nullptr, x, x_float, x_inv, h0, c0, y, y_float, hn, cn, nullptr);
} QT_CATCH

// qt_rnn on a packed sequence: x / x_float [N, K] and y / y_float [N, dirs * width] rows in
// packed order (step after step, the sequences still running at a step first), N the sum of
// batch_sizes[T] (non-increasing, batch_sizes[0] = B, the states' batch). One call for every
// layer and direction, where one call per group of equal lengths ran each group as its own
// padded batch. batch_sizes null: the padded [T, B] layout of qt_rnn. inner_steps: see
// rnn_stack (null: the ranges the layers' outputs took, over the real rows only).
void qt_rnn_packed(const QtRnnPlan* p, int64_t T, int64_t B, const int64_t* batch_sizes,
                   const int8_t* x, const float* x_float, float x_inv, const int8_t* h0,
                   const int8_t* c0, int8_t* y, float* y_float, int8_t* hn, int8_t* cn,
                   const float* inner_steps) try {
    rnn_stack(p, T, B, batch_sizes, x, x_float, x_inv, h0, c0, y, y_float, hn, cn,
              inner_steps);
} QT_CATCH

// qt_rnn on batch-first float rows, as a batch_first nn.LSTM reads and writes them: x_float
// element (b, t, k) at b * sb + t * st + k * sk (the caller's view, read through its strides:
// a permuted map needs no copy first), y_float dense [B, T, dirs * width]. The rows are moved
// to and from time-major order here (a memcpy per row where sk is 1) and qt_rnn runs on
// them: the same values in the same order, so the same bits as a transposed contiguous copy
// in and out (two torch copies and an allocation fewer per call).
void qt_rnn_batch_first(const QtRnnPlan* p, int64_t T, int64_t B, const float* x_float,
                        int64_t st, int64_t sb, int64_t sk, float x_inv, const int8_t* h0,
                        const int8_t* c0, float* y_float, int8_t* hn, int8_t* cn) try {
    const int64_t K = p->K, width = p->dirs * (p->P ? p->P : p->H);
    const auto xt = aligned_buffer<float>(T * B * K);
    const auto yt = aligned_buffer<float>(T * B * width);
    for (int64_t t = 0; t < T; ++t)
        for (int64_t b = 0; b < B; ++b) {
            const float* src = x_float + t * st + b * sb;
            float* dst = xt.get() + (t * B + b) * K;
            if (sk == 1)
                std::memcpy(dst, src, static_cast<size_t>(K) * sizeof(float));
            else
                for (int64_t k = 0; k < K; ++k) dst[k] = src[k * sk];
        }
    rnn_stack(p, T, B, nullptr, nullptr, xt.get(), x_inv, h0, c0, nullptr, yt.get(), hn, cn,
              nullptr);
    for (int64_t b = 0; b < B; ++b)
        for (int64_t t = 0; t < T; ++t)
            std::memcpy(y_float + (b * T + t) * width, yt.get() + (t * B + b) * width,
                        static_cast<size_t>(width) * sizeof(float));
} QT_CATCH

}  // extern "C"
