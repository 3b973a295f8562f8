// Every hookstats op schema, in one place. Implementations register per dispatch key:
// cpu/*.cpp for CPU, cuda/*.cu for CUDA (compiled only where a CUDA toolkit is found).
// Fake (meta) kernels for torch.compile live in hookstats/_kernels.py. The Python module itself,
// hookstats._C (whose loading runs these registrations), is defined in monitor/monitor_py.cpp.
#include <torch/library.h>
#include <torch/version.h>

#include <string>
#include <vector>

namespace hookstats {
std::string cpu_isa(const std::string& mode);  // cpu/stats_cpu.cpp
}
#include "anomaly/observer.h"  // hookstats.detect_nonfinite's observer: the _nf_* ops below

TORCH_LIBRARY(hookstats, m) {
  // Statistics of x in one read: (values, counts). values holds sum, mean, var, std, l1,
  // l2, linf, min, max in fp32 (fp64 for fp64 x); counts holds numel, nan, inf, zero
  // counts as int64. See csrc/core/stats_ops.h, Note [stats row layout].
  m.def("stats(Tensor x) -> (Tensor, Tensor)");
  // The statistics and, in the same read, a histogram (csrc/core/hist_ops.h, Note [histogram
  // layouts]): mode 1 is a fixed range of `bins` bins over [lo, hi], mode 2 the exponent
  // histogram of x's dtype. Returns (values, counts, histogram counts as int64).
  m.def("stats_hist(Tensor x, int hist_mode, int bins, float lo, float hi) -> (Tensor, Tensor, Tensor)");
  // The statistics written into row `slot` of out ([slots, 13], fp32 or fp64) and, when hist
  // is given, the histogram written into row `hist_slot` of hist (int64), or added to it when
  // hist_accumulate (Note [histogram rows] in csrc/core/bindings.h). With ring (an int64 position p
  // on x's device, read when the kernel runs) out is [ring slots, rows, 13], hist [ring slots,
  // rows, length], and row `slot` of ring slot p mod ring slots is written (Note [ring rows] in
  // csrc/core/stats_ops.h): how a call captured in a CUDA graph writes a new row every replay.
  m.def("stats_into(Tensor x, Tensor(a!) out, int slot, Tensor(b!)? hist=None, int hist_slot=0, int hist_mode=0, "
        "int bins=0, float lo=0., float hi=0., bool hist_accumulate=False, Tensor? ring=None, Tensor(c!)? loc=None, "
        "int loc_slot=0) -> ()");
  // (With loc: the element locations, two int64 (argmax_abs, first_nonfinite), written into row loc_slot of
  // loc ([rows, 2] int64, or [ring slots, rows, 2] with ring): csrc/core/loc_ops.h, Note [element locations].)
  // The statistics, element locations (int64 [2]: flat index of the first largest |x|, of the first NaN/Inf;
  // -1 where none; Note [element locations]) and, with hist_mode != 0, the histogram (else an empty int64
  // tensor), in one read: (values, counts, locations, histogram).
  m.def("stats_loc(Tensor x, int hist_mode=0, int bins=0, float lo=0., float hi=0.) -> (Tensor, Tensor, Tensor, "
        "Tensor)");
  // stats_into for many tensors of one device in one call: xs[i] into row rows[i] of out, and,
  // when hist is given, its histogram written into (or, with hist_accumulate, added to) row hist_rows[i] of hist (one histogram length:
  // group the tensors by dtype for exponent histograms), ring as in stats_into. csrc/core/multi_bindings.h.
  m.def("stats_multi_into(Tensor[] xs, Tensor(a!) out, int[] rows, Tensor(b!)? hist=None, int[] hist_rows=[], "
        "int hist_mode=0, int bins=0, float lo=0., float hi=0., bool hist_accumulate=False, Tensor? ring=None) -> ()");
  // The step prologue of a Monitor's captured CUDA graph (csrc/monitor/recorder.h, Note [monitor
  // graph replays]): with state = (k, p) int64, p = k mod steps.numel(), steps[p] = step[0], k += 1,
  // on the device. Every ring-row write of the replay that follows reads p.
  m.def("_ring_advance(Tensor(a!) state, Tensor(b!) steps, Tensor step) -> ()");
  // Norms of a list of tensors on one device (any float dtypes and layouts), one kernel call:
  // (per-tensor norms [n], the total norm of their concatenation), both float64, overflow-safe
  // (csrc/core/norm_ops.h, Note [norm partials]). p is inf or a finite p > 0.
  m.def("norms(Tensor[] xs, float p) -> (Tensor, Tensor)");
  // Multiplies every x in place by min(1, max_norm / (total + eps)), the total norm read on the
  // device (one float64 element); policy 1 writes zeros instead when total is NaN or inf.
  m.def("scale_by_norm_(Tensor(a!)[] xs, Tensor total, float max_norm, float eps, int policy) -> ()");
  // Clamps every x in place to [lo, hi] (rounded to its dtype); returns the number of changed
  // elements as a 0-d int64 tensor on the tensors' device.
  m.def("clamp_count_(Tensor(a!)[] xs, float lo, float hi) -> Tensor");
  // norms([x], p) then scale_by_norm_([x], ...) in one call; returns the norm before clipping
  // (float64, 0-d). On CUDA a flat tensor in the fused size window is clipped by one cooperative
  // launch that reads and writes it once (cuda/kernels/clip_fused.cu, Note [fused clip_norm_]); path 1
  // forces the two-launch path, 2 requires the fused one, 3 prefers it (core/tensor_list.h,
  // Note [clip_norm_ paths]).
  m.def("clip_norm_(Tensor(a!) x, float p, float max_norm, float eps, int policy, int path=0) -> Tensor");
  // The traced body of a Monitor hook (hookstats/monitor/compile.py, Note [monitor under torch.compile]):
  // records xs as one call of `hook` of the recorder registered as `monitor` (csrc/monitor/), or,
  // with index >= 0, xs[0] as tensor `index` of a grad_output tensor hook. Registered as an ordered
  // effect from Python; cudagraph_unsafe, since a replay would skip its host-side site bookkeeping.
  static const std::vector<at::Tag> monitor_record_tags{
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 8)
      at::Tag::cudagraph_unsafe
#endif
  };
  m.def("_monitor_record(Tensor?[] xs, int monitor, int hook, int index=-1) -> ()", monitor_record_tags);

  // Which CPU code path runs: "avx512", "avx2" or "default" (Note [cpu dispatch]); "" only reads it.
  m.def("_cpu_isa(str mode) -> str", &hookstats::cpu_isa);
  // Per-channel statistics along dim (csrc/core/channel_ops.h, Note [channel stats]): (values
  // [5, C] absmax, sum_abs, sum_sq, min, max over the finite values, fp32 (fp64 for fp64 x);
  // counts [2, C] int64: nonfinite, count).
  m.def("channel_stats(Tensor x, int dim) -> (Tensor, Tensor)");
  // The same, combined into a [7, C] float32/float64 buffer: max for absmax/max, min for min,
  // sums and counts added (calibration over many batches).
  m.def("channel_stats_into(Tensor x, Tensor(a!) out, int dim) -> ()");

  // hookstats.detect_nonfinite (hookstats/anomaly.py; csrc/anomaly/observer.cpp, Note [nonfinite observer]):
  // install / remove / pause the op observer, advance the devices' step counters, set the calling thread's
  // module id, and read the name table, the device states and the counters (checked, unchecked, order, slots).
  m.def("_nf_start(Tensor cpu_state, Tensor[] cuda_states, str[] ignore_ops) -> ()", &hookstats::anomaly::start);
  m.def("_nf_stop() -> ()", &hookstats::anomaly::stop);
  m.def("_nf_enable(bool on) -> ()", &hookstats::anomaly::enable);
  m.def("_nf_step() -> ()", &hookstats::anomaly::step);
  m.def("_nf_set_module(int id) -> ()", &hookstats::anomaly::set_module);
  m.def("_nf_names() -> str[]", &hookstats::anomaly::names);
  m.def("_nf_states() -> Tensor[]", &hookstats::anomaly::states);
  m.def("_nf_counters() -> int[]", &hookstats::anomaly::counters);
}
