// Reading the fast paths' Python arguments without raising: a value of another kind is
// declined (false), and the checked Python path then names it.
#pragma once

#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/utils/pybind.h>

namespace arfuse {

// A float or int, not a bool (arg_checks.real_number takes more; those go to Python).
inline bool plain_number(py::handle obj, double* out) {
  PyObject* p = obj.ptr();
  if (PyFloat_Check(p)) {
    *out = PyFloat_AS_DOUBLE(p);
    return true;
  }
  if (PyLong_Check(p) && !PyBool_Check(p)) {
    *out = PyLong_AsDouble(p);
    if (*out == -1.0 && PyErr_Occurred()) {
      PyErr_Clear();
      return false;
    }
    return true;
  }
  return false;
}

// None -> nullptr (true); a tensor -> its address (true); anything else: false.
inline bool take_tensor(py::handle obj, const at::Tensor** out) {
  if (obj.is_none()) {
    *out = nullptr;
    return true;
  }
  if (!THPVariable_Check(obj.ptr())) return false;
  *out = &THPVariable_Unpack(obj.ptr());
  return true;
}

inline bool is_ascii(py::handle obj, const char* text) {
  return PyUnicode_CompareWithASCIIString(obj.ptr(), text) == 0;
}

}  // namespace arfuse
