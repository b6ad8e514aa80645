// The XLA FFI handlers of a matmul kernel (cpu_matmul.cc, cpu_matmul_amx.cc, cpu_matmul_bf16.cc),
// around the kernel's
//   ffi::Error Run(ffi::ThreadPool&, ffi::Buffer<T>& x, ffi::Buffer<T>& w,
//                  ffi::ResultBuffer<ffi::F32>& y, bool transposed)
// for x [..., K] @ w [K, N] (transposed: @ w [N, K]^T) -> float32 y:
//   DSPARK_MATMUL_HANDLERS(Suffix, T, Run) defines DsparkSmallMatmul<Suffix> (x @ w),
//   DsparkSmallMatmul<Suffix>T (x @ w^T), DsparkLayerMatmul<Suffix> (x @ layers[index]) and
//   DsparkLayerMatmul<Suffix>T (x @ layers[index]^T).
// The layer matmul runs inside a scan over layers: every layer's [K, N] (or [N, K]) array is an
// operand and the layer's index a traced one, so the chosen matrix is read in place with no
// conditional of XLA's around the call (a switch over 30 layers cost about 5 us per matmul).

#ifndef DSPARK_JAX_CPU_MATMUL_HANDLERS_H_
#define DSPARK_JAX_CPU_MATMUL_HANDLERS_H_

#include "xla/ffi/api/ffi.h"

namespace dspark {

template <auto Run, xla::ffi::DataType T, bool Transposed>
xla::ffi::Error SmallMatmul(xla::ffi::ThreadPool pool, xla::ffi::Buffer<T> x,
                            xla::ffi::Buffer<T> w, xla::ffi::ResultBuffer<xla::ffi::F32> y) {
  return Run(pool, x, w, y, Transposed);
}

template <auto Run, xla::ffi::DataType T, bool Transposed>
xla::ffi::Error LayerMatmul(xla::ffi::ThreadPool pool, xla::ffi::Buffer<T> x,
                            xla::ffi::Buffer<xla::ffi::S32> index,
                            xla::ffi::RemainingArgs layers,
                            xla::ffi::ResultBuffer<xla::ffi::F32> y) {
  auto w = layers.get<xla::ffi::Buffer<T>>(static_cast<size_t>(index.typed_data()[0]));
  if (!w.has_value()) {
    return xla::ffi::Error::InvalidArgument("layer_matmul: the layer index is out of range");
  }
  return Run(pool, x, *w, y, Transposed);
}

}  // namespace dspark

#define DSPARK_MATMUL_BINDING(Type)      \
  xla::ffi::Ffi::Bind()                  \
      .Ctx<xla::ffi::ThreadPool>()       \
      .Arg<xla::ffi::Buffer<Type>>()     \
      .Arg<xla::ffi::Buffer<Type>>()     \
      .Ret<xla::ffi::Buffer<xla::ffi::F32>>()

#define DSPARK_LAYER_MATMUL_BINDING(Type)         \
  xla::ffi::Ffi::Bind()                           \
      .Ctx<xla::ffi::ThreadPool>()                \
      .Arg<xla::ffi::Buffer<Type>>()              \
      .Arg<xla::ffi::Buffer<xla::ffi::S32>>()     \
      .RemainingArgs()                            \
      .Ret<xla::ffi::Buffer<xla::ffi::F32>>()

#define DSPARK_MATMUL_HANDLERS(Suffix, Type, Run)                                          \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(DsparkSmallMatmul##Suffix,                                 \
                                (dspark::SmallMatmul<Run, Type, false>),                  \
                                DSPARK_MATMUL_BINDING(Type));                              \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(DsparkSmallMatmul##Suffix##T,                              \
                                (dspark::SmallMatmul<Run, Type, true>),                   \
                                DSPARK_MATMUL_BINDING(Type));                              \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(DsparkLayerMatmul##Suffix,                                 \
                                (dspark::LayerMatmul<Run, Type, false>),                  \
                                DSPARK_LAYER_MATMUL_BINDING(Type));                        \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(DsparkLayerMatmul##Suffix##T,                              \
                                (dspark::LayerMatmul<Run, Type, true>),                   \
                                DSPARK_LAYER_MATMUL_BINDING(Type))

#endif  // DSPARK_JAX_CPU_MATMUL_HANDLERS_H_
