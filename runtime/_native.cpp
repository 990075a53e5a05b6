// vjpgen's native helpers: what Python cannot do to a live autograd graph.
//
// release(nodes): Node::release_variables() on each C++ node of a sequence, as the autograd
// engine does after running a node without retain_graph (the node drops its saved tensors).
// Built on first use by vjpgen/runtime/native.py with torch.utils.cpp_extension.

#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/python_cpp_function.h>

#include <pybind11/pybind11.h>

namespace {

// Returns how many nodes were released (custom Function nodes and other Python objects are
// skipped: they keep their saved tensors in their ctx).
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
    if (torch::autograd::THPCppFunction_Check(o)) {
      auto* f = reinterpret_cast<torch::autograd::THPCppFunction*>(o);
      if (f->cdata) {
        f->cdata->release_variables();
        ++released;
      }
    }
  }
  Py_DECREF(seq);
  return released;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "vjpgen native helpers (release_variables on live autograd nodes)";
  m.def("release", &release, "Node::release_variables() on each C++ node of a sequence");
}
