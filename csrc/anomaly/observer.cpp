// hookstats.detect_nonfinite's observer: one global at::RecordFunction callback (needs inputs and outputs)
// that checks every floating output of every ATen op, forward, backward and optimizer, on its device
// (check_cpu.cpp, check_cuda.cu) into that device's state (Note [nonfinite guard state]), with no host
// sync and no Python. The ops torch.ops.hookstats._nf_* (schemas in csrc/hookstats.cpp) drive it from
// hookstats/anomaly.py.
//
// Note [nonfinite observer]
// What the callback knows about an op, all on the host when the op runs:
//   * phase: backward inside an autograd node (the BACKWARD_FUNCTION scope that Node::operator() opens
//     around apply, on whichever thread runs it); optimizer inside the USER_SCOPE that torch.optim opens
//     around step() and zero_grad() ("Optimizer.step#SGD.step"); forward otherwise;
//   * module: the id the guard's forward pre/post hooks set (thread-local); in backward, the module that
//     was current when the forward op that made the node ran: each forward op's sequence number is mapped
//     to its module, and a node carries the sequence number of the op that made it;
//   * node: the autograd node's name ("SqrtBackward0").
// Which outputs are checked: defined, strided, CPU or CUDA, float32/64, float16, bfloat16, not empty, not
// a Python subclass (FakeTensor, DTensor: their inner ops are checked) nor a functional wrapper. A view,
// or any output sharing memory with an input of its op (detach, resolve_conj returning its input, and
// addmm's resolve_conj of a result buffer not yet written) is skipped: an op that computed nothing is not
// an origin, and its values were checked where they were made. But the output of an
// in-place or out= op is checked even when it is a view; an in-place op that returns nothing (_foreach_add_)
// has its first (tensor or list) argument checked. The outputs of ops that return memory nobody wrote
// (aten::empty*, new_empty*, resize_) are not read: their bits are not values. An op given a NaN or an Inf
// as a number argument (fill_(nan), full(inf), masked_fill(-inf): an attention mask, a buffer's "no value"
// marker) made it on purpose: nothing it runs is checked, as with ignore_ops; the ops that read its output are.
// An op that only moves values (copy_, clone, cat, index_select, ...: moves_values) with the output's dtype on
// every floating input cannot make a NaN or an Inf (a converting copy can: fp32 -> fp16 overflows), and is not
// checked: a copy of a NaN is not an origin, whoever made the NaN. A decomposition's output that is, unmodified,
// one of the last few checked on this thread is not read again (seen_recently). The predicates: op_rules.h.
// The callback never runs an ATen op of its own (a thread-local flag guards the lazy allocation of a CUDA
// device's state, which runs with RecordFunction disabled). Its controls (start, step, ...): control.cpp.
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/zeros.h>
#include <ATen/record_function.h>
#include <c10/util/intrusive_ptr.h>

#include <array>
#include <cmath>
#include <atomic>
#include <cstring>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "device_fns.h"
#include "nonfinite_ops.h"
#include "observer.h"
#include "observer_state.h"
#include "op_rules.h"

namespace hookstats {
namespace anomaly {
namespace {

struct Recent {
  // Weak: the TensorImpl's memory (so its address) is not reused while it is here; its data may be freed.
  std::optional<c10::weak_intrusive_ptr<c10::TensorImpl>> impl;
  uint32_t version = 0;
};

struct NodeFrame {
  int64_t node, seq, module;
};

struct OpEntry {
  std::string name, overload;
  int64_t id;      // name-table index, -1: outputs not checked (makes_uninitialized, ignored)
  bool composite;  // a CompositeImplicitAutograd kernel: it writes only through the ops it calls
  bool ignored;    // named in ignore_ops
  bool moves;      // moves_values
};

struct Tls {
  uint64_t generation = 0;
  int64_t module = -1;
  int opt_depth = 0;
  int ignore_depth = 0;  // inside an ignore_ops op
  bool busy = false;
  std::vector<NodeFrame> nodes;
  std::unordered_map<const char*, OpEntry> op_ids;  // by the name's pointer
  std::array<Recent, 4> recent;
  int recent_pos = 0;
};

Tls& tls() {
  thread_local Tls t;
  const uint64_t g = obs().generation.load(std::memory_order_relaxed);
  if (t.generation != g) {
    t.generation = g;
    t.module = -1;
    t.opt_depth = 0;
    t.ignore_depth = 0;
    t.nodes.clear();
    t.op_ids.clear();
    for (auto& r : t.recent) r = Recent();
    t.recent_pos = 0;
  }
  return t;
}

struct BusyScope {
  Tls& t;
  explicit BusyScope(Tls& tt) : t(tt) { t.busy = true; }
  ~BusyScope() { t.busy = false; }
};

// What the observer knows of an op (its name-table index, whether it is a decomposition), cached per thread.
const OpEntry& op_entry(Tls& t, const at::RecordFunction& fn) {
  const char* name = fn.name();
  const char* overload = fn.overload_name();
  auto it = t.op_ids.find(name);
  // The pointer is a cache key only: a name built at run time may come back at the same address as another.
  if (it != t.op_ids.end() && it->second.name == name && it->second.overload == overload) return it->second;
  if (t.op_ids.size() > 65536) t.op_ids.clear();
  bool ignored;
  {
    Observer& o = obs();
    std::lock_guard<std::mutex> lock(o.mu);
    ignored = o.ignored.count(name) > 0;
  }
  const int64_t id = makes_uninitialized(name) || ignored ? -1 : name_id(name);
  OpEntry& e = t.op_ids[name];
  e = OpEntry{std::string(name), std::string(overload), id, is_composite(name, overload), ignored,
              moves_values(name)};
  return e;
}

FloatMasks masks_of(const at::Tensor& t) {
  return float_masks(static_cast<int>(t.element_size()), t.scalar_type() == c10::kBFloat16);
}

// What the start callback keeps for the end callback of an op: its first floating inputs (for the
// record's kBadInputs), and, for an in-place op, the tensors of its first argument (its outputs when it
// returns nothing).
struct OpInputs : at::ObserverContext {
  std::vector<at::Tensor> inputs;
  std::vector<at::Tensor> inplace;
  std::vector<const c10::StorageImpl*> storages;  // of every readable tensor input
  c10::ScalarType dtype = c10::ScalarType::Undefined;  // of every floating input, when they share one
  bool mixed = false;    // floating inputs of different dtypes
  bool ignored = false;  // an ignore_ops op: nothing it runs is checked
};

struct OptimizerScope : at::ObserverContext {};

void note_input(OpInputs& in, const at::Tensor& x) {
  in.storages.push_back(x.storage().unsafeGetStorageImpl());
  if (in.dtype == c10::ScalarType::Undefined) in.dtype = x.scalar_type();
  else if (in.dtype != x.scalar_type()) in.mixed = true;
}

}  // namespace

std::unique_ptr<at::ObserverContext> on_start(const at::RecordFunction& fn) {
  Tls& t = tls();
  if (t.busy) return nullptr;
  switch (fn.scope()) {
    case at::RecordScope::USER_SCOPE:
      if (is_optimizer_scope(fn.name())) {
        ++t.opt_depth;
        return std::make_unique<OptimizerScope>();
      }
      return nullptr;
    case at::RecordScope::BACKWARD_FUNCTION: {
      NodeFrame f{name_id(fn.name()), fn.seqNr(), -1};
      if (f.seq >= 0) {
        Observer& o = obs();
        std::lock_guard<std::mutex> lock(o.seq_mu);
        auto it = o.seq_module.find(f.seq);
        if (it != o.seq_module.end()) f.module = it->second;
      }
      t.nodes.push_back(f);
      return nullptr;
    }
    case at::RecordScope::FUNCTION: {
      if (t.ignore_depth > 0) return nullptr;
      if (op_entry(t, fn).ignored) {
        ++t.ignore_depth;
        auto ctx = std::make_unique<OpInputs>();
        ctx->ignored = true;
        return ctx;
      }
      if (!fn.needsInputs()) return nullptr;
      if (nonfinite_scalar(fn.inputs())) {  // told to make a NaN/Inf: not an origin (Note [nonfinite observer])
        ++t.ignore_depth;
        auto ctx = std::make_unique<OpInputs>();
        ctx->ignored = true;
        return ctx;
      }
      std::unique_ptr<OpInputs> ctx;
      const bool inplace = inplace_name(fn.name());
      bool first = true;
      for (const c10::IValue& v : fn.inputs()) {
        if (v.isTensor()) {
          const at::Tensor& x = v.toTensor();
          if (readable(x)) {
            if (!ctx) ctx = std::make_unique<OpInputs>();
            note_input(*ctx, x);
            if (inplace && first) ctx->inplace.push_back(x);
            if (ctx->inputs.size() < static_cast<size_t>(kMaxInputs)) ctx->inputs.push_back(x);
          }
        } else if (v.isTensorList()) {
          for (const at::Tensor& x : v.toTensorList().vec()) {
            if (!readable(x)) continue;
            if (!ctx) ctx = std::make_unique<OpInputs>();
            note_input(*ctx, x);
            if (inplace && first) ctx->inplace.push_back(x);
            if (ctx->inputs.size() < static_cast<size_t>(kMaxInputs)) ctx->inputs.push_back(x);
          }
        }
        first = false;
      }
      return ctx;
    }
    default:
      return nullptr;
  }
}

namespace {

// Whether x is, unchanged, one of the last outputs checked on this thread, and the op returning it is a
// decomposition (CompositeImplicitAutograd: aten::linear returning what its aten::addmm made): then it is not
// read again. Only a decomposition: a kernel may write into a tensor after an op it called checked it, without
// moving its version (addmm copies the bias into its result with copy_, then multiplies into it), so the
// output of any other op is read. Otherwise x is remembered.
bool seen_recently(Tls& t, const at::Tensor& x, bool composite) {
  if (x.is_inference()) return false;  // no version counter
  c10::TensorImpl* impl = x.unsafeGetTensorImpl();
  const uint32_t version = impl->version_counter().current_version();
  for (Recent& r : t.recent) {
    if (r.impl && r.impl->_unsafe_get_target() == impl) {
      if (composite && r.version == version) return true;
      r.version = version;
      return false;
    }
  }
  Recent& r = t.recent[t.recent_pos];
  t.recent_pos = (t.recent_pos + 1) % static_cast<int>(t.recent.size());
  r.impl.emplace(x.getIntrusivePtr());
  r.version = version;
  return false;
}

int64_t* state_for(const at::Tensor& x, int* device) {
  Observer& o = obs();
  if (x.is_cpu()) {
    *device = -1;
    return o.cpu_ptr;
  }
  const int d = x.get_device();
  *device = d;
  if (d < 0 || d >= kMaxCudaDevices || cuda_fns().check == nullptr) return nullptr;
  int64_t* p = o.cuda_ptrs[d].load(std::memory_order_acquire);
  if (p != nullptr) return p;
  // A device the guard was not started with: its state is made now, unless its stream is being captured
  // (zeroing it would become part of the graph); then the output stays unchecked.
  if (cuda_fns().capturing(d)) return nullptr;
  std::lock_guard<std::mutex> lock(o.mu);
  p = o.cuda_ptrs[d].load(std::memory_order_acquire);
  if (p != nullptr) return p;
  at::Tensor s;
  {
    at::DisableRecordFunctionGuard no_record;
    s = at::zeros({kNumSlots}, x.options().dtype(c10::kLong));
    s[kFirst].fill_(kNoIndex);
  }
  o.cuda_states[d] = s;
  p = s.data_ptr<int64_t>();
  o.cuda_ptrs[d].store(p, std::memory_order_release);
  return p;
}

struct OpContext {
  int64_t phase, op, module, node, seq;
  bool composite, moves;
  const OpInputs* inputs;
};

void fill_inputs(CheckLaunch& c, const at::Tensor& out, const OpInputs* in) {
  c.n_inputs = 0;
  if (in == nullptr) return;
  for (const at::Tensor& x : in->inputs) {
    if (c.n_inputs == kMaxInputs) break;
    // An input that is the output (in place, out=) says nothing about what came in; nor can an input on
    // another device than the output be read by the output's check.
    if (x.unsafeGetTensorImpl() == out.unsafeGetTensorImpl() || x.device() != out.device()) continue;
    if (x.is_alias_of(out) || !x.is_non_overlapping_and_dense()) continue;
    c.in_data[c.n_inputs] = x.const_data_ptr();
    c.in_numel[c.n_inputs] = x.numel();
    c.in_masks[c.n_inputs] = masks_of(x);
    ++c.n_inputs;
  }
}

// Whether x shares memory with an input of the op: a view, detach, alias, or the input itself returned
// (resolve_conj, contiguous of a contiguous tensor), or an output buffer handed to a helper before it is written
// (addmm's resolve_conj of its result).
bool aliases_input(const at::Tensor& x, const OpInputs* in) {
  if (in == nullptr) return false;
  const c10::StorageImpl* s = x.storage().unsafeGetStorageImpl();
  for (const c10::StorageImpl* p : in->storages) {
    if (p == s) return true;
  }
  return false;
}

void check_output(Tls& t, const at::Tensor& x, int64_t index, bool inplace, const OpContext& op) {
  if (!readable(x)) return;
  if (!inplace && (x.is_view() || aliases_input(x, op.inputs))) return;
  if (op.moves && op.inputs != nullptr && !op.inputs->mixed && op.inputs->dtype == x.scalar_type()) return;
  if (seen_recently(t, x, op.composite)) return;
  Observer& o = obs();
  int device = -1;
  int64_t* state = state_for(x, &device);
  if (state == nullptr) {
    o.unchecked.fetch_add(1, std::memory_order_relaxed);
    return;
  }
  CheckLaunch c;
  c.data = x.const_data_ptr();
  c.numel = x.numel();
  c.masks = masks_of(x);
  c.ndim = 0;
  c.lay.ndim = 0;
  const int ndim = static_cast<int>(x.dim());
  if (x.is_contiguous()) {
    c.mode = kFlat;
  } else if (x.is_non_overlapping_and_dense() && ndim <= kMaxDims) {
    c.mode = kDense;
    c.ndim = ndim;
    for (int d = 0; d < ndim; ++d) {
      c.sizes[d] = x.size(d);
      c.strides[d] = x.stride(d);
    }
  } else {
    c.mode = kStrided;
    if (!make_layout(ndim, x.sizes().data(), x.strides().data(), c.lay)) {
      o.unchecked.fetch_add(1, std::memory_order_relaxed);
      return;
    }
    if (c.lay.ndim == 0) c.mode = kFlat;  // coalesced to one unit-stride run
  }
  OpMeta& m = c.meta;
  m.order = o.order.fetch_add(1, std::memory_order_relaxed) + 1;
  m.phase = op.phase;
  m.op = op.op;
  m.module = op.module;
  m.node = op.node;
  m.seq = op.seq;
  m.output = index;
  m.numel = c.numel;
  m.dtype = static_cast<int64_t>(x.scalar_type());
  m.ndim = ndim;
  m.data_ptr = reinterpret_cast<int64_t>(x.const_data_ptr());
  for (int d = 0; d < kMaxShapeDims; ++d) m.shape[d] = d < ndim ? x.size(d) : 0;
  fill_inputs(c, x, op.inputs);
  c.state = state;
  o.checked.fetch_add(1, std::memory_order_relaxed);
  if (device < 0) check_cpu(c);
  else cuda_fns().check(c, device);
}

}  // namespace

void on_end(const at::RecordFunction& fn, at::ObserverContext* ctx) {
  Tls& t = tls();
  if (t.busy) return;
  switch (fn.scope()) {
    case at::RecordScope::USER_SCOPE:
      if (ctx != nullptr && t.opt_depth > 0) --t.opt_depth;
      return;
    case at::RecordScope::BACKWARD_FUNCTION:
      if (!t.nodes.empty()) t.nodes.pop_back();
      return;
    case at::RecordScope::FUNCTION:
      break;
    default:
      return;
  }
  if (ctx != nullptr && static_cast<OpInputs*>(ctx)->ignored) {
    --t.ignore_depth;
    return;
  }
  if (t.ignore_depth > 0) return;
  BusyScope busy(t);
  Observer& o = obs();
  OpContext op;
  op.node = -1;
  op.seq = fn.seqNr();
  if (!t.nodes.empty()) {
    const NodeFrame& f = t.nodes.back();
    op.phase = kBackward;
    op.module = f.module;
    op.node = f.node;
    op.seq = f.seq;
  } else if (t.opt_depth > 0) {
    op.phase = kOptimizer;
    op.module = -1;
  } else {
    op.phase = kForward;
    op.module = t.module;
    if (op.module >= 0 && op.seq >= 0) {
      std::lock_guard<std::mutex> lock(o.seq_mu);
      if (o.seq_module.size() > kMaxSeqEntries) o.seq_module.clear();
      o.seq_module[op.seq] = op.module;
    }
  }
  op.inputs = static_cast<const OpInputs*>(fn.scope() == at::RecordScope::FUNCTION ? ctx : nullptr);
  const OpEntry& entry = op_entry(t, fn);
  if (entry.id < 0) return;
  op.op = entry.id;
  op.composite = entry.composite;
  op.moves = entry.moves;
  int64_t index = 0;
  // In place or out=: the output is an argument the op wrote, checked even when it is a view.
  const bool inplace = inplace_name(fn.name()) || starts_with(fn.overload_name(), "out");
  auto check = [&](const at::Tensor& x) { check_output(t, x, index++, inplace, op); };
  for (const c10::IValue& v : fn.outputs()) {
    if (v.isTensor()) {
      check(v.toTensor());
    } else if (v.isTensorList()) {
      for (const at::Tensor& x : v.toTensorList().vec()) check(x);
    }
  }
  if (index == 0 && op.inputs != nullptr) {
    for (const at::Tensor& x : op.inputs->inplace) check(x);
  }
}


void set_module(int64_t id) { tls().module = id; }

}  // namespace anomaly
}  // namespace hookstats
