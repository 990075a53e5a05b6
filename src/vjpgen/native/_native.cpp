// vjpgen's native helpers: what Python cannot do to a live autograd graph.
//
// release(nodes[, indices]): Node::release_variables() on each node of a sequence (or on nodes[i]
// for i in indices), as the autograd engine does after running a node without retain_graph (the
// node drops its saved tensors).
// walk(roots[, meta_type, wanted]): the breadth-first walk of vjpgen.runtime.graph.walk.walk over
// next_edges, without building next_functions tuples: (nodes, structure key as bytes,
// {node: index}), and with meta_type also each node's input metadata as tuples of meta_type (a
// namedtuple class with the fields shape, dtype, device, is_nested_tensor, is_cpp_nested_tensor;
// nodes with equal input metadata share one tuple, see InternedMetas).
// With `wanted` (a sequence of nodes) the index holds only the roots and the wanted nodes found.
// With lazy=True the nodes are a NodeList: the C++ nodes, each one's Python object made on first
// access (the native gather, release and steal_grads read its nodes without them).
// With meta_type the walk also returns {index: hook bits} of the nodes that have hooks (hook_flags)
// and {index: saved_hook_key} of the nodes whose saved tensors have hooks (saved state, below).
// stealable(grad, var): whether AccumulateGrad may keep grad itself as var.grad.
// steal_grads(nodes, grads, protected[, indices]): AccumulateGrad's common case for a batch of
// leaves (nodes[i] for i in indices).
// strided_leaves(nodes, indices): every nodes[i] is the AccumulateGrad of a strided tensor.
// scatter_outputs(outs, table, buf, protected): a compiled region's outputs into the grad buffer.
// hook_flags(nodes): per node a bit set of the hooks the engine would run around it (C++ and
// Python alike, whenever they were registered): see HookFlags.
// call_node(node, grads, keep_graph): the engine's call_function for one node: tensor pre-hooks,
// retains_grad hooks, pre-hooks, the node, validate_outputs, post-hooks.
// call_leaves(nodes, grads, keep_graph): call_node for a run of AccumulateGrad nodes.
// tensor_pre_hooks(node, grads): the tensor pre-hooks and retains_grad hooks alone, as the engine
// runs them on a captured grad whose node does not execute.
// saved_value(node, name): a saved value of a generated node that torch gives Python no getter
// for (TensorGeometry, optional<bool>), read from the node struct (see "saved state" below).
// saved_hook_key(node): whether the node's saved tensors have hooks (the walk returns it per node).
// Gather(ops, n_tensors)(nodes, metas, buf): a region's inputs (T, I) read from the live nodes by a
// program fastpath.py builds once per region and static part (see "Native gather" below).
// Built on first use by vjpgen/native/__init__.py with torch.utils.cpp_extension.

#include <torch/csrc/Device.h>
#include <torch/csrc/Dtype.h>
#include <torch/csrc/DynamicTypes.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>
#include <torch/csrc/autograd/generated/Functions.h>
#include <torch/csrc/autograd/saved_variable.h>
#include <torch/csrc/autograd/python_cpp_function.h>
#include <torch/csrc/autograd/python_function.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/autograd/utils/grad_layout_contract.h>
#include <torch/version.h>

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <typeinfo>
#include <sstream>
#include <unordered_map>
#include <vector>

#include <pybind11/pybind11.h>

namespace {

// How the Python wrappers hold their node differs between the supported torch releases (see
// vjpgen.native): 2.12 keeps a std::shared_ptr<Node> in THPCppFunction::cdata and a
// std::weak_ptr<PyNode> in THPFunction::cdata, 2.13 and 2.14 a c10::intrusive_ptr<Node> in both.
// Everything below only uses NodeRef's get() and bool test.
#if TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR < 13
using NodeRef = std::shared_ptr<torch::autograd::Node>;
inline NodeRef py_node_ref(THPFunction* f) {
  return f->cdata.lock();  // empty once the graph that held the node is gone
}
#else
using NodeRef = c10::intrusive_ptr<torch::autograd::Node>;
inline NodeRef py_node_ref(THPFunction* f) {
  return f->cdata;
}
#endif

NodeRef node_of(PyObject* o) {
  if (torch::autograd::THPCppFunction_Check(o)) {
    return reinterpret_cast<torch::autograd::THPCppFunction*>(o)->cdata;
  }
  if (THPFunction_Check(o)) {
    return py_node_ref(reinterpret_cast<THPFunction*>(o));
  }
  return {};
}

// The nodes of a walk, in its order (walk(..., lazy=True)): owning references to the C++ nodes
// and their Python objects, each made on its first access from Python. A cache-hit call reads most
// nodes only from C++ (the native gather, release, the leaf sinks), and making a Python object for
// each node of a fresh graph, then freeing it, was ~0.5 µs a node.
struct NodeList {
  std::vector<NodeRef> refs;
  std::vector<PyObject*> objs;  // owned references, nullptr until first accessed
  NodeList() = default;
  NodeList(const NodeList&) = delete;
  NodeList& operator=(const NodeList&) = delete;
  ~NodeList() {
    for (PyObject* o : objs) {
      Py_XDECREF(o);
    }
  }
  Py_ssize_t size() const {
    return static_cast<Py_ssize_t>(refs.size());
  }
  // node i's Python object (a borrowed reference: the list keeps it)
  PyObject* object(size_t i) {
    PyObject*& o = objs[i];
    if (o == nullptr) {
      o = torch::autograd::functionToPyObject(refs[i]);
      if (o == nullptr) {
        throw pybind11::error_already_set();
      }
    }
    return o;
  }
  pybind11::object item(Py_ssize_t i) {
    if (i < 0) {
      i += size();
    }
    if (i < 0 || i >= size()) {
      throw pybind11::index_error("vjpgen native.NodeList index out of range");
    }
    return pybind11::reinterpret_borrow<pybind11::object>(object(static_cast<size_t>(i)));
  }
  pybind11::list as_list() {
    pybind11::list out;
    for (Py_ssize_t i = 0; i < size(); ++i) {
      out.append(pybind11::handle(object(static_cast<size_t>(i))));
    }
    return out;
  }
};

// A walk's NodeList, or nullptr for any other object (a list of node objects)
NodeList* node_list(pybind11::handle nodes) {
  if (pybind11::isinstance<NodeList>(nodes)) {
    return &nodes.cast<NodeList&>();
  }
  return nullptr;
}

// Asks for `lines` cache lines from p on (a hint: nothing is read, an invalid address is harmless).
// After the compiled graph has run, the memory of a call's nodes, leaves and their tensors is out
// of the cache, and code that reads them one after the other waits for each miss in turn; asking
// for all of them first lets the misses overlap.
inline void prefetch_lines(const void* p, int lines) {
  const char* c = static_cast<const char*>(p);
  for (int k = 0; k < lines; ++k) {
    __builtin_prefetch(c + 64 * k);
  }
}

// node i of `nodes` (a NodeList, or a sequence of node objects), held by `keep`
torch::autograd::Node* node_in(pybind11::handle nodes, NodeList* nl, Py_ssize_t i, NodeRef& keep) {
  if (nl != nullptr) {
    if (i < 0 || i >= nl->size()) {
      throw pybind11::index_error("vjpgen native: node index out of range");
    }
    return nl->refs[static_cast<size_t>(i)].get();
  }
  pybind11::object o = pybind11::reinterpret_steal<pybind11::object>(PySequence_GetItem(nodes.ptr(), i));
  if (!o) {
    throw pybind11::error_already_set();
  }
  keep = node_of(o.ptr());
  return keep.get();
}

// Returns how many nodes were released (objects that are not autograd nodes are skipped). A
// custom Function's node (PyNode) releases the tensors its ctx saved. With `indices`: the nodes
// nodes[i] for i in indices (nodes: a walk's NodeList or a sequence of node objects).
Py_ssize_t release(pybind11::handle nodes, pybind11::handle indices) {
  NodeList* nl = node_list(nodes);
  Py_ssize_t released = 0;
  auto release_one = [&](Py_ssize_t i) {
    NodeRef keep;
    if (torch::autograd::Node* fn = node_in(nodes, nl, i, keep)) {
      fn->release_variables();
      ++released;
    }
  };
  if (indices.is_none()) {
    const Py_ssize_t n = PyObject_Length(nodes.ptr());
    if (n < 0) {
      throw pybind11::error_already_set();
    }
    for (Py_ssize_t i = 0; i < n; ++i) {
      release_one(i);
    }
  } else {
    for (auto ix : indices) {
      release_one(ix.cast<Py_ssize_t>());
    }
  }
  return released;
}

// ---------------------------------------------------------------------------------------------
// Saved state: one table of the saved-state fields of every generated node class, read from the
// node structs of torch's torch/csrc/autograd/generated/Functions.h. vjpgen_saved_fields.h is
// written by vjpgen/native/__init__.py from that header of the torch being built against (one
// VJPGEN_CLASS row per class). Each field is a pointer to member of Node (a pointer to member of
// the derived struct, converted), so reading a field is `node->*member` once the node's class is
// known. What reads it: the saved tensors' hooks (saved_hook_key, in the walk) and the saved values
// Python cannot see (saved_value). A native gather of saved values per call reads this same table.
namespace saved_state {

using torch::autograd::Node;
using torch::autograd::SavedVariable;
namespace G = torch::autograd::generated;

// kScalar..kString: the plain saved values the native gather reads (at::Scalar, int64_t,
// c10::SymInt, std::vector<c10::SymInt>, std::vector<int64_t>, bool, double, their optional forms,
// std::string)
enum Kind {
  kSaved, kSavedList, kGeometry, kOptBool, kScalar, kInt, kSymInt, kSymIntList, kIntList, kBool, kDouble,
  kOptSymInt, kOptSymIntList, kOptIntList, kOptDouble, kString
};

struct Field {
  const char* name;
  Kind kind;
  SavedVariable Node::*saved = nullptr;
  std::vector<SavedVariable> Node::*saved_list = nullptr;
  at::TensorGeometry Node::*geometry = nullptr;
  std::optional<bool> Node::*opt_bool = nullptr;
  at::Scalar Node::*scalar = nullptr;
  int64_t Node::*int64 = nullptr;
  c10::SymInt Node::*symint = nullptr;
  std::vector<c10::SymInt> Node::*symint_list = nullptr;
  std::vector<int64_t> Node::*int_list = nullptr;
  bool Node::*boolean = nullptr;
  double Node::*real = nullptr;
  std::optional<c10::SymInt> Node::*opt_symint = nullptr;
  c10::OptionalArray<c10::SymInt> Node::*opt_symint_list = nullptr;
  c10::OptionalArray<int64_t> Node::*opt_int_list = nullptr;
  std::optional<double> Node::*opt_real = nullptr;
  std::string Node::*str = nullptr;
};

struct ClassFields {
  const char* cls;
  std::vector<Field> fields;
};

inline Field saved_field(const char* n, SavedVariable Node::*m) {
  Field f{n, kSaved};
  f.saved = m;
  return f;
}
inline Field saved_list_field(const char* n, std::vector<SavedVariable> Node::*m) {
  Field f{n, kSavedList};
  f.saved_list = m;
  return f;
}
inline Field geometry_field(const char* n, at::TensorGeometry Node::*m) {
  Field f{n, kGeometry};
  f.geometry = m;
  return f;
}
inline Field opt_bool_field(const char* n, std::optional<bool> Node::*m) {
  Field f{n, kOptBool};
  f.opt_bool = m;
  return f;
}

#define VJPGEN_PLAIN(K, T, member, C, f) \
  ([] { Field x{#f, K}; x.member = static_cast<T Node::*>(&G::C::f); return x; }())
#define VJPGEN_SCALAR(C, f) VJPGEN_PLAIN(kScalar, at::Scalar, scalar, C, f)
#define VJPGEN_INT(C, f) VJPGEN_PLAIN(kInt, int64_t, int64, C, f)
#define VJPGEN_SYMINT(C, f) VJPGEN_PLAIN(kSymInt, c10::SymInt, symint, C, f)
#define VJPGEN_SYMINT_LIST(C, f) VJPGEN_PLAIN(kSymIntList, std::vector<c10::SymInt>, symint_list, C, f)
#define VJPGEN_INT_LIST(C, f) VJPGEN_PLAIN(kIntList, std::vector<int64_t>, int_list, C, f)
#define VJPGEN_BOOL(C, f) VJPGEN_PLAIN(kBool, bool, boolean, C, f)
#define VJPGEN_DOUBLE(C, f) VJPGEN_PLAIN(kDouble, double, real, C, f)
#define VJPGEN_OPT_SYMINT(C, f) VJPGEN_PLAIN(kOptSymInt, std::optional<c10::SymInt>, opt_symint, C, f)
#define VJPGEN_OPT_SYMINT_LIST(C, f) \
  VJPGEN_PLAIN(kOptSymIntList, c10::OptionalArray<c10::SymInt>, opt_symint_list, C, f)
#define VJPGEN_OPT_INT_LIST(C, f) VJPGEN_PLAIN(kOptIntList, c10::OptionalArray<int64_t>, opt_int_list, C, f)
#define VJPGEN_OPT_DOUBLE(C, f) VJPGEN_PLAIN(kOptDouble, std::optional<double>, opt_real, C, f)
#define VJPGEN_STRING(C, f) VJPGEN_PLAIN(kString, std::string, str, C, f)
#define VJPGEN_SAVED(C, f) saved_field(#f, static_cast<SavedVariable Node::*>(&G::C::f))
#define VJPGEN_SAVED_LIST(C, f) \
  saved_list_field(#f, static_cast<std::vector<SavedVariable> Node::*>(&G::C::f))
#define VJPGEN_GEOMETRY(C, f) geometry_field(#f, static_cast<at::TensorGeometry Node::*>(&G::C::f))
#define VJPGEN_OPT_BOOL(C, f) opt_bool_field(#f, static_cast<std::optional<bool> Node::*>(&G::C::f))
#define VJPGEN_CLASS(C, ...) ClassFields{#C, __VA_ARGS__},

const std::vector<ClassFields>& table() {
  static const std::vector<ClassFields> t = {
#include "vjpgen_saved_fields.h"
  };
  return t;
}

#undef VJPGEN_SAVED
#undef VJPGEN_SAVED_LIST
#undef VJPGEN_GEOMETRY
#undef VJPGEN_OPT_BOOL
#undef VJPGEN_PLAIN
#undef VJPGEN_SCALAR
#undef VJPGEN_INT
#undef VJPGEN_SYMINT
#undef VJPGEN_SYMINT_LIST
#undef VJPGEN_INT_LIST
#undef VJPGEN_BOOL
#undef VJPGEN_DOUBLE
#undef VJPGEN_OPT_SYMINT
#undef VJPGEN_OPT_SYMINT_LIST
#undef VJPGEN_OPT_INT_LIST
#undef VJPGEN_OPT_DOUBLE
#undef VJPGEN_STRING
#undef VJPGEN_CLASS

// What the table knows of a node's C++ class: its fields (nullptr: not a generated node with saved
// state), and whether it is a custom Function's node (PyNode: its saved tensors are its ctx's).
struct ClassInfo {
  const ClassFields* fields = nullptr;
  bool py_function = false;
  std::vector<const Field*> saved;  // the fields' saved tensors (kSaved, kSavedList): the walk reads their hooks
};

// Looked up by the node's C++ type (typeid of the object: its vtable, no symbol of the class), the
// class name and the Python object's type only on the first sight of a type.
std::unordered_map<const std::type_info*, ClassInfo>& class_infos() {
  static std::unordered_map<const std::type_info*, ClassInfo> by_type;
  return by_type;
}

// What the table knows of the node's class if its C++ type was seen before, else nullptr.
const ClassInfo* known_class_info(Node* fn) {
  auto& by_type = class_infos();
  auto it = by_type.find(&typeid(*fn));
  return it != by_type.end() ? &it->second : nullptr;
}

const ClassInfo& class_info(Node* fn, PyObject* obj) {
  auto& by_type = class_infos();
  const std::type_info* t = &typeid(*fn);
  auto it = by_type.find(t);
  if (it != by_type.end()) {
    return it->second;
  }
  static std::unordered_map<std::string, const ClassFields*> by_name = [] {
    std::unordered_map<std::string, const ClassFields*> m;
    for (const auto& c : table()) {
      m.emplace(c.cls, &c);
    }
    return m;
  }();
  ClassInfo info;
  if (THPFunction_Check(obj)) {  // every custom Function's node is one C++ type
    info.py_function = true;
  } else if (torch::autograd::THPCppFunction_Check(obj)) {
    auto nt = by_name.find(fn->name());
    if (nt != by_name.end()) {
      info.fields = nt->second;
      for (const auto& f : info.fields->fields) {
        if (f.kind == kSaved || f.kind == kSavedList) {
          info.saved.push_back(&f);
        }
      }
    }
  }
  return by_type.emplace(t, info).first->second;
}

// The identity of the unpack hook of a saved variable with hooks (the Python function object of
// saved_tensors_hooks: one per torch.utils.checkpoint frame), 1 for a hook that is not a Python
// one, 0 without hooks.
int64_t hook_key(const SavedVariable& v) {
  if (!v.has_hooks()) {
    return 0;
  }
  try {
    auto data = v.retrieve_unpack_hook_data();
    if (!data) {
      return 1;
    }
    PyObject* fn = data->first.release();
    PyObject* packed = data->second.release();
    int64_t k = reinterpret_cast<int64_t>(fn);
    Py_XDECREF(fn);  // the hooks keep the function alive: its address stays its identity
    Py_XDECREF(packed);
    return k == 0 ? 1 : k;
  } catch (const std::exception&) {
    return 1;
  }
}

// The hook key (see hook_key) of the first saved tensor of a node that has hooks, 0 when none
// has: the saved tensors of a generated node (from the table) or of a custom Function's ctx.
int64_t saved_hook_key(const ClassInfo& info, Node* fn, PyObject* obj) {
  if (info.py_function) {
    for (const auto& v : reinterpret_cast<THPFunction*>(obj)->saved_variables) {
      if (int64_t k = hook_key(v)) {
        return k;
      }
    }
    return 0;
  }
  for (const Field* fp : info.saved) {
    const Field& f = *fp;
    if (f.kind == kSaved) {
      if (int64_t k = hook_key(fn->*(f.saved))) {
        return k;
      }
    } else if (f.kind == kSavedList) {
      for (const auto& v : fn->*(f.saved_list)) {
        if (int64_t k = hook_key(v)) {
          return k;
        }
      }
    }
  }
  return 0;
}

int64_t saved_hook_key(Node* fn, PyObject* obj) {
  return saved_hook_key(class_info(fn, obj), fn, obj);
}

pybind11::object int_or_none(const c10::SymInt& s) {
  auto v = s.maybe_as_int();
  if (!v) {
    throw pybind11::value_error("vjpgen native.saved_value: a symbolic size");
  }
  return pybind11::int_(*v);
}

pybind11::tuple ints(c10::SymIntArrayRef a) {
  pybind11::tuple t(a.size());
  for (size_t k = 0; k < a.size(); ++k) {
    t[k] = int_or_none(a[k]);
  }
  return t;
}

// A saved value of a node that Python cannot read: a TensorGeometry as (sizes, strides,
// storage_offset), an optional<bool> as None/True/False. KeyError when the node's class has no
// such field in the table (the caller falls back to what Python can see).
pybind11::object saved_value(pybind11::handle node, const std::string& name) {
  auto fn = node_of(node.ptr());
  if (!fn || !torch::autograd::THPCppFunction_Check(node.ptr())) {
    throw pybind11::key_error(name);
  }
  const ClassFields* c = class_info(fn.get(), node.ptr()).fields;
  if (c != nullptr) {
    for (const auto& f : c->fields) {
      if (name != f.name) {
        continue;
      }
      if (f.kind == kGeometry) {
        const at::TensorGeometry& g = fn.get()->*(f.geometry);
        return pybind11::make_tuple(ints(g.sym_sizes()), ints(g.sym_strides()),
                                    int_or_none(g.sym_storage_offset()));
      }
      if (f.kind == kOptBool) {
        const std::optional<bool>& b = fn.get()->*(f.opt_bool);
        if (!b) {
          return pybind11::none();
        }
        return pybind11::bool_(*b);
      }
    }
  }
  throw pybind11::key_error(name);
}

int64_t saved_hook_key_py(pybind11::handle node) {
  auto fn = node_of(node.ptr());
  if (!fn) {
    throw pybind11::type_error("vjpgen native.saved_hook_key: expected an autograd node");
  }
  return saved_hook_key(fn.get(), node.ptr());
}

}  // namespace saved_state

// ---------------------------------------------------------------------------------------------
// Native gather: a region's inputs read from the live nodes in one call, by a program that
// vjpgen.runtime.compile.fastpath builds once per region and static part S (see native_gather in
// fastpath.py). It hands back the same (T, I) the region's specialized Python gather does, or None
// wherever that one would (then the Python gather runs, and after it the general path). Ops:
//   ("grad", slot, None) / ("grad", slot, type, pos): buf[slot] is None / a tensor of exactly
//       `type`, at position pos of T (pos == len(T): appended; else it must be T[pos] itself)
//   ("node", i, node): the node whose saved values follow is nodes[i], of node's C++ class
//   ("saved", field, type, pos) / ("saved_none", field): the SavedVariable `field` of that node
//       (the saved-state table above), unpacked as its Python getter does: a tensor as in "grad" /
//       undefined. A saved variable with hooks is never unpacked here: the program returns None
//       and the Python path runs them (once per call, inside the graph task).
//   ("dtype", edge, dtype or None): the dtype of the input metadata behind the node's edge (None:
//       an invalid edge), as the generated get_saved reads `_state.dtype_of(meta)`
//   ("out", d, nr, dtype, device, ndim): input nr of nodes[d] has this dtype, device and rank
//       (plain metadata: not nested, no subclass, no symbolic size); its sizes are appended to I
//   ("options", edge, dtype, device) / ("options", edge, None, None): the TensorOptions the
//       generated get_saved reads as `_state.options_of(meta)` (strided), or an invalid edge
//   ("list_sizes", ranks, dim member or None): the sizes of a Tensor[] input's tensors (cat: one
//       invalid edge's recovered from the output), appended to I; "nedges", "list_dtypes",
//       "layout", "value": see the constructor
//   ("py", fn): fn(nodes, metas, buf, T, I) is True (a node the program cannot read natively)
// and at the end the tensors of T are distinct objects (no new aliasing), len(T) == n_tensors.
namespace native_gather {

using torch::autograd::Node;
using torch::autograd::SavedVariable;

enum OpKind {
  kGradNone, kGradTensor, kNode, kSavedTensor, kSavedNone, kMetaDtype, kOut, kPy, kValue, kLayout,
  kNEdges, kListDtypes, kListSizes, kOptions
};

// how a plain saved value is expected to read in Python (the type its getter returns)
enum ValueType { vInt, vFloat, vBool, vInts, vNone, vStr };

struct Op {
  OpKind kind;
  int64_t a = 0;  // slot, node index, edge, d
  int64_t b = 0;  // position in T, nr
  const saved_state::Field* field = nullptr;
  PyObject* obj = nullptr;  // the tensor type, or the Python part (borrowed from Program::keep)
  const std::type_info* cls = nullptr;
  PyTypeObject* pytype = nullptr;  // kNode, kOut: the Python type of the node object (a THPCppFunction one)
  int scalar = -1;  // a ScalarType, -1 for None
  c10::Device device{c10::kCPU};
  int64_t ndim = 0;
  // kValue: sym: its ints are appended to I (sizes), else compared with `ints` / `real`;
  // as_unsigned: read as torch's getter does without _state.signed (int64 as unsigned)
  ValueType vtype = vInt;
  bool sym = false;
  bool as_unsigned = false;
  std::vector<int64_t> ints;
  double real = 0;
  std::string str;
};

int scalar_of(pybind11::handle o) {
  if (o.is_none()) {
    return -1;
  }
  if (!THPDtype_Check(o.ptr())) {
    throw pybind11::type_error("vjpgen native.Gather: expected a torch.dtype or None");
  }
  return static_cast<int>(reinterpret_cast<THPDtype*>(o.ptr())->scalar_type);
}

class Program {
 public:
  Program(pybind11::list ops, int64_t n_tensors) : n_tensors_(n_tensors) {
    const saved_state::ClassFields* fields = nullptr;
    for (auto item : ops) {
      pybind11::tuple t = pybind11::reinterpret_borrow<pybind11::tuple>(item);
      std::string k = pybind11::str(t[0]);
      Op op{kPy};
      if (k == "grad") {
        op.a = t[1].cast<int64_t>();
        if (t[2].is_none()) {
          op.kind = kGradNone;
        } else {
          op.kind = kGradTensor;
          op.obj = keep(t[2]);
          op.b = t[3].cast<int64_t>();
        }
      } else if (k == "node") {
        op.kind = kNode;
        op.a = t[1].cast<int64_t>();
        auto fn = node_of(t[2].ptr());
        if (!fn) {
          throw pybind11::type_error("vjpgen native.Gather: expected an autograd node");
        }
        op.cls = &typeid(*fn);
        if (torch::autograd::THPCppFunction_Check(t[2].ptr())) {
          op.pytype = Py_TYPE(t[2].ptr());
        }
        fields = saved_state::class_info(fn.get(), t[2].ptr()).fields;
      } else if (k == "saved" || k == "saved_none") {
        op.field = &field_named(fields, t[1], [](saved_state::Kind fk) { return fk == saved_state::kSaved; });
        if (k == "saved") {
          op.kind = kSavedTensor;
          op.obj = keep(t[2]);
          op.b = t[3].cast<int64_t>();
        } else {
          op.kind = kSavedNone;
        }
      } else if (k == "dtype") {
        op.kind = kMetaDtype;
        op.a = t[1].cast<int64_t>();
        op.scalar = scalar_of(t[2]);
      } else if (k == "out") {
        op.kind = kOut;
        op.a = t[1].cast<int64_t>();
        if (t.size() > 6 && torch::autograd::THPCppFunction_Check(t[6].ptr())) {
          op.pytype = Py_TYPE(t[6].ptr());
        }
        op.b = t[2].cast<int64_t>();
        op.scalar = scalar_of(t[3]);
        if (op.scalar < 0 || !THPDevice_Check(t[4].ptr())) {
          throw pybind11::type_error("vjpgen native.Gather: an out op needs a dtype and a device");
        }
        op.device = reinterpret_cast<THPDevice*>(t[4].ptr())->device;
        op.ndim = t[5].cast<int64_t>();
      } else if (k == "value") {
        // ("value", field, signed, sym, expected): a plain saved value (see Kind kScalar..kDouble)
        op.kind = kValue;
        op.field = &field_named(fields, t[1], [](saved_state::Kind fk) { return fk >= saved_state::kScalar; });
        op.as_unsigned = !t[2].cast<bool>();
        op.sym = t[3].cast<bool>();
        pybind11::handle v = t[4];
        auto fk = op.field->kind;
        if (v.is_none()) {
          op.vtype = vNone;
        } else if (PyUnicode_CheckExact(v.ptr())) {
          op.vtype = vStr;
          op.str = v.cast<std::string>();
        } else if (fk == saved_state::kSymIntList || fk == saved_state::kIntList ||
                   fk == saved_state::kOptSymIntList || fk == saved_state::kOptIntList) {
          if (!PyTuple_Check(v.ptr())) {
            throw pybind11::type_error("vjpgen native.Gather: a list value read as a tuple expected");
          }
          op.vtype = vInts;
          for (auto x : v) {
            op.ints.push_back(x.cast<int64_t>());
          }
          op.ndim = static_cast<int64_t>(op.ints.size());
        } else if (PyBool_Check(v.ptr())) {
          op.vtype = vBool;
          op.ints.push_back(v.ptr() == Py_True ? 1 : 0);
        } else if (PyLong_CheckExact(v.ptr())) {
          op.vtype = vInt;
          op.ints.push_back(v.cast<int64_t>());
        } else if (PyFloat_CheckExact(v.ptr())) {
          op.vtype = vFloat;
          op.real = v.cast<double>();
        } else {
          throw pybind11::type_error("vjpgen native.Gather: an int, float, bool or tuple of ints expected");
        }
        if (op.sym && op.vtype != vInts && op.vtype != vInt) {  // (None is checked, never a size)
          throw pybind11::type_error("vjpgen native.Gather: only ints are sizes");
        }
      } else if (k == "layout") {
        // ("layout", edge, strided): _state.layout_of(meta) of a plain input (torch.strided), or
        // of an invalid edge (None); nested inputs are left to the Python gather
        op.kind = kLayout;
        op.a = t[1].cast<int64_t>();
        op.scalar = t[2].cast<bool>() ? 1 : -1;
      } else if (k == "nedges" || k == "list_dtypes" || k == "list_sizes") {
        // the saved values of a node whose one input is a Tensor[] (cat), from its edges' metadata:
        // ("nedges", n): len(ranges[0]); ("list_dtypes", dtypes): _state.list_dtypes (an invalid
        // edge: the node's output dtype); ("list_sizes", ranks): _state.list_sizes with every edge
        // valid (the sizes of an invalid one are derived in Python), appended to I
        if (k == "nedges") {
          op.kind = kNEdges;
          op.a = t[1].cast<int64_t>();
        } else {
          op.kind = k == "list_dtypes" ? kListDtypes : kListSizes;
          for (auto x : pybind11::reinterpret_borrow<pybind11::list>(t[1])) {
            op.ints.push_back(k == "list_dtypes" ? scalar_of(x) : x.cast<int64_t>());
          }
          op.a = static_cast<int64_t>(op.ints.size());
          // ("list_sizes", ranks, dim member or None): with cat's dim member (an int64_t) one
          // invalid edge's sizes are recovered from the output, as _state.list_sizes(cat_dim=)
          if (k == "list_sizes" && t.size() > 2 && !t[2].is_none()) {
            op.field = &field_named(fields, t[2], [](saved_state::Kind fk) { return fk == saved_state::kInt; });
          }
        }
      } else if (k == "options") {
        // ("options", edge, dtype, device) / ("options", edge, None, None): _state.options_of(meta)
        // of a plain input (its dtype and device, strided), or of an invalid edge (None)
        op.kind = kOptions;
        op.a = t[1].cast<int64_t>();
        op.scalar = scalar_of(t[2]);
        if (op.scalar >= 0) {
          if (!THPDevice_Check(t[3].ptr())) {
            throw pybind11::type_error("vjpgen native.Gather: an options op needs a device");
          }
          op.device = reinterpret_cast<THPDevice*>(t[3].ptr())->device;
        }
      } else if (k == "py") {
        op.kind = kPy;
        op.obj = keep(t[1]);
      } else {
        throw pybind11::value_error("vjpgen native.Gather: unknown op " + k);
      }
      ops_.push_back(op);
    }
  }

  // the field `name` of the node class's saved-state table whose kind `accept`s (KeyError if none)
  template <typename Accept>
  static const saved_state::Field& field_named(const saved_state::ClassFields* fields, pybind11::handle name_obj,
                                               Accept accept) {
    std::string name = pybind11::str(name_obj);
    const saved_state::Field* out = nullptr;
    if (fields != nullptr) {
      for (const auto& f : fields->fields) {
        if (accept(f.kind) && name == f.name) {
          out = &f;
        }
      }
    }
    if (out == nullptr) {
      throw pybind11::key_error(name);
    }
    return *out;
  }

  // (T, I) or (T, I, token) or None; see the comment above the namespace and arm. Armed: (T, None,
  // entry) where every tensor and int matched the armed call, else what an unarmed run gives.
  pybind11::object run(pybind11::handle nodes, pybind11::handle metas, pybind11::handle buf) {
    NodeList* lst = PyList_Check(nodes.ptr()) ? nullptr : node_list(nodes);  // a lazy walk's
    if ((lst == nullptr && !PyList_Check(nodes.ptr())) || !PyList_Check(buf.ptr())) {
      return pybind11::none();
    }
    std::shared_ptr<const Expectation> ex = armed_;  // this run's (another thread may re-arm meanwhile)
    if (ex) {
      const auto& tls = c10::impl::tls_local_dispatch_key_set();
      if (tls.included_.raw_repr() == ex->tls_included && tls.excluded_.raw_repr() == ex->tls_excluded) {
        RunState st{nullptr, ex.get()};
        pybind11::object r = run_once(nodes.ptr(), lst, metas, buf.ptr(), st);
        if (!r.is_none() && st.ipos == ex->ints.size()) {
          return pybind11::make_tuple(r, pybind11::none(), ex->entry);
        }
      }
      if (armed_ == ex) {
        armed_.reset();
      }
      ++misses_;
    }
    auto rec = std::make_shared<Expectation>();
    pybind11::list I;
    RunState st{I.ptr(), nullptr, 0, &rec->ints};
    pybind11::object T = run_once(nodes.ptr(), lst, metas, buf.ptr(), st);
    if (T.is_none()) {
      return T;
    }
    if (st.recordable && misses_ < kMaxMisses && record_tensors(T.ptr(), *rec)) {
      const auto& tls = c10::impl::tls_local_dispatch_key_set();
      rec->tls_included = tls.included_.raw_repr();
      rec->tls_excluded = tls.excluded_.raw_repr();
      auto* held = new std::shared_ptr<Expectation>(std::move(rec));
      pybind11::capsule token(held, [](void* p) { delete static_cast<std::shared_ptr<Expectation>*>(p); });
      return pybind11::make_tuple(T, I, token);
    }
    return pybind11::make_tuple(T, I);
  }

  // Arms the program with the call a `token` (the third item of an unarmed run's result) describes
  // and the compiled entry the cache's guards chose for it (a static one: exact sizes and strides).
  // While armed, a run whose tensors have the same type, dispatch keys (and thread-local dispatch
  // state), dtype, device, requires_grad, sizes and strides, and whose ints (I) are the same, hands
  // back that entry, and builds no I: the guards of that entry would pass, and no entry before it
  // in the cache's list could (a static entry is added only where every guard failed). Any
  // difference disarms it (the next lookup may arm it again); after kMaxMisses no more tokens.
  // entry None: the guards chose no static entry for that call (it counts as a miss).
  void arm(pybind11::capsule token, pybind11::object entry) {
    auto* held = static_cast<std::shared_ptr<Expectation>*>(token.get_pointer());
    if (entry.is_none()) {
      ++misses_;
      return;
    }
    if (held == nullptr || !*held || misses_ >= kMaxMisses) {
      return;
    }
    auto ex = std::make_shared<Expectation>(**held);
    ex->entry = std::move(entry);
    armed_ = std::move(ex);
  }

  // for a caller that never arms the program: unarmed runs give no token (nothing recorded)
  void never_arm() {
    misses_ = kMaxMisses;
    armed_.reset();
  }

 private:
  // the metadata a static entry's tensor guard checks (dynamo's TensorGuards, cache._MetaGuard)
  struct TensorMeta {
    PyTypeObject* type = nullptr;
    uint64_t keys = 0;
    int dtype = -1;
    c10::Device device{c10::kCPU};
    bool requires_grad = false;
    std::vector<int64_t> sizes;
    std::vector<int64_t> strides;
  };
  struct Expectation {
    std::vector<int64_t> ints;  // I, as read (an unsigned reading's bits)
    std::vector<TensorMeta> tensors;
    uint64_t tls_included = 0;
    uint64_t tls_excluded = 0;
    pybind11::object entry;
  };
  static constexpr int kMaxMisses = 16;
  // what one run reads into: I (unarmed), or the armed expectation it compares with
  struct RunState {
    PyObject* il;
    const Expectation* expect;
    size_t ipos = 0;
    std::vector<int64_t>* seen = nullptr;  // unarmed: the raw ints, for a token
    bool recordable = true;  // unarmed: whether the run can give a token
  };
  static bool tensor_meta(PyObject* v, TensorMeta& m) {
    const at::Tensor& t = THPVariable_Unpack(v);
    if (!t.defined() || t.layout() != c10::kStrided || t.is_nested() ||
        t.unsafeGetTensorImpl()->has_symbolic_sizes_strides()) {
      return false;
    }
    m.type = Py_TYPE(v);
    m.keys = t.key_set().raw_repr();
    m.dtype = static_cast<int>(t.scalar_type());
    m.device = t.device();
    m.requires_grad = t.requires_grad();
    m.sizes.assign(t.sizes().begin(), t.sizes().end());
    m.strides.assign(t.strides().begin(), t.strides().end());
    return true;
  }
  static bool same_meta(PyObject* v, const TensorMeta& m) {
    if (Py_TYPE(v) != m.type) {
      return false;
    }
    const at::Tensor& t = THPVariable_Unpack(v);
    if (!t.defined() || t.key_set().raw_repr() != m.keys || static_cast<int>(t.scalar_type()) != m.dtype ||
        t.layout() != c10::kStrided || t.unsafeGetTensorImpl()->has_symbolic_sizes_strides() ||
        t.device() != m.device || t.requires_grad() != m.requires_grad) {
      return false;
    }
    return t.sizes().equals(m.sizes) && t.strides().equals(m.strides);
  }
  static bool record_tensors(PyObject* tl, Expectation& rec) {
    const Py_ssize_t n = PyList_GET_SIZE(tl);
    rec.tensors.resize(static_cast<size_t>(n));
    for (Py_ssize_t k = 0; k < n; ++k) {
      if (!tensor_meta(PyList_GET_ITEM(tl, k), rec.tensors[k])) {
        return false;
      }
    }
    return true;
  }
  // one int of I as read: compared with the armed call's, or recorded for a token (unarmed)
  static bool note_int(RunState& st, int64_t x) {
    if (st.expect != nullptr) {
      return st.ipos < st.expect->ints.size() && st.expect->ints[st.ipos++] == x;
    }
    st.seen->push_back(x);
    return true;
  }
  // one int of I: appended (unarmed), or compared with the armed call's
  bool put(RunState& st, int64_t x, bool as_unsigned) {
    if (st.expect != nullptr) {  // armed: compared, no I built
      return note_int(st, x);
    }
    note_int(st, x);  // recorded for a token
    PyObject* o = as_unsigned ? PyLong_FromUnsignedLongLong(static_cast<uint64_t>(x)) : PyLong_FromLongLong(x);
    if (o == nullptr) {
      throw pybind11::error_already_set();
    }
    int rc = PyList_Append(st.il, o);
    Py_DECREF(o);
    if (rc != 0) {
      throw pybind11::error_already_set();
    }
    return true;
  }

  // The saved tensors the ops read, asked for before the first is read (see prefetch_lines): in
  // one round the saved variables, in a second the TensorImpls they hold. The TensorImpl's address
  // is read from the SavedVariable's first word, where torch keeps its data_ (torch gives no
  // accessor that does not touch the tensor); it is only ever used as a prefetch address.
  void prefetch(NodeList* lst) const {
    const size_t n_nodes = lst->refs.size();
    static thread_local std::vector<const SavedVariable*> svs;  // (a program may run in several threads)
    svs.clear();
    Node* cur = nullptr;
    for (const Op& op : ops_) {
      if (op.kind == kNode) {
        cur = static_cast<size_t>(op.a) < n_nodes ? lst->refs[static_cast<size_t>(op.a)].get() : nullptr;
      } else if (op.kind == kSavedTensor && cur != nullptr && op.field != nullptr && op.field->saved != nullptr) {
        const SavedVariable* sv = &(cur->*(op.field->saved));
        prefetch_lines(sv, 1);
        svs.push_back(sv);
      }
    }
    for (const SavedVariable* sv : svs) {
      prefetch_lines(*reinterpret_cast<const void* const*>(sv), 3);
    }
  }

  // T or None: one pass of the ops over the nodes nl (lst: the same as a lazy walk's NodeList)
  pybind11::object run_once(PyObject* nl, NodeList* lst, pybind11::handle metas, PyObject* bl, RunState& st) {
    const Py_ssize_t n_nodes = lst != nullptr ? lst->size() : PyList_GET_SIZE(nl);
    if (lst != nullptr) {
      prefetch(lst);
    }
    pybind11::list T;
    PyObject* tl = T.ptr();
    // a Python part appends to I: unarmed, the run's I; armed, a scratch list compared after it
    pybind11::list scratch;
    Node* cur = nullptr;  // the nodes list holds every node for the call
    for (const Op& op : ops_) {
      switch (op.kind) {
        case kGradNone: {
          if (op.a >= PyList_GET_SIZE(bl) || PyList_GET_ITEM(bl, op.a) != Py_None) {
            return pybind11::none();
          }
          break;
        }
        case kGradTensor: {
          if (op.a >= PyList_GET_SIZE(bl)) {
            return pybind11::none();
          }
          PyObject* v = PyList_GET_ITEM(bl, op.a);
          if (reinterpret_cast<PyObject*>(Py_TYPE(v)) != op.obj || !add_tensor(st, tl, v, op.b)) {
            return pybind11::none();
          }
          break;
        }
        case kNode: {
          if (op.a >= n_nodes) {
            return pybind11::none();
          }
          cur = node_at(nl, lst, op);
          if (cur == nullptr || !same_type(typeid(*cur), *op.cls)) {
            return pybind11::none();
          }
          break;
        }
        case kSavedTensor:
        case kSavedNone: {
          if (cur == nullptr) {
            return pybind11::none();
          }
          const SavedVariable& sv = cur->*(op.field->saved);
          if (sv.has_hooks()) {  // the Python path runs the hooks (once per call)
            return pybind11::none();
          }
          at::Tensor t;
          try {
            t = sv.unpack(saved_for(nl, cur));
          } catch (const std::exception&) {  // e.g. freed or modified in place: the general path says so
            return pybind11::none();
          }
          if (op.kind == kSavedNone) {
            if (t.defined()) {
              return pybind11::none();
            }
            break;
          }
          if (!t.defined()) {
            return pybind11::none();
          }
          PyObject* w = THPVariable_Wrap(std::move(t));
          if (w == nullptr) {
            throw pybind11::error_already_set();
          }
          pybind11::object wo = pybind11::reinterpret_steal<pybind11::object>(w);
          if (reinterpret_cast<PyObject*>(Py_TYPE(w)) != op.obj || !add_tensor(st, tl, w, op.b)) {
            return pybind11::none();
          }
          break;
        }
        case kMetaDtype: {
          const torch::autograd::InputMetadata* md = nullptr;
          EdgeRead r = edge_meta(op, cur, md);
          if (r == kEdgeFail || (r == kEdgeInvalid && op.scalar != -1)) {
            return pybind11::none();
          }
          if (r == kEdgeMeta && (md->was_default_constructed() ||
                                 static_cast<int>(c10::typeMetaToScalarType(md->dtype())) != op.scalar)) {
            return pybind11::none();
          }
          break;
        }
        case kOut: {
          if (op.a >= n_nodes) {
            return pybind11::none();
          }
          Node* d = node_at(nl, lst, op);
          if (d == nullptr || op.b >= static_cast<int64_t>(d->num_inputs())) {
            return pybind11::none();
          }
          const auto& md = d->input_metadata(static_cast<size_t>(op.b));
          if (md.was_default_constructed() || md.is_nested_tensor() || md.is_tensor_subclass() ||
              static_cast<int>(c10::typeMetaToScalarType(md.dtype())) != op.scalar ||
              md.device() != op.device) {
            return pybind11::none();
          }
          auto shape = md.shape_as_dim_vector();
          if (static_cast<int64_t>(shape.size()) != op.ndim) {
            return pybind11::none();
          }
          for (const auto& s : shape) {
            if (s.is_heap_allocated() || !put(st, s.as_int_unchecked(), false)) {
              return pybind11::none();
            }
          }
          break;
        }
        case kLayout: {
          const torch::autograd::InputMetadata* md = nullptr;
          EdgeRead r = edge_meta(op, cur, md);
          if (r == kEdgeFail || (r == kEdgeInvalid && op.scalar != -1)) {
            return pybind11::none();
          }
          if (r == kEdgeMeta && (op.scalar != 1 || md->was_default_constructed() || md->is_nested_tensor())) {
            return pybind11::none();
          }
          break;
        }
        case kNEdges: {
          if (cur == nullptr || static_cast<int64_t>(cur->num_outputs()) != op.a) {
            return pybind11::none();
          }
          break;
        }
        case kListDtypes: {
          if (cur == nullptr || static_cast<int64_t>(cur->num_outputs()) != op.a) {
            return pybind11::none();
          }
          for (int64_t k = 0; k < op.a; ++k) {
            const auto& e = cur->next_edge(static_cast<size_t>(k));
            const torch::autograd::InputMetadata* md = nullptr;
            if (e.is_valid()) {
              if (e.input_nr >= e.function->num_inputs()) {
                return pybind11::none();
              }
              md = &e.function->input_metadata(e.input_nr);
            } else if (cur->num_inputs() > 0) {
              md = &cur->input_metadata(0);  // the output's dtype stands in
            }
            if (md == nullptr || md->was_default_constructed() ||
                static_cast<int>(c10::typeMetaToScalarType(md->dtype())) != op.ints[k]) {
              return pybind11::none();
            }
          }
          break;
        }
        case kOptions: {
          const torch::autograd::InputMetadata* md = nullptr;
          EdgeRead r = edge_meta(op, cur, md);
          if (r == kEdgeFail || (r == kEdgeInvalid && op.scalar != -1)) {
            return pybind11::none();
          }
          if (r == kEdgeMeta && (op.scalar == -1 || md->was_default_constructed() || md->is_nested_tensor() ||
                                 static_cast<int>(c10::typeMetaToScalarType(md->dtype())) != op.scalar ||
                                 md->device() != op.device)) {
            return pybind11::none();
          }
          break;
        }
        case kListSizes:
        case kValue: {
          if (cur == nullptr || !(op.kind == kValue ? value(st, op, cur) : list_sizes(st, op, cur))) {
            return pybind11::none();
          }
          break;
        }
        case kPy: {
          PyObject* il = st.il;
          Py_ssize_t n_before = 0;
          if (st.expect != nullptr) {
            PyList_SetSlice(scratch.ptr(), 0, PyList_GET_SIZE(scratch.ptr()), nullptr);
            il = scratch.ptr();
          } else {
            n_before = PyList_GET_SIZE(il);
          }
          const Py_ssize_t t_before = PyList_GET_SIZE(tl);
          PyObject* r = PyObject_CallFunctionObjArgs(op.obj, nl, metas.ptr(), bl, tl, il, nullptr);
          if (r == nullptr) {  // as the Python gather: an error means "not this specialization"
            PyErr_Clear();
            return pybind11::none();
          }
          bool ok = r == Py_True;
          Py_DECREF(r);
          if (!ok || !python_ints(st, il, n_before)) {
            return pybind11::none();
          }
          if (st.expect != nullptr) {  // the tensors the Python part added: as the armed call's
            const Py_ssize_t t_after = PyList_GET_SIZE(tl);
            for (Py_ssize_t k = t_before; k < t_after; ++k) {
              if (static_cast<size_t>(k) >= st.expect->tensors.size() ||
                  !same_meta(PyList_GET_ITEM(tl, k), st.expect->tensors[k])) {
                return pybind11::none();
              }
            }
          }
          break;
        }
      }
    }
    const Py_ssize_t nT = PyList_GET_SIZE(tl);
    if (nT != n_tensors_) {
      return pybind11::none();
    }
    if (nT > 1 && !distinct(tl, nT)) {  // no new aliasing between the tensors
      return pybind11::none();
    }
    return std::move(T);
  }

  // the ints a Python part appended to I from position n_before: recorded (unarmed), or
  // compared with the armed call's (from a scratch list); armed, false where they differ or are
  // not plain ints (unarmed, such a run gives no token)
  bool python_ints(RunState& st, PyObject* il, Py_ssize_t n_before) {
    const Py_ssize_t n = PyList_GET_SIZE(il);
    for (Py_ssize_t k = st.expect != nullptr ? 0 : n_before; k < n; ++k) {
      PyObject* o = PyList_GET_ITEM(il, k);
      long long x = 0;
      bool plain = PyLong_CheckExact(o);
      if (plain) {
        int overflow = 0;
        x = PyLong_AsLongLongAndOverflow(o, &overflow);
        if (overflow > 0) {
          unsigned long long u = PyLong_AsUnsignedLongLong(o);  // an unsigned reading (>= 2**63)
          if (PyErr_Occurred()) {
            PyErr_Clear();
            plain = false;
          }
          x = static_cast<long long>(u);
        } else if (overflow < 0) {
          plain = false;
        }
      }
      if (!plain) {
        if (st.expect != nullptr) {
          return false;
        }
        st.recordable = false;
        continue;
      }
      if (!note_int(st, x)) {
        return false;
      }
    }
    return true;
  }
  // the input metadata behind edge op.a of the current node (kEdgeMeta, md set), an invalid edge
  // (kEdgeInvalid), or neither: no such edge or input (kEdgeFail)
  enum EdgeRead { kEdgeMeta, kEdgeInvalid, kEdgeFail };
  static EdgeRead edge_meta(const Op& op, Node* cur, const torch::autograd::InputMetadata*& md) {
    if (cur == nullptr || op.a >= static_cast<int64_t>(cur->num_outputs())) {
      return kEdgeFail;
    }
    const auto& e = cur->next_edge(static_cast<size_t>(op.a));
    if (!e.is_valid()) {
      return kEdgeInvalid;
    }
    if (e.input_nr >= e.function->num_inputs()) {
      return kEdgeFail;
    }
    md = &e.function->input_metadata(e.input_nr);
    return kEdgeMeta;
  }
  static bool same_type(const std::type_info& a, const std::type_info& b) {
    return &a == &b || a == b;
  }
  // whether the n objects of list tl are distinct: an open-addressing set of their addresses
  static bool distinct(PyObject* tl, Py_ssize_t n) {
    static thread_local std::vector<PyObject*> slots;
    size_t cap = 16;
    while (cap < 2 * static_cast<size_t>(n)) {
      cap *= 2;
    }
    slots.assign(cap, nullptr);
    const size_t mask = cap - 1;
    for (Py_ssize_t k = 0; k < n; ++k) {
      PyObject* o = PyList_GET_ITEM(tl, k);
      size_t i = static_cast<size_t>((reinterpret_cast<uintptr_t>(o) >> 4) * 0x9E3779B97F4A7C15ull) & mask;
      while (slots[i] != nullptr) {
        if (slots[i] == o) {
          return false;
        }
        i = (i + 1) & mask;
      }
      slots[i] = o;
    }
    return true;
  }
  // nodes[op.a] (op.a < len(nodes)) as a C++ node: from a lazy walk's NodeList directly; of a list,
  // a THPCppFunction of the expected Python type is read directly, any other object through node_of
  static Node* node_at(PyObject* nl, NodeList* lst, const Op& op) {
    if (lst != nullptr) {
      return lst->refs[static_cast<size_t>(op.a)].get();
    }
    PyObject* o = PyList_GET_ITEM(nl, op.a);
    if (op.pytype != nullptr && Py_TYPE(o) == op.pytype) {
      return reinterpret_cast<torch::autograd::THPCppFunction*>(o)->cdata.get();
    }
    return node_of(o).get();  // the list's object keeps the node alive
  }
  // the owning reference SavedVariable::unpack takes (the node the value was saved for)
  static NodeRef saved_for(PyObject* /*nl*/, Node* n) {
#if TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR < 13
    return n->shared_from_this();
#else
    return c10::intrusive_ptr<Node>::unsafe_reclaim_from_nonowning(n);
#endif
  }
  // one int as I holds it (the getter's unsigned reading unless the generated code signs it)
  bool append_int(RunState& st, const Op& op, int64_t x) {
    return put(st, x, op.as_unsigned);
  }
  // a sequence of n ints read by get(k, x): compared with op.ints, or appended to I (sym)
  template <typename Get>
  bool ints_match(RunState& st, const Op& op, size_t n, Get get) {
    if (op.vtype != vInts || static_cast<int64_t>(n) != op.ndim) {
      return false;
    }
    for (size_t k = 0; k < n; ++k) {
      int64_t x;
      if (!get(k, x)) {
        return false;
      }
      if (op.sym) {
        if (!append_int(st, op, x)) {
          return false;
        }
      } else if (x != op.ints[k]) {
        return false;
      }
    }
    return true;
  }
  // The sizes of each tensor of a Tensor[] input (_state.list_sizes), appended to I: from the
  // edges' metadata; with cat's dim member (op.field) one invalid edge's from the output's sizes,
  // which along dim take what the others leave (1-D empty inputs, which cat skips, leave nothing
  // unless the output is 1-D). False where the Python reading would differ or raise.
  bool list_sizes(RunState& st, const Op& op, Node* cur) {
    if (static_cast<int64_t>(cur->num_outputs()) != op.a) {
      return false;
    }
    std::vector<c10::SymDimVector> shapes(static_cast<size_t>(op.a));
    int64_t missing = -1;
    for (int64_t k = 0; k < op.a; ++k) {
      const auto& e = cur->next_edge(static_cast<size_t>(k));
      if (!e.is_valid()) {
        if (op.field == nullptr || missing >= 0) {
          return false;
        }
        missing = k;
        continue;
      }
      if (e.input_nr >= e.function->num_inputs()) {
        return false;
      }
      const auto& md = e.function->input_metadata(e.input_nr);
      if (md.was_default_constructed() || md.is_nested_tensor() || md.is_tensor_subclass()) {
        return false;
      }
      auto sh = md.shape_as_dim_vector();
      shapes[k].assign(sh.begin(), sh.end());
    }
    if (missing >= 0) {
      if (cur->num_inputs() == 0) {
        return false;
      }
      const auto& om = cur->input_metadata(0);
      if (om.was_default_constructed() || om.is_nested_tensor() || om.is_tensor_subclass()) {
        return false;
      }
      auto om_shape = om.shape_as_dim_vector();
      c10::SymDimVector out(om_shape.begin(), om_shape.end());
      const int64_t n = static_cast<int64_t>(out.size());
      int64_t d = cur->*(op.field->int64);
      if (d < 0) {
        d += n;
      }
      if (d < 0 || d >= n) {
        return false;
      }
      c10::SymInt used = 0;
      for (int64_t k = 0; k < op.a; ++k) {
        const auto& s = shapes[k];
        if (k == missing || (s.size() == 1 && s[0] == 0 && n != 1)) {
          continue;
        }
        if (static_cast<int64_t>(s.size()) <= d) {
          return false;  // the Python reading raises (IndexError): its path reports it
        }
        used = used + s[d];
      }
      out[d] = out[d] - used;
      shapes[missing] = out;
    }
    for (int64_t k = 0; k < op.a; ++k) {
      if (static_cast<int64_t>(shapes[k].size()) != op.ints[k]) {
        return false;
      }
      for (const auto& x : shapes[k]) {
        if (x.is_heap_allocated() || !put(st, x.as_int_unchecked(), false)) {
          return false;
        }
      }
    }
    return true;
  }
  // a plain saved value checked (or its ints appended to I); false: not the specialized reading
  bool value(RunState& st, const Op& op, Node* fn) {
    using saved_state::Kind;
    const saved_state::Field& f = *op.field;
    switch (f.kind) {
      case Kind::kScalar: {
        const at::Scalar& s = fn->*(f.scalar);
        if (s.isSymbolic() || s.isComplex()) {
          return false;
        }
        if (s.isFloatingPoint()) {
          return op.vtype == vFloat && !op.sym && s.to<double>() == op.real;
        }
        if (s.isBoolean()) {
          return op.vtype == vBool && !op.sym && static_cast<int64_t>(s.to<bool>()) == op.ints[0];
        }
        if (s.isIntegral(false)) {
          return op.vtype == vInt && !op.sym && s.to<int64_t>() == op.ints[0];
        }
        return false;
      }
      case Kind::kInt:
      case Kind::kSymInt: {
        int64_t x;
        if (f.kind == Kind::kInt) {
          x = fn->*(f.int64);
        } else {
          auto m = (fn->*(f.symint)).maybe_as_int();
          if (!m) {
            return false;
          }
          x = *m;
        }
        if (op.vtype != vInt) {
          return false;
        }
        if (op.sym) {
          return append_int(st, op, x);
        }
        return x == op.ints[0];
      }
      case Kind::kSymIntList:
      case Kind::kIntList: {
        if (op.vtype != vInts) {
          return false;
        }
        size_t n = f.kind == Kind::kIntList ? (fn->*(f.int_list)).size() : (fn->*(f.symint_list)).size();
        if (static_cast<int64_t>(n) != op.ndim) {
          return false;
        }
        for (size_t k = 0; k < n; ++k) {
          int64_t x;
          if (f.kind == Kind::kIntList) {
            x = (fn->*(f.int_list))[k];
          } else {
            auto m = (fn->*(f.symint_list))[k].maybe_as_int();
            if (!m) {
              return false;
            }
            x = *m;
          }
          if (op.sym) {
            if (!append_int(st, op, x)) {
              return false;
            }
          } else if (x != op.ints[k]) {
            return false;
          }
        }
        return true;
      }
      case Kind::kBool:
        return op.vtype == vBool && !op.sym && static_cast<int64_t>(fn->*(f.boolean)) == op.ints[0];
      case Kind::kDouble:
        return op.vtype == vFloat && !op.sym && fn->*(f.real) == op.real;
      case Kind::kOptDouble: {
        const auto& o = fn->*(f.opt_real);
        if (!o) {
          return op.vtype == vNone;
        }
        return op.vtype == vFloat && !op.sym && *o == op.real;
      }
      case Kind::kString:
        return op.vtype == vStr && fn->*(f.str) == op.str;
      case Kind::kOptSymInt: {
        const auto& o = fn->*(f.opt_symint);
        if (!o) {
          return op.vtype == vNone;
        }
        auto m = o->maybe_as_int();
        if (!m || op.vtype != vInt) {
          return false;
        }
        return op.sym ? append_int(st, op, *m) : *m == op.ints[0];
      }
      case Kind::kOptSymIntList:
      case Kind::kOptIntList: {
        if (f.kind == Kind::kOptIntList) {
          const auto& o = (fn->*(f.opt_int_list)).list;
          if (!o) {
            return op.vtype == vNone;
          }
          return ints_match(st, op, o->size(), [&](size_t k, int64_t& x) { x = (*o)[k]; return true; });
        }
        const auto& o = (fn->*(f.opt_symint_list)).list;
        if (!o) {
          return op.vtype == vNone;
        }
        return ints_match(st, op, o->size(), [&](size_t k, int64_t& x) {
          auto m = (*o)[k].maybe_as_int();
          if (!m) {
            return false;
          }
          x = *m;
          return true;
        });
      }
      default:
        return false;
    }
  }
  PyObject* keep(pybind11::handle o) {
    keep_.push_back(pybind11::reinterpret_borrow<pybind11::object>(o));
    return o.ptr();
  }
  // v at position pos of T: appended when pos is the next one, else it must be T[pos] itself
  static bool add_tensor(const RunState& st, PyObject* tl, PyObject* v, int64_t pos) {
    Py_ssize_t n = PyList_GET_SIZE(tl);
    if (pos == n) {
      if (st.expect != nullptr &&
          (static_cast<size_t>(pos) >= st.expect->tensors.size() || !same_meta(v, st.expect->tensors[pos]))) {
        return false;
      }
      if (PyList_Append(tl, v) != 0) {
        throw pybind11::error_already_set();
      }
      return true;
    }
    return pos < n && PyList_GET_ITEM(tl, pos) == v;
  }
  std::vector<Op> ops_;
  std::vector<pybind11::object> keep_;
  int64_t n_tensors_;
  std::shared_ptr<const Expectation> armed_;
  int misses_ = 0;
};

}  // namespace native_gather

// A new reference to the torch.device object of a device (one object per device, kept).
PyObject* device_object(const c10::Device& d) {
  static std::map<std::pair<int, int>, PyObject*> cache;
  auto k = std::make_pair(static_cast<int>(d.type()), static_cast<int>(d.index()));
  auto it = cache.find(k);
  if (it == cache.end()) {
    PyObject* o = THPDevice_New(d);
    if (o == nullptr) {
      throw pybind11::error_already_set();
    }
    it = cache.emplace(k, o).first;
  }
  Py_INCREF(it->second);
  return it->second;
}

// Interned input metadata: nodes whose inputs have equal metadata (the same dtypes, devices and
// shapes: most nodes of a model or a chain) share one tuple of meta_type instances, which are
// immutable. A walk then allocates no metadata objects for a graph it has seen, instead of ~4
// per node; on a 10,000-node graph those allocations, and freeing them after the call, made the
// per-node cost grow with the graph. At most kMaxInterned tuples are kept (the table is emptied
// when full); `sig` is the lookup key of the node being read, reused to avoid an allocation
// on a hit.
struct InternedMetas {
  struct Hash {
    size_t operator()(const std::vector<int64_t>& v) const {
      uint64_t h = 0xcbf29ce484222325ull;
      for (int64_t x : v) {
        h = (h ^ static_cast<uint64_t>(x)) * 0x100000001b3ull;
      }
      return static_cast<size_t>(h);
    }
  };
  static constexpr size_t kMaxInterned = 4096;
  std::unordered_map<std::vector<int64_t>, PyObject*, Hash> table;
  PyObject* type = nullptr;  // the meta_type the table's tuples hold instances of (borrowed)
  std::vector<int64_t> sig;

  // a new reference to the tuple interned for `sig`, or nullptr
  PyObject* find(PyObject* meta_type) {
    if (meta_type != type) {
      clear();
      type = meta_type;
      return nullptr;
    }
    auto it = table.find(sig);
    if (it == table.end()) {
      return nullptr;
    }
    Py_INCREF(it->second);
    return it->second;
  }
  void add(std::vector<int64_t> key, PyObject* metas) {
    if (table.size() >= kMaxInterned) {
      clear();
    }
    Py_INCREF(metas);
    table.emplace(std::move(key), metas);
  }
  void clear() {
    for (auto& e : table) {
      Py_DECREF(e.second);
    }
    table.clear();
  }
};
InternedMetas interned_metas;

// A node's input metadata: a tuple of meta_type instances, or the node's own _input_metadata
// (pybind objects with the same attributes) where an input is unusual: default constructed,
// nested, a tensor subclass or of symbolic shape.
PyObject* node_metas(torch::autograd::Node* fn, PyObject* obj, pybind11::handle meta_type, NodeList* nl, size_t at) {
  auto n = fn->num_inputs();
  // one pass over the inputs: whether all are plain, and the intern key of their metadata
  std::vector<int64_t>& sig = interned_metas.sig;
  sig.clear();
  sig.push_back(static_cast<int64_t>(n));
  bool plain = true;
  for (uint32_t k = 0; k < n && plain; ++k) {
    const auto& md = fn->input_metadata(k);
    if (md.was_default_constructed() || md.is_nested_tensor() || md.is_tensor_subclass()) {
      plain = false;
      break;
    }
    const auto& d = md.device();
    auto shape = md.shape_as_dim_vector();
    sig.push_back(static_cast<int64_t>(c10::typeMetaToScalarType(md.dtype())));
    sig.push_back(static_cast<int64_t>(d.type()) * 65536 + static_cast<int64_t>(d.index()));
    sig.push_back(static_cast<int64_t>(shape.size()));
    for (const auto& s : shape) {
      if (s.is_heap_allocated()) {
        plain = false;
        break;
      }
      sig.push_back(s.as_int_unchecked());
    }
  }
  if (!plain) {
    if (obj == nullptr) {  // a lazy walk's node: its Python object, made now
      obj = nl->object(at);
    }
    PyObject* r = PyObject_GetAttrString(obj, "_input_metadata");
    if (r == nullptr) {
      throw pybind11::error_already_set();
    }
    return r;
  }
  auto* tp = reinterpret_cast<PyTypeObject*>(meta_type.ptr());
  if (PyObject* hit = interned_metas.find(meta_type.ptr())) {
    return hit;
  }
  // a copy: building the tuple allocates, which may run a garbage collection and, through a
  // finalizer, Python code that walks another graph and overwrites `sig`
  std::vector<int64_t> key = sig;
  PyObject* out = PyTuple_New(static_cast<Py_ssize_t>(n));
  if (out == nullptr) {
    throw pybind11::error_already_set();
  }
  pybind11::object out_owner = pybind11::reinterpret_steal<pybind11::object>(out);
  for (uint32_t k = 0; k < n; ++k) {
    const auto& md = fn->input_metadata(k);
    auto shape = md.shape_as_dim_vector();
    PyObject* sh = PyTuple_New(static_cast<Py_ssize_t>(shape.size()));
    if (sh == nullptr) {
      throw pybind11::error_already_set();
    }
    for (size_t d = 0; d < shape.size(); ++d) {
      PyTuple_SET_ITEM(sh, static_cast<Py_ssize_t>(d), PyLong_FromLongLong(shape[d].as_int_unchecked()));
    }
    PyObject* dt = reinterpret_cast<PyObject*>(torch::getTHPDtype(c10::typeMetaToScalarType(md.dtype())));
    Py_INCREF(dt);
    PyObject* m = tp->tp_alloc(tp, 5);  // a namedtuple instance: a tuple subclass of 5 items
    if (m == nullptr) {
      Py_DECREF(sh);
      Py_DECREF(dt);
      throw pybind11::error_already_set();
    }
    PyTuple_SET_ITEM(m, 0, sh);
    PyTuple_SET_ITEM(m, 1, dt);
    PyTuple_SET_ITEM(m, 2, device_object(md.device()));
    PyTuple_SET_ITEM(m, 3, Py_NewRef(Py_False));
    PyTuple_SET_ITEM(m, 4, Py_NewRef(Py_False));
    PyTuple_SET_ITEM(out, static_cast<Py_ssize_t>(k), m);
  }
  interned_metas.add(std::move(key), out);
  return out_owner.release().ptr();
}

// Node* -> index of the walk: open addressing with linear probing in one array (no allocation per
// node, unlike std::unordered_map, whose per-entry mallocs and rehashes were ~40% of a walk over
// 30,000 nodes). It starts at 16 slots and doubles when half full (a size hint from the previous
// walk made no measurable difference).
class NodeIndex {
 public:
  NodeIndex() { resize(16); }
  // empty again, keeping its size: the walk reuses one table (growing a table of 10,000 nodes from
  // 16 slots rehashed ~20,000 entries per call); only the slots used are cleared
  void reset() {
    for (size_t i : used_) {
      slots_[i] = {nullptr, 0};
    }
    used_.clear();
    count_ = 0;
  }
  // the index of n, inserting j for it if absent; `inserted` says which
  int64_t find_or_insert(torch::autograd::Node* n, int64_t j, bool& inserted) {
    if (2 * (count_ + 1) > slots_.size()) {
      grow();
    }
    size_t i = slot(n);
    while (slots_[i].first != nullptr) {
      if (slots_[i].first == n) {
        inserted = false;
        return slots_[i].second;
      }
      i = (i + 1) & mask_;
    }
    slots_[i] = {n, j};
    used_.push_back(i);
    ++count_;
    inserted = true;
    return j;
  }
  int64_t find(torch::autograd::Node* n) const {  // -1 if absent
    for (size_t i = slot(n); slots_[i].first != nullptr; i = (i + 1) & mask_) {
      if (slots_[i].first == n) {
        return slots_[i].second;
      }
    }
    return -1;
  }
 private:
  size_t slot(torch::autograd::Node* n) const {  // Fibonacci hashing of the address
    return static_cast<size_t>((reinterpret_cast<uintptr_t>(n) * 0x9E3779B97F4A7C15ull) >> shift_);
  }
  void resize(size_t cap) {
    slots_.assign(cap, {nullptr, 0});
    mask_ = cap - 1;
    shift_ = 64;
    for (size_t c = cap; c > 1; c >>= 1) {
      --shift_;
    }
  }
  void grow() {
    auto old = std::move(slots_);
    resize(old.size() * 2);
    used_.clear();
    for (const auto& e : old) {
      if (e.first != nullptr) {
        size_t i = slot(e.first);
        while (slots_[i].first != nullptr) {
          i = (i + 1) & mask_;
        }
        slots_[i] = e;
        used_.push_back(i);
      }
    }
  }
  std::vector<std::pair<torch::autograd::Node*, int64_t>> slots_;
  std::vector<size_t> used_;
  size_t mask_ = 0;
  int shift_ = 64;
  size_t count_ = 0;
};

// Nodes in breadth-first order from the roots (each once), the structure key and the index of
// each node object. Per node the key holds: the node's Python type (its address), the number of
// inputs, the number of edges and per edge (index of the next node, input_nr), or (-1, 0) for an
// invalid edge. Equal keys mean the same graph structure within this process.
int64_t flags_of(torch::autograd::Node* fn);  // the hook bits of a node (see HookFlags)

pybind11::tuple walk(pybind11::handle roots, pybind11::handle meta_type, pybind11::handle wanted, bool lazy) {
  PyObject* seq = PySequence_Fast(roots.ptr(), "vjpgen native.walk: expected a sequence of nodes");
  if (seq == nullptr) {
    throw pybind11::error_already_set();
  }
  pybind11::object seq_owner = pybind11::reinterpret_steal<pybind11::object>(seq);
  pybind11::list nodes;
  std::unique_ptr<NodeList> lazy_nodes(lazy ? new NodeList() : nullptr);
  NodeList* nl = lazy_nodes.get();
  pybind11::dict index;
  std::vector<torch::autograd::Node*> order;
  // one table per thread, reused; a walk nested in another (Python code run by an allocation) gets
  // its own
  static thread_local NodeIndex shared_index;
  static thread_local bool shared_in_use = false;
  NodeIndex local_index;
  const bool use_shared = !shared_in_use;
  NodeIndex& seen = use_shared ? shared_index : local_index;
  if (use_shared) {
    shared_index.reset();
    shared_in_use = true;
  }
  struct Release {
    bool on;
    ~Release() {
      if (on) {
        shared_in_use = false;
      }
    }
  } release_shared{use_shared};
  std::vector<int64_t> key;
  Py_ssize_t nroots = PySequence_Fast_GET_SIZE(seq);
  PyObject** items = PySequence_Fast_ITEMS(seq);
  for (Py_ssize_t i = 0; i < nroots; ++i) {
    auto fn = node_of(items[i]);
    if (!fn) {
      throw pybind11::type_error("vjpgen native.walk: a root is not an autograd node");
    }
    bool inserted = false;
    seen.find_or_insert(fn.get(), static_cast<int64_t>(order.size()), inserted);
    if (inserted) {
      index[pybind11::handle(items[i])] = pybind11::int_(static_cast<int64_t>(order.size()));
      order.push_back(fn.get());
      if (nl != nullptr) {
        nl->refs.push_back(fn);
        nl->objs.push_back(Py_NewRef(items[i]));
      } else {
        nodes.append(pybind11::handle(items[i]));
      }
    }
  }
  key.reserve(order.size() * 8);
  // each node's metadata is read when the node is reached, while its memory is in the cache (a
  // second pass over a 10,000-node graph missed the cache on every node)
  pybind11::list metas;
  pybind11::dict hooked;
  pybind11::dict saved_hooked;  // {index: hook key} of the nodes whose saved tensors have hooks
  const bool with_metas = !meta_type.is_none();
  for (size_t i = 0; i < order.size(); ++i) {
    torch::autograd::Node* fn = order[i];
    // ahead of the nodes the walk reads next: the edge array of the node after next, and the nodes
    // the next node's edges lead to (found then, each first touched by taking a reference to it).
    // Walk stage, paired: ViT-tiny (640 nodes) -20%, LLaMA -8%, GPT-2 unchanged.
    if (i + 2 < order.size()) {
      const auto& e2 = order[i + 2]->next_edges();
      if (!e2.empty()) {
        prefetch_lines(e2.data(), 1);
      }
    }
    if (i + 1 < order.size()) {
      for (const auto& e : order[i + 1]->next_edges()) {
        if (e.function) {
          prefetch_lines(e.function.get(), 1);
        }
      }
    }
    if (with_metas) {  // the hooks the engine would run around this node, while it is in the cache
      int64_t hf = flags_of(fn);
      if (hf != 0) {
        hooked[pybind11::int_(static_cast<int64_t>(i))] = pybind11::int_(hf);
      }
    }
    // the node's Python object: nullptr for a lazy walk's node not made yet; made now on the first
    // sight of its C++ type (which tells a custom Function's node) and for a custom Function's
    // node (its ctx, whose saved tensors and Python type the walk reads)
    PyObject* obj = nl != nullptr ? nl->objs[i] : PyList_GET_ITEM(nodes.ptr(), static_cast<Py_ssize_t>(i));
    const saved_state::ClassInfo* known = obj == nullptr ? saved_state::known_class_info(fn) : nullptr;
    if (obj == nullptr && (known == nullptr || known->py_function)) {
      obj = nl->object(i);
    }
    const saved_state::ClassInfo& ci = known != nullptr ? *known : saved_state::class_info(fn, obj);
    if (with_metas) {
      if (int64_t sk = saved_state::saved_hook_key(ci, fn, obj)) {  // (the class looked up once)
        saved_hooked[pybind11::int_(static_cast<int64_t>(i))] = pybind11::int_(sk);
      }
      pybind11::object m = pybind11::reinterpret_steal<pybind11::object>(node_metas(fn, obj, meta_type, nl, i));
      if (PyList_Append(metas.ptr(), m.ptr()) != 0) {
        throw pybind11::error_already_set();
      }
    }
    const auto& edges = fn->next_edges();
    // the node's class: its C++ type, or for a custom Function's node the Python type of its ctx
    // (what type() of the node object is)
    key.push_back(ci.py_function ? reinterpret_cast<int64_t>(Py_TYPE(obj))
                                 : reinterpret_cast<int64_t>(&typeid(*fn)));
    key.push_back(static_cast<int64_t>(fn->num_inputs()));
    key.push_back(static_cast<int64_t>(edges.size()));
    for (const auto& e : edges) {
      if (!e.function) {
        key.push_back(-1);
        key.push_back(0);
        continue;
      }
      torch::autograd::Node* m = e.function.get();
      bool fresh = false;
      int64_t j = seen.find_or_insert(m, static_cast<int64_t>(order.size()), fresh);
      if (fresh) {
        // read when the walk reaches it, later in breadth-first order: a node's first 8 lines hold
        // what the walk reads of it (Node is 464 bytes in torch 2.13; 4 lines gained less, 12 no more)
        prefetch_lines(m, 8);
        order.push_back(m);
        if (nl != nullptr) {
          nl->refs.push_back(e.function);
          nl->objs.push_back(nullptr);
          if (wanted.is_none()) {
            index[pybind11::handle(nl->object(static_cast<size_t>(j)))] = pybind11::int_(j);
          }
        } else {
          pybind11::object mo = pybind11::reinterpret_steal<pybind11::object>(
              torch::autograd::functionToPyObject(e.function));
          if (!mo) {
            throw pybind11::error_already_set();
          }
          if (wanted.is_none()) {
            index[mo] = pybind11::int_(j);
          }
          nodes.append(mo);
        }
      }
      key.push_back(j);
      key.push_back(static_cast<int64_t>(e.input_nr));
    }
  }
  pybind11::bytes kb(reinterpret_cast<const char*>(key.data()), key.size() * sizeof(int64_t));
  if (!wanted.is_none()) {  // the index of the roots (already in it) and of these nodes only
    for (auto w : wanted) {
      auto fw = node_of(w.ptr());
      if (!fw) {
        continue;
      }
      int64_t at = seen.find(fw.get());
      if (at >= 0) {
        PyObject* wo = nl != nullptr ? nl->object(static_cast<size_t>(at))
                                     : PyList_GET_ITEM(nodes.ptr(), static_cast<Py_ssize_t>(at));
        index[pybind11::handle(wo)] = pybind11::int_(at);
      }
    }
  }
  pybind11::object out = nl != nullptr ? pybind11::cast(lazy_nodes.release(), pybind11::return_value_policy::take_ownership)
                                        : pybind11::object(nodes);
  if (!with_metas) {
    return pybind11::make_tuple(out, kb, index);
  }
  return pybind11::make_tuple(out, kb, index, metas, hooked, saved_hooked);
}

// Whether AccumulateGrad may keep `grad` itself as `var.grad` (vjpgen.runtime.execute.leaves._stealable
// without its per-call part): grad is not a view into a larger storage, and it obeys the gradient
// layout contract with var (as AccumulateGrad::accumulateGrad requires to steal).
bool stealable(pybind11::handle grad, pybind11::handle var) {
  if (!THPVariable_Check(grad.ptr()) || !THPVariable_Check(var.ptr())) {
    return false;
  }
  const at::Tensor& g = THPVariable_Unpack(grad.ptr());
  const at::Tensor& v = THPVariable_Unpack(var.ptr());
  if (!g.defined() || !v.defined() || g.is_sparse() || g.is_sparse_csr() || v.is_sparse() ||
      v.is_sparse_csr() || v.is_nested() || g.is_nested()) {
    return false;
  }
  if (g.is_view()) {  // stealing a view keeps its whole storage alive: only when that is all of it
    if (g.storage_offset() != 0 || !g.has_storage() ||
        g.storage().nbytes() != static_cast<size_t>(g.numel()) * g.itemsize()) {
      return false;
    }
  }
  return torch::autograd::utils::obeys_layout_contract(g, v);
}

bool no_hooks(PyObject* hooks) {  // Python's `not var._backward_hooks`
  if (hooks == nullptr || hooks == Py_None) {
    return true;
  }
  int t = PyObject_IsTrue(hooks);
  if (t < 0) {
    throw pybind11::error_already_set();
  }
  return t == 0;
}

// The memory steal_grads reads for the leaves accs[i] and grads gs[i] (a list), asked for in three
// rounds, each reading what the one before asked for (steal_grads asked for the nodes themselves):
// where each AccumulateGrad keeps its variable and the grads' Python objects; the TensorImpls; the
// leaves' autograd metadata (their .grad).
// Halved the leaf sinks of ViT-tiny (152 leaves, 250 -> 143 µs).
void prefetch_leaves(const std::vector<torch::autograd::AccumulateGrad*>& accs, PyObject* gs) {
  const size_t n = accs.size();
  for (size_t i = 0; i < n; ++i) {
    if (accs[i] != nullptr) {
      prefetch_lines(&accs[i]->variable, 1);
    }
    prefetch_lines(PyList_GET_ITEM(gs, static_cast<Py_ssize_t>(i)), 1);
  }
  std::vector<c10::TensorImpl*> vi(n, nullptr);
  for (size_t i = 0; i < n; ++i) {
    if (accs[i] != nullptr) {
      vi[i] = accs[i]->variable.unsafeGetTensorImpl();
      prefetch_lines(vi[i], 3);
    }
    PyObject* g = PyList_GET_ITEM(gs, static_cast<Py_ssize_t>(i));
    if (THPVariable_Check(g)) {
      prefetch_lines(THPVariable_Unpack(g).unsafeGetTensorImpl(), 3);
    }
  }
  for (size_t i = 0; i < n; ++i) {
    if (vi[i] != nullptr && vi[i]->autograd_meta() != nullptr) {
      prefetch_lines(vi[i]->autograd_meta(), 2);
    }
  }
}

// AccumulateGrad's common case for a batch of leaves (vjpgen.runtime.execute.leaves.accumulate_leaf's
// fast path): where nodes[i] is an AccumulateGrad whose variable has no .grad and no tensor or
// post-accumulate-grad hooks, and grads[i] is a tensor that does not require grad, is not in
// `protected` (ids of tensors something else of this call holds) and is stealable() with the
// variable's metadata, var.grad becomes grads[i] itself and its id joins `protected`.
// Returns per leaf whether it was done; the caller accumulates the others itself.
pybind11::list steal_grads(pybind11::handle nodes, pybind11::handle grads, pybind11::handle protected_ids,
                           pybind11::handle indices) {
  pybind11::list out;
  pybind11::sequence gs = pybind11::reinterpret_borrow<pybind11::sequence>(grads);
  if (!PySet_Check(protected_ids.ptr())) {
    throw pybind11::type_error("vjpgen native.steal_grads: protected must be a set");
  }
  // the leaves: nodes[i] for i in indices (nodes: a lazy walk's NodeList or a list), or nodes;
  // each resolved once, before any grad is stolen (a bad index steals nothing)
  const bool by_index = !indices.is_none();
  NodeList* nl = node_list(nodes);
  pybind11::sequence ix = pybind11::reinterpret_borrow<pybind11::sequence>(by_index ? indices : nodes);
  size_t n = ix.size();
  if (gs.size() != n) {
    throw pybind11::value_error("vjpgen native.steal_grads: as many grads as nodes expected");
  }
  std::vector<NodeRef> keep(n);  // (a list's nodes; a NodeList holds its own)
  std::vector<torch::autograd::Node*> fs(n, nullptr);
  for (size_t i = 0; i < n; ++i) {
    fs[i] = node_in(nodes, nl, by_index ? ix[i].cast<Py_ssize_t>() : static_cast<Py_ssize_t>(i), keep[i]);
    prefetch_lines(fs[i], 1);  // (the type, read by the cast below)
  }
  std::vector<torch::autograd::AccumulateGrad*> accs(n, nullptr);
  for (size_t i = 0; i < n; ++i) {
    accs[i] = dynamic_cast<torch::autograd::AccumulateGrad*>(fs[i]);
  }
  if (PyList_CheckExact(grads.ptr())) {
    prefetch_leaves(accs, grads.ptr());
  }
  for (size_t i = 0; i < n; ++i) {
    pybind11::object grad = gs[i];
    bool done = false;
    auto* acc = accs[i];
    if (acc != nullptr && THPVariable_Check(grad.ptr())) {
      const at::Tensor& var = acc->variable;
      const at::Tensor& g = THPVariable_Unpack(grad.ptr());
      pybind11::object pyvar = pybind11::reinterpret_steal<pybind11::object>(THPVariable_Wrap(var));
      if (!pyvar) {
        throw pybind11::error_already_set();
      }
      auto* tv = reinterpret_cast<THPVariable*>(pyvar.ptr());
      pybind11::object gid = pybind11::reinterpret_steal<pybind11::object>(PyLong_FromVoidPtr(grad.ptr()));
      if (var.defined() && g.defined() && !var.grad().defined() && !g.requires_grad() &&
          no_hooks(tv->backward_hooks) && no_hooks(tv->post_accumulate_grad_hooks) &&
          PySet_Contains(protected_ids.ptr(), gid.ptr()) == 0 && g.dtype() == var.dtype() &&
          g.device() == var.device() && g.layout() == var.layout() &&
          g.sym_sizes().equals(var.sym_sizes()) && stealable(grad, pyvar)) {
        var.mutable_grad() = g;
        if (PySet_Add(protected_ids.ptr(), gid.ptr()) < 0) {
          throw pybind11::error_already_set();
        }
        done = true;
      }
    }
    out.append(pybind11::bool_(done));
  }
  return out;
}

// Whether every nodes[i] (i in indices) is an AccumulateGrad whose variable is a strided tensor:
// the per-call check of the leaves whose layout a traced formula reads (sparse.check_layout_leaves
// runs in Python only when this is False), without a Python object per leaf.
bool strided_leaves(pybind11::handle nodes, pybind11::handle indices) {
  NodeList* nl = node_list(nodes);
  for (auto i : indices) {
    NodeRef keep;
    auto* acc = dynamic_cast<torch::autograd::AccumulateGrad*>(node_in(nodes, nl, i.cast<Py_ssize_t>(), keep));
    if (acc == nullptr || !acc->variable.defined() || acc->variable.layout() != c10::kStrided) {
      return false;
    }
  }
  return true;
}

// A compiled region's outputs into the call's grad buffer (vjpgen.runtime.execute.scatter.call_and_scatter): `table` holds
// three ints per region output: its slot s in buf, its position k in outs (-1: the graph produced
// none) and flags (1: the slot's grad is replaced, not summed; 2: the output may alias an input,
// so its id joins `protected`). buf[s] becomes outs[k], or buf[s] + outs[k] where buf[s] holds a
// grad that is summed; an output not produced clears a replaced slot.
void scatter_outputs(pybind11::handle outs, pybind11::handle table, pybind11::handle buf, pybind11::handle protected_ids) {
  if (!PyList_CheckExact(buf.ptr()) || !PyTuple_CheckExact(table.ptr()) || !PySet_Check(protected_ids.ptr())) {
    throw pybind11::type_error("vjpgen native.scatter_outputs: expected outs, a tuple, a list and a set");
  }
  PyObject* seq = PySequence_Fast(outs.ptr(), "vjpgen native.scatter_outputs: outs must be a sequence");
  if (seq == nullptr) {
    throw pybind11::error_already_set();
  }
  pybind11::object seq_owner = pybind11::reinterpret_steal<pybind11::object>(seq);
  const Py_ssize_t n_outs = PySequence_Fast_GET_SIZE(seq);
  const Py_ssize_t n = PyTuple_GET_SIZE(table.ptr());
  const Py_ssize_t n_buf = PyList_GET_SIZE(buf.ptr());
  if (n % 3 != 0) {
    throw pybind11::value_error("vjpgen native.scatter_outputs: table of (slot, k, flags) triples expected");
  }
  for (Py_ssize_t i = 0; i < n; i += 3) {
    const Py_ssize_t s = PyLong_AsSsize_t(PyTuple_GET_ITEM(table.ptr(), i));
    const Py_ssize_t k = PyLong_AsSsize_t(PyTuple_GET_ITEM(table.ptr(), i + 1));
    const long flags = PyLong_AsLong(PyTuple_GET_ITEM(table.ptr(), i + 2));
    if (PyErr_Occurred()) {
      throw pybind11::error_already_set();
    }
    if (s < 0 || s >= n_buf || k >= n_outs) {
      throw pybind11::index_error("vjpgen native.scatter_outputs: slot or output out of range");
    }
    if (k < 0) {
      if (flags & 1) {
        PyList_SetItem(buf.ptr(), s, Py_NewRef(Py_None));
      }
      continue;
    }
    PyObject* g = PySequence_Fast_GET_ITEM(seq, k);
    if (flags & 2) {
      pybind11::object gid = pybind11::reinterpret_steal<pybind11::object>(PyLong_FromVoidPtr(g));
      if (!gid || PySet_Add(protected_ids.ptr(), gid.ptr()) < 0) {
        throw pybind11::error_already_set();
      }
    }
    PyObject* cur = PyList_GET_ITEM(buf.ptr(), s);
    if ((flags & 1) || cur == Py_None) {
      PyList_SetItem(buf.ptr(), s, Py_NewRef(g));
    } else {
      PyObject* sum = PyNumber_Add(cur, g);
      if (sum == nullptr) {
        throw pybind11::error_already_set();
      }
      PyList_SetItem(buf.ptr(), s, sum);
    }
  }
}

// Bits of hook_flags(): which hooks the engine runs around a node.
enum HookFlags : int64_t {
  kTensorPre = 1,  // tensor pre-hooks (register_hook on the tensor the node's input is the grad of;
                   // for AccumulateGrad the leaf's hooks, C++ ones included)
  kRetainsGrad = 2,  // retain_grad()
  kPre = 4,  // node pre-hooks (register_prehook; C++ FunctionPreHooks)
  kPost = 8,  // node post-hooks (register_hook; C++ FunctionPostHooks such as DDP's reducer hook)
  kPostAccumulate = 16,  // AccumulateGrad: the leaf's post-accumulate-grad hook
};

int64_t flags_of(torch::autograd::Node* fn) {
  int64_t f = 0;
  if (!fn->tensor_pre_hooks().empty()) {
    f |= kTensorPre;
  }
  if (!fn->retains_grad_hooks().empty()) {
    f |= kRetainsGrad;
  }
  if (!fn->pre_hooks().empty()) {
    f |= kPre;
  }
  if (!fn->post_hooks().empty()) {
    f |= kPost;
  }
  const std::type_info& ti = typeid(*fn);
  if (&ti != &typeid(torch::autograd::AccumulateGrad) && ti != typeid(torch::autograd::AccumulateGrad)) {  // (cheaper than a dynamic_cast per node)
    return f;
  }
  if (auto* acc = static_cast<torch::autograd::AccumulateGrad*>(fn)) {
    if (acc->variable.defined() && acc->tensor_post_acc_grad_hooks() != nullptr) {
      f |= kPostAccumulate;
    }
  }
  return f;
}

// {index: flags} for the nodes of a sequence that have any hook (see HookFlags).
pybind11::dict hook_flags(pybind11::handle nodes) {
  pybind11::dict out;
  pybind11::sequence ns = pybind11::reinterpret_borrow<pybind11::sequence>(nodes);
  size_t n = ns.size();
  for (size_t i = 0; i < n; ++i) {
    pybind11::object o = ns[i];
    auto fn = node_of(o.ptr());
    if (!fn) {
      continue;
    }
    int64_t f = flags_of(fn.get());
    if (f != 0) {
      out[pybind11::int_(static_cast<int64_t>(i))] = pybind11::int_(f);
    }
  }
  return out;
}

// engine.cpp's call_function, for one node outside the engine's ready queue (the caller is inside
// a graph task of the engine, so hooks that queue final callbacks or read the graph task work).
torch::autograd::variable_list engine_call(torch::autograd::Node& fn, torch::autograd::variable_list inputs, bool keep_graph) {
  for (const auto& hook : fn.tensor_pre_hooks()) {
    inputs = (*hook)(inputs);
  }
  for (const auto& pair : fn.retains_grad_hooks()) {
    inputs = (*pair.second)(inputs);
  }
  for (const auto& hook : fn.pre_hooks()) {
    inputs = (*hook)(inputs);
  }
  if (!keep_graph) {
    fn.will_release_variables();
  }
  const bool has_post_hooks = !fn.post_hooks().empty();
  torch::autograd::variable_list outputs;
  if (has_post_hooks) {
    auto inputs_copy = inputs;
    outputs = fn(std::move(inputs_copy));
  } else {
    outputs = fn(std::move(inputs));
  }
  torch::autograd::validate_outputs(fn.next_edges(), outputs, [&](const std::string& msg) {
    std::ostringstream ss;
    ss << "Function " << fn.name() << " returned an " << msg;
    return ss.str();
  });
  if (has_post_hooks) {
    for (const auto& hook : fn.post_hooks()) {
      outputs = (*hook)(outputs, inputs);
    }
  }
  return outputs;
}

// engine.cpp's call_tensor_pre_hooks: what the engine runs on the grads of a node it captures a
// grad at but does not execute (a grad() input that is a leaf, or a non-leaf whose node is not
// needed): the tensor pre-hooks and retains_grad hooks, nothing else.
torch::autograd::variable_list engine_tensor_pre_hooks(torch::autograd::Node& fn, torch::autograd::variable_list inputs) {
  for (const auto& hook : fn.tensor_pre_hooks()) {
    inputs = (*hook)(inputs);
  }
  for (const auto& pair : fn.retains_grad_hooks()) {
    inputs = (*pair.second)(inputs);
  }
  return inputs;
}

// Runs fn with the GIL released, as the engine runs nodes; a Python error raised inside (a Python
// hook) is restored as the pending Python exception and a C++ error becomes the Python exception
// torch's bindings raise for it (c10::NotImplementedError a NotImplementedError, c10::IndexError an
// IndexError, ...; any other a RuntimeError) with torch's message (torch::processErrorMsg:
// "torch.FloatTensor", not "CPUFloatType", as eager says it).
template <typename F>
void without_gil(F&& fn) {
  bool py_err = false;
  std::string cpp_err;
  PyObject* kind = PyExc_RuntimeError;
  {
    pybind11::gil_scoped_release nogil;
    try {
      fn();
    } catch (python_error& e) {
      pybind11::gil_scoped_acquire gil;
      e.restore();
      py_err = true;
    } catch (const c10::NotImplementedError& e) {
      cpp_err = e.what_without_backtrace();
      kind = PyExc_NotImplementedError;
    } catch (const c10::IndexError& e) {
      cpp_err = e.what_without_backtrace();
      kind = PyExc_IndexError;
    } catch (const c10::ValueError& e) {
      cpp_err = e.what_without_backtrace();
      kind = PyExc_ValueError;
    } catch (const c10::TypeError& e) {
      cpp_err = e.what_without_backtrace();
      kind = PyExc_TypeError;
    } catch (const c10::Error& e) {
      cpp_err = e.what_without_backtrace();
    } catch (const std::exception& e) {
      cpp_err = e.what();
    }
  }
  if (py_err) {
    throw pybind11::error_already_set();
  }
  if (!cpp_err.empty()) {  // with the Python names of tensor types, as torch's own bindings say them
    PyErr_SetString(kind, torch::processErrorMsg(cpp_err).c_str());
    throw pybind11::error_already_set();
  }
}

// Calls `node` with `grads` (tensors or None) as the engine would: see engine_call. Returns one
// entry per next edge (None for an undefined grad). The GIL is released meanwhile, as the engine
// runs nodes without it (a C++ hook may wait on a thread that needs it).
// `grads` (a sequence of tensors or None) as the engine's variable_list; `who` names the caller
torch::autograd::variable_list grads_of(pybind11::handle grads, const char* who) {
  torch::autograd::variable_list inputs;
  for (auto g : grads) {
    if (g.is_none()) {
      inputs.emplace_back();
    } else if (THPVariable_Check(g.ptr())) {
      inputs.push_back(THPVariable_Unpack(g.ptr()));
    } else {
      throw pybind11::type_error(std::string("vjpgen native.") + who + ": grads must be tensors or None");
    }
  }
  return inputs;
}

// a variable_list as a Python list (None for an undefined tensor)
pybind11::list list_of(const torch::autograd::variable_list& outputs) {
  pybind11::list out;
  for (auto& t : outputs) {
    if (t.defined()) {
      out.append(pybind11::reinterpret_steal<pybind11::object>(THPVariable_Wrap(t)));
    } else {
      out.append(pybind11::none());
    }
  }
  return out;
}

pybind11::list call_node(pybind11::handle node, pybind11::handle grads, bool keep_graph) {
  auto fn = node_of(node.ptr());
  if (!fn) {
    throw pybind11::type_error("vjpgen native.call_node: expected an autograd node");
  }
  torch::autograd::variable_list inputs = grads_of(grads, "call_node");
  torch::autograd::variable_list outputs;
  without_gil([&] { outputs = engine_call(*fn, std::move(inputs), keep_graph); });
  return list_of(outputs);
}

// The tensor pre-hooks and retains_grad hooks of `node` on `grads` (see engine_tensor_pre_hooks);
// one entry per input of the node. The GIL is released meanwhile, as in call_node.
pybind11::list tensor_pre_hooks(pybind11::handle node, pybind11::handle grads) {
  auto fn = node_of(node.ptr());
  if (!fn) {
    throw pybind11::type_error("vjpgen native.tensor_pre_hooks: expected an autograd node");
  }
  torch::autograd::variable_list inputs = grads_of(grads, "tensor_pre_hooks");
  torch::autograd::variable_list outputs;
  without_gil([&] { outputs = engine_tensor_pre_hooks(*fn, std::move(inputs)); });
  return list_of(outputs);
}

// call_node for a run of AccumulateGrad nodes (one grad each, nothing returned): the live leaf
// steps of a plan, in order, with one GIL release for all (DDP's reducer hook on each parameter).
void call_leaves(pybind11::handle nodes, pybind11::handle grads, bool keep_graph) {
  pybind11::sequence ns = pybind11::reinterpret_borrow<pybind11::sequence>(nodes);
  pybind11::sequence gs = pybind11::reinterpret_borrow<pybind11::sequence>(grads);
  size_t n = ns.size();
  if (gs.size() != n) {
    throw pybind11::value_error("vjpgen native.call_leaves: as many grads as nodes expected");
  }
  std::vector<NodeRef> fns;
  std::vector<torch::autograd::variable_list> inputs;
  fns.reserve(n);
  inputs.reserve(n);
  for (size_t i = 0; i < n; ++i) {
    pybind11::object o = ns[i];
    pybind11::object g = gs[i];
    auto fn = node_of(o.ptr());
    if (!fn) {
      throw pybind11::type_error("vjpgen native.call_leaves: expected autograd nodes");
    }
    torch::autograd::variable_list in;
    if (g.is_none()) {
      in.emplace_back();
    } else if (THPVariable_Check(g.ptr())) {
      in.push_back(THPVariable_Unpack(g.ptr()));
    } else {
      throw pybind11::type_error("vjpgen native.call_leaves: grads must be tensors or None");
    }
    fns.push_back(std::move(fn));
    inputs.push_back(std::move(in));
  }
  without_gil([&] {
    for (size_t i = 0; i < n; ++i) {
      engine_call(*fns[i], std::move(inputs[i]), keep_graph);
    }
  });
}

// Per node of a sequence (None: false): whether the running backward executes it or captures a
// grad at it, as torch._C._will_engine_execute_node answers from the engine's graph task, except for
// a leaf's node that autograd.grad() captures at: true here, where torch's raises (its answer for
// such a node is not defined), and a raise per leaf cost ~9 us from Python (a whole step's
// autograd.grad(loss, weights) through a compiled graph asked it for each of 26 weights).
// Outside a backward (a node's apply called directly): None.
pybind11::object engine_will_execute(const pybind11::sequence& nodes) {
  const auto* info = torch::autograd::get_current_graph_task_exec_info();
  const auto* in_graph = torch::autograd::get_current_graph_task_nodes_in_graph();
  if (info == nullptr || in_graph == nullptr) {
    return pybind11::none();
  }
  const size_t n = pybind11::len(nodes);
  pybind11::tuple out(n);
  for (size_t i = 0; i < n; ++i) {
    pybind11::object o = nodes[i];
    bool r = false;
    if (!o.is_none()) {
      NodeRef ref = node_of(o.ptr());
      torch::autograd::Node* fn = ref.get();
      r = fn != nullptr && in_graph->count(fn) > 0;
      if (r && !info->empty()) {
        auto it = info->find(fn);
        r = it != info->end() && it->second.should_execute();
      }
    }
    out[i] = pybind11::bool_(r);
  }
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "vjpgen native helpers: release_variables and the graph walk on live autograd nodes";
  pybind11::class_<NodeList>(m, "NodeList", "a walk's nodes: C++ nodes, their Python objects made on first access")
      .def("__len__", &NodeList::size)
      .def("__getitem__", &NodeList::item)
      .def("__iter__", [](NodeList& l) { return pybind11::iter(l.as_list()); })
      .def("list", &NodeList::as_list, "every node's Python object, in walk order")
      .def("made", [](const NodeList& l) {
        return static_cast<int64_t>(std::count_if(l.objs.begin(), l.objs.end(), [](PyObject* o) { return o != nullptr; }));
      }, "how many of the nodes' Python objects exist (the roots and those read from Python)");
  m.def("release", &release, "Node::release_variables() on each node of a sequence (or on nodes[i] for i in indices)",
        pybind11::arg("nodes"), pybind11::arg("indices") = pybind11::none());
  m.def("walk", &walk, "breadth-first walk from root nodes: (nodes, structure key bytes, {node: index}[, metas, hooked, saved_hooked]); lazy: nodes is a NodeList",
        pybind11::arg("roots"), pybind11::arg("meta_type") = pybind11::none(),
        pybind11::arg("wanted") = pybind11::none(), pybind11::arg("lazy") = false);
  m.def("steal_grads", &steal_grads, "AccumulateGrad's common case for a batch of leaves (see vjpgen.runtime.execute.leaves.accumulate_leaf)",
        pybind11::arg("nodes"), pybind11::arg("grads"), pybind11::arg("protected"),
        pybind11::arg("indices") = pybind11::none());
  m.def("strided_leaves", &strided_leaves, "every nodes[i] (i in indices) is the AccumulateGrad of a strided tensor",
        pybind11::arg("nodes"), pybind11::arg("indices"));
  m.def("scatter_outputs", &scatter_outputs, "a compiled region's outputs into the grad buffer (see vjpgen.runtime.execute.scatter.call_and_scatter)",
        pybind11::arg("outs"), pybind11::arg("table"), pybind11::arg("buf"), pybind11::arg("protected"));
  m.def("hook_flags", &hook_flags, "{index: hook bits} for the nodes of a sequence that have hooks");
  m.def("call_node", &call_node, "the engine's call_function: hooks, the node, validate_outputs",
        pybind11::arg("node"), pybind11::arg("grads"), pybind11::arg("keep_graph"));
  m.def("tensor_pre_hooks", &tensor_pre_hooks,
        "the engine's call_tensor_pre_hooks: a captured node's tensor pre-hooks and retains_grad hooks",
        pybind11::arg("node"), pybind11::arg("grads"));
  m.def("call_leaves", &call_leaves, "call_node for a run of AccumulateGrad nodes, one grad each",
        pybind11::arg("nodes"), pybind11::arg("grads"), pybind11::arg("keep_graph"));
  m.def("saved_value", &saved_state::saved_value,
        "a saved value Python cannot read (TensorGeometry as (sizes, strides, offset), optional<bool>)",
        pybind11::arg("node"), pybind11::arg("name"));
  m.def("saved_hook_key", &saved_state::saved_hook_key_py,
        "the unpack hook identity of the node's first saved tensor with hooks, 0 when none has");
  pybind11::class_<native_gather::Program>(m, "Gather", "a region's native gather program (see fastpath.native_gather)")
      .def(pybind11::init<pybind11::list, int64_t>(), pybind11::arg("ops"), pybind11::arg("n_tensors"))
      .def("__call__", &native_gather::Program::run, pybind11::arg("nodes"), pybind11::arg("metas"),
           pybind11::arg("buf"))
      .def("arm", &native_gather::Program::arm, pybind11::arg("token"), pybind11::arg("entry"))
      .def("never_arm", &native_gather::Program::never_arm);
  m.def("engine_will_execute", &engine_will_execute,
        "per node: the running backward executes it or captures at it (torch._C._will_engine_execute_node, a captured leaf true)",
        pybind11::arg("nodes"));
  m.def("stealable", &stealable, "AccumulateGrad may keep grad itself as var.grad (layout contract, whole storage)");
}
