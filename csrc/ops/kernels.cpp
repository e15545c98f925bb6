#include "ops/kernels.h"

#include <torch/csrc/inductor/aoti_torch/utils.h>

#include "common/device_name.h"
#include "common/error.h"

namespace lmk_ops {
namespace {

// The kernels are on the stable ABI and the op layer not yet (issue 14): this adapter, the one place the two meet,
// goes when the op layer moves too. An ATen tensor as a stable-ABI one: the same tensor, one more reference.
stable_abi::Tensor stable(const at::Tensor& t) {
  return stable_abi::Tensor(torch::aot_inductor::new_tensor_handle(at::Tensor(t)));
}
stable_abi::RowSelection stable(const RowSelection& r) {
  return {stable(r.mask), stable(r.positions), stable(r.starts), stable(r.lengths)};
}
stable_abi::AttentionRows stable(const AttentionRows& r) {
  return {stable(r.listed), stable(r.valid), stable(r.text_of_row)};
}

// A device's stable-ABI table as one taking ATen tensors.
template <const stable_abi::Kernels& (*table)()>
const Kernels& adapted() {
  using stable_abi::Tensor;
  static const Kernels adapter{
      [](const at::Tensor& values, int64_t lo, int64_t hi, const std::string& expected, bool landmarks) {
        table().check_range(stable(values), lo, hi, expected, landmarks);
      },
      [](const at::Tensor& hidden, const RowSelection& rows, at::Tensor& out) {
        Tensor o = stable(out);
        table().mean_forward(stable(hidden), stable(rows), o);
      },
      [](const at::Tensor& hidden, const RowSelection& rows, at::Tensor& out, at::Tensor& argmax) {
        Tensor o = stable(out), a = stable(argmax);
        table().max_forward(stable(hidden), stable(rows), o, a);
      },
      [](const at::Tensor& scaled, const RowSelection& rows, at::Tensor& grad_hidden) {
        Tensor g = stable(grad_hidden);
        table().mean_backward(stable(scaled), stable(rows), g);
      },
      [](const at::Tensor& grad, const at::Tensor& argmax, at::Tensor& grad_hidden) {
        Tensor g = stable(grad_hidden);
        table().max_backward(stable(grad), stable(argmax), g);
      },
      [](const at::Tensor& hidden, const at::Tensor& positions, at::Tensor& out) {
        Tensor o = stable(out);
        table().gather_forward(stable(hidden), stable(positions), o);
      },
      [](const at::Tensor& grad, const at::Tensor& positions, at::Tensor& grad_hidden) {
        Tensor g = stable(grad_hidden);
        table().gather_backward(stable(grad), stable(positions), g);
      },
      [](const at::Tensor& hidden, const AttentionRows& rows, const at::Tensor& query, double scale, at::Tensor& out,
         at::Tensor& stats, at::Tensor& weights) {
        Tensor o = stable(out), s = stable(stats), w = stable(weights);
        table().attention_forward(stable(hidden), stable(rows), stable(query), scale, o, s, w);
      },
      [](const at::Tensor& grad, const at::Tensor& grad_weights, const at::Tensor& hidden, const AttentionRows& rows,
         const at::Tensor& query, const at::Tensor& out, const at::Tensor& stats, double scale,
         at::Tensor& grad_hidden, at::Tensor& grad_query) {
        Tensor gh = stable(grad_hidden), gq = stable(grad_query);
        table().attention_backward(stable(grad), stable(grad_weights), stable(hidden), stable(rows), stable(query),
                                   stable(out), stable(stats), scale, gh, gq);
      },
  };
  return adapter;
}

}  // namespace

const Kernels& kernels_for(const at::Tensor& t) {
#ifdef LMK_OPS_WITH_CUDA
  if (t.is_cuda()) {
    return adapted<&cuda::kernels>();
  }
#endif
  // The ops are registered for CPU (and CUDA when built with it) only, so the dispatcher never brings another
  // device here; the check keeps a future registration honest.
  LMK_CHECK(t.is_cpu(), "lmk_ops: no kernels for device ", device_name(t));
  return adapted<&cpu::kernels>();
}

}  // namespace lmk_ops
