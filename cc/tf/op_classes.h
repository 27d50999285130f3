// Which TensorFlow kernels the operator manager gates and charges.
//
// Busy time is device work. Some kernels mostly *wait*: for input (iterator
// ops, queues, staging areas, Recv), for other kernels they run themselves
// (function-call and control-flow ops, whose inner kernels pass the manager on
// their own), or for Python (py_function, whose eager ops pass it too). Gating
// them would charge their waiting as work (holding an input-bound job far below
// its share) and, for the ones that run inner kernels, count that work twice.
// They start at once and are not charged. docs/op-manager.md lists the rule;
// tests/tf/test_op_classes.py checks every name against TF's op registry.
#ifndef TF_ANTMAN_CC_TF_OP_CLASSES_H_
#define TF_ANTMAN_CC_TF_OP_CLASSES_H_

#include <string_view>

namespace antman {

// True for an op type whose kernel waits rather than works (see above).
bool IsWaitingOpType(std::string_view op_type);

// The list itself, terminated by nullptr, for tests.
const char* const* WaitingOpTypes();

}  // namespace antman

#endif  // TF_ANTMAN_CC_TF_OP_CLASSES_H_
