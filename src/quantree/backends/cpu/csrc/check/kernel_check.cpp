// C-level check of every GEMM path the CPU runs against the reference GEMM, bit for bit,
// on random shapes (odd sizes included), every epilogue kind, with and without a low plane.
// Built from the library's sources by tests/backends/test_kernel_check.py (natively, and
// cross-compiled for aarch64 and run under qemu). Prints "cases N mismatches M" per path.
//   kernel_check [cases] [bench M N K]
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "../qt_kernels.h"

extern "C" int qt_select_isa(int cap);
extern "C" int qt_current_isa();

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

// Runs one case on the selected path; returns the output bytes.
std::vector<uint8_t> run(const Case& c, bool bench = false) {
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
    qt::gemm_u8s8(c.M, c.N, c.Kp, c.A.data(), c.lda, c.B.data(), ep,
                  c.dual ? c.A2.data() : nullptr);
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
    std::vector<Case> all;
    for (int i = 0; i < cases; ++i) all.push_back(make());
    // the reference: gemm_reference, which the portable path runs too except on x86-64
    qt_select_isa(0);
    qt::kernels.gemm = qt::gemm_reference;
    std::vector<std::vector<uint8_t>> ref;
    for (const Case& c : all) ref.push_back(run(c));
    int failures = 0;
    for (int isa = 0; isa < 8; ++isa) {
        if (qt_select_isa(isa) != isa) continue;
        if (isa == 0 && qt::kernels.gemm == qt::gemm_reference) continue;
        int bad = 0;
        for (size_t i = 0; i < all.size(); ++i) {
            if (run(all[i]) != ref[i]) {
                if (bad < 5)
                    std::printf("path %d mismatch: M %lld N %lld K %lld kind %d dual %d\n", isa,
                                static_cast<long long>(all[i].M), static_cast<long long>(all[i].N),
                                static_cast<long long>(all[i].K), all[i].kind, all[i].dual);
                ++bad;
            }
        }
        std::printf("path %d cases %d mismatches %d\n", isa, cases, bad);
        failures += bad;
    }
    return failures == 0 ? 0 : 1;
}
