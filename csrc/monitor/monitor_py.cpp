// The hookstats._C Python module: the Monitor's C++ hook path (pybind11). Loading it also
// registers every op (csrc/hookstats.cpp and the kernels' TORCH_LIBRARY_IMPL blocks).
//
// The hook callables below are what hookstats/monitor/hooks.py registers on modules (behind a
// thin Python function that dynamo can trace, Note [monitor under torch.compile]): they flatten
// what the hook sees in C++, skip non-floating tensors, and launch the stats kernel into the
// site's row (Note [monitor sites] in recorder.h) with no Python per tensor. grad_output is
// recorded when autograd computes it, per output slot (Note [grad_output per output slot]), by a
// C++ tensor hook or an alias's node, which the autograd engine runs without Python or the GIL.
#include <torch/extension.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>
#include <pybind11/numpy.h>

#include <ATen/SequenceNumber.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/graph_task.h>

#include <cstring>
#include <type_traits>
#include <typeinfo>
#include <iterator>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "recorder.h"

namespace py = pybind11;

namespace hookstats {
namespace monitor {
namespace {

using Tensors = std::vector<std::pair<int32_t, at::Tensor>>;

// A tensor that dispatches to Python (a DTensor, a tensor subclass): its local part, from the
// Python function set by set_local_part (hookstats.distributed.local_part). Needs the GIL.
py::object& local_part_fn() {
  static py::object* fn = new py::object();  // leaked: outlives interpreter teardown
  return *fn;
}

at::Tensor plain(const at::Tensor& t) {
  if (!t.unsafeGetTensorImpl()->is_python_dispatch()) return t;
  py::gil_scoped_acquire gil;
  py::object& fn = local_part_fn();
  if (!fn) return t;
  py::object r = fn(py::reinterpret_steal<py::object>(THPVariable_Wrap(t)));
  return THPVariable_Unpack(r.ptr());
}

bool is_dataclass_instance(PyObject* o) {
  return PyObject_HasAttrString(reinterpret_cast<PyObject*>(Py_TYPE(o)), "__dataclass_fields__");
}

// The tensors of a hook argument, depth first, as hookstats.hooks._flatten(keep_none=True):
// tensors, tuples and lists (namedtuples, structseqs), dicts (OrderedDict, ModelOutput) by their
// values, dataclass instances by their fields; None keeps its index; anything else is not a tensor position.
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

Tensors flat(py::handle obj) {
  Tensors ts;
  int32_t index = 0;
  flatten(obj.ptr(), ts, index);
  for (auto& p : ts) p.second = plain(p.second);
  return ts;
}

void record_obj(Recorder& r, int32_t hook, py::handle obj) {
  if (!r.active()) return;
  Tensors ts = flat(obj);
  if (ts.empty()) return;
  const int32_t call = r.next_call(hook);
  py::gil_scoped_release nogil;  // the kernels need no Python; tensor hooks of other threads may record meanwhile
  r.record_many(hook, call, ts);
}

// Note [grad_output per output slot]
// PyTorch's full backward pre-hook sees, for each output slot of a call, the gradient that flows
// through that slot (BackwardHook wraps the returned tensors in a node of their own). A tensor
// hook sees the tensor's total gradient, which is the same only when every consumer of the tensor
// reached it through this slot. hook_outputs proves that from the autograd sequence numbers
// (thread-local, one per node created) and gives every other output an edge of its own:
// - exact with a tensor hook: the output's grad_fn was created during this call (its sequence
//   number is >= the one taken by forward_start before the forward ran) and is the newest node of
//   the thread (nothing differentiable was computed after it, so nothing in the module consumed
//   it), and the tensor fills one slot only (several outputs of one node, such as chunk's, can
//   all be newest);
// - otherwise (a leaf; an input or any tensor from before the call; a tensor the module computed
//   on after producing it, or returned twice) the output is replaced by an alias: a detach() of
//   it (same storage and version counter, so in-place ops and saved-tensor checks work as before)
//   whose grad_fn is a SlotGrad node that records its gradient and passes it on unchanged to the
//   tensor's own edge. The alias dies with the graph: no hook is left on a leaf. When one output
//   of a call needs an alias, every output of the call gets one.
// The alias adds a gradient buffer on the path: a tensor whose gradient has three or more
// contributions, some through the alias, may have them summed in another grouping (Note
// [grad_output by tensor hooks] in hookstats/monitor/hooks.py).
struct SlotGrad : torch::autograd::Node {
  std::weak_ptr<Recorder> rec;
  int32_t hook, index;
  SlotGrad(std::weak_ptr<Recorder> r, int32_t h, int32_t i) : rec(std::move(r)), hook(h), index(i) {}
  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
    const at::Tensor& g = grads[0];
    if (g.defined()) {
      auto r = rec.lock();
      if (r && r->active()) r->record(hook, index, r->next_tensor_call(hook, index), plain(g));
    }
    return std::move(grads);
  }
  std::string name() const override { return "hookstats::SlotGrad"; }
};

// A new autograd node of type N, held the way this torch's edges hold nodes: std::shared_ptr in
// torch 2.11 (Node derives from std::enable_shared_from_this), c10::intrusive_ptr in 2.13 and 2.14
// (Node is an intrusive_ptr_target). Decided by Edge::function's type rather than by version
// numbers, so that it follows whichever torch headers the build sees (`make check-torch-range`
// compiles against the oldest supported and the venv's).
template <class N, class... Args>
auto make_node(Args&&... args) {
  using Held = decltype(torch::autograd::Edge::function);
  constexpr bool shared = std::is_same_v<Held, std::shared_ptr<torch::autograd::Node>>;
  static_assert(shared || std::is_same_v<Held, c10::intrusive_ptr<torch::autograd::Node>>,
                "hookstats: unknown autograd Edge::function type: extend make_node in monitor_py.cpp");
  if constexpr (shared) {
    return std::make_shared<N>(std::forward<Args>(args)...);
  } else {
    return c10::make_intrusive<N>(std::forward<Args>(args)...);
  }
}

// The autograd sequence number each monitored call started at (forward_start), per thread, with
// the state of the forward hook that takes it back; entries left by a forward that raised are
// dropped when an outer call ends.
using Start = std::pair<const void*, uint64_t>;
std::vector<Start>& starts() {
  static thread_local std::vector<Start> s;
  return s;
}

// The start of the call `key` is ending, or 0 (unknown: every output gets an alias).
uint64_t take_start(const void* key) {
  auto& s = starts();
  for (size_t i = s.size(); i-- > 0;) {
    if (s[i].first == key) {
      const uint64_t v = s[i].second;
      s.resize(i);
      return v;
    }
  }
  return 0;
}

// grad_output of each output that requires grad (Note [grad_output per output slot]): a tensor
// hook where that is exact, else an alias. Returns the aliases as a list of (flat index, alias),
// or None.
py::object hook_outputs(const std::shared_ptr<Recorder>& r, int32_t hook, const Tensors& ts, uint64_t start) {
  // All tensor hooks, or (when one output needs an alias) all aliases, made in output order: the records of a
  // call then come in the same order (the engine runs later nodes first) for every Monitor on the model.
  const uint64_t newest = at::sequence_number::peek();  // before any alias is made
  bool exact = true;
  for (size_t k = 0; exact && k < ts.size(); ++k) {
    const at::Tensor& t = ts[k].second;
    if (!t.defined() || !t.requires_grad()) continue;
    const auto& fn = t.grad_fn();
    exact = fn && start > 0 && fn->sequence_nr() >= start && fn->sequence_nr() + 1 == newest;
    for (size_t j = 0; exact && j < ts.size(); ++j) {
      exact = j == k || !ts[j].second.defined() || !ts[j].second.is_same(t);
    }
  }
  py::object out = py::none();
  for (size_t k = 0; k < ts.size(); ++k) {
    const at::Tensor& t = ts[k].second;
    if (!t.defined() || !t.requires_grad()) continue;
    const int32_t index = ts[k].first;
    std::weak_ptr<Recorder> weak = r;
    if (exact) {
      const_cast<at::Tensor&>(t).register_hook([weak, hook, index](const at::Tensor& g) {
        if (!g.defined()) return;  // an output of a multi-output op that the loss does not use
        auto rec = weak.lock();
        if (!rec || !rec->active()) return;
        rec->record(hook, index, rec->next_tensor_call(hook, index), plain(g));
      });
      continue;
    }
    py::object alias = py::none();  // None: no alias could be made (a subclass refusing detach): counted
    try {
      auto node = make_node<SlotGrad>(weak, hook, index);
      node->set_next_edges(torch::autograd::collect_next_edges(t));
      at::Tensor a = t.detach();
      torch::autograd::create_gradient_edge(a, std::move(node));
      alias = py::reinterpret_steal<py::object>(THPVariable_Wrap(a));
    } catch (const std::exception&) {
      PyErr_Clear();
    }
    if (out.is_none()) out = py::list();
    out.cast<py::list>().append(py::make_tuple(index, alias));
  }
  return out;
}

// Whether a forward hook runs inside the autograd engine: activation checkpointing recomputing a forward during the
// backward (torch.utils.checkpoint with either use_reentrant, HF's gradient checkpointing). That call's inputs and
// output were recorded by the first forward; recording them again would count every checkpointed call twice.
// (hookstats._owned_hooks.in_backward() is the Python side's same question.)
bool recomputing() { return torch::autograd::get_current_graph_task_id() != -1; }

// forward pre-hook of a module whose grad_output is recorded: the call's start (take_start).
struct ForwardStart {
  std::shared_ptr<const void> key;  // the ForwardHook's identity
  void operator()(py::handle module, py::handle args) const {
    auto& s = starts();
    if (s.size() > 4096) s.clear();  // only forwards that raised leave entries behind
    s.emplace_back(key.get(), at::sequence_number::peek());
  }
};

// forward hook (module, args, output): records output (fwd >= 0) and hooks grad_output (grad >= 0);
// returns hook_outputs' aliases (the Python hook puts them in place of the outputs) or None.
struct ForwardHook {
  std::shared_ptr<Recorder> rec;
  int32_t fwd, grad;
  std::shared_ptr<const void> key;  // shared with its ForwardStart (null: none)
  py::object operator()(py::handle module, py::handle args, py::handle output) const {
    const uint64_t start = key ? take_start(key.get()) : 0;
    if (!rec->active()) return py::none();
    Tensors ts = flat(output);
    if (ts.empty()) return py::none();
    py::object aliases = grad >= 0 ? hook_outputs(rec, grad, ts, start) : py::none();
    // A recomputation (activation checkpointing) places the grad_output edges as the first forward did, since a
    // reentrant checkpoint's backward runs through them, but records no second output.
    if (fwd >= 0 && !recomputing()) {
      const int32_t call = rec->next_call(fwd);
      py::gil_scoped_release nogil;
      rec->record_many(fwd, call, ts);
    }
    return aliases;
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

// Recorders that compiled graphs reach by id (the `monitor` argument of hookstats::_monitor_record).
std::mutex& registry_mutex() {
  static std::mutex* m = new std::mutex();
  return *m;
}
std::unordered_map<int64_t, std::weak_ptr<Recorder>>& registry() {
  static auto* r = new std::unordered_map<int64_t, std::weak_ptr<Recorder>>();
  return *r;
}

void register_recorder(int64_t id, const std::shared_ptr<Recorder>& r) {
  std::lock_guard<std::mutex> g(registry_mutex());
  auto& reg = registry();
  for (auto it = reg.begin(); it != reg.end();) {  // forget dropped recorders
    it = it->second.expired() ? reg.erase(it) : std::next(it);
  }
  reg[id] = r;
}

// hookstats::_monitor_record: what a compiled graph runs where a traced Monitor hook was (no Python).
void monitor_record(const c10::List<std::optional<at::Tensor>>& xs, int64_t monitor, int64_t hook, int64_t index) {
  std::shared_ptr<Recorder> rec;
  {
    std::lock_guard<std::mutex> g(registry_mutex());
    auto it = registry().find(monitor);
    if (it != registry().end()) rec = it->second.lock();
  }
  if (!rec || !rec->active()) return;
  const int32_t h = static_cast<int32_t>(hook);
  if (index >= 0) {
    const std::optional<at::Tensor> g = xs.size() ? xs.get(0) : std::nullopt;
    if (!g.has_value() || !g->defined()) return;
    rec->record(h, static_cast<int32_t>(index), rec->next_tensor_call(h, static_cast<int32_t>(index)), *g);
    return;
  }
  Tensors ts;
  for (size_t i = 0; i < xs.size(); ++i) {
    const std::optional<at::Tensor> t = xs.get(i);
    if (t.has_value() && t->defined()) ts.emplace_back(static_cast<int32_t>(i), *t);
  }
  if (ts.empty()) return;
  rec->record_many(h, rec->next_call(h), ts);
}

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
  } else {
    h(args[0], args[1]);
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
      .def("record_tensors",
           [](Recorder& r, int32_t hook, const std::vector<std::optional<at::Tensor>>& xs) {
             if (!r.active()) return;
             Tensors ts;
             for (size_t i = 0; i < xs.size(); ++i) {
               if (xs[i].has_value()) ts.emplace_back(static_cast<int32_t>(i), plain(*xs[i]));
             }
             if (ts.empty()) return;
             const int32_t call = r.next_call(hook);
             py::gil_scoped_release nogil;
             r.record_many(hook, call, ts);
           })
      .def("record_grad",
           [](Recorder& r, int32_t hook, int32_t index, const at::Tensor& g) {
             if (!r.active()) return;
             at::Tensor x = plain(g);
             const int32_t call = r.next_tensor_call(hook, index);
             py::gil_scoped_release nogil;
             r.record(hook, index, call, x);
           })
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

  m.def("forward_hook", [](std::shared_ptr<Recorder> r, int32_t fwd, int32_t grad) -> py::object {
    if (grad < 0) return py::make_tuple(make_hook<ForwardHook, 3>(ForwardHook{r, fwd, -1, nullptr}, "forward_hook"),
                                        py::none(), py::none());
    std::shared_ptr<const void> key = std::make_shared<char>();
    return py::make_tuple(make_hook<ForwardHook, 3>(ForwardHook{r, fwd, grad, key}, "forward_hook"),
                          make_hook<ForwardStart, 2>(ForwardStart{key}, "forward_start"),
                          make_hook<ForwardHook, 3>(ForwardHook{r, fwd, -1, key}, "forward_hook"));
  }, "(forward hook, forward pre-hook, forward hook without grad_output): the forward hook (module, args, output) "
     "records output (hook id fwd >= 0) and hooks grad_output (grad >= 0, Note [grad_output per output slot]), "
     "returning None or the (index, alias) pairs to put in place of outputs; the pre-hook (module, args) takes the "
     "call's start, which the third (output only) also takes back; with grad < 0: (forward hook, None, None)");
  m.def("forward_pre_hook", [](std::shared_ptr<Recorder> r, int32_t hook) {
    return make_hook<PreHook, 2>(PreHook{ArgsHook{std::move(r), hook}}, "forward_pre_hook");
  }, "a forward pre-hook (module, args): records the positional inputs");
  m.def("backward_hook", [](std::shared_ptr<Recorder> r, int32_t hook) {
    return make_hook<GradInputHook, 3>(GradInputHook{ArgsHook{std::move(r), hook}}, "backward_hook");
  }, "a full backward hook (module, grad_input, grad_output): records grad_input");
  m.def("register_recorder", &register_recorder,
        "makes a recorder reachable by id from hookstats::_monitor_record (held weakly)");
  m.def("set_local_part", [](py::object fn) { local_part_fn() = std::move(fn); },
        "the function that maps a tensor subclass (DTensor) to the plain tensor to record");
  py::tuple stat_names(static_cast<size_t>(hookstats::kNumStatFields));  // Note [stats row layout]; checked by tests/test_fields.py
  for (int i = 0; i < hookstats::kNumStatFields; ++i) stat_names[i] = py::str(hookstats::kStatFieldNames[i]);
  m.attr("STAT_FIELD_NAMES") = stat_names;
}

TORCH_LIBRARY_IMPL(hookstats, CompositeExplicitAutograd, m) {
  m.impl("_monitor_record", &hookstats::monitor::monitor_record);
}
