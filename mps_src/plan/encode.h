// The one description of how a plan is encoded, shared by the Metal host and the simulator.
//
// Both back ends implement the Encoder concept below and hand it to encode_plan, so the order
// and content of bindings cannot drift between what the simulator verifies and what the Mac runs:
//
//   struct Encoder {
//     // Select the pipeline for d.kernel specialized with d.constants.
//     void set_pipeline(const steel::Dispatch& d);
//     // [[buffer(index)]] = the tensor in `slot`, at that tensor's own storage offset.
//     void set_tensor(uint32_t index, int32_t slot);
//     // [[buffer(index)]] = a copy of `size` bytes (setBytes).
//     void set_bytes(uint32_t index, const void* data, size_t size);
//     // [[threadgroup(index)]] gets `bytes` bytes.
//     void set_threadgroup_memory(uint32_t index, uint32_t bytes);
//     void dispatch_threadgroups(const uint32_t grid[3], const uint32_t threads[3]);
//   };
#pragma once

#include "plan.h"

namespace steel {

template <class Encoder>
void encode_dispatch(Encoder& encoder, const Dispatch& dispatch) {
  encoder.set_pipeline(dispatch);
  for (const Binding& binding : dispatch.bindings) {
    if (binding.kind == Binding::Kind::Tensor) {
      encoder.set_tensor(binding.index, binding.slot);
    } else {
      encoder.set_bytes(binding.index, binding.bytes.data(), binding.bytes.size());
    }
  }
  for (const ThreadgroupMemory& memory : dispatch.threadgroup_memory) {
    encoder.set_threadgroup_memory(memory.index, memory.bytes);
  }
  encoder.dispatch_threadgroups(dispatch.grid, dispatch.threads);
}

template <class Encoder>
void encode_plan(Encoder& encoder, const Plan& plan) {
  for (const Dispatch& dispatch : plan.dispatches) encode_dispatch(encoder, dispatch);
}

}  // namespace steel
