// Lanes as fibers: a minimal context switch and a pool of stacks.
//
// On x86-64 a switch saves the callee-saved registers and the stack pointer (fiber.cpp, a few
// nanoseconds); elsewhere, or when built with -DSTEEL_SIM_UCONTEXT (to test that path here), it
// falls back to ucontext, which costs a signal-mask syscall per switch but is portable.
#pragma once

#include <cstddef>

#if defined(__x86_64__) && !defined(STEEL_SIM_UCONTEXT)
#define STEEL_SIM_X86_64_SWITCH 1
#else
#include <ucontext.h>
#endif

namespace steel_sim {

struct Context {
#if defined(STEEL_SIM_X86_64_SWITCH)
  void* sp = nullptr;
#else
  ucontext_t uc;
#endif
};

using FiberMain = void (*)(void* arg);

// Prepares `ctx` to run fn(arg) on [stack, stack + size) at its next switch_context into it.
// fn must never return (a lane ends by switching away for good).
void make_context(Context* ctx, char* stack, size_t size, FiberMain fn, void* arg);
// Saves the running context into `from` and resumes `to`.
void switch_context(Context* from, Context* to);

// Stacks for up to `count` fibers from one mmap, each below a PROT_NONE guard page.
class StackPool {
 public:
  StackPool() = default;
  ~StackPool();
  StackPool(const StackPool&) = delete;
  StackPool& operator=(const StackPool&) = delete;
  // Makes room for `count` stacks of `size` bytes (keeps the mapping when it is large enough).
  void reserve(size_t count, size_t size);
  char* stack(size_t i) const { return base_ + i * (size_ + guard_) + guard_; }
  size_t size() const { return size_; }
  // The guard page below stack i, for a stack-overflow message.
  bool in_guard(const void* addr) const;

 private:
  char* base_ = nullptr;
  size_t count_ = 0;
  size_t size_ = 0;
  size_t guard_ = 0;
};

}  // namespace steel_sim
