// A straight-line region program: a run of lowered ops (int8 linears, quantize/dequantize,
// float add/mul/sigmoid/tanh/silu, layer norm, RMSNorm, chunk/unbind/stack, row copies of
// transposes and broadcasts) executed in one native call.
//
// An unrolled recurrence written with modules (a layer-normed LSTM stepped in Python) leaves
// a dozen small ops per step; at batch 1 each costs the dispatcher and the interpreter more
// than its arithmetic. Here the whole region runs with the instructions of qt_program.h over
// one workspace, laid out for the shapes the region was compiled for.
#include "qt_program.h"

using namespace qt::prog;

extern "C" {

// inputs[i] (dense, the slot in_slots[i]'s rows x cols) are copied in, the code is run once,
// and the slots out_slots[i] are copied out to outputs[i]. A LINEAR writing int8 reads its
// multipliers from the constant c[11] (mult, then add: 2 N floats). ``size``: the value of
// the size symbol this call (1 for a static program), ``fields``: 6 or 8 per slot.
void qt_program_run(void** inputs, const int64_t* in_slots, int64_t n_in, void** outputs,
                    const int64_t* out_slots, int64_t n_out, const int64_t* slots, int64_t n_slots,
                    int64_t fields, int64_t size, const int64_t* code, const float* fcode,
                    int64_t n_code, void** consts) try {
    std::vector<int64_t> table = resolve_slots(slots, n_slots, fields, size);
    // A dense, 64-byte aligned input or output whose slot owns its storage is used in place:
    // no copy in or out, no workspace (a transformer layer's program moved ~0.3 MB per call
    // through copies and a cleared workspace, ~25 us, more than its layer norm).
    std::vector<char*> outside(static_cast<size_t>(n_slots), nullptr);
    auto own = [&](int64_t k, void* p) {
        const int64_t* r = table.data() + NSR * k;
        return r[1] == k && r[3] == r[4] && reinterpret_cast<uintptr_t>(p) % 64 == 0;
    };
    for (int64_t i = 0; i < n_in; ++i)
        if (own(in_slots[i], inputs[i])) outside[in_slots[i]] = static_cast<char*>(inputs[i]);
    for (int64_t i = 0; i < n_out; ++i) {
        const int64_t k = out_slots[i];
        int64_t uses = 0;
        for (int64_t j = 0; j < n_out; ++j) uses += out_slots[j] == k;
        if (uses == 1 && !outside[k] && own(k, outputs[i]))
            outside[k] = static_cast<char*>(outputs[i]);
    }
    // One workspace and one scratch per thread, kept between calls and never cleared: every
    // value is written by the instruction that makes it before any reads it, and a fresh
    // buffer per call cost more than the layer norms and adds of a transformer layer (a
    // megabyte's page faults and zeroing; benchmarks/README.md, branch h-bertln).
    thread_local std::vector<char> ws;
    thread_local std::vector<uint8_t> u8;
    // Owners whose instruction spans do not meet share bytes: a chunked scan's program at
    // 512 tokens makes ~60 values of up to 0.5 MB, of which a few are live at once, and a
    // workspace of them all streamed every instruction's operands through the last cache.
    const auto lives = program_lives(table.data(), n_slots, NSR, code, n_code, in_slots, n_in,
                                     out_slots, n_out);
    const std::vector<Slot> s = lay_out(
        ws, table.data(), n_slots, NSR, [](const int64_t* d) { return d[5]; }, &outside,
        false, &lives);
    int64_t scratch = 0;
    for (int64_t n = 0; n < n_code; ++n) {
        const int64_t* c = code + NI * n;
        if (c[0] == LINEAR || c[0] == LINEAR16) {  // LINEAR16: two planes
            const int64_t need = s[c[2]].rows * (c[9] + 4) * (c[0] == LINEAR16 ? 2 : 1);
            scratch = need > scratch ? need : scratch;
        }
    }
    if (u8.size() < static_cast<size_t>(scratch)) u8.resize(static_cast<size_t>(scratch));
    for (int64_t i = 0; i < n_in; ++i) {
        const Slot& d = s[in_slots[i]];
        const char* src = static_cast<const char*>(inputs[i]);
        if (d.base == src) continue;
        for (int64_t r = 0; r < d.rows; ++r)
            std::memcpy(d.base + r * d.ld * d.size, src + r * d.cols * d.size,
                        static_cast<size_t>(d.cols * d.size));
    }
    run_code(code, fcode, n_code, s, consts, u8.data());
    for (int64_t i = 0; i < n_out; ++i) {
        const Slot& d = s[out_slots[i]];
        char* dst = static_cast<char*>(outputs[i]);
        if (d.base == dst) continue;
        for (int64_t r = 0; r < d.rows; ++r)
            std::memcpy(dst + r * d.cols * d.size, d.base + r * d.ld * d.size,
                        static_cast<size_t>(d.cols * d.size));
    }
} QT_CATCH

}  // extern "C"
