// Which TensorFlow kernels the operator manager gates and charges.
//
// Busy time is device work. Some kernels mostly *wait*: for input (iterator
// ops, queues, staging areas, Recv), for other kernels they run themselves
// (function-call and control-flow ops, whose inner kernels pass the manager on
// their own), or for Python (py_function, whose eager ops pass it too). Gating
// them would charge their waiting as work (holding an input-bound job far below
// its share) and, for the ones that run inner kernels, count that work twice.
// They start at once and are not charged. So are XLA's compile kernels
// (_XlaCompile: host work) and NCCL's (waiting for peer GPUs).
//
// One exception: a function-call op whose node carries _XlaMustCompile=true
// (tf.function(jit_compile=True) called from a graph, Keras 3's train step) is
// not run by TF's call kernel but by XLA's launch kernel (XlaLocalLaunchBase,
// created by TF's custom kernel creator with the call node's type): the whole
// compiled step is that one kernel, with no inner TF kernel to gate, so it is
// gated and charged like any kernel that works. _XlaRun and XlaLaunch are not
// on the list and are gated too. docs/op-manager.md lists the rule;
// tests/tf/test_throttle_input.py checks every name against TF's op registry.
#ifndef TF_ANTMAN_CC_TF_OP_CLASSES_H_
#define TF_ANTMAN_CC_TF_OP_CLASSES_H_

#include <string_view>

namespace tensorflow {
class NodeDef;
class OpKernel;
}  // namespace tensorflow

namespace antman {

// The attribute that makes TF hand a call node to XLA ("_XlaMustCompile",
// tensorflow/compiler/jit/defs.h; spelt here, the wheel's jit library is not linked).
inline constexpr char kXlaMustCompileAttr[] = "_XlaMustCompile";

// True for an op type whose kernel waits rather than works (see above).
bool IsWaitingOpType(std::string_view op_type);

// A PartitionedCall/StatefulPartitionedCall node that XLA compiles and launches.
bool IsXlaLaunchedCall(std::string_view op_type, const tensorflow::NodeDef& def);

// What the devices ask: a waiting type, unless XLA launches it (see above).
bool IsWaitingKernel(const tensorflow::OpKernel& kernel);

// The list itself, terminated by nullptr, for tests.
const char* const* WaitingOpTypes();

}  // namespace antman

#endif  // TF_ANTMAN_CC_TF_OP_CLASSES_H_
