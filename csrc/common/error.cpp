#include "common/error.h"

#include <dlfcn.h>
#include <torch/csrc/inductor/aoti_torch/c/shim.h>

namespace lmk_ops {
namespace {

// What torch said about the last exception a C-shim call (allocation, a dispatcher call) turned into an error
// code, or "" where this torch cannot say: torch_exception_get_what_without_backtrace came with torch 2.13, and the
// build, which also serves older torch, looks it up at run time.
std::string shim_error_message() {
  using What = const char* (*)();
  // Found in the library that defines the shim functions this extension calls, if that torch has it.
  static const What what = []() -> What {
    Dl_info info{};
    if (dladdr(reinterpret_cast<void*>(&aoti_torch_empty_strided), &info) == 0 || info.dli_fname == nullptr) {
      return nullptr;
    }
    void* torch_library = dlopen(info.dli_fname, RTLD_LAZY | RTLD_NOLOAD);
    return torch_library == nullptr
               ? nullptr
               : reinterpret_cast<What>(dlsym(torch_library, "torch_exception_get_what_without_backtrace"));
  }();
  const char* message = what != nullptr ? what() : nullptr;
  return message != nullptr ? message : "";
}

}  // namespace

void throw_shim_error(const std::string& doing) {
  const std::string message = shim_error_message();
  if (message.empty()) {
    fail("lmk_ops: ", doing, " failed (torch logged why above)");
  }
  fail(message, " (lmk_ops: while ", doing, ")");
}

namespace {

// torch/headeronly/util/shim_utils.h's TORCH_ERROR_CODE_CHECK, which the stable ABI's functions use.
bool is_failed_shim_call(const std::string& what) {
  return what.find(" API call failed at ") != std::string::npos;
}

}  // namespace

void rethrow_naming_op(const char* op, const std::runtime_error& failure) {
  const std::string what = failure.what();
  if (!is_failed_shim_call(what)) {
    throw;
  }
  fail("lmk_ops::", op, ": a call into torch failed: ", failure_reason(failure), " (", what, ")");
}

std::string failure_reason(const std::exception& failure) {
  const std::string what = failure.what();
  if (!is_failed_shim_call(what)) {
    return what;
  }
  const std::string message = shim_error_message();
  return message.empty() ? "torch logged why above" : message;
}

}  // namespace lmk_ops
