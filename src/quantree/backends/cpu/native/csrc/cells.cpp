// A cells-mode loop (one layer and direction) run natively: a small program, compiled in
// Python from the lowered cell body, executed for every time step in one call.
//
// Values are 2-d [batch, cols] slices (row stride ld) of one workspace laid out per call for
// the batch at hand; a chunk's pieces are views of their source. The instructions are
// qt_program.h's.
#include <memory>

#include "qt_program.h"

using namespace qt::prog;

namespace {

// The loop of both entry points. batch_sizes null: every step has all B rows, step t's
// rows at t * B of xs / ys. Else step t has batch_sizes[t] rows (non-increasing, the
// first B), stored one step after another (a packed sequence's order): the sequences
// still running at a step are the first rows, so a step runs the program on a prefix of
// the workspace's rows, and the rows past it keep the state they reached (forward: the
// finished sequences' final states) or still hold their initial state (reverse: the
// sequences that have not started).
void cell_loop(const float* xs, float* ys, int64_t T, int reverse, float** states,
               int64_t n_states, const int64_t* outs, const int64_t* slots, int64_t n_slots,
               int64_t B, const int64_t* batch_sizes, const int64_t* code, const float* fcode,
               int64_t n_code, void** consts) {
    std::vector<char> ws;
    const std::vector<Slot> s =
        lay_out(ws, slots, n_slots, NS, [B](const int64_t*) { return B; });
    int64_t scratch_k = 0;
    for (int64_t n = 0; n < n_code; ++n)
        if ((code[NI * n] == LINEAR || code[NI * n] == LINEAR16) && code[NI * n + 9] > scratch_k)
            scratch_k = code[NI * n + 9];
    const int64_t I = s[0].cols;
    std::vector<uint8_t> u8(static_cast<size_t>(2 * B * (scratch_k + 4)));  // LINEAR16: 2 planes
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
    // every linear's weights, multiplied at each step, prepared once for the GEMM path
    std::vector<std::unique_ptr<qt::PreparedB>> prepared(static_cast<size_t>(n_code));
    for (int64_t n = 0; n < n_code && T > 1; ++n) {
        const int64_t* c = code + NI * n;
        if (c[0] == LINEAR)
            prepared[n] = std::make_unique<qt::PreparedB>(
                static_cast<const int8_t*>(consts[c[3]]), c[8], c[9], s[c[2]].rows);
    }
    for (int64_t k = 0; k < n_states; ++k) {  // initial states into their slots
        const Slot& st = s[1 + k];
        for (int64_t r = 0; r < st.rows; ++r)
            std::memcpy(st.f(r), states[k] + r * st.cols, static_cast<size_t>(st.cols) * 4);
    }
    std::vector<int64_t> first(static_cast<size_t>(T) + 1, 0);  // step t's first row
    for (int64_t t = 0; t < T; ++t) first[t + 1] = first[t] + (batch_sizes ? batch_sizes[t] : B);
    std::vector<Slot> v = s;  // the slots with the step's row count
    for (int64_t step = 0; step < T; ++step) {
        const int64_t t = reverse ? T - 1 - step : step;
        const int64_t rows = first[t + 1] - first[t];
        if (rows != v[0].rows)
            for (size_t i = 0; i < v.size(); ++i) v[i].rows = rows;
        for (int64_t r = 0; r < rows; ++r)
            std::memcpy(v[0].f(r), xs + (first[t] + r) * I, static_cast<size_t>(I) * 4);
        for (int64_t n = 0; n < n_code; ++n) {
            const int64_t* c = code + NI * n;
            const float* f = fcode + NF * n;
            const float* m = f[0] > 0 && c[0] == LINEAR ? mult[n].data() : nullptr;
            const float* ad = m ? add[n].data() : nullptr;
            run_op(c, f, v, consts, u8.data(), m, ad, prepared[n].get());
        }
        const Slot& y = v[outs[0]];
        for (int64_t r = 0; r < rows; ++r)
            std::memcpy(ys + (first[t] + r) * y.cols, y.f(r), static_cast<size_t>(y.cols) * 4);
        for (int64_t k = 0; k < n_states; ++k) {  // new states become next step's inputs
            const Slot& from = v[outs[k]];
            const Slot& to = v[1 + k];
            for (int64_t r = 0; r < rows; ++r)
                std::memcpy(to.f(r), from.f(r), static_cast<size_t>(to.cols) * 4);
        }
    }
    for (int64_t k = 0; k < n_states; ++k) {
        const Slot& st = s[1 + k];
        for (int64_t r = 0; r < st.rows; ++r)
            std::memcpy(states[k] + r * st.cols, st.f(r), static_cast<size_t>(st.cols) * 4);
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
                  int64_t n_code, void** consts) try {
    cell_loop(xs, ys, T, reverse, states, n_states, outs, slots, n_slots, B, nullptr, code,
              fcode, n_code, consts);
} QT_CATCH

// A packed sequence's rows: xs float [N, I], ys float [N, H], N the sum of batch_sizes[T]
// (non-increasing, batch_sizes[0] = B, the states' rows). One call for the whole sequence,
// where one loop per group of equal lengths ran each group's steps at its own small batch.
void qt_cell_loop_packed(const float* xs, float* ys, int64_t T, int reverse,
                         const int64_t* batch_sizes, float** states, int64_t n_states,
                         const int64_t* outs, const int64_t* slots, int64_t n_slots, int64_t B,
                         const int64_t* code, const float* fcode, int64_t n_code,
                         void** consts) try {
    cell_loop(xs, ys, T, reverse, states, n_states, outs, slots, n_slots, B, batch_sizes, code,
              fcode, n_code, consts);
} QT_CATCH

}  // extern "C"
