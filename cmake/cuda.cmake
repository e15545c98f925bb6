# Decides LMK_OPS_WITH_CUDA from LMK_OPS_CUDA (AUTO, ON, OFF) and, when on, sets up the CUDA language so that
# find_package(Torch) (which follows) finds the toolkit it expects. Included by CMakeLists.txt.
set(LMK_OPS_WITH_CUDA OFF)
set(LMK_OPS_CUDA_VERSION "")  # torch.version.cuda of the torch built against, when the CUDA kernels are built
if(NOT LMK_OPS_CUDA MATCHES "^(AUTO|ON|OFF)$")
  message(FATAL_ERROR "lmk_ops: LMK_OPS_CUDA must be AUTO, ON or OFF, got '${LMK_OPS_CUDA}'")
endif()

# Says why CUDA is not built: an error when it was asked for, a status line under AUTO.
macro(lmk_ops_no_cuda why)
  if(LMK_OPS_CUDA STREQUAL "ON")
    message(FATAL_ERROR "lmk_ops: LMK_OPS_CUDA=ON, but ${why}")
  endif()
  message(STATUS "lmk_ops: building the CPU kernels only (${why})")
  return()
endmacro()

if(LMK_OPS_CUDA STREQUAL "OFF")
  message(STATUS "lmk_ops: building the CPU kernels only (LMK_OPS_CUDA=OFF)")
  return()
endif()

execute_process(
  COMMAND "${Python_EXECUTABLE}" -c "import torch; print(torch.version.cuda or '')"
  OUTPUT_VARIABLE _torch_cuda OUTPUT_STRIP_TRAILING_WHITESPACE COMMAND_ERROR_IS_FATAL ANY)
if(_torch_cuda STREQUAL "")
  lmk_ops_no_cuda("torch ${LMK_OPS_TORCH_VERSION} is a CPU-only build")
endif()

include(CheckLanguage)
check_language(CUDA)
if(NOT CMAKE_CUDA_COMPILER)
  lmk_ops_no_cuda("no CUDA compiler (nvcc) was found; put it on PATH or set CUDACXX")
endif()
# CUDA C++20 needs a newer CMake than the C++ part does.
if(CMAKE_VERSION VERSION_LESS 3.26)
  lmk_ops_no_cuda("CMake ${CMAKE_VERSION} cannot compile CUDA as C++20 (torch's headers need it); use CMake >= 3.26")
endif()

# Architectures: torch's CMake turns TORCH_CUDA_ARCH_LIST ("9.0", "8.0;9.0+PTX") into -gencode flags, or without it
# looks for the GPU of this machine; it ignores CMAKE_CUDA_ARCHITECTURES. A machine without a GPU must name them.
if("$ENV{TORCH_CUDA_ARCH_LIST}" STREQUAL "")
  execute_process(COMMAND nvidia-smi -L RESULT_VARIABLE _smi OUTPUT_QUIET ERROR_QUIET)
  if(NOT _smi EQUAL 0)
    lmk_ops_no_cuda("no GPU is visible to pick architectures for; set TORCH_CUDA_ARCH_LIST (e.g. 9.0)")
  endif()
endif()
set(CMAKE_CUDA_ARCHITECTURES OFF)
enable_language(CUDA)
set(CMAKE_CUDA_STANDARD 20)
set(CMAKE_CUDA_STANDARD_REQUIRED ON)

# torch's CMake looks for the toolkit under CUDA_TOOLKIT_ROOT_DIR: the one this nvcc belongs to.
find_package(CUDAToolkit REQUIRED)
get_filename_component(CUDA_TOOLKIT_ROOT_DIR "${CUDAToolkit_BIN_DIR}" DIRECTORY)
# A pip-installed toolkit (nvidia-cuda-nvcc) has no nvrtc, which torch's CMake insists on finding; torch's own
# wheel ships it (nvidia-cuda-nvrtc) beside its other CUDA libraries.
if(NOT TARGET CUDA::nvrtc)
  execute_process(
    COMMAND "${Python_EXECUTABLE}" -c
            "import glob, os, torch; print(';'.join(sorted(glob.glob(os.path.join(os.path.dirname(torch.__file__), '..', 'nvidia', '**', 'libnvrtc.so*'), recursive=True))))"
    OUTPUT_VARIABLE _nvrtc OUTPUT_STRIP_TRAILING_WHITESPACE)
  list(FILTER _nvrtc INCLUDE REGEX "libnvrtc\\.so(\\.[0-9]+)?$")
  if(_nvrtc)
    list(GET _nvrtc 0 _nvrtc)
    add_library(CUDA::nvrtc SHARED IMPORTED)
    set_target_properties(CUDA::nvrtc PROPERTIES IMPORTED_LOCATION "${_nvrtc}")
    set(CUDA_NVRTC_LIB "${_nvrtc}" CACHE FILEPATH "nvrtc library for torch's CMake")
  endif()
endif()
# ATen's CUDA headers include the cuBLAS/cuSPARSE/cuSOLVER headers, which a pip-installed toolkit leaves out;
# torch's wheel brings them (nvidia/cu*/include), searched after the toolkit's own.
set(LMK_OPS_CUDA_LIBRARY_INCLUDES "")
find_path(_cusparse_header cusparse.h HINTS ${CUDAToolkit_INCLUDE_DIRS} NO_DEFAULT_PATH)
if(NOT _cusparse_header)
  execute_process(
    COMMAND "${Python_EXECUTABLE}" -c
            "import glob, os, torch; print(';'.join(sorted(os.path.dirname(h) for h in glob.glob(os.path.join(os.path.dirname(torch.__file__), '..', 'nvidia', '*', 'include', 'cusparse.h')))))"
    OUTPUT_VARIABLE LMK_OPS_CUDA_LIBRARY_INCLUDES OUTPUT_STRIP_TRAILING_WHITESPACE)
  if(NOT LMK_OPS_CUDA_LIBRARY_INCLUDES)
    lmk_ops_no_cuda("cusparse.h (needed by ATen's CUDA headers) is neither in the CUDA toolkit nor in torch's nvidia packages")
  endif()
endif()
set(LMK_OPS_CUDA_VERSION "${_torch_cuda}")
message(STATUS "lmk_ops: building the CUDA kernels (torch CUDA ${_torch_cuda}, nvcc ${CMAKE_CUDA_COMPILER_VERSION}, "
               "TORCH_CUDA_ARCH_LIST '$ENV{TORCH_CUDA_ARCH_LIST}')")
set(LMK_OPS_WITH_CUDA ON)
