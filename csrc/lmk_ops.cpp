// The pybind11 module of the compiled core, which carries build information only. The ops are reached through
// torch.ops.lmk_ops: their schemas are defined in Python (python/lmk_ops/_schemas.py), their kernels registered per
// dispatch key by ops/ (for CPU and CUDA), their fake kernels and autograd in Python (_meta.py, _autograd.py).
#include <pybind11/pybind11.h>
#include <torch/csrc/stable/ops.h>

#include "common/host_path.h"
#include "ops/kernels.h"

namespace py = pybind11;

PYBIND11_MODULE(_C, m) {
  m.doc() = "lmk_ops compiled core: registers the lmk_ops operators with the PyTorch dispatcher.";
  m.def(
      "build_info",
      [] {
        py::dict info;
        info["version"] = LMK_OPS_VERSION;
        info["torch_version"] = LMK_OPS_TORCH_VERSION;
        info["min_torch"] = LMK_OPS_MIN_TORCH;
#ifdef LMK_OPS_WITH_CUDA
        info["cuda"] = true;
#else
        info["cuda"] = false;
#endif
        // A test build (LMK_OPS_CPU_TWIN, common/host_path.h): CPU tensors take the paths CUDA runs.
        info["cpu_twin"] = lmk_ops::kCpuTwin;
        info["num_threads"] = static_cast<int64_t>(torch::stable::get_num_threads());
        info["cpu_capability"] = lmk_ops::cpu::kernels_capability();
        info["cpu_prefetch"] = lmk_ops::cpu::prefetch_levels_name();
        return info;
      },
      "What this build of lmk_ops was compiled against and uses at run time.");
}
