// MSL 4 tensors (<metal_tensor>): extents, and tensor views of device or threadgroup memory.
//
// What the simulator models (/work/shared/METAL4_TENSOR_OPS.md, "Surface" and "Specified"):
//   - dimension 0 is the innermost (a 2-D tensor's extents are (columns, rows)); strides are in
//     elements and start with 1;
//   - extents are static (a number: no edge checks) or dynamic_extent (read from the value);
//   - slice(x, y) moves the origin and keeps the original tensor's extents: a dynamic dimension
//     of a slice is edge-checked against the original tensor (elements past it read as zero in a
//     tensor operation and are not written); slice<C, R>(x, y) gives static extents, which are
//     not checked: an element past the original tensor reads as poison (NaN; "NaN or garbage"
//     on M5) and writing one is an error;
//   - element offsets are int32 arithmetic (an offset of 2^31 elements or more wraps, as on the
//     GPU, and the wrapped address is then out of bounds).
// Only tensor_inline tensors (a pointer with extents and strides) exist here; tensor_handle
// (an MTLTensor argument) is not modelled.
#pragma once

#include "types.h"

#if __METAL_VERSION__ < 400
#error "<metal_tensor> needs MSL 4 (-std=metal4.0; the simulator compiles *_msl4.metal files so)"
#endif

namespace metal {

inline constexpr size_t dynamic_extent = size_t(-1);

namespace steel_tensor {
template <size_t... E>
constexpr size_t count_dynamic() {
  return ((E == dynamic_extent ? 1 : 0) + ... + 0);
}
}  // namespace steel_tensor

template <typename IndexType, size_t... Extents>
struct extents {
  using index_type = IndexType;
  static constexpr size_t steel_rank = sizeof...(Extents);
  static constexpr size_t steel_static[steel_rank] = {Extents...};
  static_assert(steel_rank >= 1 && steel_rank <= 2,
                "the simulator's tensors have rank 1 or 2 (what matmul2d and the reductions use)");
  static_assert(__is_same(IndexType, int) || __is_same(IndexType, short) ||
                    __is_same(IndexType, ushort) || __is_same(IndexType, uint),
                "tensor extents are indexed by a 16- or 32-bit integer");

  IndexType steel_values[steel_rank];

  // Static extents only.
  constexpr extents() : steel_values() {
    for (size_t d = 0; d < steel_rank; ++d) steel_values[d] = IndexType(steel_static[d]);
  }
  // One value per dynamic extent, innermost first (or one per extent, as std::extents allows).
  template <typename... I>
  constexpr explicit extents(I... values) : steel_values() {
    static_assert(sizeof...(I) == steel_tensor::count_dynamic<Extents...>() ||
                      sizeof...(I) == steel_rank,
                  "extents: one value per dynamic extent (or one per extent)");
    const IndexType v[] = {IndexType(values)...};
    size_t next = 0;
    for (size_t d = 0; d < steel_rank; ++d) {
      if (sizeof...(I) == steel_rank) {
        steel_values[d] = v[d];
      } else {
        steel_values[d] = steel_static[d] == dynamic_extent ? v[next++] : IndexType(steel_static[d]);
      }
    }
  }

  static constexpr size_t rank() { return steel_rank; }
  static constexpr size_t static_extent(size_t d) { return steel_static[d]; }
  constexpr IndexType extent(size_t d) const { return steel_values[d]; }
};

namespace steel_tensor {
template <typename IndexType, size_t Rank>
struct dextents_of;
template <typename IndexType>
struct dextents_of<IndexType, 1> {
  using type = extents<IndexType, dynamic_extent>;
};
template <typename IndexType>
struct dextents_of<IndexType, 2> {
  using type = extents<IndexType, dynamic_extent, dynamic_extent>;
};
}  // namespace steel_tensor

template <typename IndexType, size_t Rank>
using dextents = typename steel_tensor::dextents_of<IndexType, Rank>::type;

struct tensor_inline {};
struct tensor_handle {};
struct tensor_offset {};

// ElementType carries the address space: tensor<device half, dextents<int32_t, 2>, tensor_inline>.
template <typename ElementType, typename Extents, typename Descriptor = tensor_handle>
struct tensor {
  static_assert(__is_same(Descriptor, tensor_inline),
                "the simulator models tensor_inline tensors (a pointer, extents and strides)");
  static_assert(remove_address_space<ElementType>::value == 1 ||
                    remove_address_space<ElementType>::value == 3,
                "a tensor_inline tensor views device or threadgroup memory");
  using element_type = ElementType;
  using value_type = remove_cv_t<remove_address_space_t<ElementType>>;
  using extents_type = Extents;
  using index_type = typename Extents::index_type;
  static constexpr size_t steel_rank = Extents::rank();

  // The original tensor: element 0, extents (what dynamic dimensions are edge-checked against)
  // and strides; the view's origin in it. A slice shares all but the origin and static extents.
  ElementType* steel_data;
  int32_t steel_ext[steel_rank];
  int32_t steel_stride[steel_rank];
  int32_t steel_origin[steel_rank];

  tensor(ElementType* data, Extents e) : steel_data(data) {
    int32_t packed = 1;
    for (size_t d = 0; d < steel_rank; ++d) {
      steel_ext[d] = int32_t(e.extent(d));
      steel_stride[d] = packed;
      steel_origin[d] = 0;
      packed = int32_t(uint32_t(packed) * uint32_t(steel_ext[d]));
    }
  }
  tensor(ElementType* data, Extents e, array<index_type, steel_rank> strides) : steel_data(data) {
    for (size_t d = 0; d < steel_rank; ++d) {
      steel_ext[d] = int32_t(e.extent(d));
      steel_stride[d] = int32_t(strides[d]);
      steel_origin[d] = 0;
    }
    if (steel_stride[0] != 1) {
      steel_sim::fail("tensor: the stride of dimension 0 (the innermost) must be 1");
    }
  }

  // The extent of dimension d: a static one, or the original tensor's (slices keep it).
  index_type get_extent(size_t d) const {
    return Extents::static_extent(d) == dynamic_extent ? index_type(steel_ext[d])
                                                       : index_type(Extents::static_extent(d));
  }
  static constexpr size_t get_rank() { return steel_rank; }
  index_type get_stride(size_t d) const { return index_type(steel_stride[d]); }

  // Elements [origin, origin + extent) of dimension d that the view covers: a static extent, or
  // up to the original tensor's edge.
  int32_t steel_extent(size_t d) const {
    if (Extents::static_extent(d) != dynamic_extent) return int32_t(Extents::static_extent(d));
    const int32_t n = steel_ext[d] - steel_origin[d];
    return n > 0 ? n : 0;
  }
  // Whether view element i of dimension d lies inside the original tensor.
  bool steel_inside(size_t d, int32_t i) const {
    const int32_t at = steel_origin[d] + i;
    return at >= 0 && at < steel_ext[d];
  }
  // The address of view element (i0, i1): int32 offsets, wrapping as on the GPU.
  ElementType* steel_at(int32_t i0, int32_t i1 = 0) const {
    uint32_t off = uint32_t(steel_origin[0] + i0) * uint32_t(steel_stride[0]);
    if constexpr (steel_rank > 1) off += uint32_t(steel_origin[1] + i1) * uint32_t(steel_stride[1]);
    return steel_data + int32_t(off);
  }

  template <typename... I>
  tensor slice(I... origin) const {
    static_assert(sizeof...(I) == steel_rank, "slice: one origin per dimension");
    tensor out = *this;
    const int32_t o[] = {int32_t(origin)...};
    for (size_t d = 0; d < steel_rank; ++d) out.steel_origin[d] = steel_origin[d] + o[d];
    return out;
  }
  template <size_t E0, size_t... E, typename... I>
  tensor<ElementType, metal::extents<index_type, E0, E...>, Descriptor> slice(I... origin) const {
    using X = metal::extents<index_type, E0, E...>;
    static_assert(X::rank() == steel_rank && sizeof...(I) == steel_rank,
                  "slice<...>: one extent and one origin per dimension");
    tensor<ElementType, X, Descriptor> out(steel_data, X(), steel_stride_array());
    const int32_t o[] = {int32_t(origin)...};
    for (size_t d = 0; d < steel_rank; ++d) {
      out.steel_ext[d] = steel_ext[d];
      out.steel_origin[d] = steel_origin[d] + o[d];
    }
    return out;
  }

  array<index_type, steel_rank> steel_stride_array() const {
    array<index_type, steel_rank> s;
    for (size_t d = 0; d < steel_rank; ++d) s[d] = index_type(steel_stride[d]);
    return s;
  }
};

template <typename ElementType, typename Extents, typename Strides>
tensor(ElementType*, Extents, Strides) -> tensor<ElementType, Extents, tensor_inline>;

}  // namespace metal
