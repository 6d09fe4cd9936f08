// ExecuTorch kernel library of quantree: `quantree_et::rnn.out`, a whole int8 LSTM / GRU /
// RNN (stacked, bidirectional, projected) as ONE operator of a .pte, computed by the same
// C++ core as quantree's CPU backend (qt_rnn, cpu/native/csrc/rnn.cpp: int8 GEMMs of the
// input projection per chunk of steps and of the hidden state per step, gate math in float).
//
// Why a kernel library and not XNNPACK patterns: XNNPACK has no recurrent op, so a graph of
// its int8 linears has to unroll the time loop (the program and ExecuTorch's lowering time
// grow with T: minutes at T128, and per-step delegate calls cost more than the float
// loop). A custom operator keeps the loop inside one kernel call, whatever T is.
//
// Built against the headers the executorch wheel ships (executorch/include) and linked
// against its shared runtime (libexecutorch.so, where the operator registry lives) and
// quantree's kernels library; registering happens when the library is loaded (a static
// initializer), in Python (quantree.backends.executorch.kernels) or in a C++ runtime linking
// it (docs/deployment-executorch.md).
//
// Everything read here comes from a .pte file, untrusted: every argument's type, dtype,
// rank and size is checked against what qt_rnn will read and write before it runs, and a
// mismatch fails the method with an ExecuTorch error (InvalidArgument), never a crash.
#include <executorch/runtime/core/exec_aten/util/tensor_util.h>
#include <executorch/runtime/kernel/kernel_includes.h>
#include <executorch/runtime/kernel/operator_registry.h>

#include <cmath>
#include <cstdint>
#include <vector>

#include "qt_rnn.h"

namespace {

using executorch::aten::ScalarType;
using executorch::aten::Tensor;
using executorch::runtime::Error;
using executorch::runtime::EValue;
using executorch::runtime::KernelRuntimeContext;
using executorch::runtime::Span;

constexpr int64_t LIMIT = int64_t(1) << 31;  // every size: the kernels multiply pairs in int64
constexpr int64_t CONFIG = 8;   // kind, hidden, layers, dirs, hidden_bits, proj, float in, out
constexpr int64_t CONFIG_WIDE = 10;  // then x bits, y bits (8, or 16: symmetric int16 float)
constexpr int64_t QPARAMS = 18;  // as QtRnnPlan's floats, the final states' scales not inverted
constexpr int64_t ARGS = 9;      // x, h0, c0, params, config, qparams, out, h_n, c_n

bool fail(KernelRuntimeContext& ctx, const char* what, int64_t a = 0, int64_t b = 0) {
    ET_LOG(Error, "quantree_et::rnn.out: %s (%lld, %lld); the kernel was not run", what,
           static_cast<long long>(a), static_cast<long long>(b));
    ctx.fail(Error::InvalidArgument);
    return false;
}

// A contiguous tensor of `dtype` holding exactly `numel` elements.
bool flat(const Tensor& t, ScalarType dtype, int64_t numel) {
    return t.scalar_type() == dtype && t.numel() == numel &&
           executorch::runtime::tensor_is_default_dim_order(t);
}

// A packed weight (packing.pack: [ceil(N / 16), Kp / 4, 64] int8) of `rows` output channels
// and depth `depth` (Kp: depth rounded up to 4); its Kp, or -1.
int64_t packed(const Tensor& t, int64_t rows, int64_t depth) {
    if (t.scalar_type() != ScalarType::Char || t.dim() != 3 || t.size(2) != 64 ||
        !executorch::runtime::tensor_is_default_dim_order(t))
        return -1;
    const int64_t kp = static_cast<int64_t>(t.size(1)) * 4;
    if (t.size(0) != (rows + 15) / 16 || kp != (depth + 3) / 4 * 4) return -1;
    return kp;
}

bool finite_positive(double v) { return std::isfinite(v) && v > 0.0; }

bool sized(const Tensor& t, ScalarType dtype, std::initializer_list<int64_t> sizes) {
    if (t.scalar_type() != dtype || t.dim() != static_cast<ssize_t>(sizes.size()) ||
        !executorch::runtime::tensor_is_default_dim_order(t))
        return false;
    int d = 0;
    for (int64_t s : sizes)
        if (t.size(d++) != s) return false;
    return true;
}

Error resize(Tensor& t, std::initializer_list<int64_t> sizes) {
    executorch::aten::SizesType s[3];
    size_t n = 0;
    for (int64_t v : sizes) s[n++] = static_cast<executorch::aten::SizesType>(v);
    return executorch::runtime::resize_tensor(t, {s, n});
}

// quantree_et::rnn.out(Tensor x, Tensor? h0, Tensor? c0, Tensor[] params, int[] config,
//     float[] qparams, *, Tensor(a!) out, Tensor(b!) h_n, Tensor(c!) c_n) -> (...)
// x [T, B, K] time-major, int8 on the input grid (float with config[6]); h0 / c0 int8
// [layers * dirs, B, width / H] or None (zeros); out [T, B, dirs * width] int8 (float with
// config[7]); h_n / c_n int8 on their grids (c_n of a non-LSTM: left as it is).
void rnn_out(KernelRuntimeContext& ctx, Span<EValue*> stack) {
    if (stack.size() < ARGS) {
        fail(ctx, "too few arguments", static_cast<int64_t>(stack.size()), ARGS);
        return;
    }
    EValue** a = stack.data();
    for (size_t i = 0; i < ARGS; ++i)
        if (a[i] == nullptr) {
            fail(ctx, "missing argument", static_cast<int64_t>(i));
            return;
        }
    const bool typed = a[0]->isTensor() && (a[1]->isNone() || a[1]->isTensor()) &&
                       (a[2]->isNone() || a[2]->isTensor()) && a[3]->isTensorList() &&
                       a[4]->isIntList() && a[5]->isDoubleList() && a[6]->isTensor() &&
                       a[7]->isTensor() && a[8]->isTensor();
    if (!typed) {
        fail(ctx, "an argument has the wrong type");
        return;
    }
    const Tensor& x = a[0]->toTensor();
    const auto params = a[3]->toTensorList();
    const auto config = a[4]->toIntList();
    const auto q = a[5]->toDoubleList();
    Tensor& out = a[6]->toTensor();
    Tensor& h_n = a[7]->toTensor();
    Tensor& c_n = a[8]->toTensor();
    if ((config.size() != CONFIG && config.size() != CONFIG_WIDE) || q.size() != QPARAMS) {
        fail(ctx, "config / qparams lengths", static_cast<int64_t>(config.size()),
             static_cast<int64_t>(q.size()));
        return;
    }
    const int64_t kind = config[0], H = config[1], L = config[2], D = config[3];
    const int64_t bits = config[4], P = config[5], float_in = config[6], float_out = config[7];
    const bool wide_io = config.size() == CONFIG_WIDE;
    const int64_t x_bits = wide_io ? config[8] : 8, y_bits = wide_io ? config[9] : 8;
    if (kind < 0 || kind > 3 || H < 1 || H >= LIMIT || L < 1 || L >= 1024 || D < 1 || D > 2 ||
        (bits != 8 && bits != 16) || P < 0 || P >= H || (P && kind != 0) || float_in < 0 ||
        float_in > 1 || float_out < 0 || float_out > 1 || (x_bits != 8 && x_bits != 16) ||
        (y_bits != 8 && y_bits != 16) || (x_bits == 16 && !float_in) ||
        (y_bits == 16 && !float_out)) {
        fail(ctx, "config out of range (kind, hidden)", kind, H);
        return;
    }
    for (int64_t i = 0; i < QPARAMS; ++i)
        if (!std::isfinite(q[i])) {
            fail(ctx, "a quantization parameter is not finite", i);
            return;
        }
    // scales the kernel divides by or multiplies into every value
    for (int64_t i : {0, 2, 4, 6, 8, 10, 11, 14, 16})
        if (!finite_positive(q[i])) {
            fail(ctx, "a scale is not positive", i);
            return;
        }
    const bool lstm = kind == 0;
    const int64_t G = lstm ? 4 : (kind == 1 ? 3 : 1), N = G * H, W = P ? P : H;
    if (x.dim() != 3 || !executorch::runtime::tensor_is_default_dim_order(x) ||
        x.scalar_type() != (float_in ? ScalarType::Float : ScalarType::Char)) {
        fail(ctx, "x is not a [T, B, K] tensor of the input's dtype", x.dim());
        return;
    }
    const int64_t T = x.size(0), B = x.size(1), K = x.size(2);
    if (T < 0 || B < 1 || K < 1 || T * B >= LIMIT || K >= LIMIT) {
        fail(ctx, "x sizes out of range", T, B);
        return;
    }
    const int64_t per = 8 + (P ? 3 : 0);
    if (static_cast<int64_t>(params.size()) != L * D * per) {
        fail(ctx, "params count", static_cast<int64_t>(params.size()), L * D * per);
        return;
    }
    std::vector<const void*> pointers(params.size());
    std::vector<int64_t> depth(static_cast<size_t>(2 * L * D));
    for (int64_t l = 0; l < L; ++l)
        for (int64_t d = 0; d < D; ++d) {
            const int64_t i = l * D + d;
            const Tensor* p = params.data() + i * per;
            const int64_t in = l == 0 ? K : D * W;
            const int64_t kp_ih = packed(p[0], N, in), kp_hh = packed(p[4], N, W);
            bool ok = kp_ih > 0 && kp_hh > 0;
            for (int j : {1, 5}) ok = ok && flat(p[j], ScalarType::Int, N);
            for (int j : {2, 3, 6, 7}) ok = ok && flat(p[j], ScalarType::Float, N);
            if (P) {
                ok = ok && packed(p[8], P, H) == (H + 3) / 4 * 4;
                ok = ok && flat(p[9], ScalarType::Int, P) && flat(p[10], ScalarType::Float, P);
            }
            if (!ok) {
                fail(ctx, "a weight of (layer, direction) has the wrong dtype or shape", l, d);
                return;
            }
            depth[2 * i] = kp_ih;
            depth[2 * i + 1] = kp_hh;
            for (int64_t j = 0; j < per; ++j) pointers[i * per + j] = p[j].const_data_ptr();
        }
    const int8_t* h0 = nullptr;
    const int8_t* c0 = nullptr;
    if (a[1]->isTensor()) {
        const Tensor& t = a[1]->toTensor();
        if (!sized(t, ScalarType::Char, {L * D, B, W})) {
            fail(ctx, "h0 is not int8 [layers * dirs, B, width]", t.dim());
            return;
        }
        h0 = t.const_data_ptr<int8_t>();
    }
    if (a[2]->isTensor() && lstm) {
        const Tensor& t = a[2]->toTensor();
        if (!sized(t, ScalarType::Char, {L * D, B, H}) || h0 == nullptr) {
            fail(ctx, "c0 is not int8 [layers * dirs, B, hidden] beside h0", t.dim());
            return;
        }
        c0 = t.const_data_ptr<int8_t>();
    } else if (lstm && h0 != nullptr) {
        fail(ctx, "an LSTM given h0 needs c0 too");
        return;
    }
    if (resize(out, {T, B, D * W}) != Error::Ok || resize(h_n, {L * D, B, W}) != Error::Ok ||
        (lstm && resize(c_n, {L * D, B, H}) != Error::Ok)) {
        fail(ctx, "an output cannot take its shape", T, B);
        return;
    }
    if (!sized(out, float_out ? ScalarType::Float : ScalarType::Char, {T, B, D * W}) ||
        !sized(h_n, ScalarType::Char, {L * D, B, W}) ||
        (lstm && !sized(c_n, ScalarType::Char, {L * D, B, H}))) {
        fail(ctx, "an output has the wrong dtype or shape");
        return;
    }
    const auto f = [&](int64_t i) { return static_cast<float>(q[i]); };
    QtRnnPlan plan{};
    plan.kind = kind, plan.layers = L, plan.dirs = D, plan.K = K, plan.H = H, plan.P = P;
    plan.wide = bits == 16;
    plan.x16 = x_bits == 16, plan.y16 = y_bits == 16;
    plan.x_s = f(0), plan.x_z = f(1), plan.inner_s = f(2), plan.inner_z = f(3);
    plan.y_s = f(4), plan.y_z = f(5), plan.h_s = f(6), plan.h_z = f(7), plan.c_s = f(8);
    plan.c_z = f(9), plan.inner_fb = f(10), plan.last_s = f(11), plan.last_z = f(12);
    plan.last_fb = f(13);
    // the final states are quantized with 1 / scale, as quantize (and ops/recurrent/rnn.py) compute it
    plan.hn_inv = static_cast<float>(1.0 / q[14]), plan.hn_z = f(15);
    plan.cn_inv = static_cast<float>(1.0 / q[16]), plan.cn_z = f(17);
    plan.params = pointers.data();
    plan.depth = depth.data();
    const float x_inv = static_cast<float>(1.0 / q[0]);
    qt_rnn(&plan, T, B, float_in ? nullptr : x.const_data_ptr<int8_t>(),
           float_in ? x.const_data_ptr<float>() : nullptr, x_inv, h0, c0,
           float_out ? nullptr : out.mutable_data_ptr<int8_t>(),
           float_out ? out.mutable_data_ptr<float>() : nullptr, h_n.mutable_data_ptr<int8_t>(),
           lstm ? c_n.mutable_data_ptr<int8_t>() : nullptr);
    if (const int error = qt_take_error()) {
        ET_LOG(Error, "quantree_et::rnn.out: the kernel failed (%s)",
               error == 1 ? "out of memory" : "internal error");
        ctx.fail(error == 1 ? Error::MemoryAllocationFailed : Error::Internal);
    }
}

const executorch::runtime::Kernel KERNELS[] = {
    executorch::runtime::Kernel("quantree_et::rnn.out", rnn_out),
};

// Registers the kernels with the runtime this library is linked against, once, at load.
struct Registration {
    Registration() {
        qt_select_isa(1 << 20);  // the best path the CPU has (Python re-applies its cap)
        const Error error = executorch::runtime::register_kernels({KERNELS, 1});
        if (error != Error::Ok) ET_LOG(Error, "quantree_et: registration failed (%d)", int(error));
    }
};
const Registration registration;

}  // namespace

// For loaders: whether the library's registration ran (1).
extern "C" int quantree_et_kernels_loaded() { return 1; }
