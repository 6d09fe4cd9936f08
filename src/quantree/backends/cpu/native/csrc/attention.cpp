// Float attention, softmax(q k^T * scale + mask) v, as one call per attention block.
//
// The default recipe keeps attention's two matmuls, the scale, the additive mask and the
// softmax in float (benchmarks/README.md, branch `acc`): the reference graph runs them as
// about a dozen ATen calls with the heads' transposes between them. Here each (batch, head)
// is one pass over blocks of query rows: their scores, softmax and weighted sum of values stay
// in a few kilobytes of workspace, and q, k, v and the output are read and written through
// their strides, so the transposes around the block cost nothing. ATen's fused CPU attention
// (scaled_dot_product_attention) saved only a tenth of the block's time on BERT's shapes, so
// the block is written here (the AVX-512 path in attention_avx512.cpp, the AVX2 one in
// attention_avx2.cpp).
//
// Semantics are the reference graph's, in its order: s = (q . k) * scale, then + mask, then
// softmax over the keys, then p v. A row whose every score is -inf is NaN, as softmax makes it.
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "qt_kernels.h"

extern "C" int qt_current_isa();

namespace qt {

#if defined(__x86_64__)
void attention_avx512(const AttentionArgs& a);
void attention_avx2(const AttentionArgs& a);
#endif

// One (batch, head) at a time, one query row at a time: the path of CPUs without AVX-512.
static void attention_portable(const AttentionArgs& a) {
    std::vector<float> s(static_cast<size_t>(a.Sk > 0 ? a.Sk : 1));
    for (int64_t b = 0; b < a.B; ++b)
        for (int64_t h = 0; h < a.H; ++h) {
            const float* q = a.q + b * a.qs[0] + h * a.qs[1];
            const float* k = a.k + b * a.ks[0] + h * a.ks[1];
            const float* v = a.v + b * a.vs[0] + h * a.vs[1];
            const float* m = a.mask ? a.mask + b * a.ms[0] + h * a.ms[1] : nullptr;
            float* o = a.out + b * a.os[0] + h * a.os[1];
            for (int64_t i = 0; i < a.Sq; ++i) {
                const float* qi = q + i * a.qs[2];
                float top = -std::numeric_limits<float>::infinity();
                for (int64_t j = 0; j < a.Sk; ++j) {
                    const float* kj = k + j * a.ks[2];
                    float dot = 0.0f;
                    for (int64_t d = 0; d < a.D; ++d) dot += qi[d] * kj[d];
                    float x = dot * a.scale;
                    if (m) x = x + m[i * a.ms[2] + j];
                    s[j] = x;
                    top = x > top ? x : top;
                }
                float* oi = o + i * a.os[2];
                if (a.Sk > 0 && top == -std::numeric_limits<float>::infinity()) {
                    for (int64_t d = 0; d < a.Dv; ++d)
                        oi[d] = std::numeric_limits<float>::quiet_NaN();
                    continue;
                }
                float sum = 0.0f;
                for (int64_t j = 0; j < a.Sk; ++j) {
                    s[j] = std::exp(s[j] - top);
                    sum += s[j];
                }
                const float inv = 1.0f / sum;
                for (int64_t d = 0; d < a.Dv; ++d) oi[d] = 0.0f;
                for (int64_t j = 0; j < a.Sk; ++j) {
                    const float p = s[j] * inv;
                    const float* vj = v + j * a.vs[2];
                    for (int64_t d = 0; d < a.Dv; ++d) oi[d] += p * vj[d];
                }
            }
        }
}

}  // namespace qt

extern "C" {

// q [B, H, Sq, D], k [B, H, Sk, D], v [B, H, Sk, Dv], mask (or null) broadcast to
// [B, H, Sq, Sk], out [B, H, Sq, Dv]; strides[20]: each tensor's four element strides in
// that order (q, k, v, mask, out), the last of each 1 but the mask's key stride may not be 0.
void qt_attention(const float* q, const float* k, const float* v, const float* mask, float* out,
                  int64_t B, int64_t H, int64_t Sq, int64_t Sk, int64_t D, int64_t Dv,
                  const int64_t* strides, float scale) try {
    qt::AttentionArgs a{q, k, v, mask, out, B, H, Sq, Sk, D, Dv, {}, {}, {}, {}, {}, scale};
    for (int i = 0; i < 3; ++i) {
        a.qs[i] = strides[i];
        a.ks[i] = strides[4 + i];
        a.vs[i] = strides[8 + i];
        a.ms[i] = strides[12 + i];
        a.os[i] = strides[16 + i];
    }
    if (B <= 0 || H <= 0 || Sq <= 0 || Dv <= 0) return;
#if defined(__x86_64__)
    const int isa = qt_current_isa();
    if (isa == qt::AVX512VNNI) return qt::attention_avx512(a);
    if (isa == qt::AVX2 || isa == qt::AVXVNNI) return qt::attention_avx2(a);
#endif
    qt::attention_portable(a);
} QT_CATCH

}  // extern "C"
