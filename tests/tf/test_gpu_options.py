"""TF's GPU options under tf-antman's GPU device factory (cc/tf/gpu_options.cc): what is refused,
and what sizes a GPU's memory. No GPU here, so the rules are driven with TF's own ConfigProto
(serialized, parsed by the library as TF's factory receives it) and with the limit TF's
BaseGPUDeviceFactory computes; the refusal is also seen end to end, through a Session whose
device creation reaches the registered factory (it refuses before TF looks for GPUs)."""

from __future__ import annotations

import textwrap

from tests.conftest import run_py

GIB = 1 << 30

CONFIGS = """
from tensorflow.core.protobuf import config_pb2
def cfg(**experimental):
    c = config_pb2.ConfigProto()
    vd = experimental.pop("virtual_devices", None)
    for limits in vd or []:  # as tf.config.set_logical_device_configuration builds them (context.py)
        c.gpu_options.experimental.virtual_devices.add(memory_limit_mb=limits,
                                                        device_ordinal=list(range(len(limits))))
    for k, v in experimental.items():
        setattr(c.gpu_options.experimental, k, v)
    return c
"""


def test_refused_and_accepted_gpu_options() -> None:
    job = run_py("import tensorflow as tf\nfrom tf_antman import native\nlib = native.load()\n" + CONFIGS
                 + textwrap.dedent("""
        cases = {
            "default": cfg(),
            "one_logical_with_limit": cfg(virtual_devices=[[4096]]),
            "one_per_gpu_on_two_gpus": cfg(virtual_devices=[[4096], [2048]]),
            "two_logical_on_one_gpu": cfg(virtual_devices=[[4096], [1024, 1024]]),
            "num_virtual_devices_per_gpu": cfg(num_virtual_devices_per_gpu=2),
            "use_cuda_malloc_async": cfg(use_cuda_malloc_async=True),
            "timestamped_allocator": cfg(timestamped_allocator=True),
        }
        out = {k: lib.check_gpu_options(c.SerializeToString()) for k, c in cases.items()}
        try:
            lib.check_gpu_options(b"\\xff\\xff")
            out["garbage"] = "accepted"
        except native.NativeError as e:
            out["garbage"] = str(e)
        emit(out)
    """))
    r = job.result
    assert r["default"] == "" and r["one_logical_with_limit"] == "" and r["one_per_gpu_on_two_gpus"] == ""
    assert "several logical devices on one GPU" in r["two_logical_on_one_gpu"]
    assert "GPU 1 of the visible list is split into 2" in r["two_logical_on_one_gpu"]
    assert "num_virtual_devices_per_gpu=2" in r["num_virtual_devices_per_gpu"]
    assert "use_cuda_malloc_async is not supported" in r["use_cuda_malloc_async"]
    assert "timestamped_allocator is not supported" in r["timestamped_allocator"]
    for k, line in r.items():
        assert "\n" not in line, k  # one line each
    assert "not a serialized tensorflow.ConfigProto" in r["garbage"]


def test_session_with_two_logical_devices_per_gpu_is_refused_by_the_cuda_factory() -> None:
    """The refusal is wired where TF creates GPU devices: the Session fails with the line."""
    job = run_py(textwrap.dedent("""
        import tensorflow as tf
        from tf_antman import native
        lib = native.load()
        lib.configure("cuda", 0, 0, 0, 1 << 30, 1.0)  # what a GPU machine runs, minus the GPUs
    """) + CONFIGS + textwrap.dedent("""
        out = {}
        for name, c in {"split": cfg(virtual_devices=[[1024, 1024]]),
                        "async": cfg(use_cuda_malloc_async=True), "plain": cfg()}.items():
            try:
                with tf.compat.v1.Session(graph=tf.Graph(), config=c) as s:
                    out[name] = "created"
            except Exception as e:  # TF's InvalidArgumentError
                out[name] = f"{type(e).__name__}: {e}"
        emit(out)
    """))
    r = job.result
    assert r["plain"] == "created"
    assert r["split"].startswith("InvalidArgumentError") and "several logical devices on one GPU" in r["split"]
    assert "use_cuda_malloc_async is not supported" in r["async"]


def test_gpu_memory_is_sized_by_tensorflows_own_limit() -> None:
    """TF's limit (free memory less its system reserve, per_process_gpu_memory_fraction, a logical
    device's memory_limit) is the capacity; ANTMAN_* values may lower it, never raise it."""
    job = run_py(f"""
        from tf_antman import native
        lib = native.load()
        G = {GIB}
        plans = {{
            "unset": lib.plan_gpu_memory(0, 0, 10 * G),
            "device_memory_lower": lib.plan_gpu_memory(8 * G, 0, 10 * G),
            "device_memory_higher": lib.plan_gpu_memory(12 * G, 0, 10 * G),
            "limit_higher": lib.plan_gpu_memory(0, 12 * G, 10 * G),
            "limit_lower": lib.plan_gpu_memory(8 * G, 6 * G, 10 * G),
            "tf_unknown": lib.plan_gpu_memory(0, 0, 0),
        }}
        emit(plans)
    """)
    r, g = job.result, GIB
    assert r["unset"] == [10 * g, 0, ""]
    assert r["device_memory_lower"] == [8 * g, 0, ""]
    cap, limit, note = r["device_memory_higher"]
    assert (cap, limit) == (10 * g, 0) and note.startswith(f"tf-antman: ANTMAN_DEVICE_MEMORY={12 * g} bytes is above")
    assert f"using {10 * g} bytes" in note
    cap, limit, note = r["limit_higher"]
    assert (cap, limit) == (10 * g, 10 * g) and "ANTMAN_MEMORY_LIMIT" in note
    assert r["limit_lower"] == [8 * g, 6 * g, ""]
    assert r["tf_unknown"] == [0, 0, ""]  # the core's default: the GPU's free memory
