// The simulator runtime: what translated shader code calls into.
//
// This header is the boundary between the two halves of the simulator:
//   - the language half (shim/metal_stdlib, the source pre-pass, types, simd_* functions and
//     simdgroup_matrix built on simd_exchange), and
//   - the execution half (runtime.cpp: fibers, the lane scheduler, barriers and rendezvous,
//     kernel registry, buffers, checkers, counters, plan execution).
// It uses only builtin C++ types so that it does not depend on the shim.
#pragma once

#include <cstddef>
#include <cstdint>

namespace steel_sim {

// The thread-position attributes of the running lane (Metal's [[...]] kernel attributes).
struct LaneInfo {
  uint32_t thread_position_in_grid[3];
  uint32_t threadgroup_position_in_grid[3];
  uint32_t thread_position_in_threadgroup[3];
  uint32_t threads_per_threadgroup[3];  // a partial threadgroup's own size (dispatchThreads)
  uint32_t dispatch_threads_per_threadgroup[3];  // the dispatch's threadgroup size
  uint32_t threadgroups_per_grid[3];
  uint32_t threads_per_grid[3];
  uint32_t thread_index_in_threadgroup;
  uint32_t simdgroup_index_in_threadgroup;
  uint32_t thread_index_in_simdgroup;
  uint32_t simdgroups_per_threadgroup;
  uint32_t threads_per_simdgroup;  // always 32
};

const LaneInfo& lane();

// [[buffer(index)]]: the bound buffer's base (tensor storage + its offset, or inline bytes).
void* buffer(uint32_t index);
// A [[buffer(index), function_constant(c)]] parameter whose constant is false. Metal's compiler
// removes the parameter and, with it, any read whose value is then unused; here the parameter
// points into a poison region instead of nothing, so that such reads do not fault. A write there
// is an error; reads are noted, and launch() runs the dispatch again with other poison bytes: if
// the results differ, the value of a disabled buffer was used, which is an error too.
void* disabled_buffer(uint32_t index);
// Called by each lane for every [[buffer(index)]] parameter in the constant address space: the
// bytes read from it count as Counters::constant_read too.
void constant_buffer(uint32_t index);
// [[threadgroup(index)]]: memory sized by the dispatch's threadgroup_memory entry.
void* threadgroup_buffer(uint32_t index);
// A `threadgroup T name[N];` declared in a kernel body. decl_id is unique per declaration in the
// translated source; every lane of one threadgroup gets the same storage, counted against the
// 32 KiB limit and watched by the race checker.
void* threadgroup_array(uint32_t decl_id, size_t bytes, size_t align);

// Function constants of the current dispatch, by [[function_constant(index)]].
bool function_constant_defined(uint32_t index);
// The value of a constant declared bool, integer (int, uint, short, ...) or floating point
// (float, half). A dispatch that sets it with a value of another kind is an error, as Metal
// refuses a constant value of the wrong type (Int and UInt stand for each other: Python has one
// integer type).
bool function_constant_bool(uint32_t index);
int64_t function_constant_int(uint32_t index);
float function_constant_float(uint32_t index);

// Barriers. Reached by only some of the non-exited lanes: a SimulatorError naming the kernel.
void threadgroup_barrier();
void simdgroup_barrier();
// threadgroup_barrier(mem_flags) with Metal's flag bits (mem_device = 1, mem_threadgroup = 2,
// ...): only a barrier whose flags include mem_threadgroup orders threadgroup memory for the race
// checker (mem_none is an execution barrier only). threadgroup_barrier() means all flags.
void threadgroup_barrier_flags(uint32_t mem_flags);
// simdgroup_barrier(mem_flags): orders the memory its flags name between the simdgroup's lanes
// (mem_none: execution only). simd_* functions and simdgroup-matrix operations order no memory.
void simdgroup_barrier_flags(uint32_t mem_flags);

// What a rendezvous was for, for the counters and for divergence errors.
enum class SimdKind : uint32_t { Shuffle = 0, Reduce = 1, Ballot = 2, MatrixLoad = 3, MatrixStore = 4, MatrixMma = 5, TensorOp = 6 };

// The one primitive behind every simd_* function and simdgroup-matrix operation: every
// non-exited lane of the simdgroup contributes `bytes` bytes; once all have arrived, each lane
// gets a pointer to the 32 contributions, lane-major (lane l at l * bytes), valid until that
// lane's next simd_exchange, and the mask of lanes that contributed. Lanes that reach a different
// kind or size, or a barrier instead, are a divergence error.
const void* simd_exchange(const void* mine, size_t bytes, SimdKind kind, uint32_t* active_mask);

// ---- Metal 4 tensor operations (shim/steel_shim/tensor_ops.h: mpp::tensor_ops) ----
//
// An operation of an execution scope (matmul2d::run, reduce_rows, ...) is two rendezvous of all
// the scope's threads: tensor_op_gather, after which the scope's first thread (the leader) does
// the whole operation through the pointers every thread contributed, then tensor_op_release,
// which holds the others until the leader is done. `simdgroups` is the scope's size: 1 is the
// caller's simdgroup; more is the whole threadgroup, which must have exactly that many full
// simdgroups. Divergent threads (another call site, a barrier), missing (exited) threads and a
// threadgroup of another size are errors naming `op`. Neither rendezvous orders memory.
// Returns every thread's `mine`, by thread index in the scope.
const void* const* tensor_op_gather(const void* mine, uint32_t simdgroups, const char* op);
void tensor_op_release(uint32_t simdgroups, const char* op);
// Scratch memory for the leader's operation (operand copies), valid until the next call.
void* tensor_op_scratch(size_t bytes);
// Counts one scope operation and its multiply-adds (Counters::tensor_ops, tensor_multiply_adds).
void count_tensor_op(uint64_t multiply_adds);

// The element-to-(thread, slot) map of a cooperative tensor role. Implementation-defined on the
// GPU (the driver supplies it when it builds the pipeline), so the simulator draws it at random
// from the launch's layout seed (TORCH_STEEL_SIM_LAYOUT_SEED, default 0) and the role's key:
// kernels that assume a layout fail under some seed. Slot s of thread t holds element
// element_at[t * capacity + s], or is invalid (-1: its value and index are garbage); invalid
// slots get index_of_invalid[...] as their multidimensional index, a made-up in-range element.
struct TensorLayout {
  uint32_t threads = 0;
  uint32_t capacity = 0;  // slots per thread
  uint32_t elements = 0;
  const int32_t* element_at = nullptr;
  const int32_t* index_of_invalid = nullptr;
  // Where each element lives (thread * capacity + slot); replicated roles (reduction results,
  // held by every thread that holds an element of the reduced row or column) list the holder
  // that stores it, and owner[t * capacity + s] says which slot that is.
  const int32_t* place_of = nullptr;
  const uint8_t* owner = nullptr;
};
// A role whose elements are spread over the threads, each held once (at most max_capacity slots).
const TensorLayout* tensor_layout(uint64_t role_key, uint32_t elements, uint32_t threads,
                                  uint32_t max_capacity);
// The result of reducing a rows x cols source (element e = row * cols + col) along its rows
// (keep_rows: one element per row) or columns: every thread holds the results of the rows
// (columns) its source elements lie in, in a slot order drawn at random.
const TensorLayout* tensor_reduction_layout(uint64_t role_key, const TensorLayout* source,
                                            uint32_t rows, uint32_t cols, bool keep_rows,
                                            uint32_t max_capacity);

// Kernels, registered by host name (the translated source does this for every
// [[host_name("...")]] instantiation and every plain [[kernel]] function).
using KernelEntry = void (*)();
void register_kernel(const char* host_name, KernelEntry entry);
// The same for a kernel with [[max_total_threads_per_threadgroup(max_threads)]] (0: none): a
// dispatch with more threads per threadgroup is refused, as Metal's pipeline refuses it.
void register_kernel_limited(const char* host_name, KernelEntry entry, uint32_t max_threads);

// The pessimistic-precision mode (TORCH_STEEL_SIM_FAST_MATH=worst, read at each launch): the
// shim's fast:: and half-precision transcendentals then return results at the edge of the
// error bounds the MSL specification allows (steel_shim/math.h), each moved up or down as a hash
// of the seed (TORCH_STEEL_SIM_FAST_MATH_SEED, default 0), the function and its arguments
// decides, so that a run is reproducible and a tolerance that holds under several seeds holds
// for any conforming GPU. 0 when off.
bool worst_precision();
uint64_t precision_seed();

// Raise a SimulatorError from shader-side code (e.g. an unsupported shim feature at run time).
[[noreturn]] void fail(const char* message);
// The same, naming `pc` (a return address into shader code) as the place.
[[noreturn]] void fail_at(const char* message, const void* pc);

}  // namespace steel_sim
