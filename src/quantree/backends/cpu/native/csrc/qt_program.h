// The instruction set of quantree's small native programs, shared by the cells-mode loop
// (cells.cpp: one lowered cell body run for every time step) and straight-line region
// programs (program.cpp: a run of lowered ops with no kernel boundary between them).
//
// Values are 2-d [rows, cols] slices (row stride ld) of one workspace; a chunk's pieces, an
// unbind's items and a stack's parts are views of their source. Instructions are fixed-size
// records of int64 and float fields. Every instruction but the sigmoid/tanh of FLOAT_UNARY
// (which goes through the selected path's activation, as the recurrent kernels do), LOOKUP
// (the path's table lookup, exact on every path), and on the AVX-512 / AVX2 paths a LAYER_NORM or
// gelu marked "vector" (program_avx512.cpp, program_avx2.cpp: vector rows, equal to these loops up to float
// rounding; the region pass marks only those too large for the scalar loops, which it takes
// on that path alone, so every program made before keeps its bits) is plain C++ with no ISA dispatch, so it gives the same bits on every path.
#pragma once
#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <utility>
#include <cstring>
#include <vector>

#include "qt_kernels.h"

extern "C" int qt_current_isa();
extern "C" void qt_matmul(const int8_t* a, const int8_t* bmat, int64_t batch, int64_t M,
                          int64_t K, int64_t N, float za, float zb, float scale, int8_t* out_q,
                          float* out_f, float inv, float zp);
extern "C" void qt_attention(const float* q, const float* k, const float* v, const float* mask,
                             float* out, int64_t B, int64_t H, int64_t Sq, int64_t Sk,
                             int64_t D, int64_t Dv, const int64_t* strides, float scale);

namespace qt::prog {

#if defined(__x86_64__)
// program_avx512.cpp: the AVX-512 path's layer norm and erf / tanh gelu rows
void layer_norm_rows_avx512(const float* a, int64_t lda, float* out, int64_t ldo, int64_t rows,
                            int64_t n, const float* w, const float* b, float eps);
void gelu_rows_avx512(int64_t kind, const float* a, int64_t lda, float* out, int64_t ldo,
                      int64_t rows, int64_t n);
// program_avx2.cpp: the same rows in 8 lanes, for the AVX2 and AVX-VNNI paths
void layer_norm_rows_avx2(const float* a, int64_t lda, float* out, int64_t ldo, int64_t rows,
                          int64_t n, const float* w, const float* b, float eps);
void gelu_rows_avx2(int64_t kind, const float* a, int64_t lda, float* out, int64_t ldo,
                    int64_t rows, int64_t n);
inline bool vector_rows_avx2(int isa) { return isa == qt::AVX2 || isa == qt::AVXVNNI; }
#endif

// Fields per resolved slot: dtype (0 f32, 1 i8), owner, byte offset, cols, ld, rows. A slot
// table of 8 fields (a dynamic program's) adds the rows' and the byte offset's coefficients
// of the size symbol: rows = f[5] + f[6] * size, offset = f[2] + f[7] * size. Tables of 6
// fields (programs saved before) are static.
constexpr int NSR = 6;

// The slot table resolved for this call's size symbol (one place for program.cpp and
// program_loop.cpp, which read the same tables).
inline std::vector<int64_t> resolve_slots(const int64_t* slots, int64_t n_slots, int64_t fields,
                                          int64_t size) {
    std::vector<int64_t> table(static_cast<size_t>(n_slots * NSR));
    for (int64_t i = 0; i < n_slots; ++i) {
        const int64_t* d = slots + fields * i;
        int64_t* r = table.data() + NSR * i;
        std::memcpy(r, d, NSR * sizeof(int64_t));
        if (fields >= 8) {
            r[2] = d[2] + d[7] * size;
            r[5] = d[5] + d[6] * size;
        }
    }
    return table;
}

enum Op {
    QUANT = 0,
    DEQUANT = 1,
    LINEAR = 2,
    BINARY = 3,
    LOOKUP = 4,
    COPY = 5,
    FAKE_QUANT = 6,    // float -> float through an integer grid (an int16 point, say)
    FLOAT_BINARY = 7,  // float add / mul / sub
    FLOAT_UNARY = 8,   // float sigmoid / tanh / relu / gelu / tanh-gelu / silu / neg (0-6)
    LAYER_NORM = 9,    // float layer norm over each row, optional weight / bias
    LINEAR16 = 10,     // float rows quantized to int16, times int8 weights (ops_wide.py)
    RMS_NORM = 11,     // float x * rsqrt(mean(x^2) + eps) over each row, optional weight
    FLOAT_SCALAR = 12, // float a op scalar f[0]: add mul sub rsub div rdiv max min pow (0-8)
    MATMUL = 13,       // int8 batched a @ b (qt_matmul): c[4] rows of a per batch
    FLOAT_MATMUL = 14, // float batched a @ b: c[4] rows of a per batch
    ATTENTION = 15,    // float softmax(q k^T * f[0] + mask) v over heads of 2-d rows
    // numbered apart from the opcodes other branches add next to 14 (merged separately)
    TRANSPOSE = 20,    // a [batch * c[3], C] -> [batch * C, c[3]]: each batch's last two dims swapped
    ROW_SUM = 21,      // float sum of each row of a into one value (a [rows, 1] result)
    CUMSUM = 22,       // float running sum along each row (c[3] 0), or down each column of
                       // every block of c[3] rows (a cumsum over dim -2)
    TRI_FILL = 23,     // row i of each block of c[3] rows: f[0] where column j - i > c[4], else a
    STRIDED = 24,      // dst (dense) = a's elements at up to 4 sizes c[3..6] / strides c[7..10]
};
constexpr int NI = 12, NF = 8;  // fields per instruction
constexpr int NS = 5;  // fields per slot: dtype (0 f32, 1 i8), owner slot, byte offset, cols, ld

struct Slot {
    char* base;
    int64_t rows, cols, ld, size;
    float* f(int64_t r) const { return reinterpret_cast<float*>(base) + r * ld; }
    int8_t* q(int64_t r) const { return reinterpret_cast<int8_t*>(base) + r * ld; }
};

// The workspace both runners (a cell loop, a region program) lay out from their slot table:
// each owner slot 64-byte aligned, a view at its source's start plus its byte offset
// (owners come first: a view follows its source). ``fields`` is the slot record's length;
// ``rows(d)`` a slot's row count (the batch of a cell loop, the record's own for a region).
// ``outside[i]`` (if given and not null): owner slot i lives in that caller's buffer (a
// region program's dense input or output), so it takes no workspace and its views point there.
// ``clear``: the workspace starts zeroed (a cell loop's state starts at zero); without it
// ``ws`` is only grown, its old bytes kept (a region program writes every value before it
// reads it, and its caller reuses one buffer per thread).
// ``lives`` (if given): per owner slot, the first and last instruction that may touch it (a
// region program's, ``program_lives``); owners whose spans do not meet share bytes, so the
// workspace holds the values live at once instead of every value the program makes.
template <class Rows>
inline std::vector<Slot> lay_out(std::vector<char>& ws, const int64_t* slots, int64_t n_slots,
                                 int fields, Rows rows,
                                 const std::vector<char*>* outside = nullptr, bool clear = true,
                                 const std::vector<std::pair<int64_t, int64_t>>* lives = nullptr) {
    std::vector<int64_t> start(static_cast<size_t>(n_slots));
    int64_t bytes = 0;
    struct Held { int64_t first, last, at, bytes; };
    std::vector<Held> held;  // owners placed so far (with ``lives``)
    for (int64_t i = 0; i < n_slots; ++i) {
        const int64_t* d = slots + fields * i;
        if (outside && (*outside)[d[1]]) {
            start[i] = d[1] == i ? 0 : start[d[1]] + d[2];
        } else if (d[1] == i) {
            const int64_t need = (rows(d) * d[4] * (d[0] == 0 ? 4 : 1) + 63) / 64 * 64;
            if (!lives) {
                start[i] = bytes;
                bytes += need;
                continue;
            }
            // first fit: the lowest offset no owner whose span meets this one's covers
            const auto [first, last] = (*lives)[static_cast<size_t>(i)];
            int64_t at = 0;
            for (bool moved = true; moved;) {
                moved = false;
                for (const Held& h : held)
                    if (h.first <= last && first <= h.last && h.at < at + need && at < h.at + h.bytes) {
                        at = h.at + h.bytes;
                        moved = true;
                    }
            }
            held.push_back({first, last, at, need});
            start[i] = at;
            bytes = at + need > bytes ? at + need : bytes;
        } else {
            start[i] = start[d[1]] + d[2];
        }
    }
    if (clear) {
        ws.assign(static_cast<size_t>(bytes) + 64, 0);
    } else if (ws.size() < static_cast<size_t>(bytes) + 64) {
        ws.resize(static_cast<size_t>(bytes) + 64);
    }
    std::vector<Slot> s(static_cast<size_t>(n_slots));
    for (int64_t i = 0; i < n_slots; ++i) {
        const int64_t* d = slots + fields * i;
        char* base = outside && (*outside)[d[1]] ? (*outside)[d[1]] : ws.data();
        s[i] = Slot{base + start[i], rows(d), d[3], d[4], d[0] == 0 ? 4 : 1};
    }
    return s;
}

// Per owner slot of a region program, the span of instructions that may touch it: every
// field of an instruction naming a slot index is taken as a touch of that slot's owner (some
// fields are sizes or constant indices: a span only grows, never misses a use); an input
// (copied in before the code) starts at -1, an output (copied out after it) and an owner
// no instruction names last to the end. ``table``: the resolved slot records (NSR fields).
inline std::vector<std::pair<int64_t, int64_t>> program_lives(
    const int64_t* table, int64_t n_slots, int64_t fields, const int64_t* code, int64_t n_code,
    const int64_t* in_slots, int64_t n_in, const int64_t* out_slots, int64_t n_out) {
    std::vector<std::pair<int64_t, int64_t>> lives(static_cast<size_t>(n_slots),
                                                   {INT64_MAX, INT64_MIN});
    auto touch = [&](int64_t k, int64_t n) {
        if (k < 0 || k >= n_slots) return;
        auto& l = lives[static_cast<size_t>(table[fields * k + 1])];
        l.first = n < l.first ? n : l.first;
        l.second = n > l.second ? n : l.second;
    };
    for (int64_t n = 0; n < n_code; ++n)
        for (int f = 1; f < NI; ++f) touch(code[NI * n + f], n);
    for (int64_t i = 0; i < n_in; ++i) touch(in_slots[i], -1);
    for (int64_t i = 0; i < n_out; ++i) touch(out_slots[i], n_code);
    for (auto& l : lives)
        if (l.first > l.second) l = {-1, n_code};
    return lives;
}

// Row kernels with restrict pointers, so that the compiler vectorizes them (the workspace is
// one char buffer: without restrict every int8 store may alias every float load).
static inline void quantize_row(const float* __restrict a, int8_t* __restrict out, int64_t n, float inv,
                  float zp) {
    for (int64_t j = 0; j < n; ++j)
        out[j] = static_cast<int8_t>(qt::quantize_value(a[j], inv, zp, -128.0f, 127.0f));
}

static inline void dequantize_row(const int8_t* __restrict a, float* __restrict out, int64_t n, float scale,
                    float zp) {
    for (int64_t j = 0; j < n; ++j) out[j] = (static_cast<float>(a[j]) - zp) * scale;
}

static inline void binary_row(int64_t kind, const int8_t* __restrict a, const int8_t* __restrict b,
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
static inline void fake_quant_row(const float* __restrict a, float* __restrict out, int64_t n, const float* f) {
    const float inv = f[0], zp = f[1], lo = f[2], hi = f[3], scale = f[4];
    for (int64_t j = 0; j < n; ++j) out[j] = (qt::quantize_value(a[j], inv, zp, lo, hi) - zp) * scale;
}

static inline void float_binary_row(int64_t kind, const float* a, const float* b, float* out, int64_t n) {
    if (kind == 0) {
        for (int64_t j = 0; j < n; ++j) out[j] = a[j] + b[j];
    } else if (kind == 1) {
        for (int64_t j = 0; j < n; ++j) out[j] = a[j] * b[j];
    } else if (kind == 2) {
        for (int64_t j = 0; j < n; ++j) out[j] = a[j] - b[j];
    } else if (kind == 3) {
        for (int64_t j = 0; j < n; ++j) out[j] = a[j] / b[j];
    } else if (kind == 4) {  // maximum / minimum: NaN wins, as ATen's
        for (int64_t j = 0; j < n; ++j)
            out[j] = (a[j] != a[j] || a[j] > b[j]) ? a[j] : b[j];
    } else {
        for (int64_t j = 0; j < n; ++j)
            out[j] = (a[j] != a[j] || a[j] < b[j]) ? a[j] : b[j];
    }
}

// a op scalar, in float as ATen computes a float tensor with a Python scalar (clamp's
// bounds: max / min, NaN kept).
static inline void float_scalar_row(int64_t kind, const float* a, float* out, int64_t n, float s) {
    switch (kind) {
        case 0: for (int64_t j = 0; j < n; ++j) out[j] = a[j] + s; break;
        case 1: for (int64_t j = 0; j < n; ++j) out[j] = a[j] * s; break;
        case 2: for (int64_t j = 0; j < n; ++j) out[j] = a[j] - s; break;
        case 3: for (int64_t j = 0; j < n; ++j) out[j] = s - a[j]; break;
        case 4: for (int64_t j = 0; j < n; ++j) out[j] = a[j] / s; break;
        case 5: for (int64_t j = 0; j < n; ++j) out[j] = s / a[j]; break;
        case 6: for (int64_t j = 0; j < n; ++j) out[j] = a[j] != a[j] || a[j] > s ? a[j] : s; break;
        case 7: for (int64_t j = 0; j < n; ++j) out[j] = a[j] != a[j] || a[j] < s ? a[j] : s; break;
        default:
            if (s == 2.0f) {
                for (int64_t j = 0; j < n; ++j) out[j] = a[j] * a[j];
            } else {
                for (int64_t j = 0; j < n; ++j) out[j] = std::pow(a[j], s);
            }
            break;
    }
}

// Eight float lanes in the compiler's vector extension (two SSE registers where there is no
// AVX): a multiply then an add per lane, as the scalar loop (-ffp-contract=off: no fused FMA).
typedef float V8 __attribute__((vector_size(32)));
static inline V8 load8(const float* p) {
    V8 v;
    std::memcpy(&v, p, 32);
    return v;
}

// Batched float a [batch * M, K] @ b [batch * K, N] -> [batch * M, N], rows of ld strides,
// summed in k order in float (ATen's bmm blocks its sums: equal up to rounding).
static inline void float_matmul(const Slot& a, const Slot& b, const Slot& d, int64_t M) {
    const int64_t K = a.cols, N = b.cols, batch = M > 0 ? a.rows / M : 0;
    if (N == 1) {  // a matrix times a vector (a scan's read-out): dot products, 8 partial sums
        for (int64_t t = 0; t < batch; ++t) {
            const float* w = b.f(t * K);  // dense (checked): K values
            for (int64_t m = 0; m < M; ++m) {
                const float* x = a.f(t * M + m);
                float acc[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
                int64_t k = 0;
                for (; k + 8 <= K; k += 8)
                    for (int l = 0; l < 8; ++l) acc[l] += x[k + l] * w[k + l];
                float sum = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
                for (; k < K; ++k) sum += x[k] * w[k];
                d.f(t * M + m)[0] = sum;
            }
        }
        return;
    }
    // Each result element summed in k order as before (the same bits), a block of 32 or 8
    // of them held in registers across k instead of loaded and stored at every k (a chunked
    // scan's einsums as [16, 16] @ [16, 16] spent most of their time in those stores).
    for (int64_t t = 0; t < batch; ++t) {
        int64_t m = 0;
        // four rows by 16 columns: eight independent sums in flight, each w loaded once for
        // four rows (two rows' four sums waited on the add's latency: the SSD's [16, 16] @
        // [16, 16] and [33, 33] @ [33, 256] products ran at about a third of the adders' rate)
        for (; m + 4 <= M && N >= 16; m += 4) {
            const float* x0 = a.f(t * M + m);
            const float* x1 = a.f(t * M + m + 1);
            const float* x2 = a.f(t * M + m + 2);
            const float* x3 = a.f(t * M + m + 3);
            int64_t j = 0;
            for (; j + 16 <= N; j += 16) {
                V8 p0 = {}, p1 = {}, q0 = {}, q1 = {}, r0 = {}, r1 = {}, u0 = {}, u1 = {};
                for (int64_t k = 0; k < K; ++k) {
                    const float* w = b.f(t * K + k) + j;
                    const V8 w0 = load8(w), w1 = load8(w + 8);
                    p0 += x0[k] * w0;
                    p1 += x0[k] * w1;
                    q0 += x1[k] * w0;
                    q1 += x1[k] * w1;
                    r0 += x2[k] * w0;
                    r1 += x2[k] * w1;
                    u0 += x3[k] * w0;
                    u1 += x3[k] * w1;
                }
                const V8* rows[4][2] = {{&p0, &p1}, {&q0, &q1}, {&r0, &r1}, {&u0, &u1}};
                for (int i = 0; i < 4; ++i) {
                    float* y = d.f(t * M + m + i) + j;
                    std::memcpy(y, rows[i][0], 32);
                    std::memcpy(y + 8, rows[i][1], 32);
                }
            }
            for (; j < N; ++j) {  // the last N % 16 columns, one sum each, as the rows below
                const float* xs[4] = {x0, x1, x2, x3};
                for (int i = 0; i < 4; ++i) {
                    float acc = 0.0f;
                    for (int64_t k = 0; k < K; ++k) acc += xs[i][k] * b.f(t * K + k)[j];
                    d.f(t * M + m + i)[j] = acc;
                }
            }
        }
        for (; m + 2 <= M && N >= 8; m += 2) {  // two rows: four independent sums in flight
            const float* x0 = a.f(t * M + m);
            const float* x1 = a.f(t * M + m + 1);
            float* y0 = d.f(t * M + m);
            float* y1 = d.f(t * M + m + 1);
            int64_t j = 0;
            for (; j + 16 <= N; j += 16) {
                V8 p0 = {}, p1 = {}, q0 = {}, q1 = {};
                for (int64_t k = 0; k < K; ++k) {
                    const float* w = b.f(t * K + k) + j;
                    const V8 w0 = load8(w), w1 = load8(w + 8);
                    p0 += x0[k] * w0;
                    p1 += x0[k] * w1;
                    q0 += x1[k] * w0;
                    q1 += x1[k] * w1;
                }
                std::memcpy(y0 + j, &p0, 32);
                std::memcpy(y0 + j + 8, &p1, 32);
                std::memcpy(y1 + j, &q0, 32);
                std::memcpy(y1 + j + 8, &q1, 32);
            }
            for (; j + 8 <= N; j += 8) {
                V8 p0 = {}, q0 = {};
                for (int64_t k = 0; k < K; ++k) {
                    const V8 w0 = load8(b.f(t * K + k) + j);
                    p0 += x0[k] * w0;
                    q0 += x1[k] * w0;
                }
                std::memcpy(y0 + j, &p0, 32);
                std::memcpy(y1 + j, &q0, 32);
            }
            for (; j < N; ++j) {
                float s0 = 0.0f, s1 = 0.0f;
                for (int64_t k = 0; k < K; ++k) {
                    s0 += x0[k] * b.f(t * K + k)[j];
                    s1 += x1[k] * b.f(t * K + k)[j];
                }
                y0[j] = s0;
                y1[j] = s1;
            }
        }
        for (; m < M; ++m) {
            const float* x = a.f(t * M + m);
            float* y = d.f(t * M + m);
            int64_t j = 0;
            for (; j + 32 <= N; j += 32) {
                V8 c0 = {}, c1 = {}, c2 = {}, c3 = {};
                for (int64_t k = 0; k < K; ++k) {
                    const float* w = b.f(t * K + k) + j;
                    const float v = x[k];
                    c0 += v * load8(w);
                    c1 += v * load8(w + 8);
                    c2 += v * load8(w + 16);
                    c3 += v * load8(w + 24);
                }
                std::memcpy(y + j, &c0, 32);
                std::memcpy(y + j + 8, &c1, 32);
                std::memcpy(y + j + 16, &c2, 32);
                std::memcpy(y + j + 24, &c3, 32);
            }
            for (; j + 8 <= N; j += 8) {
                V8 c0 = {};
                for (int64_t k = 0; k < K; ++k) c0 += x[k] * load8(b.f(t * K + k) + j);
                std::memcpy(y + j, &c0, 32);
            }
            for (; j < N; ++j) {
                float acc = 0.0f;
                for (int64_t k = 0; k < K; ++k) acc += x[k] * b.f(t * K + k)[j];
                y[j] = acc;
            }
        }
    }
}

// d[i * ldd + j] = a[j * lda + i] for i < C, j < R: a [R, C] block written as [C, R], in
// tiles of 16 x 16 so that both the reads down a's columns and the writes stay in a few
// cache lines; typed element copies (a memcpy call per element cost ~6 ns: a conv output's
// [160, 515] transpose at 512 tokens took 0.5 ms).
template <class T>
static inline void transpose_tile(const T* __restrict a, int64_t lda, T* __restrict d,
                                  int64_t ldd, int64_t R, int64_t C) {
    constexpr int64_t B = 16;
    for (int64_t i0 = 0; i0 < C; i0 += B) {
        const int64_t ie = i0 + B < C ? i0 + B : C;
        for (int64_t j0 = 0; j0 < R; j0 += B) {
            const int64_t je = j0 + B < R ? j0 + B : R;
            for (int64_t i = i0; i < ie; ++i) {
                T* y = d + i * ldd;
                for (int64_t j = j0; j < je; ++j) y[j] = a[j * lda + i];
            }
        }
    }
}

// Each batch's [R, C] block of a written as [C, R] (a step's K^T before its K^T @ V and
// K^T.sum(-1), a conv output's [channels, time] as [time, channels]): copies, the same bits.
static inline void transpose_blocks(const Slot& a, const Slot& d, int64_t R) {
    const int64_t C = a.cols, batch = R > 0 ? a.rows / R : 0, size = a.size;
    for (int64_t t = 0; t < batch; ++t) {
        if (size == 4) {
            transpose_tile(a.f(t * R), a.ld, d.f(t * C), d.ld, R, C);
        } else {
            transpose_tile(a.q(t * R), a.ld, d.q(t * C), d.ld, R, C);
        }
    }
}

// torch.sum over the last dimension, summed in double and rounded once (ATen's vectorized
// float sums differ from it by rounding only).
static inline void row_sums(const Slot& a, const Slot& d) {
    for (int64_t r = 0; r < d.rows; ++r) {
        const float* x = a.f(r);
        double sum = 0.0;
        for (int64_t j = 0; j < a.cols; ++j) sum += x[j];
        d.f(r)[0] = static_cast<float>(sum);
    }
}

// torch.cumsum in float, summed in double as ATen's CPU kernel accumulates (the same bits):
// along each row (R 0) or down each column of every block of R rows.
static inline void cumsum_rows(const Slot& a, const Slot& d, int64_t R) {
    const int64_t C = d.cols;
    if (R == 0) {
        for (int64_t r = 0; r < d.rows; ++r) {
            const float* x = a.f(r);
            float* y = d.f(r);
            double sum = 0.0;
            for (int64_t j = 0; j < C; ++j) {
                sum += x[j];
                y[j] = static_cast<float>(sum);
            }
        }
        return;
    }
    std::vector<double> sum(static_cast<size_t>(C));
    for (int64_t r = 0; r < d.rows; ++r) {
        if (r % R == 0) std::fill(sum.begin(), sum.end(), 0.0);
        const float* x = a.f(r);
        float* y = d.f(r);
        for (int64_t j = 0; j < C; ++j) {
            sum[j] += x[j];
            y[j] = static_cast<float>(sum[j]);
        }
    }
}

// masked_fill with a triangular mask: row i of each block of R rows takes v in the columns
// j with j - i > k (k -R or less: every column, a constant fill), a's value elsewhere.
static inline void tri_fill(const Slot& a, const Slot& d, int64_t R, int64_t k, float v) {
    for (int64_t r = 0; r < d.rows; ++r) {
        const int64_t i = r % R;
        const float* x = a.f(r);
        float* y = d.f(r);
        int64_t first = i + k + 1;  // the first filled column
        first = first < 0 ? 0 : first > d.cols ? d.cols : first;
        for (int64_t j = 0; j < first; ++j) y[j] = x[j];
        for (int64_t j = first; j < d.cols; ++j) y[j] = v;
    }
}

// A strided view of a's elements (from a's first one) written dense into d: a permute, an
// expand (stride 0), a select, an einsum's operand in matmul order. Sizes and strides are
// in elements, outermost first, any dtype: copies, the same bits.
static inline void strided_copy(const Slot& a, const Slot& d, const int64_t* size,
                                const int64_t* stride) {
    const int64_t e = a.size;
    char* out = d.base;
    const char* src = a.base;
    for (int64_t i0 = 0; i0 < size[0]; ++i0)
        for (int64_t i1 = 0; i1 < size[1]; ++i1) {
            const char* x0 = src + (i0 * stride[0] + i1 * stride[1]) * e;
            if (stride[2] == 1 && stride[3] > 1) {  // the last two dimensions swapped (a
                // permute's [.., 8, 256] -> [.., 256, 8]): tiles, not a gather per element
                if (e == 4) {
                    transpose_tile(reinterpret_cast<const float*>(x0), stride[3],
                                   reinterpret_cast<float*>(out), size[3], size[3], size[2]);
                } else {
                    transpose_tile(reinterpret_cast<const int8_t*>(x0), stride[3],
                                   reinterpret_cast<int8_t*>(out), size[3], size[3], size[2]);
                }
                out += size[2] * size[3] * e;
                continue;
            }
            if (stride[3] == 1 && size[3] * e == 64) {  // rows of 16 floats (a chunked
                // scan's heads of 16): a copy of constant size, no memcpy call per row
                for (int64_t i2 = 0; i2 < size[2]; ++i2, out += 64)
                    std::memcpy(out, x0 + i2 * stride[2] * e, 64);
                continue;
            }
            for (int64_t i2 = 0; i2 < size[2]; ++i2) {
                const char* x = x0 + i2 * stride[2] * e;
                if (stride[3] == 1) {
                    std::memcpy(out, x, static_cast<size_t>(size[3] * e));
                } else if (e == 4) {
                    const float* xf = reinterpret_cast<const float*>(x);
                    float* of = reinterpret_cast<float*>(out);
                    if (stride[3] == 0) {  // an expand of the last dimension
                        std::fill(of, of + size[3], xf[0]);
                    } else {
                        for (int64_t i3 = 0; i3 < size[3]; ++i3) of[i3] = xf[i3 * stride[3]];
                    }
                } else {
                    for (int64_t i3 = 0; i3 < size[3]; ++i3) out[i3] = x[i3 * stride[3]];
                }
                out += size[3] * e;
            }
        }
}

// exp of eight lanes: a degree-6 polynomial on a Cody-Waite reduced argument (qt_vmath.h's,
// about 1 ulp), 2^n built in the exponent bits; below -87.3 (where 2^n would leave the normal
// range) 0, so that exp(-inf) is 0 as ATen's. FLOAT_UNARY kind 12: exps too large for libm's
// element by element loop (a chunked scan's segment sums at 512 tokens), the same bits on
// every path (the compiler's vector extension, no fused multiply-add).
typedef int32_t I8x __attribute__((vector_size(32)));
static inline V8 exp8(const V8 src) {
    const V8 lo = src < -87.3f ? V8{} - 87.3f : src;  // NaN compares false: kept
    const V8 x = lo > 88.7f ? V8{} + 88.7f : lo;
    const V8 t = x * 1.44269504088896f;
    const I8x k = __builtin_convertvector(t + (t < 0.0f ? V8{} - 0.5f : V8{} + 0.5f), I8x);
    const V8 nf = __builtin_convertvector(k, V8);
    V8 r = x - nf * 0.693145751953125f;
    r = r - nf * 1.428606765330187045e-06f;
    V8 p = V8{} + 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * (r * r) + (r + 1.0f);
    const I8x bits = (k + 127) << 23;
    V8 scale;
    std::memcpy(&scale, &bits, 32);
    const V8 y = p * scale;
    return src < -87.3f ? V8{} : y;
}

static inline void exp_rows(const float* a, float* out, int64_t n) {
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) {
        const V8 y = exp8(load8(a + j));
        std::memcpy(out + j, &y, 32);
    }
    for (; j < n; ++j) out[j] = std::exp(a[j]);
}

// softplus (beta 1, threshold 20) of eight lanes: x above 20, else log1p(exp(x)) as
// log(u) * e / (u - 1) with u = 1 + e (e where u rounds to 1), log(u) cephes' logf on the
// mantissa in [sqrt(1/2), sqrt(2)) (about 1 ulp) plus the exponent times ln 2. FLOAT_UNARY
// kind 13: softplus too large for libm's exp and log1p per element (Mamba-2's time steps,
// [tokens, heads]), the same bits on every path as exp8's.
static inline void softplus_rows(const float* a, float* out, int64_t n) {
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) {
        const V8 x = load8(a + j);
        const V8 e = exp8(x);
        const V8 u = e + 1.0f;
        I8x ub;
        std::memcpy(&ub, &u, 32);
        I8x k = ((ub >> 23) & 0xff) - 126;
        I8x mb = (ub & 0x007fffff) | 0x3f000000;  // mantissa in [1/2, 1)
        V8 m;
        std::memcpy(&m, &mb, 32);
        const auto small = m < 0.707106781186547524f;
        k = small ? k - 1 : k;
        m = small ? m + m : m;
        const V8 f = m - 1.0f;
        const V8 z = f * f;
        V8 p = V8{} + 7.0376836292e-2f;
        p = p * f - 1.1514610310e-1f;
        p = p * f + 1.1676998740e-1f;
        p = p * f - 1.2420140846e-1f;
        p = p * f + 1.4249322787e-1f;
        p = p * f - 1.6668057665e-1f;
        p = p * f + 2.0000714765e-1f;
        p = p * f - 2.4999993993e-1f;
        p = p * f + 3.3333331174e-1f;
        const V8 kf = __builtin_convertvector(k, V8);
        V8 y = p * f * z;
        y = y + kf * -2.12194440e-4f;
        y = y - 0.5f * z;
        V8 lg = f + y;
        lg = lg + kf * 0.693359375f;
        const V8 um1 = u - 1.0f;
        const V8 safe = um1 == 0.0f ? V8{} + 1.0f : um1;
        V8 r = um1 == 0.0f ? e : lg * (e / safe);
        r = x > 20.0f ? x : r;
        r = x != x ? x : r;  // NaN in, NaN out
        std::memcpy(out + j, &r, 32);
    }
    for (; j < n; ++j) out[j] = a[j] > 20.0f ? a[j] : std::log1p(std::exp(a[j]));
}

static inline void float_unary_row(int64_t kind, const float* a, float* out, int64_t n) {
    if (kind < 2) {
        qt::kernels.activation(static_cast<int>(kind), a, out, n);
        return;
    }
    if (kind == 0) {
        for (int64_t j = 0; j < n; ++j) out[j] = 1.0f / (1.0f + std::exp(-a[j]));
    } else if (kind == 1) {
        for (int64_t j = 0; j < n; ++j) out[j] = std::tanh(a[j]);
    } else if (kind == 2) {
        for (int64_t j = 0; j < n; ++j) out[j] = a[j] > 0.0f ? a[j] : 0.0f;
    } else if (kind == 3) {  // gelu: x / 2 (1 + erf(x / sqrt 2)), as ATen's
        for (int64_t j = 0; j < n; ++j)
            out[j] = 0.5f * a[j] * (1.0f + std::erf(a[j] * 0.70710678118654752f));
    } else if (kind == 4) {  // gelu, approximate="tanh"
        for (int64_t j = 0; j < n; ++j) {
            const float x = a[j];
            out[j] = 0.5f * x * (1.0f + std::tanh(0.79788456080286536f * (x + 0.044715f * x * x * x)));
        }
    } else if (kind == 5) {  // silu: x * sigmoid(x), the sigmoid the path's vector kernel
        qt::kernels.activation(0, a, out, n);
        for (int64_t j = 0; j < n; ++j) out[j] *= a[j];
    } else if (kind == 6) {  // neg
        for (int64_t j = 0; j < n; ++j) out[j] = -a[j];
    } else if (kind == 7) {
        for (int64_t j = 0; j < n; ++j) out[j] = std::exp(a[j]);
    } else if (kind == 8) {
        for (int64_t j = 0; j < n; ++j) out[j] = std::log(a[j]);
    } else if (kind == 9) {  // softplus, beta 1, threshold 20 (ATen's defaults)
        for (int64_t j = 0; j < n; ++j) out[j] = a[j] > 20.0f ? a[j] : std::log1p(std::exp(a[j]));
    } else if (kind == 10) {
        for (int64_t j = 0; j < n; ++j) out[j] = 1.0f / std::sqrt(a[j]);
    } else if (kind == 12) {
        exp_rows(a, out, n);
    } else if (kind == 13) {
        softplus_rows(a, out, n);
    } else {  // abs
        for (int64_t j = 0; j < n; ++j) out[j] = std::fabs(a[j]);
    }
}


// torch's layer_norm over the last dimension: (x - mean) / sqrt(var + eps) * w + b, the
// biased variance; sums in double (ATen's vectorized float sums differ by rounding only).
static inline void layer_norm_row(const float* __restrict a, float* __restrict out, int64_t n,
                                  const float* w, const float* b, float eps) {
    double sum = 0.0;
    for (int64_t j = 0; j < n; ++j) sum += a[j];
    const double mean = sum / static_cast<double>(n);
    double sq = 0.0;
    for (int64_t j = 0; j < n; ++j) sq += (a[j] - mean) * (a[j] - mean);
    const float m = static_cast<float>(mean);
    const float rstd = static_cast<float>(1.0 / std::sqrt(sq / static_cast<double>(n) + eps));
    for (int64_t j = 0; j < n; ++j) {
        float y = (a[j] - m) * rstd;
        if (w) y *= w[j];
        if (b) y += b[j];
        out[j] = y;
    }
}

// RMSNorm over the last dimension as the five ATen ops compute it (pow, mean, add eps,
// rsqrt, mul; then the weight): x * (1 / sqrt(mean(x^2) + eps)) * w, the mean summed in
// double (ATen's float reduction differs by rounding only), in eight partial sums (element
// j into sum j % 8, then added pairwise): one running sum waited on the add's latency for
// every element, about a cycle and a half each (a gated norm of [512, 128] per chunked scan).
static inline void rms_norm_row(const float* __restrict a, float* __restrict out, int64_t n,
                                const float* w, float eps) {
    double part[8] = {0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0};
    int64_t j = 0;
    for (; j + 8 <= n; j += 8)
        for (int l = 0; l < 8; ++l) part[l] += static_cast<double>(a[j + l]) * a[j + l];
    for (int l = 0; j < n; ++j, ++l) part[l] += static_cast<double>(a[j]) * a[j];
    const double sq = ((part[0] + part[4]) + (part[1] + part[5])) +
                      ((part[2] + part[6]) + (part[3] + part[7]));
    const float r = 1.0f / std::sqrt(static_cast<float>(sq / static_cast<double>(n)) + eps);
    if (w) {
        for (int64_t j = 0; j < n; ++j) out[j] = w[j] * (a[j] * r);
    } else {
        for (int64_t j = 0; j < n; ++j) out[j] = a[j] * r;
    }
}

// Runs instruction c (its float fields f) over the slots s. u8: scratch for the widest
// linear's input rows; mult / add: the linear's int8-output multipliers (or null);
// prepared: a linear's weights prepared for the GEMM path (or null).
// An elementwise instruction's dense operand of the result's width, and the result, read as
// one long row: the same arithmetic element by element, without a call and a switch per row
// (a [16384, 16] value of a chunked scan has 16384 rows of 16).
static inline bool joins(const Slot& x, const Slot& d) {
    return x.ld == x.cols && x.cols == d.cols && x.size == d.size;
}
static inline Slot one_row(const Slot& x, int64_t rows) {
    const int64_t n = rows * x.cols;
    return Slot{x.base, 1, n, n, x.size};
}
static inline bool elementwise(const int64_t* c) {
    switch (c[0]) {
        case QUANT: case DEQUANT: case FAKE_QUANT: case FLOAT_SCALAR: case FLOAT_UNARY:
        case LOOKUP: case COPY:
            return true;
        case FLOAT_BINARY: case BINARY:
            return c[5] == 0;
        default:
            return false;
    }
}

static inline void run_op(const int64_t* c, const float* f, const std::vector<Slot>& s,
                        void* const* consts, uint8_t* u8, const float* mult, const float* add,
                        const qt::PreparedB* prepared = nullptr) {
    Slot dst = s[c[1]];
    Slot a = s[c[2]];
    if (dst.rows > 1 && dst.ld == dst.cols && elementwise(c)) {
        const bool quant = c[0] == QUANT || c[0] == DEQUANT;  // int8 <-> float: sizes differ
        const bool two = c[0] == FLOAT_BINARY || c[0] == BINARY;
        const bool ok_a = quant ? a.ld == a.cols && a.cols == dst.cols : joins(a, dst);
        if (ok_a && (!two || joins(s[c[3]], dst))) {
            a = one_row(a, dst.rows);
            if (two) {
                Slot b = one_row(s[c[3]], dst.rows);
                dst = one_row(dst, dst.rows);
                if (c[0] == FLOAT_BINARY) float_binary_row(c[4], a.f(0), b.f(0), dst.f(0), dst.cols);
                else binary_row(c[4], a.q(0), b.q(0), dst.q(0), dst.cols, f);
                return;
            }
            dst = one_row(dst, dst.rows);
        }
    }
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
            qt::to_u8(a.q(0), a.rows, K, a.ld, u8, Kp);
            qt::Epilogue ep{static_cast<const int32_t*>(consts[c[6]]),
                            static_cast<const float*>(consts[c[4]]),
                            c[5] >= 0 ? static_cast<const float*>(consts[c[5]]) : nullptr,
                            f[0] > 0 ? nullptr : dst.f(0),
                            f[0] > 0 ? dst.q(0) : nullptr,
                            dst.ld, f[0] > 0 ? 1.0f / f[0] : 0.0f, f[1], -128.0f, 127.0f};
            if (c[10]) ep.qmin = f[1] > -128.0f ? f[1] : -128.0f;
            if (f[0] > 0) {
                ep.mult = mult;
                ep.add = add;
            }
            qt::gemm_u8s8(a.rows, N, Kp, u8, Kp,
                          static_cast<const int8_t*>(consts[c[3]]), ep, nullptr, prepared);
            break;
        }
        case LINEAR16: {  // c[3] weight, c[4] scale, c[5] float bias (or -1), c[6] offset
            const int64_t K = a.cols, N = c[8], Kp = c[9];
            uint8_t* lo = u8 + a.rows * Kp;
            qt::split16_rows(a.f(0), a.rows, K, a.ld, f[0], f[1], f[2], u8, lo, Kp);
            const qt::Epilogue ep{static_cast<const int32_t*>(consts[c[6]]),
                                  static_cast<const float*>(consts[c[4]]),
                                  c[5] >= 0 ? static_cast<const float*>(consts[c[5]]) : nullptr,
                                  dst.f(0), nullptr, dst.ld, 0.0f, 0.0f, -128.0f, 127.0f};
            qt::gemm_u8s8(a.rows, N, Kp, u8, Kp, static_cast<const int8_t*>(consts[c[3]]), ep,
                          lo, prepared);
            break;
        }
        case BINARY: {  // c[5] 1: b is one value (a [1] operand), read for every element;
                        // 2 (3): b (a) is a column, one value per row (an outer product)
            const Slot& b = s[c[3]];
            if (c[5] == 2 || c[5] == 3) {  // the one-value path's arithmetic, a value per row
                const bool bc = c[5] == 2;
                const Slot& full = bc ? a : b;
                const Slot& col = bc ? b : a;
                int8_t row[64];
                for (int64_t r = 0; r < dst.rows; ++r) {
                    std::memset(row, col.q(r)[0], sizeof(row));
                    for (int64_t j = 0; j < dst.cols; j += 64) {
                        const int64_t n = dst.cols - j < 64 ? dst.cols - j : 64;
                        if (bc) binary_row(c[4], full.q(r) + j, row, dst.q(r) + j, n, f);
                        else binary_row(c[4], row, full.q(r) + j, dst.q(r) + j, n, f);
                    }
                }
                break;
            }
            if (c[5] == 1) {
                int8_t row[64];
                std::memset(row, b.q(0)[0], sizeof(row));
                for (int64_t r = 0; r < dst.rows; ++r)
                    for (int64_t j = 0; j < dst.cols; j += 64) {
                        const int64_t n = dst.cols - j < 64 ? dst.cols - j : 64;
                        binary_row(c[4], a.q(r) + j, row, dst.q(r) + j, n, f);
                    }
                break;
            }
            for (int64_t r = 0; r < dst.rows; ++r)
                binary_row(c[4], a.q(r), b.q(r), dst.q(r), dst.cols, f);
            break;
        }
        case LOOKUP: {
            // through the path's lookup (exact everywhere): on AVX2 a shuffle per 16 table
            // entries, about twice the scalar loop's bytes per cycle (a third of the cell
            // loop's own time at batch 32 was this loop, perf)
            const int8_t* table = static_cast<const int8_t*>(consts[c[3]]);
            const int64_t rows = dst.rows, cols = dst.cols;
            for (int64_t r = 0; r < rows; ++r) qt::kernels.lookup(table, a.q(r), dst.q(r), cols);
            break;
        }
        case FAKE_QUANT:
            for (int64_t r = 0; r < dst.rows; ++r) fake_quant_row(a.f(r), dst.f(r), dst.cols, f);
            break;
        case FLOAT_BINARY: {  // c[5] 1 (2): b (a) is a column, one value per row;
                              // c[5] 3 (4): b (a) is one value (a [1] operand) for every row
            const Slot& b = s[c[3]];
            if (c[5] >= 1 && c[5] <= 4) {  // as FLOAT_SCALAR's kinds: x op s, s op x
                static const int64_t b_col[6] = {0, 1, 2, 4, 6, 7}, a_col[6] = {0, 1, 3, 5, 6, 7};
                const bool bc = c[5] == 1 || c[5] == 3;
                const bool one = c[5] >= 3;
                const Slot& full = bc ? a : b;
                const Slot& col = bc ? b : a;
                const int64_t k = bc ? b_col[c[4]] : a_col[c[4]];
                for (int64_t r = 0; r < dst.rows; ++r)
                    float_scalar_row(k, full.f(r), dst.f(r), dst.cols, col.f(one ? 0 : r)[0]);
                break;
            }
            for (int64_t r = 0; r < dst.rows; ++r)
                float_binary_row(c[4], a.f(r), b.f(r), dst.f(r), dst.cols);
            break;
        }
        case FLOAT_UNARY:  // c[4] 1: a gelu the path may run as vector rows
#if defined(__x86_64__)
            if ((c[3] == 3 || c[3] == 4) && c[4] && qt_current_isa() == qt::AVX512VNNI) {
                gelu_rows_avx512(c[3], a.f(0), a.ld, dst.f(0), dst.ld, dst.rows, dst.cols);
                break;
            }
            if ((c[3] == 3 || c[3] == 4) && c[4] && vector_rows_avx2(qt_current_isa())) {
                gelu_rows_avx2(c[3], a.f(0), a.ld, dst.f(0), dst.ld, dst.rows, dst.cols);
                break;
            }
#endif
            for (int64_t r = 0; r < dst.rows; ++r) float_unary_row(c[3], a.f(r), dst.f(r), dst.cols);
            break;
        case LAYER_NORM: {  // c[3], c[4]: weight / bias constants or -1; f[0]: eps; c[5]: vector
            const float* w = c[3] >= 0 ? static_cast<const float*>(consts[c[3]]) : nullptr;
            const float* b = c[4] >= 0 ? static_cast<const float*>(consts[c[4]]) : nullptr;
#if defined(__x86_64__)
            if (c[5] && qt_current_isa() == qt::AVX512VNNI) {
                layer_norm_rows_avx512(a.f(0), a.ld, dst.f(0), dst.ld, dst.rows, dst.cols, w, b,
                                       f[0]);
                break;
            }
            if (c[5] && vector_rows_avx2(qt_current_isa())) {
                layer_norm_rows_avx2(a.f(0), a.ld, dst.f(0), dst.ld, dst.rows, dst.cols, w, b, f[0]);
                break;
            }
#endif
            for (int64_t r = 0; r < dst.rows; ++r) layer_norm_row(a.f(r), dst.f(r), dst.cols, w, b, f[0]);
            break;
        }
        case RMS_NORM: {  // c[3]: weight constant or -1; f[0]: eps
            const float* w = c[3] >= 0 ? static_cast<const float*>(consts[c[3]]) : nullptr;
            for (int64_t r = 0; r < dst.rows; ++r) rms_norm_row(a.f(r), dst.f(r), dst.cols, w, f[0]);
            break;
        }
        case FLOAT_SCALAR:
            for (int64_t r = 0; r < dst.rows; ++r)
                float_scalar_row(c[3], a.f(r), dst.f(r), dst.cols, f[0]);
            break;
        case MATMUL: {  // dense operands (checked): f = za, zb, scale, 1 / out scale or 0, zo
            const Slot& b = s[c[3]];
            const int64_t M = c[4], batch = M > 0 ? a.rows / M : 0;
            const bool q = f[3] > 0;
            qt_matmul(a.q(0), b.q(0), batch, M, a.cols, b.cols, f[0], f[1], f[2],
                      q ? dst.q(0) : nullptr, q ? nullptr : dst.f(0), f[3], f[4]);
            break;
        }
        case FLOAT_MATMUL:
            float_matmul(a, s[c[3]], dst, c[4]);
            break;
        case ATTENTION: {
            // a = q [B Sq, H D], c[3] k and c[4] v [B Sk, H D | H Dv] (column views of a
            // joined projection, say), dst [B Sq, H Dv]: head h is columns h D .. (h + 1) D,
            // so the heads' views and transposes around attention need no copy. c[5] the
            // mask slot or -1, c[6] H, c[7] Sq, c[8] Sk, c[9] the mask's rows: 0 one per
            // batch ([B, 1, 1, Sk]), 1 one for all ([1, 1, 1, Sk]), 2 Sq per batch
            // ([B, 1, Sq, Sk]); c[10] D, c[11] Dv; f[0] the scale.
            const Slot& k = s[c[3]];
            const Slot& v = s[c[4]];
            const int64_t H = c[6], Sq = c[7], Sk = c[8], D = c[10], Dv = c[11];
            const int64_t B = Sq > 0 ? a.rows / Sq : 0;
            const float* mask = nullptr;
            int64_t mb = 0, mi = 0;
            if (c[5] >= 0) {
                const Slot& m = s[c[5]];
                mask = m.f(0);
                mb = c[9] == 0 ? m.ld : c[9] == 2 ? Sq * m.ld : 0;
                mi = c[9] == 2 ? m.ld : 0;
            }
            const int64_t strides[20] = {
                Sq * a.ld, D, a.ld, 1, Sk * k.ld, D, k.ld, 1, Sk * v.ld, Dv, v.ld, 1,
                mb, 0, mi, 1, Sq * dst.ld, Dv, dst.ld, 1};
            qt_attention(a.f(0), k.f(0), v.f(0), mask, dst.f(0), B, H, Sq, Sk, D, Dv, strides,
                         f[0]);
            break;
        }
        case TRANSPOSE:
            transpose_blocks(a, dst, c[3]);
            break;
        case ROW_SUM:
            row_sums(a, dst);
            break;
        case CUMSUM:
            cumsum_rows(a, dst, c[3]);
            break;
        case TRI_FILL:
            tri_fill(a, dst, c[3], c[4], f[0]);
            break;
        case STRIDED:
            strided_copy(a, dst, c + 3, c + 7);
            break;
        case COPY:
            for (int64_t r = 0; r < dst.rows; ++r)
                std::memcpy(dst.base + r * dst.ld * dst.size, a.base + r * a.ld * a.size,
                            static_cast<size_t>(dst.cols * dst.size));
            break;
        default:
            break;
    }
}

// Runs a whole program once over the slots s (program.cpp once per call, program_loop.cpp
// once per step): a LINEAR writing int8 reads its multipliers from the constant c[11].
static inline void run_code(const int64_t* code, const float* fcode, int64_t n_code,
                            const std::vector<Slot>& s, void* const* consts, uint8_t* u8) {
    for (int64_t n = 0; n < n_code; ++n) {
        const int64_t* c = code + NI * n;
        const float* f = fcode + NF * n;
        const bool requant = c[0] == LINEAR && f[0] > 0;
        const float* mult = requant ? static_cast<const float*>(consts[c[11]]) : nullptr;
        run_op(c, f, s, consts, u8, mult, requant ? mult + c[8] : nullptr);
    }
}

}  // namespace qt::prog
