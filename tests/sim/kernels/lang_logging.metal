// Logging as production headers write it (issue 26 finding 2): <metal_logging> and metal::os_log
// from MSL 3.2 on, an empty fallback with a constant-qualified constructor before.
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
  constexpr os_log(int, int) constant {}
  template <typename... Args>
  void log_debug(int, Args...) const thread {}
  template <typename... Args>
  void log_debug(int, Args...) const constant {}
};
}
#endif

#if __METAL_VERSION__ >= 320
constant app::os_log logger("tests", "logging");
#define FORMAT "lane %u"
#else
constant app::os_log logger(1, 2);
#define FORMAT 0
#endif

kernel void logging(device uint* out [[buffer(0)]], uint i [[thread_position_in_grid]]) {
  logger.log_debug(FORMAT, i);
  out[i] = __METAL_VERSION__ + i;
}
