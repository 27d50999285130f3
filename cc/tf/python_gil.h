// Lends Python's GIL while a TensorFlow op waits for its admission.
//
// TF runs eager ops and tf.function calls from Python with the GIL held. An op
// held back by the operator manager (throttled, or paused at share 0) would
// keep it, stopping every other Python thread of the job: its input pipeline's
// Python code, the job agent that applies the coordinator's next control (so a
// pause could never be lifted), the stats writer. This hook releases the GIL
// for the wait and takes it back before the op runs.
//
// The Python C API is looked up at run time (dlsym in the process), so the
// library has no link-time dependency on a Python version; without Python in
// the process the hook lends nothing.
#ifndef TF_ANTMAN_CC_TF_PYTHON_GIL_H_
#define TF_ANTMAN_CC_TF_PYTHON_GIL_H_

#include "cc/core/op_manager.h"

namespace antman {

// The process-wide hook (never deleted).
BlockingHooks* PythonGilHooks();

}  // namespace antman

#endif  // TF_ANTMAN_CC_TF_PYTHON_GIL_H_
