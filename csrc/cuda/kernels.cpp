// The CUDA kernel table (common/kernel_types.h).
#include "cuda/attention_kernels.h"
#include "cuda/pool_kernels.h"
#include "cuda/rows.h"

namespace lmk_ops::cuda {

const Kernels& kernels() {
  static const Kernels k{&check_range,    &mean_forward,    &max_forward,       &grad_over_counts,   &mean_backward,
                         &max_backward,
                         &gather_forward, &gather_backward, &attention_forward, &attention_backward, &find_rows,
                         &shift_rows,  &packed_offsets, /*normalize_rows: the host path's, CPU only*/ nullptr};
  return k;
}

}  // namespace lmk_ops::cuda
