// The tensors of what a Python hook sees: py_tensors.h.
#include "py_tensors.h"

#include <pybind11/pybind11.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>

namespace py = pybind11;

namespace hookstats {
namespace monitor {
namespace {

py::object& local_part_fn() {
  static py::object* fn = new py::object();  // leaked: outlives interpreter teardown
  return *fn;
}

bool is_dataclass_instance(PyObject* o) {
  return PyObject_HasAttrString(reinterpret_cast<PyObject*>(Py_TYPE(o)), "__dataclass_fields__");
}

void flatten(PyObject* o, Tensors& out, int32_t& index) {
  if (THPVariable_Check(o)) {
    out.emplace_back(index++, THPVariable_Unpack(o));
  } else if (o == Py_None) {
    ++index;
  } else if (PyTuple_Check(o)) {
    const Py_ssize_t n = PyTuple_GET_SIZE(o);
    for (Py_ssize_t i = 0; i < n; ++i) flatten(PyTuple_GET_ITEM(o, i), out, index);
  } else if (PyList_Check(o)) {
    const Py_ssize_t n = PyList_GET_SIZE(o);
    for (Py_ssize_t i = 0; i < n; ++i) flatten(PyList_GET_ITEM(o, i), out, index);
  } else if (PyDict_CheckExact(o)) {
    PyObject *k, *v;
    Py_ssize_t pos = 0;
    while (PyDict_Next(o, &pos, &k, &v)) flatten(v, out, index);
  } else if (PyDict_Check(o)) {  // a subclass (OrderedDict, ModelOutput): its own order
    py::object vals = py::reinterpret_borrow<py::object>(o).attr("values")();
    for (py::handle v : vals) flatten(v.ptr(), out, index);
  } else if (is_dataclass_instance(o)) {  // checked last: only objects that are none of the above pay for it
    static py::object* fields = new py::object(py::module_::import("dataclasses").attr("fields"));
    py::handle obj(o);
    for (py::handle f : (*fields)(obj)) {
      py::object v = obj.attr(f.attr("name"));
      flatten(v.ptr(), out, index);
    }
  }
}

}  // namespace

at::Tensor plain(const at::Tensor& t) {
  if (!t.unsafeGetTensorImpl()->is_python_dispatch()) return t;
  py::gil_scoped_acquire gil;
  py::object& fn = local_part_fn();
  if (!fn) return t;
  py::object r = fn(py::reinterpret_steal<py::object>(THPVariable_Wrap(t)));
  return THPVariable_Unpack(r.ptr());
}

void set_local_part_fn(PyObject* fn) { local_part_fn() = py::reinterpret_borrow<py::object>(fn); }

Tensors flat(PyObject* obj) {
  Tensors ts;
  int32_t index = 0;
  flatten(obj, ts, index);
  for (auto& p : ts) p.second = plain(p.second);
  return ts;
}

// Note [field views]: hookstats.stats hands each field of its result as a view of a row of the op's (values, counts)
// outputs (Note [record fields]). Tensor.unbind makes them through Python's argument parser, the dispatcher and
// autograd's view bookkeeping, ~0.4 µs a view, 13 a call: 6 µs of a 64-element call's 10, and a tenth of a 2^20
// float32 call. Here each is a TensorImpl over the output's storage with the row's sizes, strides and offset, made
// directly (~0.1 µs with its Python object). They are not autograd views of the output (no ._base, their own version
// counters): nothing else holds the outputs, and the fields never require grad. Plain tensors only: a subclass, or a
// call that dynamo traces, takes unbind (_kernels.result_of).
PyObject* field_views(PyObject* /*self*/, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  if (nargs != 3 || !THPVariable_CheckExact(args[0]) || !THPVariable_CheckExact(args[1]) || !PyTuple_Check(args[2])) {
    PyErr_SetString(PyExc_TypeError, "hookstats._C._fields takes (values: Tensor, counts: Tensor, codes: tuple)");
    return nullptr;
  }
  const at::Tensor* parts[2] = {&THPVariable_Unpack(args[0]), &THPVariable_Unpack(args[1])};
  const Py_ssize_t n = PyTuple_GET_SIZE(args[2]);
  PyObject* out = PyTuple_New(n);
  if (out == nullptr) return nullptr;
  for (Py_ssize_t i = 0; i < n; ++i) {
    const long code = PyLong_AsLong(PyTuple_GET_ITEM(args[2], i));
    const at::Tensor& b = *parts[(code >> 16) & 1];
    const int64_t j = code & 0xffff;
    if (code < 0 || b.dim() < 1 || j >= b.size(0)) {
      Py_DECREF(out);
      if (!PyErr_Occurred()) PyErr_Format(PyExc_IndexError, "hookstats._C._fields: code %ld out of range", code);
      return nullptr;
    }
    auto impl = c10::make_intrusive<c10::TensorImpl>(c10::Storage(b.storage()), b.key_set(), b.dtype());
    impl->set_sizes_and_strides(b.sizes().slice(1), b.strides().slice(1), b.storage_offset() + j * b.stride(0));
    PyTuple_SET_ITEM(out, i, THPVariable_Wrap(at::Tensor(std::move(impl))));
  }
  return out;
  END_HANDLE_TH_ERRORS
}

}  // namespace monitor
}  // namespace hookstats
