// eval_gpu for builds without a GPU backend (the mlx[cpu] wheel).
#include "aot_launch.h"

#include <stdexcept>

namespace mlx_aot {

void AotLaunch::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("[mlx_aot] this build of registry._ext has no GPU backend (built against mlx[cpu]); "
                           "rebuild against mlx[cuda13] with `pip install --no-build-isolation -e .`");
}

std::string cuda_device_arch(int) { return ""; }
std::string memory_kind(const mx::array&) { return ""; }
bool built_with_cuda() { return false; }
bool built_with_metal() { return false; }

}  // namespace mlx_aot
