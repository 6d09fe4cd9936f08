// The whole-layer recurrent kernel's C entry point (rnn.cpp) and its plan, for callers
// outside the ctypes path: the ExecuTorch kernel library (backends/executorch/csrc) builds a
// QtRnnPlan from its own tensors and calls qt_rnn, the same compute core the CPU backend's
// `quantree.rnn` op reaches through ctypes. Plain pointers only, no torch headers.
#pragma once
#include <cstdint>

extern "C" {

// Everything constant about one lowered recurrent op, laid out once by ops/recurrent/rnn.py (a
// ctypes.Structure): a call then passes one pointer and the activations, not ~40 converted
// arguments per layer and direction.
struct QtRnnPlan {
    int64_t kind, layers, dirs, K, H, P;  // P: proj_size, 0 for none
    int64_t wide;                         // the last layer feeds its hidden state back as int16
    float x_s, x_z, inner_s, inner_z, y_s, y_z, h_s, h_z, c_s, c_z, inner_fb, last_s, last_z,
        last_fb;
    float hn_inv, hn_z, cn_inv, cn_z;  // grids of the final states (inverse scales)
    const void* const* params;  // per layer and direction: w_ih, colsum_ih, ws_ih, b_ih, w_hh,
                                // colsum_hh, ws_hh, b_hh (then w_hr, colsum_hr, ws_hr with P)
    const int64_t* depth;       // per layer and direction: Kp of w_ih and of w_hh
    // int16 boundaries (0: int8): x16, the first layer reads x_float as symmetric int16 on
    // x_s (two byte planes, one dual pass over W_ih); y16, the last layer writes y_float on
    // the symmetric int16 grid y_s (quantize and dequantize of the graph, fused).
    int64_t x16, y16;
};

// A whole stacked (bidirectional) LSTM / GRU / RNN over [T, B] time-major rows (rnn.cpp).
void qt_rnn(const QtRnnPlan* p, int64_t T, int64_t B, const int8_t* x, const float* x_float,
            float x_inv, const int8_t* h0, const int8_t* c0, int8_t* y, float* y_float,
            int8_t* hn, int8_t* cn);

// The error the last entry point of this thread recorded (QT_CATCH), cleared (gemm.cpp).
int qt_take_error();
// Chooses every kernel's instruction-set path, at most `cap` (a qt::Isa); returns it.
int qt_select_isa(int cap);

}  // extern "C"
