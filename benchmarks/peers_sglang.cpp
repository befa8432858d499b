// SGLang's CPU shared-memory all-reduce and fused add + RMSNorm (sgl-kernel) as torch ops,
// registered with the schemas of sgl-kernel's csrc/cpu/torch_extension_cpu.cpp so that a call
// goes through torch's dispatcher as it does in SGLang. Only declarations here: the definitions
// are sgl-kernel's own csrc/cpu/interface.cpp, shm.cpp and norm.cpp, compiled unchanged beside
// this file by benchmarks/peers.py from the source tree it is given.
#include <omp.h>
#include <torch/all.h>
#include <torch/library.h>

void initialize(int64_t size, int64_t rank);
void shm_allreduce(at::Tensor& data, int64_t op);
void fused_add_rmsnorm_cpu(at::Tensor& input, at::Tensor& residual, at::Tensor& weight,
                           double eps);

// The OpenMP threads the peer's parallel loops run on (n > 0 sets them first): the
// benchmark runs one per rank, and records what the peer saw.
static int64_t openmp_threads(int64_t n) {
  if (n > 0) omp_set_num_threads(static_cast<int>(n));
  return omp_get_max_threads();
}

TORCH_LIBRARY(peer_sglang, m) {
  m.def("initialize(int size, int rank) -> ()");
  m.def("shm_allreduce(Tensor(a!) data, int reduce_op) -> ()");
  m.impl("shm_allreduce", torch::kCPU, &shm_allreduce);
  m.def("fused_add_rmsnorm_cpu(Tensor(a!) input, Tensor(a!) residual, Tensor weight, float eps) -> ()");
  m.impl("fused_add_rmsnorm_cpu", torch::kCPU, &fused_add_rmsnorm_cpu);
  m.def("openmp_threads(int n) -> int", &openmp_threads);
}

TORCH_LIBRARY_IMPL(peer_sglang, CatchAll, m) {
  m.impl("initialize", &initialize);
}
