// Ops that let a test look at tf-antman from inside TensorFlow. Built as a
// separate library for tf.load_op_library: the main library is loaded before
// `import tensorflow` (to install the device factory), and TF only generates
// Python wrappers for ops registered while *it* loads a library.
#include <string>

#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/common_shape_fns.h"

namespace antman {
namespace {

using tensorflow::OpKernel;
using tensorflow::OpKernelConstruction;
using tensorflow::OpKernelContext;

REGISTER_OP("AntmanDeviceInfo")
    .Output("allocator_name: string")
    .Output("device_name: string")
    .SetIsStateful()  // never constant-folded: it must run on the device at run time
    .SetShapeFn(tensorflow::shape_inference::ScalarShape)
    .Doc("Reports the allocator the running device serves tensors with, and the device name.");

class AntmanDeviceInfoOp : public OpKernel {
 public:
  explicit AntmanDeviceInfoOp(OpKernelConstruction* c) : OpKernel(c) {}
  void Compute(OpKernelContext* ctx) override {
    tsl::Allocator* a = ctx->device()->GetAllocator(tsl::AllocatorAttributes());
    tensorflow::Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, tensorflow::TensorShape({}), &out));
    out->scalar<tensorflow::tstring>()() = a->Name();
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, tensorflow::TensorShape({}), &out));
    out->scalar<tensorflow::tstring>()() = ctx->device()->name();
  }
};

REGISTER_KERNEL_BUILDER(Name("AntmanDeviceInfo").Device(tensorflow::DEVICE_CPU), AntmanDeviceInfoOp);
// On a GPU device the kernel only reads host-side names: both outputs in host memory.
REGISTER_KERNEL_BUILDER(Name("AntmanDeviceInfo")
                            .Device(tensorflow::DEVICE_GPU)
                            .HostMemory("allocator_name")
                            .HostMemory("device_name"),
                        AntmanDeviceInfoOp);

}  // namespace
}  // namespace antman
