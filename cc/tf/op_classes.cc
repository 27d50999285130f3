#include "cc/tf/op_classes.h"

#include <string>
#include <unordered_set>

#include "tensorflow/core/framework/node_def.pb.h"
#include "tensorflow/core/framework/op_kernel.h"

namespace antman {
namespace {

// One place for the rule (docs/op-manager.md, "What is charged").
const char* const kWaitingOpTypes[] = {
    // tf.data: the iterator hands over what the pipeline's own kernels made.
    "IteratorGetNext", "IteratorGetNextSync", "IteratorGetNextAsOptional",
    "MultiDeviceIteratorGetNextFromShard", "OptionalGetValue",
    // Cross-device and cross-process transfers wait for their producer.
    "_Recv", "_HostRecv", "Recv",
    // Queues and staging areas block until an element or a slot is there.
    "QueueDequeueV2", "QueueDequeueManyV2", "QueueDequeueUpToV2", "QueueEnqueueV2",
    "QueueEnqueueManyV2", "QueueDequeue", "QueueDequeueMany", "QueueDequeueUpTo",
    "QueueEnqueue", "QueueEnqueueMany", "Unstage", "Stage", "StagePeek", "MapUnstage",
    "MapUnstageNoKey", "MapStage", "MapPeek", "OrderedMapUnstage", "OrderedMapUnstageNoKey",
    "OrderedMapStage", "OrderedMapPeek", "BarrierTakeMany",
    // Function calls and control flow: their inner kernels are gated themselves.
    "PartitionedCall", "StatefulPartitionedCall", "RemoteCall", "SymbolicGradient",
    "While", "StatelessWhile", "If", "StatelessIf", "Case", "StatelessCase", "For",
    // Python: the eager ops a py_function runs are gated themselves.
    "EagerPyFunc", "PyFunc", "PyFuncStateless",
    // Collectives wait for their peers.
    "CollectiveReduce", "CollectiveReduceV2", "CollectiveGather", "CollectiveGatherV2",
    "CollectiveBcastSend", "CollectiveBcastRecv", "CollectiveBcastSendV2",
    "CollectiveBcastRecvV2", "CollectiveAllToAllV2", "CollectiveAllToAllV3",
    "CollectiveReduceV3", "CollectiveReduceScatterV2",
    // NCCL (MirroredStrategy's all-reduce on GPUs): a rank's kernel waits on the device for its
    // peers, which gating would charge as this job's work.
    "NcclAllReduce", "NcclReduce", "NcclBroadcast", "_NcclReduceSend", "_NcclReduceRecv",
    "_NcclBroadcastSend", "_NcclBroadcastRecv",
    // XLA's compile half of an auto-clustered pair (_XlaCompile -> _XlaRun): host work (seconds
    // at every recompile) whose output is a key in host memory. _XlaRun runs the executable and
    // is gated like any kernel.
    "_XlaCompile",
    nullptr,
};

const std::unordered_set<std::string_view>& WaitingSet() {
  static const auto* set = [] {
    auto* s = new std::unordered_set<std::string_view>();
    for (const char* const* p = kWaitingOpTypes; *p != nullptr; ++p) s->insert(*p);
    return s;
  }();
  return *set;
}

}  // namespace

bool IsWaitingOpType(std::string_view op_type) { return WaitingSet().count(op_type) != 0; }

bool IsXlaLaunchedCall(std::string_view op_type, const tensorflow::NodeDef& def) {
  if (op_type != "PartitionedCall" && op_type != "StatefulPartitionedCall") return false;
  // The attribute TF's custom kernel creator reads (compilability_check_util.cc,
  // CanCreateXlaKernel): a call node with it true gets XLA's launch kernel.
  const auto it = def.attr().find(kXlaMustCompileAttr);
  return it != def.attr().end() && it->second.b();
}

bool IsWaitingKernel(const tensorflow::OpKernel& kernel) {
  absl::string_view t = kernel.type_string_view();
  std::string_view type(t.data(), t.size());
  return IsWaitingOpType(type) && !IsXlaLaunchedCall(type, kernel.def());
}

const char* const* WaitingOpTypes() { return kWaitingOpTypes; }

}  // namespace antman
