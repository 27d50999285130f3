#include "cc/tf/op_classes.h"

#include <string>
#include <unordered_set>

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
    "CollectiveBcastRecvV2", "CollectiveAllToAllV3", "CollectiveReduceV3",
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

const char* const* WaitingOpTypes() { return kWaitingOpTypes; }

}  // namespace antman
