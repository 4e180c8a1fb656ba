// The C kernels of cpu_fused.c, cpu_paged_attention.c and cpu_gemm.c as C++ torch operators
// (namespace meshserve_cpu), for the torch.compile'd decode step
// (executor/worker/compiled_decode.py): its generated code calls a C++ operator
// through the dispatcher with no Python in between, where a Python custom op costs
// ~20 us a call, which is what the graph saves. The kernels are not compiled again
// here: set_kernels takes the addresses of the functions in the libraries that
// cpu_fused.py and cpu_kernel.py built and loaded (so the numbers are the eager
// path's, bit for bit). Built by executor/models/cpu_ops.py with
// torch.utils.cpp_extension; float32 CPU tensors only (the callers check).
#include <torch/library.h>
#include <ATen/ATen.h>
#include <cstdint>

typedef void (*norm_fn)(const float*, float*, const float*, float*, int64_t, int64_t, float, int32_t);
typedef void (*rot_fn)(float*, int64_t, int64_t, int64_t, int64_t, const float*, const float*);
typedef void (*silu_fn)(const float*, float*, int64_t, int64_t);
typedef int (*attn_fn)(const void*, const void*, const void*, const int32_t*, int64_t, const int32_t*, void*,
                       int64_t, int64_t, int64_t, int64_t, int64_t, float, int);
static norm_fn k_norm; static rot_fn k_rot; static silu_fn k_silu; static attn_fn k_attn;
static int32_t k_lanes = 8;  // the norm's sum order: cpu_fused.FusedKernels.lanes (measured at load)
typedef int32_t (*gemm_fn)(const float*, int64_t, int64_t, int64_t, const float*, int64_t, float*, int64_t);
static gemm_fn k_gemm;  // cpu_gemm.c's packed_gemm, where it was built (set_gemm)

void set_kernels(int64_t a, int64_t b, int64_t c, int64_t d, int64_t lanes) {
  k_norm = (norm_fn)a; k_rot = (rot_fn)b; k_silu = (silu_fn)c; k_attn = (attn_fn)d; k_lanes = (int32_t)lanes;
}
void set_gemm(int64_t a) { k_gemm = (gemm_fn)a; }
at::Tensor panel_linear(const at::Tensor& x, const at::Tensor& packed, int64_t n) {
  TORCH_CHECK(k_gemm != nullptr, "the CPU GEMM kernel is not loaded");
  TORCH_CHECK(x.scalar_type() == at::kFloat && packed.scalar_type() == at::kFloat && packed.dim() == 3 &&
              packed.is_contiguous() && x.size(-1) == packed.size(1) &&
              (packed.size(0) - 1) * packed.size(2) < n && n <= packed.size(0) * packed.size(2),
              "panel_linear: the input and the packed weight do not match");
  auto k = x.size(-1);
  auto x2 = x.reshape({-1, k});
  if (x2.stride(1) != 1) x2 = x2.contiguous();
  auto sizes = x.sizes().vec();
  sizes.back() = n;
  auto y = at::empty({x2.size(0), n}, x.options());
  if (x2.size(0) > 0)
    TORCH_CHECK(k_gemm(x2.data_ptr<float>(), x2.size(0), k, x2.stride(0), packed.data_ptr<float>(), n,
                       y.data_ptr<float>(), n) == 0, "the CPU GEMM kernel's scratch buffer");
  return y.view(sizes);
}
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  auto out = at::empty_like(x);
  k_norm(nullptr, x.data_ptr<float>(), w.data_ptr<float>(), out.data_ptr<float>(), x.size(0), x.size(1), (float)eps,
         k_lanes);
  return out;
}
at::Tensor add_rms_norm(const at::Tensor& x, at::Tensor& residual, const at::Tensor& w, double eps) {
  auto out = at::empty_like(residual);
  auto xc = x.contiguous();
  k_norm(xc.data_ptr<float>(), residual.data_ptr<float>(), w.data_ptr<float>(), out.data_ptr<float>(),
         residual.size(0), residual.size(1), (float)eps, k_lanes);
  return out;
}
void rotary_(at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  k_rot(x.data_ptr<float>(), x.stride(0), x.size(0), x.size(1), x.size(2), cos.data_ptr<float>(), sin.data_ptr<float>());
}
at::Tensor silu_mul(const at::Tensor& g) {
  auto out = at::empty({g.size(0), g.size(1) / 2}, g.options());
  k_silu(g.data_ptr<float>(), out.data_ptr<float>(), g.size(0), g.size(1) / 2);
  return out;
}
at::Tensor padded_decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& kc,
                                   at::Tensor& vc, const at::Tensor& slots, const at::Tensor& bt,
                                   const at::Tensor& seq_lens, const at::Tensor& num_valid, double scale) {
  int64_t n = num_valid.item<int64_t>();
  int64_t kvh = kc.size(2), d = kc.size(3);
  auto s = slots.slice(0, 0, n);
  kc.view({-1, kvh, d}).index_copy_(0, s, k.slice(0, 0, n));
  vc.view({-1, kvh, d}).index_copy_(0, s, v.slice(0, 0, n));
  auto out = at::empty(q.sizes(), q.options());
  if (n < q.size(0)) out.slice(0, n).zero_();
  auto qc = q.slice(0, 0, n).contiguous();
  int rc = k_attn(qc.data_ptr(), kc.data_ptr(), vc.data_ptr(), bt.data_ptr<int32_t>(), bt.stride(0),
                  seq_lens.data_ptr<int32_t>(), out.data_ptr(), n, q.size(1), kvh, d, kc.size(1), (float)scale, 0);
  TORCH_CHECK(rc == 0, "attention scratch");
  return out;
}
// padded_decode_attention writes the caches in place but its schema does not say so:
// a layer's key and value caches are views of one allocation (executor/worker/kv_cache.py),
// and inductor re-inplaces only one mutated argument per storage, so with the mutation
// declared every step copied each layer's value cache (with its keys: 34 MB a layer at
// 1 GiB) out and back (30 layers: ~1 GB each way a step, several times slower than eager).
// The graph has no other reader or writer of the caches, so the undeclared write cannot
// be reordered against one (vLLM's attention op likewise reaches its caches outside the graph).
TORCH_LIBRARY(meshserve_cpu, m) {
  m.def("set_kernels(int a, int b, int c, int d, int lanes) -> ()");
  m.def("set_gemm(int a) -> ()");
  m.def("panel_linear(Tensor x, Tensor packed, int out_features) -> Tensor");
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor(a!) residual, Tensor weight, float eps) -> Tensor");
  m.def("rotary_(Tensor(a!) x, Tensor cos, Tensor sin) -> ()");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.def("padded_decode_attention(Tensor q, Tensor k, Tensor v, Tensor key_cache, Tensor value_cache, Tensor slot_mapping, Tensor block_table, Tensor seq_lens, Tensor num_valid, float scale) -> Tensor");
}
TORCH_LIBRARY_IMPL(meshserve_cpu, CPU, m) {
  m.impl("rms_norm", rms_norm); m.impl("add_rms_norm", add_rms_norm); m.impl("rotary_", rotary_);
  m.impl("silu_mul", silu_mul); m.impl("padded_decode_attention", padded_decode_attention);
  m.impl("panel_linear", panel_linear);
}
TORCH_LIBRARY_IMPL(meshserve_cpu, CompositeExplicitAutograd, m) {
  m.impl("set_kernels", set_kernels); m.impl("set_gemm", set_gemm);
}
