// Test-only kernels for tests/sim/test_types.py: half and bfloat arithmetic, conversions, vector
// construction, conversion and swizzles.
#include <metal_stdlib>

using namespace metal;

// Eight results per element, each a chain of operations that must round after every step.
template <typename T>
[[kernel]] void lang_arith(const device T* a [[buffer(0)]], const device T* b [[buffer(1)]],
                           device T* out [[buffer(2)]], uint i [[thread_position_in_grid]]) {
  const T x = a[i];
  const T y = b[i];
  device T* o = out + 8 * i;
  o[0] = x + y;
  o[1] = x - y;
  o[2] = x * y;
  o[3] = x / y;
  o[4] = x * y + x;        // rounded product, then rounded sum (no fused multiply-add)
  o[5] = (x + y) * (x - y);
  T acc = x;
  for (int k = 0; k < 4; ++k) acc = acc * y + x;
  o[6] = acc;
  o[7] = -x * 3;
}

template [[host_name("lang_arith_f16")]] [[kernel]] decltype(lang_arith<half>) lang_arith<half>;
template [[host_name("lang_arith_bf16")]] [[kernel]] decltype(lang_arith<bfloat>)
    lang_arith<bfloat>;

// float -> T -> float, rounding to nearest even.
template <typename T>
[[kernel]] void lang_convert(const device float* a [[buffer(0)]], device float* out [[buffer(1)]],
                             device T* narrow [[buffer(2)]], uint i [[thread_position_in_grid]]) {
  const T t = T(a[i]);
  narrow[i] = t;
  out[i] = float(t);
}

template [[host_name("lang_convert_f16")]] [[kernel]] decltype(lang_convert<half>)
    lang_convert<half>;
template [[host_name("lang_convert_bf16")]] [[kernel]] decltype(lang_convert<bfloat>)
    lang_convert<bfloat>;

// Vector construction, conversion and swizzles of in[0] = a; writes 64 floats and 10 ints.
#define PUT2(v) out[n++] = float((v).x), out[n++] = float((v).y)
#define PUT3(v) PUT2(v), out[n++] = float((v).z)
#define PUT4(v) PUT3(v), out[n++] = float((v).w)

[[kernel]] void lang_vectors(const device float4* in [[buffer(0)]], device float* out [[buffer(1)]],
                             device int* iout [[buffer(2)]]) {
  const float4 a = in[0];
  int n = 0;
  PUT4(float4(1, 2, a.xy));              // 0..3: scalars and a vector
  PUT3(float3(a.w));                     // 4..6: splat
  const half4 h = half4(a);              // elementwise conversion, rounding to nearest even
  PUT4(h);                               // 7..10
  PUT4((float4)h);                       // 11..14: a C-style cast converts too
  PUT4(a.wzyx);                          // 15..18
  PUT4(a.xxyy);                          // 19..22
  float4 w = float4(0.0);
  w.xz = a.yw;
  w.yw = float2(7, 8);
  PUT4(w);                               // 23..26: swizzle assignment
  PUT4((vec<float, 4>(a.x, a.yzw)));     // 27..30
  PUT4(float4(float2(1, 2), float2(3, 4)));  // 31..34
  PUT2(float2());                        // 35..36: zero
  PUT2(bfloat2(a.xy));                   // 37..38
  PUT2(half2(1.5h, 2.25h));              // 39..40: half literals
  PUT2(float2(uint2(5, 6)));             // 41..42
  PUT3(metal::float3(a.z, 0.5, 0.25));   // 43..45: unsuffixed literals are float
  int k = 0;
  const int4 t = int4(a);                // conversion truncates toward zero
  iout[k++] = t.x, iout[k++] = t.y, iout[k++] = t.z, iout[k++] = t.w;
  const int4 c = (int4)a;
  iout[k++] = c.x, iout[k++] = c.y;
  iout[k++] = int(as_type<uint>(a.x));   // bits
  iout[k++] = int(as_type<uint>(half2(h.xy)));
  const int2 s = static_cast<int2>(a.zw);  // converts, as a constructor does
  iout[k++] = s.x, iout[k++] = s.y;
}

// fma(a, b, c) in T, rounded once; lanes 0-1 also through the two-component vector form.
template <typename T>
[[kernel]] void lang_fma(const device T* a [[buffer(0)]], const device T* b [[buffer(1)]],
                         const device T* c [[buffer(2)]], device T* out [[buffer(3)]],
                         uint i [[thread_position_in_grid]]) {
  out[i] = fma(a[i], b[i], c[i]);
  if (i < 2) {
    const vec<T, 2> v = fma(vec<T, 2>(a[i], a[i]), vec<T, 2>(b[i], b[i]), vec<T, 2>(c[i], c[i]));
    if (v.x != out[i] && !(isnan(v.x) && isnan(out[i]))) out[i] = T(-1);
  }
}

template [[host_name("lang_fma_f16")]] [[kernel]] decltype(lang_fma<half>) lang_fma<half>;
template [[host_name("lang_fma_bf16")]] [[kernel]] decltype(lang_fma<bfloat>) lang_fma<bfloat>;

// MSL's math constants (tables 6.5 to 6.7), as float.
[[kernel]] void lang_constants(device float* out [[buffer(0)]]) {
  const float c[] = {INFINITY, -INFINITY, NAN, MAXFLOAT, HUGE_VALF, M_PI_F, M_SQRT1_2_F,
                     float(MAXHALF), float(HUGE_VALH), float(M_PI_H), float(M_LN2_H),
                     float(MAXBFLOAT), float(HUGE_VALBF), float(M_PI_BF), float(M_E_BF)};
  for (uint k = 0; k < 15; ++k) out[k] = c[k];
}
