// Members qualified with an address space, of every kind (issue 26 findings 1 to 3):
// constructors (defaulted, with initializers, templates), conversions to vectors and to any
// scalar (templates), operators, member templates, variadic member templates, a destructor and
// a static member, each in thread, threadgroup, device and constant memory where Metal has
// them, called on objects in each space.
#include <metal_stdlib>
using namespace metal;

template <typename T>
struct Pair {
  T lo;
  T hi;

  Pair() thread = default;
  Pair() threadgroup = default;
  Pair() device = default;
  Pair() constant = default;
  constexpr Pair(T a, T b) thread : lo(a), hi(b) {}
  constexpr Pair(T a, T b) constant : lo(a), hi(b) {}
  template <typename U, typename = typename enable_if<is_convertible_v<U, T>>::type>
  constexpr Pair(U x) thread : lo(static_cast<T>(x)), hi(static_cast<T>(0)) {}
  template <typename U, typename = typename enable_if<is_convertible_v<U, T>>::type>
  constexpr Pair(U x) device : lo(static_cast<T>(x)), hi(static_cast<T>(0)) {}
  constexpr Pair(vec<T, 2> v) thread : lo(v.x), hi(v.y) {}
  constexpr Pair(vec<T, 2> v) threadgroup : lo{v.x}, hi{v.y} {}

  constexpr operator vec<T, 2>() const thread { return vec<T, 2>(lo, hi); }
  constexpr operator vec<T, 2>() const threadgroup { return vec<T, 2>(lo, hi); }
  constexpr operator vec<T, 2>() const device { return vec<T, 2>(lo, hi); }
  constexpr operator vec<T, 2>() const constant { return vec<T, 2>(lo, hi); }

  template <typename U, typename = typename enable_if<is_convertible_v<T, U>>::type>
  constexpr operator U() const thread { return static_cast<U>(lo); }
  template <typename U, typename = typename enable_if<is_convertible_v<T, U>>::type>
  constexpr operator U() const threadgroup { return static_cast<U>(lo + hi); }
  template <typename U, typename = typename enable_if<is_convertible_v<T, U>>::type>
  constexpr operator U() const device { return static_cast<U>(lo - hi); }
  template <typename U, typename = typename enable_if<is_convertible_v<T, U>>::type>
  constexpr operator U() const constant { return static_cast<U>(lo * hi); }

  Pair operator+(Pair o) const device { return Pair(lo + o.lo, hi + o.hi); }
  Pair operator+(Pair o) const thread { return Pair(lo + o.lo, hi + o.hi + T(100)); }
  T operator[](int i) const threadgroup { return i == 0 ? lo : hi; }
  thread Pair& operator*=(T s) thread {
    lo *= s;
    hi *= s;
    return *this;
  }
  void operator*=(T s) device {
    lo *= s;
    hi *= s;
  }

  template <int N>
  T power() const device {
    T r = T(1);
    for (int k = 0; k < N; ++k) r *= lo;
    return r;
  }
  static constexpr T zero() { return T(0); }
  static constant constexpr int kLanes = 2;
};

// A logging fallback of the kind production headers carry for MSL < 3.2: a constant-qualified
// constructor, variadic member templates with unnamed parameters in two spaces. (Their
// `constant char*` parameters take string literals, which the simulator keeps in generic
// memory: not modelled yet, hence ints.)
struct Logger {
  constexpr Logger(int, int) constant {}
  template <typename... Args>
  void debug(int, Args...) const thread {}
  template <typename... Args>
  void debug(int, Args...) const constant {}
};

constant Logger logger(1, 2);
constant Pair<float> kScale(3.0f, 4.0f);

struct Counted {
  int n;
  ~Counted() thread {}
};

kernel void member_spaces(device Pair<float>* p [[buffer(0)]],
                          device float* out [[buffer(1)]],
                          uint i [[thread_position_in_grid]],
                          uint l [[thread_index_in_threadgroup]]) {
  threadgroup Pair<float> shared[32];
  shared[l] = Pair<float>(float2(p[i]));  // a device conversion, then a thread constructor
  threadgroup_barrier(mem_flags::mem_threadgroup);
  const device Pair<float>& d = p[i];
  Pair<float> t(float(i), 2.0f);
  Counted c{int(i)};
  logger.debug(0, int(i), c.n);
  out[i * 12 + 0] = float(d);                           // device: lo - hi
  out[i * 12 + 1] = float(shared[l]);                   // threadgroup: lo + hi
  out[i * 12 + 2] = float(kScale);                      // constant: lo * hi
  out[i * 12 + 3] = float(t);                           // thread: lo
  out[i * 12 + 4] = float2(kScale).y + float2(shared[l]).x;
  out[i * 12 + 5] = (d + t).hi;                         // device operator+
  out[i * 12 + 6] = (t + t).hi;                         // thread operator+
  out[i * 12 + 7] = shared[l][1];                       // threadgroup operator[]
  out[i * 12 + 8] = d.power<3>() + Pair<float>::zero() + float(Pair<float>::kLanes);
  t *= 2.0f;
  out[i * 12 + 9] = t.lo;
  const Pair<float> from_int = Pair<float>(int(i) + 1);  // a converting constructor template
  out[i * 12 + 10] = from_int.lo + from_int.hi;
  p[i] *= 0.5f;                                          // device operator*=
  out[i * 12 + 11] = float(d);
}

// A function-pointer parameter, resolved when the call is inlined (issue 26 finding 5).
inline float add_op(float a, float b) { return a + b; }
inline float max_op(float a, float b) { return a > b ? a : b; }
template <typename T>
inline T combine(T a, T b, T (*op)(T, T)) {
  return op(a, b);
}

kernel void function_pointer_parameter(device float* out [[buffer(0)]],
                                       uint i [[thread_position_in_grid]]) {
  out[i * 2 + 0] = combine(float(i), 2.0f, add_op);
  out[i * 2 + 1] = combine(float(i), 2.0f, max_op);
}
