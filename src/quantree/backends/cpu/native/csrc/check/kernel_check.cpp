// C-level check of every kernel path the CPU runs against the portable path (its GEMM
// taken from the plain C++ gemm_reference, which x86-64's SSE2 portable GEMM must equal
// too), bit for bit, on random shapes (odd sizes included): the GEMM (every epilogue kind, with and without a low
// plane, and with weights prepared for the path: gemm_prepared) and every exported kernel built on it or beside it (linear, conv2d plain / grouped /
// depthwise, transposed, 1-d with int16 weights, matmul, max_pool2d, softmax, binary, lookup, quantize, dequantize, quantize16,
// the recurrent layer in each cell kind with projection, int16 feedback and int16 input,
// the whole stacked op on a padded batch and on a packed sequence, and a cells-mode
// program). Built from the library's sources by
// tests/backends/test_kernel_check.py (natively, and cross-compiled for aarch64 and run under
// qemu-aarch64, and under qemu-x86_64 as CPU models older and other than this one). Prints
// "cpu features F selected path P" (qt_cpu_features, and the path qt_select_isa takes
// uncapped), then "path P KERNEL cases N mismatches M" per path and kernel.
//
// The float gate math (sigmoid, tanh) of the vector paths (x86 and aarch64) is a polynomial,
// not libm's expf / tanhf, so their recurrent layers and float activations cannot equal the
// portable path bit for bit; there those cases are reported as "inexact" and only the
// kernels whose arithmetic is the same by construction must match bit for bit. The gate math
// itself ("gate_math": the path's cell and activation functions against the portable ones,
// every cell kind, int8 and int16 feedback, random and saturating pre-activations) must stay
// within GATE_ABS + GATE_REL |x| of the portable floats and one step of its integers.
//   kernel_check [cases] [bench M N K]
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <vector>

#include "../qt_kernels.h"

extern "C" {
int qt_select_isa(int cap);
int qt_amx(int mode);
int qt_current_isa();
int qt_cpu_features();
void qt_linear(const int8_t*, int64_t, int64_t, int64_t, int64_t, const int8_t*, const int32_t*,
               const float*, const float*, int8_t*, float*, float, float, int);
void qt_conv2d(const int8_t*, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
               int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
               int64_t, const int8_t*, const int32_t*, const float*, const float*, int8_t*,
               float*, float, float, int);
void qt_conv2d_grouped(const int8_t*, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                       int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                       int64_t, int64_t, int64_t, int64_t, const int8_t*, const int32_t*,
                       const float*, const float*, int8_t*, float*, float, float, int);
void qt_conv2d_depthwise(const int8_t*, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                         int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                         int64_t, const int8_t*, const int32_t*, const float*, const float*,
                         int8_t*, float*, float, float, int);
void qt_matmul(const int8_t*, const int8_t*, int64_t, int64_t, int64_t, int64_t, float, float,
               float, int8_t*, float*, float, float);
void qt_quantize(const float*, int64_t, float, float, int8_t*);
void qt_dequantize(const int8_t*, int64_t, float, float, float*);
void qt_quantize16(const float*, int64_t, float, int16_t*);
void qt_binary(int, const int8_t*, const int8_t*, int64_t, float, float, float, float, float,
               float, int8_t*);
void qt_lookup(const int8_t*, int64_t, const int8_t*, int8_t*);
void qt_softmax(const int8_t*, int64_t, int64_t, const float*, float, float, int8_t*);
void qt_conv_transpose(const int8_t*, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                       int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                       int64_t, int64_t, const int8_t*, const int32_t*, const int32_t*,
                       const float*, const float*, int8_t*, float*, int64_t, int64_t, int64_t,
                       int64_t, float, float, int);
void qt_conv_transpose16(const float*, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                         int64_t, int64_t, float, float, float, int64_t, int64_t, int64_t,
                         int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                         int64_t, const int8_t*, const int32_t*, const int32_t*, const int32_t*,
                         const float*, const float*, const float*, float*, int64_t, int64_t,
                         int64_t, int64_t);
void qt_max_pool2d(const int8_t*, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                   int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int8_t*);
void qt_rnn_layer(int, int64_t, int64_t, int64_t, int64_t, int, const int8_t*, float, float,
                  const int8_t*, int64_t, const int32_t*, const float*, const float*,
                  const int8_t*, int64_t, const int32_t*, const float*, const float*, float,
                  float, float, float, int, int8_t*, int64_t, float, float, float*, float*,
                  const int8_t*, int64_t, const int32_t*, const float*, float*, const int16_t*);
struct QtRnnPlan {  // as rnn.cpp lays it out
    int64_t kind, layers, dirs, K, H, P, wide;
    float x_s, x_z, inner_s, inner_z, y_s, y_z, h_s, h_z, c_s, c_z, inner_fb, last_s, last_z,
        last_fb, hn_inv, hn_z, cn_inv, cn_z;
    const void* const* params;
    const int64_t* depth;
};
void qt_rnn(const QtRnnPlan*, int64_t, int64_t, const int8_t*, const float*, float,
            const int8_t*, const int8_t*, int8_t*, float*, int8_t*, int8_t*);
void qt_rnn_packed(const QtRnnPlan*, int64_t, int64_t, const int64_t*, const int8_t*,
                   const float*, float, const int8_t*, const int8_t*, int8_t*, float*, int8_t*,
                   int8_t*, const float*);
void qt_conv1d_w16(const float*, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, float,
                   float, float, float, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                   int64_t, const int16_t*, int64_t, const float*, const float*, float*, int64_t,
                   int64_t, int64_t);
void qt_cell_loop(const float*, float*, int64_t, int, float**, int64_t, const int64_t*,
                  const int64_t*, int64_t, int64_t, const int64_t*, const float*, int64_t,
                  void**);
}

namespace {

uint64_t state = 0x9E3779B97F4A7C15ull;
uint32_t rnd() {
    state ^= state << 13;
    state ^= state >> 7;
    state ^= state << 17;
    return static_cast<uint32_t>(state >> 11);
}
int64_t pick(const int64_t* sizes, int n) { return sizes[rnd() % n]; }

// Packs w [N, K] (int8) into the VNNI block layout of qt_kernels.h.
std::vector<int8_t> pack(const std::vector<int8_t>& w, int64_t N, int64_t K, int64_t Kp) {
    const int64_t nb = (N + 15) / 16, kq = Kp / 4;
    std::vector<int8_t> out(static_cast<size_t>(nb * kq * 64), 0);
    for (int64_t n = 0; n < N; ++n)
        for (int64_t k = 0; k < K; ++k)
            out[(n / 16) * kq * 64 + (k / 4) * 64 + (n % 16) * 4 + k % 4] = w[n * K + k];
    return out;
}

struct Case {
    int64_t M, N, K, Kp, lda;
    int kind;  // 0 float out, 1 float accumulate, 2 int8 via scale, 3 int8 via mult/add
    bool dual, row_off, bias, extreme;
    std::vector<uint8_t> A, A2;
    std::vector<int8_t> B;
    std::vector<int32_t> off, roff;
    std::vector<float> scale, biasv, mult, add, init;
};

// Weights of a reduced-range recipe: within [-63, 63], reaching both ends; with extreme,
// activations only at 0 and 255 (the largest `vpmaddubsw` pair sums, 2 x 255 x 63).
void seven_bit(Case& c) {
    std::vector<int8_t> w(static_cast<size_t>(c.N * c.K));
    for (auto& v : w)
        v = static_cast<int8_t>(c.extreme || rnd() % 3 == 0 ? (rnd() % 2 ? 63 : -63)
                                                           : static_cast<int>(rnd() % 127) - 63);
    c.B = pack(w, c.N, c.K, c.Kp);
    if (c.extreme)
        for (auto& a : c.A) a = rnd() % 2 ? 255 : 0;
}

// 8-bit weights one byte away from 7-bit ones: every weight 63 but one of 127 (or -128, or
// 64), every activation 255. A GEMM for 7-bit weights would saturate on the 127's pair (255 x
// (127 + 63) > 2^15) and give other bits: these must never reach it.
void one_byte_wide(Case& c) {
    std::vector<int8_t> w(static_cast<size_t>(c.N * c.K), 63);
    static const int wide[] = {127, -128, 64, -64};
    w[rnd() % w.size()] = static_cast<int8_t>(wide[rnd() % 4]);
    c.B = pack(w, c.N, c.K, c.Kp);
    for (auto& a : c.A) a = 255;
    c.dual = false;
}

Case make(bool bench_shape = false, int64_t bm = 0, int64_t bn = 0, int64_t bk = 0) {
    static const int64_t ms[] = {1, 2, 3, 4, 5, 7, 8, 13, 31, 32, 33, 67, 100};
    static const int64_t ns[] = {1, 3, 7, 8, 9, 15, 16, 17, 31, 33, 48, 64, 65, 100, 130};
    static const int64_t ks[] = {1, 3, 4, 5, 7, 16, 17, 31, 64, 100, 255, 256, 300};
    Case c;
    c.M = bench_shape ? bm : pick(ms, 13);
    c.N = bench_shape ? bn : pick(ns, 15);
    c.K = bench_shape ? bk : pick(ks, 13);
    c.Kp = (c.K + 3) / 4 * 4;
    c.lda = c.Kp + (rnd() % 3 == 0 ? 4 * (rnd() % 3) : 0);
    c.kind = static_cast<int>(rnd() % 4);
    c.dual = !bench_shape && rnd() % 4 == 0;
    c.row_off = !bench_shape && rnd() % 3 == 0;
    c.bias = rnd() % 2 == 0;
    c.extreme = !bench_shape && rnd() % 3 == 0;  // operands at the ends of their ranges
    c.A.resize(static_cast<size_t>(c.M * c.lda));
    c.A2.resize(c.A.size());
    for (auto& a : c.A) a = c.extreme ? (rnd() % 2 ? 255 : (rnd() % 2 ? 0 : 254)) : rnd() % 256;
    for (auto& a : c.A2) a = rnd() % 256;
    std::vector<int8_t> w(static_cast<size_t>(c.N * c.K));
    const bool full = !bench_shape && rnd() % 4 == 0;  // weights reaching -128 (no symmetric spec makes them)
    for (auto& v : w) {
        int x = c.extreme ? (rnd() % 2 ? 127 : -127) : static_cast<int>(rnd() % 255) - 127;
        if (full && rnd() % 5 == 0) x = -128;
        v = static_cast<int8_t>(x);
    }
    c.B = pack(w, c.N, c.K, c.Kp);
    for (int64_t i = 0; i < c.N; ++i) {
        c.off.push_back(static_cast<int32_t>(rnd() % 20001) - 10000);
        c.scale.push_back(1e-4f * static_cast<float>(1 + rnd() % 100));
        c.biasv.push_back(0.01f * (static_cast<float>(rnd() % 200) - 100.0f));
        c.mult.push_back(1e-4f * static_cast<float>(1 + rnd() % 100));
        c.add.push_back(0.5f * (static_cast<float>(rnd() % 200) - 100.0f));
    }
    for (int64_t i = 0; i < c.M; ++i) c.roff.push_back(static_cast<int32_t>(rnd() % 2001) - 1000);
    c.init.resize(static_cast<size_t>(c.M * c.N));
    for (auto& v : c.init) v = static_cast<float>(rnd() % 1000) * 0.01f;
    return c;
}

// Runs one case on the selected path; returns the output bytes. With prepared, B is first
// prepared for the path (qt::PreparedB; nothing where the path prepares nothing).
// The weights' range is proven as the library proves it (qt::within7); with force_w7 the
// path's GEMM for 7-bit weights runs whatever B holds (the witness that it would differ).
std::vector<uint8_t> run(const Case& c, bool bench = false, bool prepared = false,
                         bool force_w7 = false) {
    static std::vector<float> scratch;
    if (bench) scratch.resize(c.init.size());
    std::vector<float> of(bench ? 0 : c.init.size());
    if (!bench) of = c.init;
    float* ofp = bench ? scratch.data() : of.data();
    std::vector<int8_t> oq(static_cast<size_t>(c.M * c.N), 0);
    qt::Epilogue ep{c.off.data(), c.scale.data(), c.bias ? c.biasv.data() : nullptr,
                    c.kind < 2 ? ofp : nullptr, c.kind < 2 ? nullptr : oq.data(),
                    c.N, 1.0f / 0.05f, 3.0f, -128.0f, 127.0f};
    ep.accumulate = c.kind == 1;
    if (c.kind == 3) {
        ep.mult = c.mult.data();
        ep.add = c.add.data();
    }
    if (c.row_off) ep.row_off = c.roff.data();
    const std::unique_ptr<qt::PreparedB> pb =
        prepared ? std::make_unique<qt::PreparedB>(c.B.data(), c.N, c.Kp, c.M) : nullptr;
    if (force_w7)
        qt::kernels.gemm_w7(c.M, c.N, c.Kp, c.A.data(), c.lda, c.B.data(), ep, nullptr);
    else
        qt::gemm_u8s8(c.M, c.N, c.Kp, c.A.data(), c.lda, c.B.data(), ep,
                      c.dual ? c.A2.data() : nullptr, pb.get(),
                      qt::within7(c.B.data(), static_cast<int64_t>(c.B.size())));
    std::vector<uint8_t> bytes;
    if (bench) return bytes;
    if (c.kind < 2) {
        bytes.resize(of.size() * 4);
        std::memcpy(bytes.data(), of.data(), bytes.size());
    } else {
        bytes.assign(oq.begin(), oq.end());
    }
    return bytes;
}


// ---- every other exported kernel: each case is a closure giving its output bytes ----------

std::vector<int8_t> i8(int64_t n, int lo = -128, int hi = 127) {
    std::vector<int8_t> v(static_cast<size_t>(n));
    for (auto& x : v) x = static_cast<int8_t>(lo + static_cast<int>(rnd() % (hi - lo + 1)));
    return v;
}
std::vector<float> f32(int64_t n, float lo, float hi) {
    std::vector<float> v(static_cast<size_t>(n));
    for (auto& x : v) x = lo + (hi - lo) * static_cast<float>(rnd() % 100001) / 100000.0f;
    return v;
}
std::vector<int32_t> i32(int64_t n, int range) {
    std::vector<int32_t> v(static_cast<size_t>(n));
    for (auto& x : v) x = static_cast<int32_t>(rnd() % (2 * range + 1)) - range;
    return v;
}
template <typename T>
void append(std::vector<uint8_t>& out, const std::vector<T>& v) {
    const size_t at = out.size();
    out.resize(at + v.size() * sizeof(T));
    if (!v.empty()) std::memcpy(out.data() + at, v.data(), v.size() * sizeof(T));
}
int64_t kp_of(int64_t K) { return (K + 3) / 4 * 4; }
std::vector<int8_t> packed(int64_t N, int64_t K) { return pack(i8(N * K, -127, 127), N, K, kp_of(K)); }

using Run = std::function<std::vector<uint8_t>()>;
struct Kernel {
    const char* name;
    bool float_gates;  // uses sigmoid / tanh in float: exact only where the gate math is shared
    std::vector<Run> cases;
};

// An int8 output (requantized through mult/add) or a float one, chosen per case.
struct Out {
    bool to_float;
    std::vector<int8_t> q;
    std::vector<float> f;
    Out(int64_t n, bool flt) : to_float(flt), q(static_cast<size_t>(n)), f(static_cast<size_t>(n)) {}
    int8_t* qp() { return to_float ? nullptr : q.data(); }
    float* fp() { return to_float ? f.data() : nullptr; }
    std::vector<uint8_t> bytes() const {
        std::vector<uint8_t> b;
        if (to_float) append(b, f); else append(b, q);
        return b;
    }
};

// 7-bit weights reaching -63 and 63 on activations reaching -128 and 127 (u8 0 and 255).
std::vector<int8_t> packed7(int64_t N, int64_t K) {
    std::vector<int8_t> w = i8(N * K, -63, 63);
    for (auto& v : w)
        if (rnd() % 3 == 0) v = rnd() % 2 ? 63 : -63;
    return pack(w, N, K, kp_of(K));
}
std::vector<int8_t> i8_ends(int64_t n) {
    std::vector<int8_t> v = i8(n);
    for (auto& x : v)
        if (rnd() % 2 == 0) x = rnd() % 2 ? 127 : -128;
    return v;
}

Run linear_case(bool w7 = false) {
    static const int64_t ms[] = {1, 2, 3, 5, 17}, ks[] = {1, 3, 8, 30, 67}, ns[] = {1, 5, 16, 33};
    const int64_t M = pick(ms, 5), K = pick(ks, 5), N = pick(ns, 4), relu = rnd() % 2;
    const bool flt = rnd() % 2 == 0;
    auto x = w7 ? i8_ends(M * K) : i8(M * K);
    auto w = w7 ? packed7(N, K) : packed(N, K);
    auto off = i32(N, 3000);
    auto sc = f32(N, 1e-4f, 1e-2f), bias = f32(N, -1.0f, 1.0f);
    return [=] {
        Out o(M * N, flt);
        qt_linear(x.data(), M, K, N, kp_of(K), w.data(), off.data(), sc.data(), bias.data(),
                  o.qp(), o.fp(), 20.0f, -3.0f, static_cast<int>(relu));
        return o.bytes();
    };
}

Run conv_case(int kind, bool w7 = false) {  // 0 plain, 1 grouped, 2 depthwise
    static const int64_t sizes[] = {1, 2, 3, 5, 7}, chans[] = {1, 2, 3, 4, 6};
    const int64_t batch = 1 + rnd() % 2, H = pick(sizes, 5), W = pick(sizes, 5);
    const int64_t groups = kind == 1 ? 1 + rnd() % 3 : 1;
    // depthwise: also blocks of 8 channels and their tails (the AVX2 build's vector loop)
    static const int64_t dw_chans[] = {1, 3, 8, 13, 21};
    int64_t C = kind == 2 ? pick(dw_chans, 5) : pick(chans, 5) * groups;
    const int64_t OC = kind == 2 ? C : pick(chans, 5) * groups;
    const int64_t KH = 1 + rnd() % 3, KW = 1 + rnd() % 3, sh = 1 + rnd() % 2, sw = 1 + rnd() % 2;
    const int64_t ph = rnd() % 2, pw = rnd() % 2, dh = 1 + rnd() % 2, dw = 1;
    const int64_t OH = (H + 2 * ph - dh * (KH - 1) - 1) / sh + 1;
    const int64_t OW = (W + 2 * pw - dw * (KW - 1) - 1) / sw + 1;
    if (OH < 1 || OW < 1) return conv_case(kind, w7);
    const int64_t Kg = KH * KW * (C / groups), Kp = kp_of(Kg), OCg = OC / groups;
    auto x = w7 ? i8_ends(batch * H * W * C) : i8(batch * H * W * C);
    std::vector<int8_t> w;
    if (kind == 2) {
        w = i8(KH * KW * C, -127, 127);
    } else {
        for (int64_t g = 0; g < groups; ++g) {
            auto part = w7 ? packed7(OCg, Kg) : packed(OCg, Kg);
            w.insert(w.end(), part.begin(), part.end());
        }
    }
    auto off = i32(OC, 3000);
    auto sc = f32(OC, 1e-4f, 1e-2f), bias = f32(OC, -1.0f, 1.0f);
    const int64_t zp = static_cast<int64_t>(rnd() % 21) - 10, relu = rnd() % 2;
    const bool flt = rnd() % 2 == 0;
    return [=] {
        Out o(batch * OH * OW * OC, flt);
        if (kind == 0)
            qt_conv2d(x.data(), batch, C, H, W, zp, OC, KH, KW, sh, sw, ph, pw, dh, dw, OH, OW,
                      Kp, w.data(), off.data(), sc.data(), bias.data(), o.qp(), o.fp(), 20.0f,
                      2.0f, static_cast<int>(relu));
        else if (kind == 1)
            qt_conv2d_grouped(x.data(), batch, C, H, W, zp, OC, groups, KH, KW, sh, sw, ph, pw,
                              dh, dw, OH, OW, Kp, w.data(), off.data(), sc.data(), bias.data(),
                              o.qp(), o.fp(), 20.0f, 2.0f, static_cast<int>(relu));
        else
            qt_conv2d_depthwise(x.data(), batch, C, H, W, zp, KH, KW, sh, sw, ph, pw, dh, dw, OH,
                                OW, w.data(), off.data(), sc.data(), bias.data(), o.qp(), o.fp(),
                                20.0f, 2.0f, static_cast<int>(relu));
        return o.bytes();
    };
}

// A transposed convolution (1-d as height 1), its weight packed per group and per chunk of
// at most 512 input channels (conv_transpose.cpp); sometimes more than 512 channels a group.
Run conv_transpose_case() {
    static const int64_t sizes[] = {1, 2, 3, 5, 7, 150}, chans[] = {1, 2, 3, 5, 17, 40};
    const bool wide = rnd() % 8 == 0;
    const int64_t batch = 1 + rnd() % 2, H = wide ? 1 : pick(sizes, 5), W = pick(sizes, 6);
    const int64_t groups = wide ? 1 : 1 + rnd() % 3;
    const int64_t C = (wide ? 520 : pick(chans, 5)) * groups, OC = pick(chans, 6) * groups;
    const int64_t KH = H == 1 ? 1 : 1 + rnd() % 3, KW = 1 + rnd() % 4;
    const int64_t sh = 1 + rnd() % 3, sw = 1 + rnd() % 3, dh = 1 + rnd() % 2, dw = 1 + rnd() % 2;
    const int64_t ph = rnd() % 2, pw = rnd() % 2, oph = rnd() % sh, opw = rnd() % sw;
    const int64_t OH = (H - 1) * sh - 2 * ph + dh * (KH - 1) + oph + 1;
    const int64_t OW = (W - 1) * sw - 2 * pw + dw * (KW - 1) + opw + 1;
    if (OH < 1 || OW < 1) return conv_transpose_case();
    const int64_t Cg = C / groups, N = KH * KW * (OC / groups);
    std::vector<int8_t> w;
    std::vector<int32_t> col_off;
    for (int64_t g = 0; g < groups; ++g)
        for (int64_t k0 = 0; k0 < Cg; k0 += 512) {
            const int64_t Kc = Cg - k0 < 512 ? Cg - k0 : 512;
            auto part = packed(N, Kc);
            w.insert(w.end(), part.begin(), part.end());
            auto off = i32(N, 3000);
            col_off.insert(col_off.end(), off.begin(), off.end());
        }
    auto x = i8(batch * H * W * C);
    auto out_off = i32(OC, 3000);
    auto sc = f32(OC, 1e-4f, 1e-2f), bias = f32(OC, -1.0f, 1.0f);
    const int64_t relu = rnd() % 2, with_bias = rnd() % 2;
    const bool flt = rnd() % 2 == 0;
    // the output's layout: channels innermost (the flat epilogue), or channels outermost
    // ([N, O, L] of a 1-d float result: rows_float; [N, O, H, W]: the per-pixel epilogue)
    const bool planar = rnd() % 3 == 0;
    const int64_t oc = planar ? OH * OW : 1, oh_s = planar ? OW : OW * OC, ow_s = planar ? 1 : OC;
    return [=] {
        Out o(batch * OH * OW * OC, flt);
        qt_conv_transpose(x.data(), batch, C, H, W, OC, groups, KH, KW, sh, sw, ph, pw, dh, dw,
                          OH, OW, w.data(), col_off.data(), out_off.data(), sc.data(),
                          with_bias ? bias.data() : nullptr, o.qp(), o.fp(), OH * OW * OC, oc,
                          oh_s, ow_s, 20.0f, 2.0f, static_cast<int>(relu));
        return o.bytes();
    };
}

// The int16-input form (conv_transpose.cpp's qt_conv_transpose16): a float input read through
// its strides (contiguous [N, C, H, W] or channels-last), quantized and split into two byte
// planes, both GEMMs per panel and one float epilogue.
Run conv_transpose16_case() {
    static const int64_t sizes[] = {1, 2, 3, 5, 7, 150}, chans[] = {1, 2, 3, 5, 17, 40};
    const bool wide = rnd() % 8 == 0;
    const int64_t batch = 1 + rnd() % 2, H = wide ? 1 : pick(sizes, 5), W = pick(sizes, 6);
    const int64_t groups = wide ? 1 : 1 + rnd() % 3;
    const int64_t C = (wide ? 520 : pick(chans, 5)) * groups, OC = pick(chans, 6) * groups;
    const int64_t KH = H == 1 ? 1 : 1 + rnd() % 3, KW = 1 + rnd() % 8;
    const int64_t sh = 1 + rnd() % 3, sw = 1 + rnd() % 4, dh = 1 + rnd() % 2, dw = 1 + rnd() % 2;
    const int64_t ph = rnd() % 2, pw = rnd() % 2, oph = rnd() % sh, opw = rnd() % sw;
    const int64_t OH = (H - 1) * sh - 2 * ph + dh * (KH - 1) + oph + 1;
    const int64_t OW = (W - 1) * sw - 2 * pw + dw * (KW - 1) + opw + 1;
    if (OH < 1 || OW < 1) return conv_transpose16_case();
    const int64_t Cg = C / groups, N = KH * KW * (OC / groups);
    std::vector<int8_t> w;
    std::vector<int32_t> hi_off, lo_off;
    for (int64_t g = 0; g < groups; ++g)
        for (int64_t k0 = 0; k0 < Cg; k0 += 512) {
            const int64_t Kc = Cg - k0 < 512 ? Cg - k0 : 512;
            auto part = packed(N, Kc);
            w.insert(w.end(), part.begin(), part.end());
            auto a = i32(N, 3000), b = i32(N, 3000);
            hi_off.insert(hi_off.end(), a.begin(), a.end());
            lo_off.insert(lo_off.end(), b.begin(), b.end());
        }
    auto x = f32(batch * C * H * W, -40.0f, 40.0f);  // beyond the int16 range too (clamped)
    const bool last = rnd() % 2 == 0;  // channels-last input, else contiguous
    const int64_t sn = C * H * W, sc = last ? 1 : H * W, sxh = last ? W * C : W,
                  sxw = last ? C : 1;
    auto out_off = i32(OC, 3000);
    auto hs = f32(OC, 1e-3f, 1e-1f), sc_lo = f32(OC, 1e-4f, 1e-2f), bias = f32(OC, -1.0f, 1.0f);
    const int64_t with_bias = rnd() % 2;
    const bool planar = rnd() % 2 == 0;
    const int64_t oc = planar ? OH * OW : 1, oh_s = planar ? OW : OW * OC, ow_s = planar ? 1 : OC;
    return [=] {
        Out o(batch * OH * OW * OC, true);
        qt_conv_transpose16(x.data(), sn, sc, sxh, sxw, batch, C, H, W, 1.0f / 0.001f, -32768.0f,
                            32767.0f, OC, groups, KH, KW, sh, sw, ph, pw, dh, dw, OH, OW,
                            w.data(), hi_off.data(), lo_off.data(), out_off.data(), hs.data(),
                            sc_lo.data(), with_bias ? bias.data() : nullptr, o.fp(),
                            OH * OW * OC, oc, oh_s, ow_s);
        return o.bytes();
    };
}

Run matmul_case() {
    const int64_t batch = 1 + rnd() % 3, M = 1 + rnd() % 9, K = 1 + rnd() % 40, N = 1 + rnd() % 35;
    auto a = i8(batch * M * K), b = i8(batch * K * N);
    const float za = static_cast<float>(static_cast<int>(rnd() % 11) - 5);
    const float zb = static_cast<float>(static_cast<int>(rnd() % 11) - 5);
    const bool flt = rnd() % 2 == 0;
    return [=] {
        Out o(batch * M * N, flt);
        qt_matmul(a.data(), b.data(), batch, M, K, N, za, zb, 1e-3f, o.qp(), o.fp(), 30.0f, 1.0f);
        return o.bytes();
    };
}

Run pointwise_case(int kind) {  // 0 pool, 1 softmax, 2 binary, 3 lookup, 4 quantize, 5 dequantize, 6 quantize16
    const int64_t n = 1 + rnd() % 300;
    auto a = i8(n), b = i8(n), table = i8(256);
    auto x = f32(n, -40.0f, 40.0f);
    const int op = static_cast<int>(rnd() % 3);
    if (kind == 0) {
        const int64_t batch = 1 + rnd() % 2, C = 1 + rnd() % 19, H = 1 + rnd() % 7, W = 1 + rnd() % 7;
        const int64_t KH = 1 + rnd() % 3, KW = 1 + rnd() % 3, sh = 1 + rnd() % 2, sw = 1 + rnd() % 2;
        const int64_t ph = rnd() % 2 && KH > 1 ? 1 : 0, pw = rnd() % 2 && KW > 1 ? 1 : 0;
        const int64_t OH = (H + 2 * ph - KH) / sh + 1, OW = (W + 2 * pw - KW) / sw + 1;
        if (OH < 1 || OW < 1) return pointwise_case(kind);
        auto img = i8(batch * H * W * C);
        return [=] {
            std::vector<int8_t> out(static_cast<size_t>(batch * OH * OW * C));
            qt_max_pool2d(img.data(), batch, C, H, W, KH, KW, sh, sw, ph, pw, 1, 1, OH, OW, out.data());
            std::vector<uint8_t> r;
            append(r, out);
            return r;
        };
    }
    if (kind == 1) {
        const int64_t rows = 1 + rnd() % 5, cols = 1 + rnd() % 70;
        auto q = i8(rows * cols);
        std::vector<float> table_f(256);
        for (int d = 0; d < 256; ++d) table_f[d] = std::exp(-0.05f * static_cast<float>(d));
        return [=] {
            std::vector<int8_t> out(static_cast<size_t>(rows * cols));
            qt_softmax(q.data(), rows, cols, table_f.data(), 255.0f, -128.0f, out.data());
            std::vector<uint8_t> r;
            append(r, out);
            return r;
        };
    }
    return [=] {
        std::vector<uint8_t> r;
        if (kind == 2) {
            std::vector<int8_t> out(static_cast<size_t>(n));
            qt_binary(op, a.data(), b.data(), n, 0.02f, 3.0f, 0.03f, -5.0f, 25.0f, 1.0f, out.data());
            append(r, out);
        } else if (kind == 3) {
            std::vector<int8_t> out(static_cast<size_t>(n));
            qt_lookup(a.data(), n, table.data(), out.data());
            append(r, out);
        } else if (kind == 4) {
            std::vector<int8_t> out(static_cast<size_t>(n));
            qt_quantize(x.data(), n, 3.7f, -2.0f, out.data());
            append(r, out);
        } else if (kind == 5) {
            std::vector<float> out(static_cast<size_t>(n));
            qt_dequantize(a.data(), n, 0.037f, 4.0f, out.data());
            append(r, out);
        } else {
            std::vector<int16_t> out(static_cast<size_t>(n));
            qt_quantize16(x.data(), n, 819.0f, out.data());
            append(r, out);
        }
        return r;
    };
}

// One recurrent layer: every cell kind, forward or reverse, int8 or int16 (wide) feedback,
// int8 or int16 (two byte planes) input, int8 or float output, LSTM with a projection.
Run rnn_case(int kind) {
    const int64_t T = 1 + rnd() % 5, B = 1 + rnd() % 5, K = 1 + rnd() % 37, H = 1 + rnd() % 37;
    const int64_t G = kind == 0 ? 4 : (kind == 1 ? 3 : 1), N = G * H;
    const bool proj = kind == 0 && rnd() % 3 == 0;
    const int64_t P = proj ? 1 + rnd() % 20 : 0, HS = proj ? P : H;
    const int wide = static_cast<int>(rnd() % 2), reverse = static_cast<int>(rnd() % 2);
    const bool in16 = rnd() % 3 == 0, out_f = rnd() % 3 == 0;
    const int64_t kp_ih = kp_of(K), kp_hh = kp_of(HS), kp_hr = kp_of(H);
    auto x = i8(T * B * K);
    std::vector<int16_t> x16(static_cast<size_t>(T * B * K));
    for (auto& v : x16) v = static_cast<int16_t>(static_cast<int>(rnd() % 65535) - 32767);
    auto w_ih = packed(N, K), w_hh = packed(N, HS), w_hr = packed(P, H);
    auto cs_ih = i32(N, 2000), cs_hh = i32(N, 2000), cs_hr = i32(P, 2000);
    auto ws_ih = f32(N, 1e-3f, 2e-2f), ws_hh = f32(N, 1e-3f, 2e-2f), ws_hr = f32(P, 1e-3f, 2e-2f);
    auto b_ih = f32(N, -0.5f, 0.5f), b_hh = f32(N, -0.5f, 0.5f);
    auto h0 = f32(B * HS, -1.0f, 1.0f), c0 = f32(B * H, -2.0f, 2.0f);
    const float x_s = in16 ? 1.0f / 4096.0f : 0.05f, x_z = in16 ? 0.0f : 3.0f;
    const float in_s = wide ? 1.0f / 32767.0f : 1.0f / 127.0f, in_z = wide ? 0.0f : -1.0f;
    return [=] {
        std::vector<float> h = h0, c = c0, yf(out_f ? static_cast<size_t>(T * B * HS) : 0);
        std::vector<int8_t> y(out_f ? 0 : static_cast<size_t>(T * B * HS));
        qt_rnn_layer(kind, T, B, K, H, reverse, in16 ? nullptr : x.data(), x_s, x_z,
                     w_ih.data(), kp_ih, cs_ih.data(), ws_ih.data(), b_ih.data(), w_hh.data(),
                     kp_hh, cs_hh.data(), ws_hh.data(), b_hh.data(), 1.0f / 127.0f, 2.0f, in_s,
                     in_z, wide, out_f ? nullptr : y.data(), HS, 1.0f / 100.0f, -3.0f, h.data(),
                     kind == 0 ? c.data() : nullptr, proj ? w_hr.data() : nullptr, P,
                     proj ? cs_hr.data() : nullptr, proj ? ws_hr.data() : nullptr,
                     out_f ? yf.data() : nullptr, in16 ? x16.data() : nullptr);
        (void)kp_hr;
        std::vector<uint8_t> r;
        append(r, y);
        append(r, yf);
        append(r, h);
        if (kind == 0) append(r, c);
        return r;
    };
}

// A whole stacked op (qt_rnn): 2-3 layers, one or two directions, the layers before the
// last handing their float output on as int16 byte planes on the range it took, int8 or
// int16 feedback, given or zero initial states, int8 or float input and output, LSTM with a
// projection; batch 0 too.
Run rnn_stack_case(int kind, bool as_packed = false) {
    const int64_t T = 1 + rnd() % 5, B = as_packed || rnd() % 6 != 0 ? 1 + rnd() % 4 : 0;
    const int64_t K = 1 + rnd() % 29, H = 1 + rnd() % 29, L = 2 + rnd() % 2, D = 1 + rnd() % 2;
    const int64_t G = kind == 0 ? 4 : (kind == 1 ? 3 : 1), N = G * H;
    const int64_t P = kind == 0 && rnd() % 3 == 0 ? 1 + rnd() % 15 : 0, W = P ? P : H;
    const bool given = rnd() % 2 == 0;
    auto plan = std::make_shared<QtRnnPlan>();
    *plan = QtRnnPlan{kind, L, D, K, H, P, static_cast<int64_t>(rnd() % 2),
                      0.05f, 3.0f, 1.0f / 127.0f, -1.0f, 1.0f / 100.0f, -3.0f, 1.0f / 127.0f,
                      2.0f, 1.0f / 60.0f, 5.0f, 1.0f / 32767.0f, 1.0f / 120.0f, 4.0f,
                      1.0f / 32000.0f, 127.0f, -2.0f, 60.0f, 1.0f, nullptr, nullptr};
    auto keep = std::make_shared<std::vector<std::vector<uint8_t>>>();
    auto pointers = std::make_shared<std::vector<const void*>>();
    auto depth = std::make_shared<std::vector<int64_t>>();
    const auto hold = [&](auto v) {
        std::vector<uint8_t> bytes(reinterpret_cast<const uint8_t*>(v.data()),
                                   reinterpret_cast<const uint8_t*>(v.data() + v.size()));
        keep->push_back(std::move(bytes));
    };
    for (int64_t i = 0; i < L * D; ++i) {
        const int64_t k_in = i < D ? K : D * W;
        hold(packed(N, k_in)); hold(i32(N, 2000)); hold(f32(N, 1e-3f, 2e-2f)); hold(f32(N, -0.5f, 0.5f));
        hold(packed(N, W)); hold(i32(N, 2000)); hold(f32(N, 1e-3f, 2e-2f)); hold(f32(N, -0.5f, 0.5f));
        if (P) { hold(packed(P, H)); hold(i32(P, 2000)); hold(f32(P, 1e-3f, 2e-2f)); }
        depth->push_back(kp_of(k_in));
        depth->push_back(kp_of(W));
    }
    for (const auto& v : *keep) pointers->push_back(v.data());
    plan->params = pointers->data();
    plan->depth = depth->data();
    // packed: step t has bs[t] rows, non-increasing from B (random lengths, sorted)
    std::vector<int64_t> bs(as_packed ? static_cast<size_t>(T) : 0, 0);
    int64_t rows = T * B;
    if (as_packed) {
        std::vector<int64_t> lengths(static_cast<size_t>(B));
        for (auto& n : lengths) n = 1 + rnd() % T;
        lengths[0] = T;
        rows = 0;
        for (int64_t t = 0; t < T; ++t) {
            for (const int64_t n : lengths) bs[t] += n > t ? 1 : 0;
            rows += bs[t];
        }
    }
    auto x = i8(rows * K), h0 = i8(L * D * B * W), c0 = i8(L * D * B * H);
    auto xf = f32(rows * K, -8.0f, 8.0f);
    const bool float_in = rnd() % 3 == 0, float_out = rnd() % 3 == 0;  // quantize / dequantize inside
    return [=] {
        (void)keep, (void)pointers, (void)depth;  // the plan points into them
        std::vector<int8_t> y(static_cast<size_t>(rows * D * W)), hn(h0.size()), cn(c0.size());
        std::vector<float> yf(float_out ? y.size() : 0);
        if (as_packed)
            qt_rnn_packed(plan.get(), T, B, bs.data(), float_in ? nullptr : x.data(),
                          float_in ? xf.data() : nullptr, 20.0f, given ? h0.data() : nullptr,
                          given && kind == 0 ? c0.data() : nullptr,
                          float_out ? nullptr : y.data(), float_out ? yf.data() : nullptr,
                          hn.data(), kind == 0 ? cn.data() : nullptr, nullptr);
        else
            qt_rnn(plan.get(), T, B, float_in ? nullptr : x.data(), float_in ? xf.data() : nullptr,
                   20.0f, given ? h0.data() : nullptr, given && kind == 0 ? c0.data() : nullptr,
                   float_out ? nullptr : y.data(), float_out ? yf.data() : nullptr, hn.data(),
                   kind == 0 ? cn.data() : nullptr);
        std::vector<uint8_t> r;
        append(r, y);
        append(r, yf);
        append(r, hn);
        if (kind == 0) append(r, cn);
        return r;
    };
}

// A cells-mode program of an LSTM-like cell on int8 values (see cells.cpp for the record
// layout): quantize x and h, two int8 linears into the gates, an int8 add, a lookup table,
// dequantize, float c * f + i, a float activation (tanh, or relu where the gate math may
// differ), a fake-quant: the new h and c.
Run cell_loop_case(bool tanh) {
    const int64_t T = 1 + rnd() % 4, B = 1 + rnd() % 4, I = 1 + rnd() % 21, H = 1 + rnd() % 19;
    const int64_t N = 4 * H, kpI = kp_of(I), kpH = kp_of(H);
    auto xs = f32(T * B * I, -2.0f, 2.0f), h0 = f32(B * H, -1.0f, 1.0f), c0 = f32(B * H, -1.0f, 1.0f);
    auto w_x = packed(N, I), w_h = packed(N, H), table = i8(256);
    auto off_x = i32(N, 3000), off_h = i32(N, 3000);
    auto sc_x = f32(N, 1e-4f, 1e-2f), sc_h = f32(N, 1e-4f, 1e-2f), bias = f32(N, -1.0f, 1.0f);
    // slots: dtype (0 f32, 1 i8), owner, byte offset, cols, ld
    const std::vector<int64_t> slots = {
        0, 0, 0, I, I,          // 0 x_t
        0, 1, 0, H, H,          // 1 h
        0, 2, 0, H, H,          // 2 c
        1, 3, 0, I, I,          // 3 x int8
        1, 4, 0, H, H,          // 4 h int8
        1, 5, 0, N, N,          // 5 x . W_x (int8)
        1, 6, 0, N, N,          // 6 h . W_h (int8)
        1, 7, 0, N, N,          // 7 sum
        1, 8, 0, N, N,          // 8 table(sum)
        0, 9, 0, N, N,          // 9 dequantized gates
        0, 9, 0, H, N,          // 10 view: first gate
        0, 9, 4 * H, H, N,      // 11 view: second gate
        0, 12, 0, H, H,         // 12 gate * c
        0, 13, 0, H, H,         // 13 new c
        0, 14, 0, H, H,         // 14 activation
        0, 15, 0, H, H,         // 15 new h
    };
    const int64_t NI = 12, NF = 8;
    std::vector<int64_t> code;
    std::vector<float> fcode;
    auto ins = [&](std::vector<int64_t> c, std::vector<float> f) {
        c.resize(NI, 0);
        f.resize(NF, 0.0f);
        code.insert(code.end(), c.begin(), c.end());
        fcode.insert(fcode.end(), f.begin(), f.end());
    };
    ins({0, 3, 0}, {40.0f, 1.0f});                                    // QUANT x
    ins({0, 4, 1}, {100.0f, 0.0f});                                   // QUANT h
    ins({2, 5, 3, 0, 1, 2, 3, 0, N, kpI, 0}, {0.05f, -2.0f});         // LINEAR x
    ins({2, 6, 4, 4, 5, -1, 6, 0, N, kpH, static_cast<int64_t>(rnd() % 2)}, {0.04f, 1.0f});
    ins({3, 7, 5, 6, 0}, {0.05f, -2.0f, 0.04f, 1.0f, 12.0f, 0.0f});   // BINARY add
    ins({4, 8, 7, 7}, {});                                            // LOOKUP
    ins({1, 9, 8}, {1.0f / 128.0f, -128.0f});                         // DEQUANT
    ins({7, 12, 10, 2, 1}, {});                                       // FLOAT_BINARY mul
    ins({7, 13, 12, 11, 0}, {});                                      // FLOAT_BINARY add
    ins({8, 14, 13, tanh ? 1 : 2}, {});                               // FLOAT_UNARY
    ins({6, 15, 14}, {127.0f, 0.0f, -127.0f, 127.0f, 1.0f / 127.0f}); // FAKE_QUANT
    const std::vector<int64_t> outs = {15, 13};
    return [=] {
        std::vector<float> h = h0, c = c0, ys(static_cast<size_t>(T * B * H));
        float* states[2] = {h.data(), c.data()};
        const void* consts[8] = {w_x.data(), sc_x.data(), bias.data(), off_x.data(),
                                 w_h.data(), sc_h.data(), off_h.data(), table.data()};
        qt_cell_loop(xs.data(), ys.data(), T, 0, states, 2, outs.data(), slots.data(), 16, B,
                     code.data(), fcode.data(), static_cast<int64_t>(code.size() / NI),
                     const_cast<void**>(consts));
        std::vector<uint8_t> r;
        append(r, ys);
        append(r, h);
        append(r, c);
        return r;
    };
}

// int16 weights (extremes included) on an int8 input with a zero point or a symmetric int16
// one, every group form, depths past one int32 block (128 pairs), strided input reads.
Run conv1d_w16_case() {
    static const int64_t chans[] = {1, 2, 3, 5, 17, 40, 300};
    const bool wide = rnd() % 2 == 0, depthwise = rnd() % 3 == 0;
    const int64_t batch = 1 + rnd() % 2, L = 1 + rnd() % 150;
    int64_t groups = 1 + rnd() % 3, Cg = pick(chans, 7), OCg = 1 + rnd() % 9;
    if (depthwise) Cg = 1, groups = 1 + rnd() % 40;
    const int64_t C = Cg * groups, OC = OCg * groups;
    const int64_t K = 1 + rnd() % 7, stride = 1 + rnd() % 3, dil = 1 + rnd() % 2, pad = rnd() % 4;
    if (L + 2 * pad < dil * (K - 1) + 1) return conv1d_w16_case();
    const int64_t OL = (L + 2 * pad - dil * (K - 1) - 1) / stride + 1, R = Cg * K;
    const int64_t Rp = (R + 1) / 2 * 2;
    std::vector<int16_t> w(static_cast<size_t>(OC * Rp), 0);
    const int extreme = static_cast<int>(rnd() % 4);
    for (int64_t o = 0; o < OC; ++o)
        for (int64_t r = 0; r < R; ++r)
            w[o * Rp + r] = static_cast<int16_t>(
                extreme == 1 ? -32768 : (extreme == 2 ? 32767 : static_cast<int32_t>(rnd() % 65536) - 32768));
    const bool channels_last = rnd() % 2 == 0;  // x read through [N, L, C] strides
    const int64_t sn = C * L, sc = channels_last ? 1 : L, sl = channels_last ? C : 1;
    auto x = f32(batch * C * L, wide ? -40.0f : -3.0f, wide ? 40.0f : 3.0f);
    const float inv = wide ? 1000.0f : 50.0f, zp = wide ? 0.0f : static_cast<float>(rnd() % 256) - 128.0f;
    const float qmin = wide ? -32768.0f : -128.0f, qmax = wide ? 32767.0f : 127.0f;
    auto sc_o = f32(OC, 1e-9f, 1e-6f), bias = f32(OC, -1.0f, 1.0f);
    const bool with_bias = rnd() % 2 == 0;
    return [=] {
        std::vector<float> out(static_cast<size_t>(batch * OC * OL));
        qt_conv1d_w16(x.data(), sn, sc, sl, batch, C, L, inv, zp, qmin, qmax, OC, groups, K,
                      stride, pad, dil, OL, w.data(), Rp, sc_o.data(),
                      with_bias ? bias.data() : nullptr, out.data(), OC * OL, OL, 1);
        std::vector<uint8_t> r;
        append(r, out);
        return r;
    };
}

std::vector<Kernel> kernels_beyond_gemm(int cases) {
    const int few = cases / 4 > 4 ? cases / 4 : 4;
    std::vector<Kernel> all = {
        {"linear", false, {}}, {"conv2d", false, {}}, {"conv2d_grouped", false, {}},
        {"conv2d_depthwise", false, {}}, {"matmul", false, {}}, {"max_pool2d", false, {}},
        {"softmax", false, {}}, {"binary", false, {}}, {"lookup", false, {}},
        {"quantize", false, {}}, {"dequantize", false, {}}, {"quantize16", false, {}},
        {"rnn_lstm", true, {}}, {"rnn_gru", true, {}}, {"rnn_tanh", true, {}},
        {"rnn_relu", false, {}}, {"cell_loop_tanh", true, {}}, {"cell_loop_relu", false, {}},
        {"rnn_stack_lstm", true, {}}, {"rnn_stack_relu", false, {}},
        {"rnn_packed_lstm", true, {}}, {"rnn_packed_relu", false, {}},
        {"conv_transpose", false, {}}, {"conv_transpose16", false, {}},
        {"conv1d_w16", false, {}}, {"gemm_w7", false, {}}, {"gemm_8bit_twin", false, {}},
        {"linear_w7", false, {}}, {"conv2d_w7", false, {}},
    };
    for (int i = 0; i < few; ++i) {
        all[0].cases.push_back(linear_case());
        for (int k = 0; k < 3; ++k) all[1 + k].cases.push_back(conv_case(k));
        all[4].cases.push_back(matmul_case());
        for (int k = 0; k < 7; ++k) all[5 + k].cases.push_back(pointwise_case(k));
        for (int k = 0; k < 4; ++k) all[12 + k].cases.push_back(rnn_case(k));
        all[16].cases.push_back(cell_loop_case(true));
        all[17].cases.push_back(cell_loop_case(false));
        all[18].cases.push_back(rnn_stack_case(0));
        all[19].cases.push_back(rnn_stack_case(3));
        all[20].cases.push_back(rnn_stack_case(0, true));
        all[21].cases.push_back(rnn_stack_case(3, true));
        all[22].cases.push_back(conv_transpose_case());
        all[23].cases.push_back(conv_transpose16_case());
        all[24].cases.push_back(conv1d_w16_case());
        // 7-bit weights: through each path's GEMM for them where it has one (qt::within7)
        Case c7 = make();
        seven_bit(c7);
        all[25].cases.push_back([c7] { return run(c7); });
        Case wide = make();
        one_byte_wide(wide);
        all[26].cases.push_back([wide] { return run(wide); });
        all[27].cases.push_back(linear_case(true));
        all[28].cases.push_back(conv_case(1, true));
    }
    return all;
}

// ---- the gate math of a path against the portable one, to a tolerance -------------------

constexpr float GATE_ABS = 2e-6f, GATE_REL = 2e-6f;

bool close(float a, float b) {
    return std::fabs(a - b) <= GATE_ABS + GATE_REL * std::fabs(b);
}

// One random cell (kind, H, feedback width, output kind) or activation; true when the
// path's result is within tolerance of the portable one.
bool gate_case(int which) {
    static const int64_t hs[] = {1, 3, 4, 7, 8, 15, 16, 17, 33, 64, 70};
    const int64_t H = pick(hs, 11);
    const float spread = rnd() % 4 == 0 ? 60.0f : 6.0f;  // saturating pre-activations too
    if (which == 4) {  // the activations
        const int kind = static_cast<int>(rnd() % 2);
        auto a = f32(H, -spread, spread);
        std::vector<float> got(static_cast<size_t>(H)), want(got.size());
        qt::kernels.activation(kind, a.data(), got.data(), H);
        qt::activation_portable(kind, a.data(), want.data(), H);
        for (int64_t j = 0; j < H; ++j)
            if (!close(got[j], want[j])) return false;
        return true;
    }
    qt::RnnStep st{which, H, 1.0f / 0.01f, 3.0f, 1.0f / 0.02f, -2.0f, 0};
    const bool wide = rnd() % 2 == 0, to_float = rnd() % 2 == 0;
    const bool raw = which == qt::LSTM && rnd() % 4 == 0;
    if (wide) {
        st.h_inv = 1.0f / 5e-5f;
        st.lo_offset = H;
    }
    const int64_t G = which == qt::LSTM ? 4 : (which == qt::GRU ? 3 : 1);
    auto gx = f32(G * H, -spread, spread), gh = f32(G * H, -spread, spread);
    const auto h0 = f32(H, -1.0f, 1.0f), c0 = f32(H, -3.0f, 3.0f);
    struct Result {
        std::vector<float> h, c, yf, raw;
        std::vector<uint8_t> hu8;
        std::vector<int8_t> y;
    };
    auto one = [&](qt::CellFn fn) {
        Result r{h0, c0, std::vector<float>(H), std::vector<float>(H),
                 std::vector<uint8_t>(2 * H), std::vector<int8_t>(H)};
        fn(st, gx.data(), gh.data(), r.h.data(), r.c.data(), r.hu8.data(), r.y.data(),
           to_float ? r.yf.data() : nullptr, raw ? r.raw.data() : nullptr);
        return r;
    };
    const Result got = one(qt::kernels.cell), want = one(qt::cell_portable);
    for (int64_t j = 0; j < H; ++j) {
        if (!close(got.c[j], want.c[j])) return false;
        if (raw) {
            if (!close(got.raw[j], want.raw[j])) return false;
            continue;
        }
        if (!close(got.h[j], want.h[j])) return false;
        const int32_t gq = wide ? 256 * (got.hu8[j] - 128) + got.hu8[H + j] : got.hu8[j];
        const int32_t wq = wide ? 256 * (want.hu8[j] - 128) + want.hu8[H + j] : want.hu8[j];
        if (std::abs(gq - wq) > 1) return false;
        if (to_float ? !close(got.yf[j], want.yf[j]) : std::abs(got.y[j] - want.y[j]) > 1)
            return false;
    }
    return true;
}

// FNV-1a over output bytes: a path's outputs on one CPU, printed so that runs on different
// CPUs (natively, under qemu) can be compared too, the inexact kernels included.
uint64_t digest(uint64_t h, const std::vector<uint8_t>& bytes) {
    for (const uint8_t b : bytes) h = (h ^ b) * 0x100000001b3ull;
    return h;
}
constexpr uint64_t FNV = 0xcbf29ce484222325ull;
constexpr int AMX = 8;  // the label of the AVX-512 VNNI path with AMX tiles (qt_amx(2))

}  // namespace

int main(int argc, char** argv) {
    const int cases = argc > 1 ? std::atoi(argv[1]) : 500;
    if (argc > 5 && std::strcmp(argv[2], "bench") == 0) {
        const int64_t M = std::atoll(argv[3]), N = std::atoll(argv[4]), K = std::atoll(argv[5]);
        Case c = make(true, M, N, K);
        c.kind = 0;
        c.dual = std::getenv("QT_BENCH_DUAL") != nullptr;
        for (int isa = 0; isa < 4; ++isa) {
            if (qt_select_isa(isa) != isa) continue;
            double best = 1e30;
            for (int rep = 0; rep < 7; ++rep) {
                const int iters = isa == 0 ? 1 : cases;
                auto t0 = std::chrono::steady_clock::now();
                for (int i = 0; i < iters; ++i) run(c, true);
                const double dt = std::chrono::duration<double>(
                                      std::chrono::steady_clock::now() - t0).count() / iters;
                best = dt < best ? dt : best;
            }
            std::printf("isa %d  M %lld N %lld K %lld: %.1f us  %.1f GMAC/s\n", isa,
                        static_cast<long long>(M), static_cast<long long>(N),
                        static_cast<long long>(K), best * 1e6,
                        static_cast<double>(M * N * K) / best * 1e-9);
        }
        return 0;
    }
    // what the CPU reports and the path the library takes by itself (under qemu: the model's)
    std::printf("cpu features %d selected path %d\n", qt_cpu_features(), qt_select_isa(7));
    std::vector<Case> all;
    for (int i = 0; i < cases; ++i) all.push_back(make());
    const std::vector<Kernel> others = kernels_beyond_gemm(cases);
    // the reference: gemm_reference, which the portable path runs too except on x86-64
    qt_select_isa(0);
    qt::kernels.gemm = qt::gemm_reference;
    std::vector<std::vector<uint8_t>> ref;
    uint64_t h = FNV;
    for (const Case& c : all) ref.push_back(run(c)), h = digest(h, ref.back());
    std::printf("reference gemm digest %016llx\n", static_cast<unsigned long long>(h));
    std::vector<Case> twins;  // one_byte_wide cases for the witness below
    std::vector<std::vector<uint8_t>> twin_ref;
    for (int i = 0; i < (cases / 4 > 4 ? cases / 4 : 4); ++i) {
        twins.push_back(make());
        one_byte_wide(twins.back());
        twin_ref.push_back(run(twins.back()));
    }
    std::vector<std::vector<std::vector<uint8_t>>> ref_other;
    for (const Kernel& k : others) {
        ref_other.emplace_back();
        h = FNV;
        for (const Run& r : k.cases) ref_other.back().push_back(r()), h = digest(h, ref_other.back().back());
        std::printf("reference %s digest %016llx\n", k.name, static_cast<unsigned long long>(h));
    }
    int failures = 0;
    // path 8 (AMX) is the AVX-512 VNNI path with every product of 16 rows and more on the
    // AMX tiles (qt_amx(2)); path 3 is that path's vector kernels alone (qt_amx(0))
    for (int path = 0; path < 9; ++path) {
        const int isa = path == AMX ? qt::AVX512VNNI : path;
        if (qt_select_isa(isa) != isa) continue;
        if (isa == qt::AVX512VNNI && qt_amx(path == AMX ? 2 : 0) != (path == AMX ? 2 : 0)) continue;
        if (isa == 0 && qt::kernels.gemm == qt::gemm_reference) continue;
        int bad = 0;
        for (size_t i = 0; i < all.size(); ++i) {
            if (run(all[i]) != ref[i]) {
                if (bad < 5)
                    std::printf("path %d mismatch: M %lld N %lld K %lld kind %d dual %d\n", path,
                                static_cast<long long>(all[i].M), static_cast<long long>(all[i].N),
                                static_cast<long long>(all[i].K), all[i].kind, all[i].dual);
                ++bad;
            }
        }
        std::printf("path %d gemm cases %d mismatches %d\n", path, cases, bad);
        failures += bad;
        int bad_prepared = 0;  // the same products through weights prepared for the path
        for (size_t i = 0; i < all.size(); ++i) bad_prepared += run(all[i], false, true) != ref[i];
        std::printf("path %d gemm_prepared cases %d mismatches %d\n", path, cases, bad_prepared);
        failures += bad_prepared;
        // every vector path has its own (polynomial) gate math: within tolerance, not equal
        const bool own_gates = isa != qt::PORTABLE;
        if (own_gates) {
            int beyond = 0;
            for (int i = 0; i < cases; ++i) beyond += !gate_case(static_cast<int>(rnd() % 5));
            std::printf("path %d gate_math cases %d mismatches %d\n", path, cases, beyond);
            failures += beyond;
        }
        if (qt::kernels.gemm_w7) {
            // the witness that gemm_8bit_twin can fail: the 7-bit GEMM forced onto those
            // weights gives other bits (saturation), so their equality above means it never ran
            int differ = 0;
            for (size_t i = 0; i < twins.size(); ++i)
                differ += run(twins[i], false, false, true) != twin_ref[i];
            std::printf("path %d w7_gemm_on_8bit_weights differs %d of %d\n", path, differ,
                        static_cast<int>(twins.size()));
        }
        for (size_t k = 0; k < others.size(); ++k) {
            int differ = 0;
            h = FNV;
            for (size_t i = 0; i < others[k].cases.size(); ++i) {
                const std::vector<uint8_t> got = others[k].cases[i]();
                differ += got != ref_other[k][i];
                h = digest(h, got);
            }
            const int n = static_cast<int>(others[k].cases.size());
            const bool inexact = others[k].float_gates && own_gates;
            std::printf("path %d %s cases %d %s %d digest %016llx\n", path, others[k].name, n,
                        inexact ? "inexact" : "mismatches", differ,
                        static_cast<unsigned long long>(h));
            if (!inexact) failures += differ;
        }
    }
    qt_amx(1);
    return failures == 0 ? 0 : 1;
}
