#include "cc/tf/python_gil.h"

#include <dlfcn.h>

namespace antman {
namespace {

class PythonGil final : public BlockingHooks {
 public:
  PythonGil() {
    // Already loaded by the interpreter that loaded us; RTLD_DEFAULT finds
    // them in libpython or in a statically linked python executable.
    gil_check_ = reinterpret_cast<int (*)()>(dlsym(RTLD_DEFAULT, "PyGILState_Check"));
    save_thread_ = reinterpret_cast<void* (*)()>(dlsym(RTLD_DEFAULT, "PyEval_SaveThread"));
    restore_thread_ =
        reinterpret_cast<void (*)(void*)>(dlsym(RTLD_DEFAULT, "PyEval_RestoreThread"));
    usable_ = gil_check_ != nullptr && save_thread_ != nullptr && restore_thread_ != nullptr;
  }

  void* BeforeBlock() override {
    // Only a thread that holds the GIL may release it; TF's own threads do not.
    if (!usable_ || gil_check_() == 0) return nullptr;
    return save_thread_();
  }

  void AfterBlock(void* token) override {
    if (token != nullptr) restore_thread_(token);
  }

 private:
  int (*gil_check_)() = nullptr;
  void* (*save_thread_)() = nullptr;
  void (*restore_thread_)(void*) = nullptr;
  bool usable_ = false;
};

}  // namespace

BlockingHooks* PythonGilHooks() {
  static PythonGil* hooks = new PythonGil();
  return hooks;
}

}  // namespace antman
