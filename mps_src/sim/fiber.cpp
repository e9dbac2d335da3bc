#include "fiber.h"

#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <new>

namespace steel_sim {

#if defined(STEEL_SIM_X86_64_SWITCH)

extern "C" void steel_sim_switch(void** from_sp, void* to_sp);
extern "C" void steel_sim_trampoline();

// System V: rbx, rbp, r12-r15 are callee-saved; everything else the compiler already assumes
// clobbered across the call. MXCSR and the x87 control word are left alone: every lane runs with
// the same floating-point modes as the scheduler.
asm(R"(
  .text
  .globl steel_sim_switch
  .hidden steel_sim_switch
  .type steel_sim_switch, @function
steel_sim_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size steel_sim_switch, .-steel_sim_switch

  .globl steel_sim_trampoline
  .hidden steel_sim_trampoline
  .type steel_sim_trampoline, @function
steel_sim_trampoline:
  andq $-16, %rsp
  movq %r12, %rdi
  callq *%r13
  ud2
  .size steel_sim_trampoline, .-steel_sim_trampoline
)");

void make_context(Context* ctx, char* stack, size_t size, FiberMain fn, void* arg) {
  auto top = reinterpret_cast<uintptr_t>(stack + size) & ~uintptr_t{15};
  auto* sp = reinterpret_cast<void**>(top);
  *--sp = nullptr;                                           // keeps the frame chain finite
  *--sp = reinterpret_cast<void*>(&steel_sim_trampoline);  // `ret` of the first switch
  *--sp = nullptr;                                           // rbp
  *--sp = nullptr;                                           // rbx
  *--sp = arg;                                               // r12
  *--sp = reinterpret_cast<void*>(fn);                       // r13
  *--sp = nullptr;                                           // r14
  *--sp = nullptr;                                           // r15
  ctx->sp = sp;
}

void switch_context(Context* from, Context* to) { steel_sim_switch(&from->sp, to->sp); }

#else

namespace {
// makecontext passes int arguments only: split the pointers into two halves.
void entry(unsigned fn_hi, unsigned fn_lo, unsigned arg_hi, unsigned arg_lo) {
  auto fn = reinterpret_cast<FiberMain>((uint64_t{fn_hi} << 32) | fn_lo);
  fn(reinterpret_cast<void*>((uint64_t{arg_hi} << 32) | arg_lo));
}
}  // namespace

void make_context(Context* ctx, char* stack, size_t size, FiberMain fn, void* arg) {
  getcontext(&ctx->uc);
  ctx->uc.uc_stack.ss_sp = stack;
  ctx->uc.uc_stack.ss_size = size;
  ctx->uc.uc_link = nullptr;
  auto f = reinterpret_cast<uint64_t>(fn);
  auto a = reinterpret_cast<uint64_t>(arg);
  makecontext(&ctx->uc, reinterpret_cast<void (*)()>(&entry), 4, unsigned(f >> 32), unsigned(f),
              unsigned(a >> 32), unsigned(a));
}

void switch_context(Context* from, Context* to) { swapcontext(&from->uc, &to->uc); }

#endif

StackPool::~StackPool() {
  if (base_ != nullptr) munmap(base_, count_ * (size_ + guard_));
}

void StackPool::reserve(size_t count, size_t size) {
  size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  size = (size + page - 1) / page * page;
  if (base_ != nullptr && count <= count_ && size == size_) return;
  if (base_ != nullptr) munmap(base_, count_ * (size_ + guard_));
  base_ = nullptr;
  size_t total = count * (size + page);
  void* p = mmap(nullptr, total, PROT_READ | PROT_WRITE,
                 MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED) throw std::bad_alloc();
  base_ = static_cast<char*>(p);
  count_ = count;
  size_ = size;
  guard_ = page;
  for (size_t i = 0; i < count; ++i) mprotect(base_ + i * (size_ + guard_), guard_, PROT_NONE);
}

bool StackPool::in_guard(const void* addr) const {
  auto a = reinterpret_cast<uintptr_t>(addr);
  auto b = reinterpret_cast<uintptr_t>(base_);
  if (base_ == nullptr || a < b || a >= b + count_ * (size_ + guard_)) return false;
  return (a - b) % (size_ + guard_) < guard_;
}

}  // namespace steel_sim
