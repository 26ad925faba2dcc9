// objc_msgSend for tests/metal_launcher/probe.cpp, in its own file: metal-cpp casts the declaration
// of <objc/message.h> (`void objc_msgSend(void)`) to each message's type, so the definition cannot
// share a translation unit with it. metal-cpp passes (self, selector, args...): the integer and
// pointer arguments of the messages eval_gpu sends arrive in registers, as this signature reads them.
#include <cstdint>

extern "C" void* probe_message(const void* self, const char* sel, uintptr_t a, uintptr_t b, uintptr_t c);

extern "C" void* objc_msgSend(const void* self, const char* sel, uintptr_t a, uintptr_t b, uintptr_t c) {
  return probe_message(self, sel, a, b, c);
}
