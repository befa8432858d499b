// vLLM's CPU shared-memory all-reduce and fused add + RMSNorm as torch ops, registered with
// the schemas of vLLM's csrc/cpu/torch_bindings.cpp so that a call goes through torch's
// dispatcher as it does in vLLM. Only declarations here: the definitions are vLLM's own
// csrc/cpu/shm.cpp and csrc/cpu/layernorm.cpp, compiled unchanged beside this file by
// benchmarks/peers.py from the source tree it is given. PEER_VLLM_SHM: the shm ops too (vLLM
// builds shm.cpp and registers them only with AVX-512; without, the norm alone).
#include <omp.h>
#include <torch/all.h>
#include <torch/library.h>

#include <string>

#ifdef PEER_VLLM_SHM
int64_t init_shm_manager(const std::string& name, const int64_t group_size,
                         const int64_t rank, const int64_t thread_num);
std::string join_shm_manager(int64_t handle, const std::string& name);
void shm_allreduce(int64_t handle, torch::Tensor& data);
#endif
void fused_add_rms_norm(torch::Tensor& input, torch::Tensor& residual,
                        torch::Tensor& weight, double epsilon);

// The OpenMP threads the peer's parallel loops run on (n > 0 sets them first): the
// benchmark runs one per rank, and records what the peer saw.
static int64_t openmp_threads(int64_t n) {
  if (n > 0) omp_set_num_threads(static_cast<int>(n));
  return omp_get_max_threads();
}

TORCH_LIBRARY(peer_vllm, ops) {
#ifdef PEER_VLLM_SHM
  ops.def("init_shm_manager(str name, int group_size, int rank, int thread_num) -> int",
          &init_shm_manager);
  ops.def("join_shm_manager(int handle, str name) -> str", &join_shm_manager);
  ops.def("shm_allreduce(int handle, Tensor! data) -> ()");
  ops.impl("shm_allreduce", torch::kCPU, &shm_allreduce);
#endif
  ops.def("fused_add_rms_norm(Tensor! input, Tensor! residual, Tensor weight, float epsilon) -> ()");
  ops.impl("fused_add_rms_norm", torch::kCPU, &fused_add_rms_norm);
  ops.def("openmp_threads(int n) -> int", &openmp_threads);
}
