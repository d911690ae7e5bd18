// Only in the Python build (setup.py): a module with no methods, so that `import attnops._C` loads the library
// and its static initializers run TORCH_LIBRARY. The CMake build for C++ users leaves this file out.
#include <Python.h>

extern "C" PyObject* PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module_def);
}
