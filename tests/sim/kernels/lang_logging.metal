// Logging as production headers write it (issue 26 finding 2): <metal_logging> and metal::os_log
// from MSL 3.2 on, an empty fallback with a constant-qualified constructor before; both take
// string literals as `constant char*` (MSL keeps literals in the constant address space).
#include <metal_stdlib>
using namespace metal;

#if defined(__METAL_VERSION__) && (__METAL_VERSION__ >= 320)
#include <metal_logging>
namespace app {
using os_log = metal::os_log;
}
#else
namespace app {
struct os_log {
  constexpr os_log(constant char*, constant char*) constant {}
  template <typename... Args>
  void log_debug(constant char*, Args...) const thread {}
  template <typename... Args>
  void log_debug(constant char*, Args...) const constant {}
};
}
#endif

constant app::os_log logger("tests", "logging");

kernel void logging(device uint* out [[buffer(0)]], uint i [[thread_position_in_grid]]) {
  logger.log_debug("lane %u" " of %s", i, "a grid");
  out[i] = __METAL_VERSION__ + i;
}
