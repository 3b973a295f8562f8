// The hookstats._C Python module: the Monitor's C++ hook path (pybind11). Loading it also
// registers every op (csrc/hookstats.cpp and the kernels' TORCH_LIBRARY_IMPL blocks).
//
// The hook callables below are what hookstats/monitor/hooks.py registers on modules (behind a
// thin Python function that dynamo can trace, Note [monitor under torch.compile]): they flatten
// what the hook sees in C++ (py_tensors.h), skip non-floating tensors, and launch the stats kernel
// into the site's row (Note [monitor sites] in recorder.h) with no Python per tensor, one lock of
// the recorder a hook run. grad_output is recorded when autograd computes it, per output slot
// (Note [grad_output per output slot] in slots.cpp), by a tensor hook or an alias's node, which the
// autograd engine runs without Python or the GIL.
#include <torch/extension.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>
#include <pybind11/numpy.h>

#include <torch/csrc/autograd/graph_task.h>

#include <cstring>
#include <type_traits>
#include <typeinfo>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "py_tensors.h"
#include "recorder.h"
#include "slots.h"
#include "traced.h"

namespace py = pybind11;

namespace hookstats {
namespace monitor {
namespace {

// Records ts as one call of hook. The GIL is released around kernels that take long enough for another thread to
// use it (a CUDA launch, a large CPU tensor); a small CPU tensor's kernel takes less than releasing it.
void record_call(Recorder& r, int32_t hook, const Tensors& ts) {
  int64_t numel = 0;
  bool release = false;
  for (const auto& p : ts) {
    if (!p.second.defined()) continue;
    numel += p.second.numel();
    release = release || !p.second.is_cpu();
  }
  if (release || numel >= (int64_t{1} << 16)) {
    py::gil_scoped_release nogil;  // tensor hooks of other threads may record meanwhile
    r.record_call(hook, ts);
  } else {
    r.record_call(hook, ts);
  }
}

void record_obj(Recorder& r, int32_t hook, py::handle obj) {
  if (!r.active()) return;
  Tensors ts = flat(obj.ptr());
  if (ts.empty()) return;
  record_call(r, hook, ts);
}

// Whether compiled autograd is on (torch._dynamo.compiled_autograd.compiled_autograd_enabled; off while that
// module was never imported): its backward cannot run C++ hooks or nodes.
bool compiled_autograd_on() {
  static PyObject* key = PyUnicode_InternFromString("torch._dynamo.compiled_autograd");
  static PyObject* attr = PyUnicode_InternFromString("compiled_autograd_enabled");
  static PyObject* mod = nullptr;  // a new reference, kept
  if (mod == nullptr) {
    PyObject* m = PyDict_GetItemWithError(PyImport_GetModuleDict(), key);
    if (m == nullptr) {
      PyErr_Clear();
      return false;
    }
    Py_INCREF(m);
    mod = m;
  }
  PyObject* v = PyObject_GetAttr(mod, attr);
  if (v == nullptr) {
    PyErr_Clear();
    return false;
  }
  const bool on = PyObject_IsTrue(v) == 1;
  Py_DECREF(v);
  return on;
}

// Whether a forward hook runs inside the autograd engine: activation checkpointing recomputing a forward during the
// backward (torch.utils.checkpoint with either use_reentrant, HF's gradient checkpointing). That call's inputs and
// output were recorded by the first forward; recording them again would count every checkpointed call twice.
// (hookstats._owned_hooks.in_backward() is the Python side's same question.)
bool recomputing() { return torch::autograd::get_current_graph_task_id() != -1; }

// forward pre-hook of a module whose grad_output is recorded and whose start is needed: the call's start.
struct ForwardStart {
  std::shared_ptr<const void> key;  // the ForwardHook's identity
  void operator()(py::handle module, py::handle args) const { forward_start(key.get()); }
};

// What a module without a ForwardStart returns (hookstats/monitor/hooks.py decides): tensors its call computes
// (kComputed), or those and its positional input (kComputedOrInput: nn.Identity, Dropout that is not in place).
constexpr int32_t kComputed = 1, kComputedOrInput = 2;

// The start of a call whose module returns what `outputs` says: kFreshOutputs, or 0 (unknown: every output gets an
// alias) where an output is an input, or where the input came by keyword (the hook does not see it).
uint64_t start_of(int32_t outputs, py::handle args, const Tensors& ts) {
  if (outputs == kComputed) return kFreshOutputs;
  if (outputs != kComputedOrInput) return 0;
  const Tensors in = flat(args.ptr());
  if (in.empty()) return 0;
  for (const auto& [i, t] : ts) {
    for (const auto& [j, a] : in) {
      if (t.defined() && t.is_same(a)) return 0;
    }
  }
  return kFreshOutputs;
}

// forward hook (module, args, output): records output (fwd >= 0) and hooks grad_output (grad >= 0, Note
// [grad_output per output slot]). Returns None; the alias itself where the output is one tensor (the hook's new
// output, no Python rebuild); the (index, alias) pairs to put in place of outputs (None where no alias could be
// made); or Ellipsis: compiled autograd is on, and the Python hook puts traceable hooks instead.
struct ForwardHook {
  std::shared_ptr<Recorder> rec;
  int32_t fwd, grad;
  std::shared_ptr<const void> key;  // shared with its ForwardStart (null: none)
  int32_t outputs;                  // what the module returns, for a ForwardHook without a ForwardStart
  py::object operator()(py::handle module, py::handle args, py::handle output) const {
    uint64_t start = key ? take_start(key.get()) : 0;
    if (!rec->active()) return py::none();
    Tensors ts = flat(output.ptr());
    if (ts.empty()) return py::none();
    if (!key && grad >= 0) start = start_of(outputs, args, ts);
    py::object out = py::none();
    if (grad >= 0 && compiled_autograd_on()) {
      out = py::ellipsis();
    } else if (grad >= 0) {
      auto aliases = hook_outputs(rec, grad, ts, start);
      if (aliases.size() == 1 && aliases[0].second.defined() && THPVariable_Check(output.ptr())) {
        out = py::reinterpret_steal<py::object>(THPVariable_Wrap(std::move(aliases[0].second)));
      } else if (!aliases.empty()) {
        py::list l;
        for (auto& [index, a] : aliases) {
          py::object o = a.defined() ? py::reinterpret_steal<py::object>(THPVariable_Wrap(std::move(a))) : py::none();
          l.append(py::make_tuple(index, o));
        }
        out = std::move(l);
      }
    }
    // A recomputation (activation checkpointing) places the grad_output edges as the first forward did, since a
    // reentrant checkpoint's backward runs through them, but records no second output.
    if (fwd >= 0 && !recomputing()) record_call(*rec, fwd, ts);
    return out;
  }
};

// forward pre-hook (module, args), full backward hook (module, grad_input, grad_output): record
// the positional inputs / grad_input.
struct ArgsHook {
  std::shared_ptr<Recorder> rec;
  int32_t hook;
  void pre(py::handle module, py::handle args) const {
    if (!recomputing()) record_obj(*rec, hook, args);
  }
  void backward(py::handle module, py::handle grad_input, py::handle grad_output) const {
    record_obj(*rec, hook, grad_input);
  }
};

// post-accumulate-grad hook (param): records param.grad, read here rather than through Python's attribute lookups
// (a model has a hook per parameter: ~1,000 runs of it a step on the benchmark MLP).
struct GradHook {
  std::shared_ptr<Recorder> rec;
  int32_t hook;
  void operator()(py::handle param) const {
    if (!rec->active() || !THPVariable_Check(param.ptr())) return;
    const at::Tensor& g = THPVariable_Unpack(param.ptr()).grad();
    if (!g.defined()) return;
    record_call(*rec, hook, Tensors{{0, plain(g)}});
  }
};

// The hook callables as plain C functions (METH_FASTCALL, the hook in a capsule): a call costs
// what a builtin's call costs, a fraction of a pybind11 method's argument dispatch.
template <typename H>
void drop_capsule(PyObject* cap) {
  delete static_cast<H*>(PyCapsule_GetPointer(cap, typeid(H).name()));
}

template <typename H, int N>
PyObject* call_hook(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  if (nargs != N) {
    PyErr_Format(PyExc_TypeError, "hookstats Monitor hook takes %d arguments, got %zd", N, nargs);
    return nullptr;
  }
  const H& h = *static_cast<H*>(PyCapsule_GetPointer(self, typeid(H).name()));
  if constexpr (N == 3) {
    if constexpr (std::is_same_v<decltype(h(args[0], args[1], args[2])), py::object>) {
      return h(args[0], args[1], args[2]).release().ptr();
    } else {
      h(args[0], args[1], args[2]);
    }
  } else if constexpr (N == 2) {
    h(args[0], args[1]);
  } else {
    h(args[0]);
  }
  Py_RETURN_NONE;
  END_HANDLE_TH_ERRORS
}

struct PreHook {
  ArgsHook h;
  void operator()(py::handle m, py::handle args) const { h.pre(m, args); }
};
struct GradInputHook {
  ArgsHook h;
  void operator()(py::handle m, py::handle gi, py::handle go) const { h.backward(m, gi, go); }
};

template <typename H, int N>
py::object make_hook(H h, const char* name) {
  static PyMethodDef def = {name, reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(&call_hook<H, N>)),
                            METH_FASTCALL, "a hookstats Monitor hook (csrc/monitor/monitor_py.cpp)"};
  py::object cap = py::reinterpret_steal<py::object>(PyCapsule_New(new H(std::move(h)), typeid(H).name(),
                                                                   &drop_capsule<H>));
  return py::reinterpret_steal<py::object>(PyCFunction_New(&def, cap.ptr()));
}

py::list site_rows(const std::vector<Site>& sites) {
  py::list out;
  for (const Site& s : sites) {
    out.append(py::make_tuple(s.hook, s.index, s.call, std::string(c10::toString(s.dtype)), s.dev, s.row, s.hgroup,
                              s.hrow));
  }
  return out;
}

}  // namespace
}  // namespace monitor
}  // namespace hookstats

PYBIND11_MODULE(_C, m) {
  using namespace hookstats::monitor;
  m.doc() = "hookstats kernels (torch.ops.hookstats) and the Monitor's C++ hook path";
  py::class_<Recorder, std::shared_ptr<Recorder>>(m, "Recorder")
      .def(py::init([](int64_t slots, int64_t mode, int64_t bins, double lo, double hi, int64_t rows,
                       bool locations) {
             return std::make_shared<Recorder>(slots, HistConfig{mode, bins, lo, hi}, rows, locations);
           }),
           py::arg("slots"), py::arg("hist_mode") = 0, py::arg("bins") = 0, py::arg("lo") = 0.0,
           py::arg("hi") = 0.0, py::arg("rows") = 64, py::arg("locations") = false)
      .def_property_readonly("locations", &Recorder::locations)
      .def("add_hook", &Recorder::add_hook)
      .def("begin_step", &Recorder::begin_step, py::arg("step"), py::arg("active"), py::arg("hist_on"))
      .def_property_readonly("active", &Recorder::active)
      .def("close", &Recorder::close)
      .def("record", [](Recorder& r, int32_t hook, py::handle obj) { record_obj(r, hook, obj); },
           "records the tensors of obj (a tensor or a structure of them) as one call of hook")
      .def("record_params",
           [](Recorder& r, const std::vector<std::pair<int32_t, at::Tensor>>& grads) {
             // One record per (hook, grad), each its hook's next call: the "grad" kind's once-per-step path.
             if (!r.active()) return;
             std::vector<std::tuple<int32_t, int32_t, at::Tensor>> calls;
             calls.reserve(grads.size());
             for (const auto& [hook, g] : grads) calls.emplace_back(hook, r.next_call(hook), plain(g));
             py::gil_scoped_release nogil;
             r.record_calls(calls);
           })
      .def("take",
           [](Recorder& r) {
             Recorder::Taken t = r.take();
             py::list stats, hists;
             for (auto& [dev, block] : t.stats) stats.append(block);
             for (auto& [dev, len, block] : t.hists) hists.append(py::make_tuple(dev, len, block));
             auto arr = [](const std::vector<int32_t>& v) {
               py::array_t<int32_t> a(static_cast<py::ssize_t>(v.size()));
               if (!v.empty()) std::memcpy(a.mutable_data(), v.data(), v.size() * sizeof(int32_t));
               return a;
             };
             if (!r.locations()) {
               return py::object(py::make_tuple(stats, hists, t.steps, std::vector<bool>(t.hist_on.begin(), t.hist_on.end()),
                                     arr(t.order_slots), arr(t.order_sites)));
             }
             // With locations: also the location blocks and the records' shapes (Note [monitor sites]).
             py::list locs;
             for (auto& l : t.locs) locs.append(l);
             py::array_t<int64_t> dims(static_cast<py::ssize_t>(t.shape_dims.size()));
             if (!t.shape_dims.empty()) {
               std::memcpy(dims.mutable_data(), t.shape_dims.data(), t.shape_dims.size() * sizeof(int64_t));
             }
             return py::object(py::make_tuple(stats, hists, t.steps,
                                              std::vector<bool>(t.hist_on.begin(), t.hist_on.end()),
                                              arr(t.order_slots), arr(t.order_sites), locs, arr(t.shape_ndim), dims));
           })
      .def("reset", &Recorder::reset)
      .def_property_readonly("skipped", &Recorder::skipped)
      .def_property_readonly("dropped_replays", &Recorder::dropped_replays)
      .def_property_readonly("num_rings", &Recorder::num_rings)
      .def("_set_test_capture", &Recorder::set_test_capture, py::arg("id"), py::arg("replay") = false,
           "tests: CPU records while id != 0 behave as records in CUDA graph capture `id` (with replay, as a "
           "replay of it); Note [monitor graph replays]")
      .def_property_readonly("num_sites", &Recorder::num_sites)
      .def_property_readonly("pending_slots", &Recorder::pending_slots)
      .def("sites_from", [](Recorder& r, int64_t from) { return site_rows(r.sites_from(from)); },
           "(hook, index, call, dtype, dev, row, hist_group, hist_row) of the sites from `from` on")
      .def("devices", [](Recorder& r) {
        py::list out;
        for (const auto& d : r.devices()) out.append(d.str());
        return out;
      });

  static PyMethodDef fields_def = {"_fields", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(&field_views)),
                                   METH_FASTCALL, "a stats op's result fields as row views (Note [field views])"};
  m.add_object("_fields", py::reinterpret_steal<py::object>(PyCFunction_New(&fields_def, nullptr)));
  m.def("forward_hook", [](std::shared_ptr<Recorder> r, int32_t fwd, int32_t grad, int32_t outputs) -> py::object {
    if (grad < 0 || outputs == kComputed || outputs == kComputedOrInput) {
      return py::make_tuple(make_hook<ForwardHook, 3>(ForwardHook{r, fwd, grad, nullptr, outputs}, "forward_hook"),
                            py::none());
    }
    std::shared_ptr<const void> key = std::make_shared<char>();
    return py::make_tuple(make_hook<ForwardHook, 3>(ForwardHook{r, fwd, grad, key, 0}, "forward_hook"),
                          make_hook<ForwardStart, 2>(ForwardStart{key}, "forward_start"));
  }, py::arg("rec"), py::arg("fwd"), py::arg("grad"), py::arg("outputs") = 0,
     "(forward hook, forward pre-hook or None): the forward hook (module, args, output) records output (hook id "
     "fwd >= 0) and hooks grad_output (grad >= 0, Note [grad_output per output slot] in csrc/monitor/slots.cpp), "
     "returning None, the alias to return in place of an output that is one tensor, the (index, alias) pairs to put "
     "in place of outputs, or Ellipsis (compiled autograd is on: "
     "put traceable hooks instead); the pre-hook (module, args) takes the call's start, which a module whose outputs "
     "are known needs not: outputs 1, every tensor it returns is computed by its call; 2, those or its positional "
     "input");
  m.def("forward_pre_hook", [](std::shared_ptr<Recorder> r, int32_t hook) {
    return make_hook<PreHook, 2>(PreHook{ArgsHook{std::move(r), hook}}, "forward_pre_hook");
  }, "a forward pre-hook (module, args): records the positional inputs");
  m.def("backward_hook", [](std::shared_ptr<Recorder> r, int32_t hook) {
    return make_hook<GradInputHook, 3>(GradInputHook{ArgsHook{std::move(r), hook}}, "backward_hook");
  }, "a full backward hook (module, grad_input, grad_output): records grad_input");
  m.def("grad_hook", [](std::shared_ptr<Recorder> r, int32_t hook) {
    return make_hook<GradHook, 1>(GradHook{std::move(r), hook}, "grad_hook");
  }, "a post-accumulate-grad hook (param): records param.grad");
  m.def("register_recorder", &register_recorder,
        "makes a recorder reachable by id from hookstats::_monitor_record (held weakly)");
  m.def("set_local_part", [](py::object fn) { set_local_part_fn(fn.ptr()); },
        "the function that maps a tensor subclass (DTensor) to the plain tensor to record");
  py::tuple stat_names(static_cast<size_t>(hookstats::kNumStatFields));  // Note [stats row layout]; checked by tests/test_fields.py
  for (int i = 0; i < hookstats::kNumStatFields; ++i) stat_names[i] = py::str(hookstats::kStatFieldNames[i]);
  m.attr("STAT_FIELD_NAMES") = stat_names;
}
