// The context switch of the CUDA emulation's fibers on x86-64 (cuda_emulation.h): the System V
// callee-saved registers pushed on the current stack, the stack pointer swapped, the other
// context's registers popped; no system call, unlike swapcontext, which saves the signal mask.
#if defined(__x86_64__)
// dattn_emu_switch(Context* from, const Context* to): rdi = from, rsi = to; a Context holds the
// stack pointer first.
asm(R"(
  .text
  .globl dattn_emu_switch
  .type dattn_emu_switch, @function
dattn_emu_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  movq %rsp, (%rdi)
  movq (%rsi), %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size dattn_emu_switch, .-dattn_emu_switch
)");
#endif
