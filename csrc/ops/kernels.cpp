#include "ops/kernels.h"

#include "common/device_name.h"
#include "common/error.h"

namespace lmk_ops {

const Kernels& kernels_for(const Tensor& t) {
#ifdef LMK_OPS_WITH_CUDA
  if (t.is_cuda()) {
    return cuda::kernels();
  }
#endif
  // The ops are registered for CPU (and CUDA when built with it) only, so the dispatcher never brings another
  // device here; the check keeps a future registration honest.
  LMK_CHECK(t.is_cpu(), "lmk_ops: no kernels for device ", device_name(t));
  return cpu::kernels();
}

}  // namespace lmk_ops
