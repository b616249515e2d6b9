// The simulated tpu device's native core (optional; see hf_tpu/sim/_native.py and docs/simulator.md).
//
// Built on first use with torch.utils.cpp_extension when a C++ compiler is present. It owns what the Python
// fallback (_ops.py) would otherwise do once per op in Python:
//   - device storages: a PrivateUse1 storage over a CPU storage's memory that keeps the CPU storage alive
//     (the DataPtr's context) and counts its bytes as device memory while it lives;
//   - a boxed kernel per eligible aten op: swap each device tensor for a CPU tensor over the same memory,
//     run the CPU kernel, give each result the device storage it aliases or a fresh one, and count the op and
//     its shape signature exactly as hf_tpu/sim/_signature.py defines it;
//   - metadata-only view ops, redispatched to their CPU kernel.
// Anything the fast path does not cover (a CPU tensor argument, a float32 contraction at the emulated 'high'
// precision, a foreign storage, ...)
// goes to the op's Python kernel unchanged, which raises the simulator's usual errors.

#include <ATen/detail/PrivateUse1HooksInterface.h>
#include <c10/core/CPUAllocator.h>
#include <torch/extension.h>
#include <torch/library.h>
#include <torch/csrc/DynamicTypes.h>
#include <torch/csrc/Storage.h>
#include <torch/csrc/utils/tensor_memoryformats.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/jit/python/pybind_utils.h>

#include <atomic>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_set>
#include <vector>

namespace {

// How an argument enters the shape signature (the same codes as _signature.py).
enum Kind : int8_t { CONV = 0, BAKE = 1, SCALAR = 2, SKIP = 3, SCALARS = 4 };

std::atomic<int64_t> g_live{0}, g_peak{0}, g_window{0}, g_ops{0}, g_sigs{0}, g_hbm{0};
std::atomic<int64_t> g_in_graph{0};
std::atomic<int> g_emulate{0};  // float32 contractions: 0 the CPU's, 1 one bf16 pass here ('medium'), 2 in Python
std::mutex g_seen_mu;
std::unordered_set<uint64_t> g_seen;
PyObject* g_check_oom = nullptr;  // hf_tpu.sim._tensors.check_oom (a leaked reference: lives with the process)

void raise_max(std::atomic<int64_t>& m, int64_t v) {
  int64_t cur = m.load();
  while (v > cur && !m.compare_exchange_weak(cur, v)) {
  }
}

// ---- device storages ------------------------------------------------------------------------------------

struct Holder {
  c10::Storage cpu;
  int64_t nbytes;
};

void release(void* ctx) {
  auto* h = static_cast<Holder*>(ctx);
  g_live.fetch_sub(h->nbytes);
  delete h;
}

c10::Storage make_storage(const c10::Storage& cpu) {
  const int64_t n = static_cast<int64_t>(cpu.nbytes());
  void* p = cpu.mutable_data();
  auto* h = new Holder{cpu, n};
  c10::DataPtr dp(p, h, &release, c10::Device(c10::DeviceType::PrivateUse1, 0));
  const int64_t live = g_live.fetch_add(n) + n;
  raise_max(g_peak, live);
  raise_max(g_window, live);
  return c10::Storage(c10::Storage::use_byte_size_t(), static_cast<size_t>(n), std::move(dp), nullptr, false);
}

Holder* holder_of(const c10::Storage& s) {
  if (!s) {
    return nullptr;
  }
  const c10::DataPtr& dp = s.data_ptr();
  if (dp.get_deleter() != &release) {
    return nullptr;
  }
  return static_cast<Holder*>(dp.get_context());
}

at::Tensor over(c10::Storage storage, c10::DispatchKey key, const at::Tensor& like) {
  auto t = at::detail::make_tensor<c10::TensorImpl>(std::move(storage), c10::DispatchKeySet(key), like.dtype());
  t.unsafeGetTensorImpl()->set_sizes_and_strides(like.sizes(), like.strides(), like.storage_offset());
  return t;
}

// A new device storage over ``cpu``, after the same out-of-memory check as the Python path's (which raises the
// simulator's OutOfMemoryError through Python).
c10::Storage checked_storage(const c10::Storage& cpu, const std::string& what) {
  const int64_t nbytes = static_cast<int64_t>(cpu.nbytes());
  const int64_t hbm = g_hbm.load(std::memory_order_relaxed);
  if (hbm && g_live.load() + nbytes > hbm && g_check_oom != nullptr) {
    py::gil_scoped_acquire gil;
    py::reinterpret_borrow<py::object>(g_check_oom)(nbytes, what);
  }
  return make_storage(cpu);
}

// torch's Python name of a layout (torch.sparse_coo, ...), as the Python fallback's messages print it.
const char* layout_name(c10::Layout layout) {
  switch (layout) {
    case c10::kStrided:
      return "torch.strided";
    case c10::kSparse:
      return "torch.sparse_coo";
    case c10::kSparseCsr:
      return "torch.sparse_csr";
    case c10::kSparseCsc:
      return "torch.sparse_csc";
    case c10::kSparseBsr:
      return "torch.sparse_bsr";
    case c10::kSparseBsc:
      return "torch.sparse_bsc";
    case c10::kMkldnn:
      return "torch._mkldnn";
    case c10::kJagged:
      return "torch.jagged";
    default:
      return "non-strided";
  }
}

// ---- shape signatures -------------------------------------------------------------------------------------

inline void mix(uint64_t& h, uint64_t v) {
  v += 0x9e3779b97f4a7c15ULL + (h << 6) + (h >> 2);
  v ^= v >> 30;
  v *= 0xbf58476d1ce4e5b9ULL;
  v ^= v >> 27;
  v *= 0x94d049bb133111ebULL;
  v ^= v >> 31;
  h ^= v;
}

inline void mix_meta(uint64_t& h, const at::Tensor& t) {
  mix(h, 0x7e450001ULL + static_cast<uint64_t>(t.dim()));
  for (auto s : t.sizes()) {
    mix(h, static_cast<uint64_t>(s));
  }
  mix(h, 0x0d7e0000ULL + static_cast<uint64_t>(t.scalar_type()));
}

// A tensor argument: its shape and dtype. False: the fast path does not take it (the Python kernel will).
bool key_tensor(const at::Tensor& t, uint64_t& h) {
  if (!t.defined()) {
    mix(h, 0x40e0ULL);
    return true;
  }
  if (t.layout() != c10::kStrided || !t.has_storage()) {
    return false;
  }
  const auto type = t.device().type();
  if (type == c10::DeviceType::PrivateUse1) {
    if (holder_of(t.storage()) == nullptr || t.is_conj() || t.is_neg()) {
      return false;
    }
    mix_meta(h, t);
    return true;
  }
  if (type == c10::DeviceType::CPU && t.dim() == 0) {  // a scalar: a runtime value, as on a real device
    if (t.unsafeGetTensorImpl()->is_wrapped_number()) {
      mix(h, 0x5ca1a000ULL + (c10::isFloatingType(t.scalar_type()) ? 1 : c10::isComplexType(t.scalar_type()) ? 2 : 0));
    } else {
      mix_meta(h, t);
      mix(h, 0xc9c9ULL);
    }
    return true;
  }
  return false;  // a CPU tensor with data, or another device: the Python kernel counts or refuses it
}

bool key_conv(const c10::IValue& a, uint64_t& h) {
  if (a.isNone()) {
    mix(h, 0x40e1ULL);
    return true;
  }
  if (a.isTensor()) {
    return key_tensor(a.toTensor(), h);
  }
  if (a.isTensorList()) {
    auto list = a.toTensorList();
    mix(h, 0x1157ULL + list.size());
    for (const at::Tensor& t : list) {
      if (!key_tensor(t, h)) {
        return false;
      }
    }
    return true;
  }
  if (a.isDevice()) {  // tpu:0 becomes the CPU (no part of the signature); anything else: the Python kernel
    const c10::Device d = a.toDevice();
    return d.type() == c10::DeviceType::PrivateUse1 && (!d.has_index() || d.index() == 0);
  }
  return false;  // optional tensor lists, storages: the Python kernel
}

bool key_baked(const c10::IValue& a, uint64_t& h) {
  if (a.isNone()) {
    mix(h, 0x40e2ULL);
  } else if (a.isBool()) {
    mix(h, 0xb0000ULL + a.toBool());
  } else if (a.isInt()) {
    mix(h, 0x1a7ULL);
    mix(h, static_cast<uint64_t>(a.toInt()));
  } else if (a.isDouble()) {
    double d = a.toDouble();
    uint64_t bits;
    std::memcpy(&bits, &d, sizeof bits);
    mix(h, 0xd0ULL);
    mix(h, bits);
  } else if (a.isString()) {
    mix(h, 0x57ULL);
    mix(h, std::hash<std::string>{}(a.toStringRef()));
  } else if (a.isIntList()) {
    auto list = a.toIntList();
    mix(h, 0x11a7ULL + list.size());
    for (int64_t v : list) {
      mix(h, static_cast<uint64_t>(v));
    }
  } else if (a.isBoolList()) {
    auto list = a.toBoolList();
    mix(h, 0x11b0ULL + list.size());
    for (bool v : list) {
      mix(h, v);
    }
  } else if (a.isDoubleList()) {
    auto list = a.toDoubleList();
    mix(h, 0x11d0ULL + list.size());
    for (double d : list) {
      uint64_t bits;
      std::memcpy(&bits, &d, sizeof bits);
      mix(h, bits);
    }
  } else {
    return false;
  }
  return true;
}

uint64_t scalar_code(const c10::IValue& a) {
  if (a.isBool()) {
    return 3;
  }
  if (a.isInt()) {
    return 1;
  }
  if (a.isDouble()) {
    return 2;
  }
  if (a.isComplexDouble()) {
    return 4;
  }
  return 5;
}

bool key_scalar(const c10::IValue& a, uint64_t& h) {
  if (a.isNone()) {
    mix(h, 0x40e3ULL);
    return true;
  }
  if (!(a.isBool() || a.isInt() || a.isDouble() || a.isComplexDouble())) {
    return false;
  }
  mix(h, 0x5ca10000ULL + scalar_code(a));
  // 0, 1 and -1 are special values that torch_tpu keeps in the program (see _signature.py)
  double v = a.isBool() ? a.toBool() : a.isInt() ? static_cast<double>(a.toInt()) : a.isDouble() ? a.toDouble() : 2.0;
  if (a.isComplexDouble()) {
    auto c = a.toComplexDouble();
    v = c.imag() == 0 ? c.real() : 2.0;
  }
  if (v == 0.0 || v == 1.0 || v == -1.0) {
    mix(h, 0x5e00ULL + static_cast<uint64_t>(static_cast<int64_t>(v) + 1));
  }
  return true;
}

bool key_scalars(const c10::IValue& a, uint64_t& h) {
  if (a.isNone()) {
    mix(h, 0x40e4ULL);
    return true;
  }
  if (!a.isList()) {
    return false;
  }
  auto list = a.toListRef();
  mix(h, 0x115cULL + list.size());
  for (const c10::IValue& x : list) {
    mix(h, scalar_code(x));
  }
  return true;
}

// ---- the Python kernel, for what the fast path does not take ----------------------------------------------

void push_python_result(const c10::FunctionSchema& schema, PyObject* out, torch::jit::Stack* stack) {
  const size_t nret = schema.returns().size();
  auto push_one = [&](PyObject* o) {
    if (o == Py_None) {
      stack->emplace_back(at::Tensor());
    } else if (THPVariable_Check(o)) {
      stack->emplace_back(THPVariable_Unpack(o));
    } else {
      TORCH_CHECK(false, schema.name(), ": the simulated device's Python kernel returned ", Py_TYPE(o)->tp_name,
                  " where a tensor was expected");
    }
  };
  if (nret == 1) {
    push_one(out);
    return;
  }
  TORCH_CHECK(PyTuple_Check(out) && static_cast<size_t>(PyTuple_GET_SIZE(out)) == nret, schema.name(),
              ": the simulated device's Python kernel returned the wrong number of results");
  for (size_t i = 0; i < nret; ++i) {
    push_one(PyTuple_GET_ITEM(out, i));
  }
}

// One argument as the Python trampoline passes it: dtypes, layouts and memory formats as torch's objects (they are
// ints on the stack), everything else through torch::jit::toPyObject (a wrapped number becomes a Python number).
py::object to_python(const c10::Argument& arg, c10::IValue v) {
  if (v.isInt()) {
    c10::TypePtr type = arg.type();
    if (auto opt = type->castRaw<c10::OptionalType>()) {
      type = opt->getElementType();
    }
    switch (type->kind()) {
      case c10::TypeKind::ScalarTypeType:
        return py::reinterpret_borrow<py::object>(
            reinterpret_cast<PyObject*>(torch::getTHPDtype(static_cast<c10::ScalarType>(v.toInt()))));
      case c10::TypeKind::LayoutType:
        return py::reinterpret_borrow<py::object>(
            reinterpret_cast<PyObject*>(torch::getTHPLayout(static_cast<c10::Layout>(v.toInt()))));
      case c10::TypeKind::MemoryFormatType:
        return py::reinterpret_borrow<py::object>(
            torch::utils::getTHPMemoryFormat(static_cast<c10::MemoryFormat>(v.toInt())));
      default:
        break;
    }
  }
  return torch::jit::toPyObject(std::move(v));
}

void call_python(PyObject* kernel, const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const auto& schema = op.schema();
  const size_t n = schema.arguments().size();
  const size_t base = stack->size() - n;
  py::gil_scoped_acquire gil;
  py::list args;
  py::dict kwargs;
  for (size_t i = 0; i < n; ++i) {
    const auto& arg = schema.arguments()[i];
    py::object o = to_python(arg, std::move((*stack)[base + i]));
    if (arg.kwarg_only()) {
      kwargs[py::str(arg.name())] = o;
    } else {
      args.append(o);
    }
  }
  torch::jit::drop(*stack, n);
  py::object out = py::reinterpret_borrow<py::object>(kernel)(*py::tuple(args), **kwargs);
  push_python_result(schema, out.ptr(), stack);
}

// ---- in-place ops and out= -----------------------------------------------------------------------------------
//
// After an op that writes its arguments, each device tensor follows its CPU alias: the CPU kernel may have resized
// it (new memory in the same CPU storage, or a new size, stride or offset), or pointed it at another storage
// (set_). As _ops._write_back does on the Python path.

void write_back(c10::SmallVector<std::pair<at::Tensor, at::Tensor>, 4>& pairs, const std::string& display) {
  for (auto& [alias, dev] : pairs) {
    const c10::Storage& cs = alias.storage();
    c10::StorageImpl* ws = dev.storage().unsafeGetStorageImpl();
    Holder* hd = holder_of(dev.storage());
    if (hd == nullptr) {
      continue;
    }
    if (cs.unsafeGetStorageImpl() != hd->cpu.unsafeGetStorageImpl()) {
      // another storage: an input's device storage, or fresh memory
      c10::Storage target;
      for (auto& [other_alias, other_dev] : pairs) {
        Holder* oh = holder_of(other_dev.storage());
        if (oh != nullptr && oh->cpu.unsafeGetStorageImpl() == cs.unsafeGetStorageImpl()) {
          target = other_dev.storage();
          break;
        }
      }
      if (!target) {
        target = checked_storage(cs, display);
      }
      dev.unsafeGetTensorImpl()->set_storage_keep_dtype(std::move(target));
    } else if (cs.data_ptr().get() != ws->data_ptr().get() || static_cast<int64_t>(cs.nbytes()) != hd->nbytes) {
      // the CPU storage was reallocated (resize): the device storage points at the new memory, counted anew
      c10::Storage fresh = checked_storage(cs, display);
      ws->set_data_ptr_noswap(std::move(fresh.unsafeGetStorageImpl()->mutable_data_ptr()));  // frees the old holder
      ws->set_nbytes(cs.nbytes());
    }
    if (alias.sizes() != dev.sizes() || alias.strides() != dev.strides() ||
        alias.storage_offset() != dev.storage_offset()) {
      dev.unsafeGetTensorImpl()->set_sizes_and_strides(alias.sizes(), alias.strides(), alias.storage_offset());
    }
  }
}

// ---- the fast kernel --------------------------------------------------------------------------------------

struct FastKernel final : c10::OperatorKernel {
  std::vector<int8_t> kinds;
  uint64_t seed;
  std::string display;  // the op as Python prints it (aten.add.Tensor), for error messages
  bool precision_op;     // a contraction: with float32 operands it runs at the emulated precision (g_emulate)
  int8_t first_operand;  // its two operands: arguments first_operand and first_operand + 1 (addmm's are 1 and 2)
  bool mutable_op;    // writes an argument: its device tensor follows what the CPU kernel did to it
  PyObject* python;   // the op's Python kernel (a leaked reference: lives with the process)

  void operator()(const c10::OperatorHandle& op, c10::DispatchKeySet, torch::jit::Stack* stack) {
    const auto& schema = op.schema();
    const size_t n = schema.arguments().size();
    const size_t base = stack->size() - n;
    uint64_t h = seed;
    bool ok = kinds.size() == n;
    // A reduced precision emulated (hf_tpu/sim/_precision.py): a float32 contraction's operands are rounded to
    // bfloat16 here for one pass ('medium'), or the Python kernel runs its passes ('high').
    const int emulate = precision_op && ok ? g_emulate.load(std::memory_order_relaxed) : 0;
    bool round_operands = false;
    if (emulate != 0) {
      const c10::IValue& a = (*stack)[base + first_operand];
      const c10::IValue& b = (*stack)[base + first_operand + 1];
      if (a.isTensor() && b.isTensor() && a.toTensor().scalar_type() == at::kFloat &&
          b.toTensor().scalar_type() == at::kFloat) {
        round_operands = emulate == 1;
        ok = emulate == 1;
      }
    }
    for (size_t i = 0; ok && i < n; ++i) {
      const c10::IValue& a = (*stack)[base + i];
      switch (kinds[i]) {
        case CONV:
          ok = key_conv(a, h);
          break;
        case BAKE:
          ok = key_baked(a, h);
          break;
        case SCALAR:
          ok = key_scalar(a, h);
          break;
        case SCALARS:
          ok = key_scalars(a, h);
          break;
        default:
          break;
      }
    }
    if (!ok) {
      call_python(python, op, stack);
      return;
    }
    // Device tensors become CPU tensors over the same memory (the keys above checked every one of them).
    c10::SmallVector<std::pair<at::Tensor, at::Tensor>, 4> pairs;  // CPU alias -> device tensor
    auto host = [&](const at::Tensor& t) -> at::Tensor {
      Holder* hd = holder_of(t.storage());
      at::Tensor c = over(hd->cpu, c10::DispatchKey::CPU, t);
      pairs.emplace_back(c, t);
      return c;
    };
    for (size_t i = 0; i < n; ++i) {
      if (kinds[i] != CONV) {
        continue;
      }
      c10::IValue& a = (*stack)[base + i];
      if (a.isTensor()) {
        const at::Tensor& t = a.toTensor();
        if (t.defined() && t.device().type() == c10::DeviceType::PrivateUse1) {
          a = host(t);
        }
      } else if (a.isTensorList()) {
        auto list = a.toTensorList();
        c10::List<at::Tensor> converted;
        converted.reserve(list.size());
        for (const at::Tensor& t : list) {
          converted.push_back(t.defined() && t.device().type() == c10::DeviceType::PrivateUse1 ? host(t) : t);
        }
        a = c10::IValue(std::move(converted));
      } else if (a.isDevice()) {
        a = c10::IValue(c10::Device(c10::DeviceType::CPU));
      }
    }
    if (round_operands) {  // as _precision._passes: each float32 operand through bfloat16, the product in float32
      for (size_t i = base + first_operand; i < base + first_operand + 2; ++i) {
        (*stack)[i] = (*stack)[i].toTensor().to(at::kBFloat16).to(at::kFloat);
      }
    }
    try {
      op.redispatchBoxed(c10::DispatchKeySet(c10::DispatchKey::CPU), stack);
    } catch (const c10::NotImplementedError& e) {
      TORCH_CHECK_NOT_IMPLEMENTED(false, display, " is not supported on the simulated tpu device: ",
                                  e.what_without_backtrace());
    }
    if (mutable_op) {
      write_back(pairs, display);
    }
    // Results: an input itself, a view of an input's memory, or fresh memory (a new device allocation).
    const size_t nret = schema.returns().size();
    c10::SmallVector<std::pair<const c10::StorageImpl*, c10::Storage>, 2> fresh;
    for (size_t i = stack->size() - nret; i < stack->size(); ++i) {
      c10::IValue& r = (*stack)[i];
      if (!r.isTensor()) {
        continue;
      }
      const at::Tensor& t = r.toTensor();
      if (!t.defined()) {
        continue;
      }
      mix_meta(h, t);
      bool done = false;
      for (auto& [alias, dev] : pairs) {
        if (alias.unsafeGetTensorImpl() == t.unsafeGetTensorImpl()) {
          r = dev;
          done = true;
          break;
        }
      }
      if (done || !t.is_cpu()) {
        continue;
      }
      TORCH_CHECK_NOT_IMPLEMENTED(t.layout() == c10::kStrided, display, ": ", layout_name(t.layout()),
                                  " tensors are not supported on the simulated tpu device (torch_tpu supports "
                                  "strided tensors only); use dense tensors, or run this op on the CPU.");
      const c10::StorageImpl* cs = t.storage().unsafeGetStorageImpl();
      c10::Storage ws;
      for (auto& [alias, dev] : pairs) {
        Holder* hd = holder_of(dev.storage());
        if (hd != nullptr && hd->cpu.unsafeGetStorageImpl() == cs) {
          ws = dev.storage();
          break;
        }
      }
      if (!ws) {
        for (auto& [impl, st] : fresh) {
          if (impl == cs) {
            ws = st;
            break;
          }
        }
      }
      if (!ws) {
        ws = checked_storage(t.storage(), display);
        fresh.emplace_back(cs, ws);
      }
      at::Tensor w = over(ws, c10::DispatchKey::PrivateUse1, t);
      if (t.is_conj()) {
        w._set_conj(true);
      }
      if (t.is_neg()) {
        w._set_neg(true);
      }
      r = std::move(w);
    }
    g_ops.fetch_add(1, std::memory_order_relaxed);
    if (g_in_graph.load(std::memory_order_relaxed) == 0) {
      std::lock_guard<std::mutex> lock(g_seen_mu);
      if (g_seen.insert(h).second) {
        g_sigs.fetch_add(1, std::memory_order_relaxed);
      }
    }
  }
};

// ---- hooks: pinned host memory and storage resizing ------------------------------------------------------------
//
// torch asks the PrivateUse1 hooks for the accelerator's pinned-memory allocator (torch.empty(n, pin_memory=True),
// DDP's reducer) and to resize a device storage in place; a backend written in Python cannot provide either.
// Pinned memory here is ordinary CPU memory remembered as pinned while it lives (it only makes DMA faster on a chip).

std::mutex g_pinned_mu;
std::unordered_set<const void*> g_pinned;

void free_pinned(void* ctx) {
  auto* owner = static_cast<c10::DataPtr*>(ctx);
  {
    std::lock_guard<std::mutex> lock(g_pinned_mu);
    g_pinned.erase(owner->get());
  }
  delete owner;
}

struct PinnedAllocator final : c10::Allocator {
  c10::DataPtr allocate(size_t n) override {
    auto* owner = new c10::DataPtr(c10::GetCPUAllocator()->allocate(n));
    void* p = owner->get();
    if (p != nullptr) {
      std::lock_guard<std::mutex> lock(g_pinned_mu);
      g_pinned.insert(p);
    }
    return c10::DataPtr(p, owner, &free_pinned, c10::Device(c10::DeviceType::CPU));
  }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
};

PinnedAllocator g_pinned_allocator;

bool is_pinned_ptr(const void* p) {
  std::lock_guard<std::mutex> lock(g_pinned_mu);
  return g_pinned.count(p) != 0;
}

struct Hooks final : at::PrivateUse1HooksInterface {
  bool isBuilt() const override {
    return true;
  }
  bool isAvailable() const override {
    return true;
  }
  bool hasPrimaryContext(c10::DeviceIndex) const override {
    return true;
  }
  bool isPinnedPtr(const void* data) const override {
    return is_pinned_ptr(data);
  }
  c10::Allocator* getPinnedMemoryAllocator() const override {
    return &g_pinned_allocator;
  }
  void resizePrivateUse1Bytes(const c10::Storage& storage, size_t newsize) const override {
    Holder* h = holder_of(storage);
    TORCH_CHECK(h != nullptr, "resize_: not a storage of the simulated tpu device");
    const int64_t n = static_cast<int64_t>(newsize);
    const int64_t hbm = g_hbm.load();
    if (hbm && g_live.load() - h->nbytes + n > hbm && g_check_oom != nullptr) {
      py::gil_scoped_acquire gil;
      py::reinterpret_borrow<py::object>(g_check_oom)(n - h->nbytes, "untyped_storage().resize_");
    }
    c10::Storage cpu(c10::Storage::use_byte_size_t(), newsize, c10::GetCPUAllocator(), /*resizable=*/true);
    const size_t keep = std::min(newsize, h->cpu.nbytes());
    if (keep > 0) {
      std::memcpy(cpu.mutable_data(), h->cpu.data(), keep);
    }
    c10::Storage fresh = make_storage(cpu);  // counted; the old holder is released when its DataPtr goes
    c10::StorageImpl* impl = storage.unsafeGetStorageImpl();
    impl->set_data_ptr_noswap(std::move(fresh.unsafeGetStorageImpl()->mutable_data_ptr()));
    impl->set_nbytes(newsize);
  }
};

Hooks g_hooks;

void view_kernel(const c10::OperatorHandle& op, c10::DispatchKeySet, torch::jit::Stack* stack) {
  op.redispatchBoxed(c10::DispatchKeySet(c10::DispatchKey::CPU), stack);
}

std::unique_ptr<torch::Library> g_lib;

torch::Library& lib() {
  if (!g_lib) {
    g_lib = std::make_unique<torch::Library>(torch::Library::IMPL, "aten", c10::DispatchKey::PrivateUse1, __FILE__,
                                             __LINE__);
  }
  return *g_lib;
}

}  // namespace

// ---- Python bindings ----------------------------------------------------------------------------------------

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("make_storage", [](py::handle cpu) {
    TORCH_CHECK(THPStorage_Check(cpu.ptr()), "make_storage expects a CPU UntypedStorage");
    const c10::Storage& s = THPStorage_Unpack(cpu.ptr());
    TORCH_CHECK(s.device_type() == c10::DeviceType::CPU, "make_storage expects a CPU UntypedStorage");
    return py::reinterpret_steal<py::object>(THPStorage_Wrap(make_storage(s)));
  });
  m.def("host_storage", [](py::handle dev) -> py::object {
    if (!THPStorage_Check(dev.ptr())) {
      return py::none();
    }
    Holder* h = holder_of(THPStorage_Unpack(dev.ptr()));
    if (h == nullptr) {
      return py::none();
    }
    return py::reinterpret_steal<py::object>(THPStorage_Wrap(h->cpu));
  });
  m.def("register_op", [](const std::string& name, const std::string& display, const std::vector<int64_t>& kinds,
                          bool precision_op, bool mutable_op, py::object python) {
    auto k = std::make_unique<FastKernel>();
    k->kinds.assign(kinds.begin(), kinds.end());
    k->seed = std::hash<std::string>{}(name);
    k->display = display;
    k->precision_op = precision_op;
    k->first_operand = name.rfind("add", 0) == 0 || name.rfind("baddbmm", 0) == 0 ? 1 : 0;  // addmm(self, a, b)
    k->mutable_op = mutable_op;
    k->python = python.release().ptr();
    lib().impl(name.c_str(), torch::CppFunction::makeFromBoxedFunctor(std::move(k)));
  });
  m.def("register_view", [](const std::string& name) {
    lib().impl(name.c_str(), torch::CppFunction::makeFromBoxedFunction<&view_kernel>());
  });
  m.def("register_hooks", []() { at::RegisterPrivateUse1HooksInterface(&g_hooks); });
  m.def("is_pinned_ptr", [](uint64_t p) { return is_pinned_ptr(reinterpret_cast<const void*>(p)); });
  m.def("set_check_oom", [](py::object fn) { g_check_oom = fn.release().ptr(); });
  m.def("live", []() { return g_live.load(); });
  m.def("peak", []() { return g_peak.load(); });
  m.def("set_peak", [](int64_t v) { g_peak.store(v); });
  m.def("window", []() { return g_window.load(); });
  m.def("set_window", [](int64_t v) { g_window.store(v); });
  m.def("ops", []() { return g_ops.load(); });
  m.def("signatures", []() { return g_sigs.load(); });
  m.def("set_in_graph", [](int64_t v) { g_in_graph.store(v); });
  m.def("set_hbm", [](int64_t v) { g_hbm.store(v); });
  m.def("set_emulate", [](int v) { g_emulate.store(v); });
}
