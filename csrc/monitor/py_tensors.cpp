// The tensors of what a Python hook sees: py_tensors.h.
#include "py_tensors.h"

#include <pybind11/pybind11.h>
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

}  // namespace monitor
}  // namespace hookstats
