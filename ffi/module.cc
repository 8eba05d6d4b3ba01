// The Python module of the CPU custom calls: registrations() maps each target name to its handler.
#include <nanobind/nanobind.h>

#include "ffa_cpu.h"
#include "range_ops_cpu.h"

namespace nb = nanobind;

namespace {

template <typename T>
nb::capsule Capsule(T* fn) {
  return nb::capsule(reinterpret_cast<void*>(fn));
}

}  // namespace

NB_MODULE(_ffi_cpu, m) {
  m.def("registrations", []() {
    nb::dict targets;
    targets["magi_jax_ffa_fwd"] = Capsule(MagiFfaFwdCpu);
    targets["magi_jax_ffa_bwd"] = Capsule(MagiFfaBwdCpu);
    targets["magi_jax_range_gather"] = Capsule(MagiRangeGatherCpu);
    targets["magi_jax_range_scatter_add"] = Capsule(MagiRangeScatterAddCpu);
    targets["magi_jax_range_scatter_add_into"] = Capsule(MagiRangeScatterAddIntoCpu);
    return targets;
  });
}
