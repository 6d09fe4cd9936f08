// The AMX GEMM against the VNNI kernels and a revision's isa_amx.cpp (old_tall_amx), one process,
// one shape (argv: M N K [dual]); thread CPU time, best of 15; built by amx_gemm_ab.py.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>
#include <ctime>
static double now() { timespec t; clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t); return t.tv_sec + 1e-9 * t.tv_nsec; }
#include "qt_kernels.h"
extern "C" int qt_select_isa(int);
extern "C" int qt_amx(int);
namespace qt {
void old_tall_amx(int64_t, int64_t, int64_t, const uint8_t*, int64_t, const int8_t*, const Epilogue&, const uint8_t*, GemmFn);
}
using namespace qt;
int main(int argc, char** argv) {
    const int64_t M = atoll(argv[1]), N = atoll(argv[2]), K = atoll(argv[3]);
    const bool dual = argc > 4 && atoi(argv[4]);
    const int64_t Kp = (K + 3) / 4 * 4, nb = (N + 15) / 16;
    std::vector<uint8_t> A(M * Kp), Alo(M * Kp);
    std::vector<int8_t> B(nb * Kp * 16);
    for (auto& v : A) v = rand();
    for (auto& v : Alo) v = rand();
    for (auto& v : B) v = rand();
    std::vector<int32_t> off(nb * 16, 3);
    std::vector<float> sc(nb * 16, 0.001f), bi(nb * 16, 0.5f);
    std::vector<std::vector<float>> outs(4, std::vector<float>(M * N));
    Epilogue ep{off.data(), sc.data(), bi.data(), nullptr, nullptr, N, 1.f, 0.f, -128.f, 127.f};
    qt_select_isa(7);
    const uint8_t* lo = dual ? Alo.data() : nullptr;
    double best[4] = {1e30, 1e30, 1e30, 1e30};
    for (int rep = 0; rep < 15; ++rep)
        for (int v = 0; v < 4; ++v) {
            ep.out_f = outs[v].data();
            int it = 0; double dt; const double t0 = now();
            do {
                if (v == 0) { qt_amx(0); gemm_u8s8(M, N, Kp, A.data(), Kp, B.data(), ep, lo); }
                else if (v == 1) { qt_amx(0); old_tall_amx(M, N, Kp, A.data(), Kp, B.data(), ep, lo, kernels.gemm); }
                else { qt_amx(v - 1); gemm_u8s8(M, N, Kp, A.data(), Kp, B.data(), ep, lo); }
                ++it; dt = now() - t0;
            } while (dt < 0.01);
            best[v] = std::min(best[v], dt / it);
        }
    bool eq = true;
    for (int v = 1; v < 4; ++v) eq = eq && memcmp(outs[0].data(), outs[v].data(), 4 * M * N) == 0;
    printf("| %lld x %lld x %lld%s | %.1f | %.1f | %.1f | %.1f | %s |\n", (long long)M, (long long)N, (long long)K,
           dual ? " (int16: 2 planes)" : "", best[0] * 1e6, best[1] * 1e6, best[2] * 1e6, best[3] * 1e6, eq ? "yes" : "NO");
}
