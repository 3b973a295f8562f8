// Every hookstats op schema, in one place. Implementations register per dispatch key:
// cpu/*.cpp for CPU, cuda/*.cu for CUDA (compiled only where a CUDA toolkit is found).
// Fake (meta) kernels for torch.compile live in hookstats/_ops.py.
#include <Python.h>
#include <torch/library.h>

#include <string>

namespace hookstats {
std::string cpu_isa(const std::string& mode);  // cpu/stats_cpu.cpp
}

extern "C" {
// `import hookstats._C` loads this library, whose static initializers register the ops.
PyObject* PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module_def);
}
}

TORCH_LIBRARY(hookstats, m) {
  // Statistics of x in one read: (values, counts). values holds sum, mean, var, std, l1,
  // l2, linf, min, max in fp32 (fp64 for fp64 x); counts holds numel, nan, inf, zero
  // counts as int64. See csrc/core/stats_ops.h, Note [stats row layout].
  m.def("stats(Tensor x) -> (Tensor, Tensor)");
  // The same statistics written into row `slot` of out ([slots, 13], fp32 or fp64).
  m.def("stats_into(Tensor x, Tensor(a!) out, int slot) -> ()");
  // Which CPU code path runs: "avx2" or "default" (Note [cpu dispatch]); "" only reads it.
  m.def("_cpu_isa(str mode) -> str", &hookstats::cpu_isa);
}
