// The tensors of what a Python hook sees (csrc/monitor/py_tensors.cpp): flattened in C++, subclasses mapped to
// their local part, no Python per tensor.
#pragma once

#include <ATen/core/Tensor.h>
#include <Python.h>

#include <cstdint>
#include <utility>
#include <vector>

namespace hookstats {
namespace monitor {

// (flat index, tensor) pairs of a hook argument (Note [grad_output per output slot] counts slots by these indices).
using Tensors = std::vector<std::pair<int32_t, at::Tensor>>;

// The tensors of a hook argument, depth first, as hookstats.hooks._flatten(keep_none=True): tensors, tuples and
// lists (namedtuples, structseqs), dicts (OrderedDict, ModelOutput) by their values, dataclass instances by their
// fields; None keeps its index; anything else is not a tensor position. Each through plain(). Needs the GIL.
Tensors flat(PyObject* obj);

// A tensor that dispatches to Python (a DTensor, a tensor subclass): its local part, from the function set by
// set_local_part_fn (hookstats.distributed.local_part); any other tensor as it is. Takes the GIL for a subclass.
at::Tensor plain(const at::Tensor& t);
void set_local_part_fn(PyObject* fn);

// hookstats._C._fields(values, counts, codes) (METH_FASTCALL): the tuple of row views parts[c >> 16][c & 0xffff],
// parts = (values, counts), for each c of the tuple codes: a stats op's result fields (Note [field views]).
PyObject* field_views(PyObject* self, PyObject* const* args, Py_ssize_t nargs);

}  // namespace monitor
}  // namespace hookstats
