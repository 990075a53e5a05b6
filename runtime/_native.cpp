// vjpgen's native helpers: what Python cannot do to a live autograd graph.
//
// release(nodes): Node::release_variables() on each node of a sequence, as the autograd
// engine does after running a node without retain_graph (the node drops its saved tensors).
// walk(roots): the breadth-first walk of vjpgen.runtime.engine.walk over next_edges, without
// building next_functions tuples: (nodes, structure key as bytes, {node: index}).
// Built on first use by vjpgen/runtime/native.py with torch.utils.cpp_extension.

#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/python_cpp_function.h>
#include <torch/csrc/autograd/python_function.h>

#include <cstdint>
#include <unordered_map>
#include <vector>

#include <pybind11/pybind11.h>

namespace {

c10::intrusive_ptr<torch::autograd::Node> node_of(PyObject* o) {
  if (torch::autograd::THPCppFunction_Check(o)) {
    return reinterpret_cast<torch::autograd::THPCppFunction*>(o)->cdata;
  }
  if (THPFunction_Check(o)) {
    return reinterpret_cast<THPFunction*>(o)->cdata;
  }
  return {};
}

// Returns how many nodes were released (objects that are not autograd nodes are skipped). A
// custom Function's node (PyNode) releases the tensors its ctx saved.
Py_ssize_t release(pybind11::handle nodes) {
  PyObject* seq = PySequence_Fast(nodes.ptr(), "vjpgen native.release: expected a sequence of nodes");
  if (seq == nullptr) {
    throw pybind11::error_already_set();
  }
  Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
  PyObject** items = PySequence_Fast_ITEMS(seq);
  Py_ssize_t released = 0;
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* o = items[i];
    auto fn = node_of(o);
    if (fn) {
      fn->release_variables();
      ++released;
    }
  }
  Py_DECREF(seq);
  return released;
}

// Nodes in breadth-first order from the roots (each once), the structure key and the index of
// each node object. Per node the key holds: the node's Python type (its address), the number of
// inputs, the number of edges and per edge (index of the next node, input_nr), or (-1, 0) for an
// invalid edge. Equal keys mean the same graph structure within this process.
pybind11::tuple walk(pybind11::handle roots) {
  PyObject* seq = PySequence_Fast(roots.ptr(), "vjpgen native.walk: expected a sequence of nodes");
  if (seq == nullptr) {
    throw pybind11::error_already_set();
  }
  pybind11::object seq_owner = pybind11::reinterpret_steal<pybind11::object>(seq);
  pybind11::list nodes;
  pybind11::dict index;
  std::vector<torch::autograd::Node*> order;
  std::unordered_map<torch::autograd::Node*, int64_t> seen;
  std::vector<int64_t> key;
  Py_ssize_t nroots = PySequence_Fast_GET_SIZE(seq);
  PyObject** items = PySequence_Fast_ITEMS(seq);
  for (Py_ssize_t i = 0; i < nroots; ++i) {
    auto fn = node_of(items[i]);
    if (!fn) {
      throw pybind11::type_error("vjpgen native.walk: a root is not an autograd node");
    }
    if (seen.emplace(fn.get(), static_cast<int64_t>(order.size())).second) {
      index[pybind11::handle(items[i])] = pybind11::int_(static_cast<int64_t>(order.size()));
      order.push_back(fn.get());
      nodes.append(pybind11::handle(items[i]));
    }
  }
  key.reserve(order.size() * 8);
  for (size_t i = 0; i < order.size(); ++i) {
    torch::autograd::Node* fn = order[i];
    PyObject* obj = PyList_GET_ITEM(nodes.ptr(), static_cast<Py_ssize_t>(i));
    const auto& edges = fn->next_edges();
    key.push_back(reinterpret_cast<int64_t>(Py_TYPE(obj)));
    key.push_back(static_cast<int64_t>(fn->num_inputs()));
    key.push_back(static_cast<int64_t>(edges.size()));
    for (const auto& e : edges) {
      if (!e.function) {
        key.push_back(-1);
        key.push_back(0);
        continue;
      }
      torch::autograd::Node* m = e.function.get();
      auto it = seen.find(m);
      int64_t j;
      if (it == seen.end()) {
        j = static_cast<int64_t>(order.size());
        seen.emplace(m, j);
        order.push_back(m);
        pybind11::object mo = pybind11::reinterpret_steal<pybind11::object>(
            torch::autograd::functionToPyObject(e.function));
        if (!mo) {
          throw pybind11::error_already_set();
        }
        index[mo] = pybind11::int_(j);
        nodes.append(mo);
      } else {
        j = it->second;
      }
      key.push_back(j);
      key.push_back(static_cast<int64_t>(e.input_nr));
    }
  }
  pybind11::bytes kb(reinterpret_cast<const char*>(key.data()), key.size() * sizeof(int64_t));
  return pybind11::make_tuple(nodes, kb, index);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "vjpgen native helpers: release_variables and the graph walk on live autograd nodes";
  m.def("release", &release, "Node::release_variables() on each node of a sequence");
  m.def("walk", &walk, "breadth-first walk from root nodes: (nodes, structure key bytes, {node: index})");
}
