// grad_output per output slot: the tensor hooks and alias nodes of the Monitor's "backward_pre" kind.
//
// Note [grad_output per output slot]
// PyTorch's full backward pre-hook sees, for each output slot of a call, the gradient that flows
// through that slot (BackwardHook wraps the returned tensors in a node of their own). A tensor
// hook sees the tensor's total gradient, which is the same only when every consumer of the tensor
// reached it through this slot. hook_outputs proves that from the autograd sequence numbers
// (thread-local, one per node created) and gives every other output an edge of its own:
// - exact with a tensor hook: the output's grad_fn was created during this call and is the newest
//   node of the thread (nothing differentiable was computed after it, so nothing in the module
//   consumed it), and the tensor fills one slot only (several outputs of one node, such as
//   chunk's, can all be newest). "Created during this call": its sequence number is >= the call's
//   start, taken by a forward pre-hook before the forward ran (forward_start); or the module is one
//   whose forward computes every output it returns (kFreshOutputs: nn.Linear, convolutions, norms,
//   activations, embeddings; the list and why in hookstats/monitor/hooks.py), which needs no
//   pre-hook: its output's node, when it has one, was made by the call;
// - otherwise (a leaf; an input or any tensor from before the call; a tensor the module computed
//   on after producing it, or returned twice) the output is replaced by an alias: a detach() of
//   it (same storage and version counter, so in-place ops and saved-tensor checks work as before)
//   whose grad_fn is a SlotGrad node that records its gradient and passes it on unchanged to the
//   tensor's own edge. The alias dies with the graph: no hook is left on a leaf. When one output
//   of a call needs an alias, every output of the call gets one.
// The tensor hook is a FunctionPreHook on the output's node, as Tensor::register_hook puts there
// (without its std::function list). The alias adds a gradient buffer on the path: a tensor whose
// gradient has three or more contributions, some through the alias, may have them summed in
// another grouping (Note [grad_output by tensor hooks] in hookstats/monitor/hooks.py).
#include "slots.h"

#include <ATen/SequenceNumber.h>
#include <Python.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>

#include <string>
#include <type_traits>

namespace hookstats {
namespace monitor {
namespace {

struct SlotGrad : torch::autograd::Node {
  std::weak_ptr<Recorder> rec;
  int32_t hook, index;
  SlotGrad(std::weak_ptr<Recorder> r, int32_t h, int32_t i) : rec(std::move(r)), hook(h), index(i) {}
  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
    const at::Tensor& g = grads[0];
    if (g.defined()) {
      auto r = rec.lock();
      if (r && r->active()) r->record_tensor(hook, index, plain(g));
    }
    return std::move(grads);
  }
  std::string name() const override { return "hookstats::SlotGrad"; }
};

// The tensor hook of an exact output: records the gradient of input `slot` of its node.
struct SlotHook : torch::autograd::FunctionPreHook {
  std::weak_ptr<Recorder> rec;
  int32_t hook, index;
  size_t slot;
  SlotHook(std::weak_ptr<Recorder> r, int32_t h, int32_t i, size_t s) : rec(std::move(r)), hook(h), index(i), slot(s) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& grads) override {
    const at::Tensor& g = grads[slot];
    if (g.defined()) {  // undefined: an output of a multi-output op that the loss does not use
      auto r = rec.lock();
      if (r && r->active()) r->record_tensor(hook, index, plain(g));
    }
    return grads;
  }
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
                "hookstats: unknown autograd Edge::function type: extend make_node in slots.cpp");
  if constexpr (shared) {
    return std::make_shared<N>(std::forward<Args>(args)...);
  } else {
    return c10::make_intrusive<N>(std::forward<Args>(args)...);
  }
}

// The autograd sequence number each monitored call started at (forward_start), per thread, plus one
// (0 stays "no start"), keyed by the forward hook that takes it back. Two Monitors interleave their
// hooks (A's pre-hook, B's pre-hook, ..., A's forward hook, B's forward hook), so a call takes back
// its own entry only: dropping the entries above it would take B's start away (B then aliased every
// output, and the first Monitor's record order changed with a second one on the model). Entries
// left by a forward that raised stay until the list outgrows kMaxStarts; a key's newest entry is
// its innermost live call, so they are never taken back in place of a live one.
using Start = std::pair<const void*, uint64_t>;
constexpr size_t kMaxStarts = 4096;
std::vector<Start>& starts() {
  static thread_local std::vector<Start> s;
  return s;
}

}  // namespace

void forward_start(const void* key) {
  auto& s = starts();
  if (s.size() >= kMaxStarts) s.clear();  // only forwards that raised leave entries behind
  s.emplace_back(key, at::sequence_number::peek() + 1);
}

uint64_t take_start(const void* key) {
  auto& s = starts();
  for (size_t i = s.size(); i-- > 0;) {
    if (s[i].first == key) {
      const uint64_t v = s[i].second;
      s.erase(s.begin() + static_cast<std::ptrdiff_t>(i));
      return v;
    }
  }
  return 0;
}

std::vector<std::pair<int32_t, at::Tensor>> hook_outputs(const std::shared_ptr<Recorder>& r, int32_t hook,
                                                         const Tensors& ts, uint64_t start) {
  // All tensor hooks, or (when one output needs an alias) all aliases, made in output order: the records of a
  // call then come in the same order (the engine runs later nodes first) for every Monitor on the model.
  const uint64_t newest = at::sequence_number::peek();  // before any alias is made
  bool exact = true;
  for (size_t k = 0; exact && k < ts.size(); ++k) {
    const at::Tensor& t = ts[k].second;
    if (!t.defined() || !t.requires_grad()) continue;
    const auto& fn = t.grad_fn();
    exact = fn && start > 0 && (start == kFreshOutputs || fn->sequence_nr() + 1 >= start) &&
            fn->sequence_nr() + 1 == newest;
    for (size_t j = 0; exact && j < ts.size(); ++j) {
      exact = j == k || !ts[j].second.defined() || !ts[j].second.is_same(t);
    }
  }
  std::vector<std::pair<int32_t, at::Tensor>> aliases;
  for (size_t k = 0; k < ts.size(); ++k) {
    const at::Tensor& t = ts[k].second;
    if (!t.defined() || !t.requires_grad()) continue;
    const int32_t index = ts[k].first;
    std::weak_ptr<Recorder> weak = r;
    if (exact) {
      t.grad_fn()->add_tensor_pre_hook(std::make_unique<SlotHook>(std::move(weak), hook, index, t.output_nr()));
      continue;
    }
    at::Tensor alias;  // undefined: no alias could be made (a subclass refusing detach): counted
    try {
      auto node = make_node<SlotGrad>(std::move(weak), hook, index);
      node->set_next_edges(torch::autograd::collect_next_edges(t));
      at::Tensor a = t.detach();
      torch::autograd::create_gradient_edge(a, std::move(node));
      alias = std::move(a);
    } catch (const std::exception&) {
      PyErr_Clear();
    }
    aliases.emplace_back(index, std::move(alias));
  }
  return aliases;
}

}  // namespace monitor
}  // namespace hookstats
