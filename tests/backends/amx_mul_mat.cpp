// Runs ggml's AMX matrix multiplication (ggml/src/ggml-cpu/amx/mmq.cpp, compiled by
// tests/backends/test_amx_patch.py from the patched tree llama-server is built from)
// on batched inputs and checks every batch against a plain float reference.
//
// Hybrid and recurrent models (LFM2, Mamba) shape activations as
// [n_embd, n_seq_tokens, n_seqs]: with two sequences decoding together the weight's
// matmul has ne2 > 1, the shape that crashed llama-server on CPUs with AMX.
//
// The F16 kernels and the quantized one-row kernels use AVX-512 only, so they run on
// any CPU with AVX-512 VNNI; `amx` as the first argument adds the multi-row quantized
// kernels, which need the AMX tile registers.
//
// Single-threaded (ith 0 of 1): ggml_barrier, ggml-cpu's per-thread rendezvous, is a no-op
// below, and the quantize hooks are ggml-base's reference versions of the same format,
// so only ggml-base is linked and the kernels under test are the only CPU-specific code.

#include "ggml.h"
#include "ggml-cpu-impl.h"
#include "ggml-quants.h"
#include "amx/mmq.h"

#include <sys/syscall.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

extern "C" {
float ggml_table_f32_f16[1 << 16];
void ggml_barrier(struct ggml_threadpool *) {}
void quantize_row_q8_0(const float * x, void * y, int64_t k) {
    quantize_row_q8_0_ref(x, (block_q8_0 *) y, k);
}
void quantize_row_q8_1(const float * x, void * y, int64_t k) {
    quantize_row_q8_1_ref(x, (block_q8_1 *) y, k);
}
}

namespace {

struct Case {
    ggml_type type;
    int K, N, M, ne2, ne3;
};

bool request_amx() {
    // what ggml_amx_init does: ask the kernel for the tile data state
    return syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
}

// max |got - want| over the batch, relative to the largest |want| in it
std::vector<double> run(const Case & c, std::mt19937 & rng) {
    ggml_init_params ip = {64 * 1024 * 1024, nullptr, false};
    ggml_context * ctx = ggml_init(ip);
    std::normal_distribution<float> dist(0.0f, 1.0f);

    std::vector<float> w(size_t(c.K) * c.N);
    for (float & v : w) v = dist(rng);
    // the weight in its own format, and dequantized back: the reference's weight
    const size_t row = ggml_row_size(c.type, c.K);
    std::vector<uint8_t> raw(row * c.N);
    ggml_quantize_chunk(c.type, w.data(), raw.data(), 0, c.N, c.K, nullptr);
    ggml_get_type_traits(c.type)->to_float(raw.data(), w.data(), int64_t(c.K) * c.N);

    ggml_tensor * src0 = ggml_new_tensor_2d(ctx, c.type, c.K, c.N);
    ggml_tensor * src1 = ggml_new_tensor_4d(ctx, GGML_TYPE_F32, c.K, c.M, c.ne2, c.ne3);
    for (int64_t i = 0; i < ggml_nelements(src1); ++i) ((float *) src1->data)[i] = dist(rng);
    // the AMX buffer holds the weight repacked (quantized types) or as it is (F16)
    std::vector<uint8_t> packed(ggml_backend_amx_get_alloc_size(src0) + 64);
    src0->data = (void *) ((uintptr_t(packed.data()) + 63) & ~uintptr_t(63));
    if (c.type == GGML_TYPE_F16) {
        memcpy(src0->data, raw.data(), raw.size());
    } else {
        ggml_backend_amx_convert_weight(src0, raw.data(), 0, raw.size());
    }
    ggml_tensor * dst = ggml_mul_mat(ctx, src0, src1);
    memset(dst->data, 0, ggml_nbytes(dst));

    std::vector<uint8_t> work(ggml_backend_amx_desired_wsize(dst) + 64);
    ggml_compute_params params = {0, 1, work.size(), work.data(), nullptr, false};
    ggml_backend_amx_mul_mat(&params, dst);

    std::vector<double> errs;
    for (int b = 0; b < c.ne2 * c.ne3; ++b) {
        const float * x = (const float *) src1->data + size_t(b) * c.M * c.K;
        const float * y = (const float *) dst->data + size_t(b) * c.M * c.N;
        double err = 0, scale = 1e-6;
        for (int m = 0; m < c.M; ++m) {
            for (int n = 0; n < c.N; ++n) {
                double want = 0;
                for (int k = 0; k < c.K; ++k) want += double(x[m * c.K + k]) * w[size_t(n) * c.K + k];
                err = std::max(err, std::fabs(y[m * c.N + n] - want));
                scale = std::max(scale, std::fabs(want));
            }
        }
        errs.push_back(err / scale);
    }
    ggml_free(ctx);
    return errs;
}

}  // namespace

int main(int argc, char ** argv) {
    setvbuf(stdout, nullptr, _IOLBF, 0);  // a crash keeps the cases before it
    const bool amx = argc > 1 && strcmp(argv[1], "amx") == 0;
    if (amx && !request_amx()) {
        fprintf(stderr, "the kernel refused the AMX tile state (arch_prctl)\n");
        return 2;
    }
    for (int i = 0; i < (1 << 16); ++i) {
        ggml_table_f32_f16[i] = ggml_fp16_to_fp32(ggml_fp16_t(i));
    }
    std::vector<Case> cases;
    for (int M : {1, 2, 5}) {
        for (auto [ne2, ne3] : {std::pair{1, 1}, {2, 1}, {3, 2}}) {
            cases.push_back({GGML_TYPE_F16, 128, 96, M, ne2, ne3});
            // the quantized kernels: one row with AVX-512 VNNI, more with AMX tiles
            if (M == 1 || amx) {
                cases.push_back({GGML_TYPE_Q8_0, 128, 64, M, ne2, ne3});
                cases.push_back({GGML_TYPE_Q4_0, 128, 64, M, ne2, ne3});
            }
        }
    }
    std::mt19937 rng(1234);
    int failed = 0;
    for (const Case & c : cases) {
        // F16 is exact up to float rounding; the quantized kernels quantize src1 to 8 bits
        const double tol = c.type == GGML_TYPE_F16 ? 1e-4 : 5e-2;
        std::vector<double> errs = run(c, rng);
        for (size_t b = 0; b < errs.size(); ++b) {
            const bool ok = errs[b] <= tol;
            failed += !ok;
            printf("%s %s K=%d N=%d M=%d ne2=%d ne3=%d batch=%zu rel_err=%.2e\n", ok ? "ok" : "FAIL",
                   ggml_type_name(c.type), c.K, c.N, c.M, c.ne2, c.ne3, b, errs[b]);
        }
    }
    printf("%d failed of %zu cases\n", failed, cases.size());
    return failed ? 1 : 0;
}
