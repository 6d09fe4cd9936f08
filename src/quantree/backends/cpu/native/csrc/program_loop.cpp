// A region program (program.cpp's tables) run once per time step of a folded loop.
//
// A loop folded from a Python loop over time (recurrent/unrolled) whose lowered step is one
// region program would otherwise call the program once per step from Python: a selective
// scan's step is a few small ops on a few hundred values, so the per-step call (Python,
// argument checks, workspace layout) cost more than the step. Here the workspace is laid out
// once and the steps run back to back: each step copies its per-step inputs in (a slice of
// a [T, ...] buffer), runs the code, copies every output to step t of its [T, ...] buffer,
// and the outputs that are carried states are copied back into their input slots.
#include "qt_program.h"

using namespace qt::prog;

namespace {

// src_ld: bytes from one source row to the next (0: dense rows)
void copy_in(const Slot& d, const char* src, int64_t src_ld = 0) {
    const int64_t step = src_ld > 0 ? src_ld : d.cols * d.size;
    for (int64_t r = 0; r < d.rows; ++r)
        std::memcpy(d.base + r * d.ld * d.size, src + r * step,
                    static_cast<size_t>(d.cols * d.size));
}

void copy_out(const Slot& d, char* dst) {
    for (int64_t r = 0; r < d.rows; ++r)
        std::memcpy(dst + r * d.cols * d.size, d.base + r * d.ld * d.size,
                    static_cast<size_t>(d.cols * d.size));
}
}  // namespace

extern "C" {

// inputs[i]: slot in_slots[i]'s rows x cols, in_ld[i] bytes apart (0: dense); step t reads
// inputs[i] + t * in_step[i] bytes (in_step[i] 0: the same value every step, copied in once). outputs[o]: T dense
// values of slot out_slots[o], step t at t * its bytes. feed[o] >= 0: output o is the next
// step's input feed[o] (a carried state); feed[o] <= -2: the same for input -feed[o] - 2,
// and outputs[o] holds the last step's value only. Other arguments as qt_program_run's.
void qt_program_loop(void** inputs, const int64_t* in_slots, const int64_t* in_step,
                     const int64_t* in_ld, int64_t n_in,
                     void** outputs, const int64_t* out_slots, const int64_t* feed,
                     int64_t n_out, int64_t T, const int64_t* slots, int64_t n_slots,
                     int64_t fields, int64_t size, const int64_t* code, const float* fcode,
                     int64_t n_code, void** consts) try {
    std::vector<int64_t> table = resolve_slots(slots, n_slots, fields, size);
    std::vector<char> ws;
    std::vector<Slot> s =
        lay_out(ws, table.data(), n_slots, NSR, [](const int64_t* d) { return d[5]; });
    // A per-step input no instruction writes and no state is carried into, laid out as its
    // slot (dense rows): its slots point into step t's rows instead of a copy of them.
    std::vector<char> written(static_cast<size_t>(n_slots), 0);
    for (int64_t n = 0; n < n_code; ++n) written[table[NSR * code[NI * n + 1] + 1]] = 1;
    for (int64_t o = 0; o < n_out; ++o) {
        const int64_t f = feed[o] <= -2 ? -feed[o] - 2 : feed[o];
        if (f >= 0) written[table[NSR * in_slots[f] + 1]] = 1;
    }
    std::vector<char> in_place(static_cast<size_t>(n_in), 0);
    for (int64_t i = 0; i < n_in; ++i) {
        const int64_t k = in_slots[i];
        const Slot& d = s[k];
        const bool dense = in_ld[i] == 0 || in_ld[i] == d.cols * d.size;
        in_place[i] = in_step[i] > 0 && table[NSR * k + 1] == k && !written[k] && d.ld == d.cols && dense;
    }
    int64_t scratch = 0;
    for (int64_t n = 0; n < n_code; ++n) {
        const int64_t* c = code + NI * n;
        if (c[0] == LINEAR || c[0] == LINEAR16) {
            const int64_t need = s[c[2]].rows * (c[9] + 4) * (c[0] == LINEAR16 ? 2 : 1);
            scratch = need > scratch ? need : scratch;
        }
    }
    std::vector<uint8_t> u8(static_cast<size_t>(scratch));
    // feed[o] <= -2: output o is carried into input -feed[o] - 2 and kept for the last step
    // only (one row, overwritten every step: a state no step's output collects)
    std::vector<int64_t> out_bytes(static_cast<size_t>(n_out)), into(static_cast<size_t>(n_out));
    for (int64_t o = 0; o < n_out; ++o) {
        const Slot& d = s[out_slots[o]];
        out_bytes[o] = feed[o] <= -2 ? 0 : d.rows * d.cols * d.size;
        into[o] = feed[o] <= -2 ? -feed[o] - 2 : feed[o];
    }
    for (int64_t t = 0; t < T; ++t) {
        for (int64_t i = 0; i < n_in; ++i) {
            const char* src = static_cast<const char*>(inputs[i]) + t * in_step[i];
            if (in_place[i]) {
                for (int64_t k = 0; k < n_slots; ++k)  // the slot and its views
                    if (table[NSR * k + 1] == in_slots[i])
                        s[k].base = const_cast<char*>(src) + table[NSR * k + 2];
            } else if (t == 0 || in_step[i] > 0) {
                copy_in(s[in_slots[i]], src, in_ld[i]);
            }
        }
        run_code(code, fcode, n_code, s, consts, u8.data());
        for (int64_t o = 0; o < n_out; ++o)
            copy_out(s[out_slots[o]], static_cast<char*>(outputs[o]) + t * out_bytes[o]);
        // after every output is out: a state's slot may be another output's source
        for (int64_t o = 0; o < n_out; ++o)
            if (into[o] >= 0)
                copy_in(s[in_slots[into[o]]], static_cast<const char*>(outputs[o]) + t * out_bytes[o]);
    }
} QT_CATCH

}  // extern "C"
