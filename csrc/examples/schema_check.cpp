// Loads the attnops op library (linked in) and prints the schema of each op, as a C++ user would find them.
// Exit code 1 if an op is missing. Built by CMakeLists.txt, run by tests/test_cmake.py.
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/torch.h>

#include <iostream>

int main() {
  int missing = 0;
  for (const char* name :
       {"attnops::paged_attention", "attnops::paged_attention_with_lse", "attnops::reshape_and_cache"}) {
    for (const char* overload : {"", "out"}) {
      if (std::string(name) == "attnops::reshape_and_cache" && std::string(overload) == "out") continue;
      auto op = c10::Dispatcher::singleton().findSchema({name, overload});
      if (!op) {
        std::cerr << "missing: " << name << "." << overload << "\n";
        ++missing;
        continue;
      }
      std::cout << op->schema() << "\n";
    }
  }
  return missing ? 1 : 0;
}
