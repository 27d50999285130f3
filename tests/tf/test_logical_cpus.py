"""Several logical CPU devices (the usual way to try MirroredStrategy on a CPU, or a Session's
`device_count={"CPU": 2}`) are all the job's one emulated device: every one of them allocates
from the same budget and passes the same operator manager (docs/emulated-device.md). Before,
CPU:1 and later were stock ThreadPoolDevices: unlimited memory and ungated ops."""

from __future__ import annotations

from tests.conftest import run_py

TWO_CPUS = """
        import tensorflow as tf, tf_antman
        from tf_antman import native
        cpus = tf.config.list_physical_devices("CPU")
        tf.config.set_logical_device_configuration(
            cpus[0], [tf.config.LogicalDeviceConfiguration(), tf.config.LogicalDeviceConfiguration()])
        ops = tf.load_op_library(str(native.lib_path(native.OPS_LIB)))
        logical = [d.name for d in tf.config.list_logical_devices("CPU")]
"""

MiB = 1 << 20


def test_every_logical_cpu_allocates_from_the_one_budget() -> None:
    job = run_py(TWO_CPUS + """
        out = {"logical": logical}
        for dev in ("/cpu:0", "/cpu:1"):
            with tf.device(dev):
                alloc, name = ops.antman_device_info()
                out[dev] = {"allocator": alloc.numpy().decode(), "device": name.numpy().decode()}
                try:
                    big = tf.ones((5000, 5000)) + 1.0      # 100 MB, far over the 8 MiB limit
                    big.numpy()
                    out[dev]["big"] = "allocated"
                except tf.errors.ResourceExhaustedError as e:
                    out[dev]["big"] = "tf-antman" in str(e)
        # One budget for both devices: 5 MiB held on CPU:0 leaves no room for 5 MiB on CPU:1...
        with tf.device("/cpu:0"):
            held = tf.random.uniform((5 * 1024 * 1024 // 4,))
        in_use_one = tf_antman.memory_stats()["in_use"]
        with tf.device("/cpu:1"):
            try:
                other = tf.random.uniform((5 * 1024 * 1024 // 4,))
                out["second_5mib"] = "allocated"
            except tf.errors.ResourceExhaustedError:
                out["second_5mib"] = "refused"
        # ...and once it is freed, CPU:1 gets it.
        del held
        with tf.device("/cpu:1"):
            other = tf.random.uniform((5 * 1024 * 1024 // 4,))
            out["after_free"] = tf_antman.memory_stats()["in_use"]
        out["in_use_one"] = in_use_one
        emit(out)
    """, ANTMAN_MEMORY_LIMIT="8MiB", ANTMAN_HOST_MEMORY="0")
    r = job.result
    assert r["logical"] == ["/device:CPU:0", "/device:CPU:1"]
    for i, dev in enumerate(("/cpu:0", "/cpu:1")):
        assert r[dev]["device"].endswith(f"/device:CPU:{i}")
        assert r[dev]["allocator"] == "antman_universal", r[dev]
        assert r[dev]["big"] is True, f"{dev} allocated 100 MB past an 8 MiB limit: {r[dev]}"
    assert r["in_use_one"] >= 5 * MiB
    assert r["second_5mib"] == "refused", "the two logical CPUs have separate budgets"
    assert 5 * MiB <= r["after_free"] <= 8 * MiB


def test_every_logical_cpu_is_gated_by_the_one_manager() -> None:
    job = run_py(TWO_CPUS + """
        tf_antman.set_compute_share(0.5)
        f = tf.function(lambda x: tf.reduce_sum(tf.matmul(x, x)))
        out = {}
        for dev in ("/cpu:0", "/cpu:1"):
            with tf.device(dev):
                a = tf.random.uniform((256, 256))
                f(a).numpy()                              # traced for this device
                before = tf_antman.compute_stats()
                for _ in range(50):
                    f(a).numpy()
                after = tf_antman.compute_stats()
            out[dev] = {"gated": after["ops_total"] - before["ops_total"],
                        "busy_ns": after["busy_ns"] - before["busy_ns"]}
        emit(out)
    """, ANTMAN_ENABLE="1")
    r = job.result
    for dev in ("/cpu:0", "/cpu:1"):
        # MatMul and Sum of each of the 50 calls passed the manager
        assert r[dev]["gated"] >= 2 * 50, f"ops on {dev} were not gated: {r}"
        assert r[dev]["busy_ns"] > 0


def test_session_with_two_cpus_is_limited_and_gated_on_cpu1() -> None:
    job = run_py("""
        import tensorflow as tf, tf_antman
        from tf_antman import native
        tf1 = tf.compat.v1
        tf1.disable_eager_execution()
        ops = tf.load_op_library(str(native.lib_path(native.OPS_LIB)))
        with tf.device("/cpu:1"):
            info = ops.antman_device_info()
            # random, not constant: grappler must not fold it away before it runs on CPU:1
            big = tf.reduce_sum(tf.random.uniform((5000, 5000)) + 1.0)
            small = tf.reduce_sum(tf.matmul(tf.random.uniform((64, 64)), tf.random.uniform((64, 64))))
        out = {}
        tf_antman.set_compute_share(0.5)
        with tf1.Session(config=tf1.ConfigProto(device_count={"CPU": 2})) as s:
            alloc, name = s.run(info)
            out["allocator"], out["device"] = alloc.decode(), name.decode()
            before = tf_antman.compute_stats()["ops_total"]
            for _ in range(20):
                s.run(small)
            out["gated"] = tf_antman.compute_stats()["ops_total"] - before
            try:
                s.run(big)
                out["big"] = "allocated"
            except tf.errors.ResourceExhaustedError as e:
                out["big"] = "tf-antman" in str(e)
        emit(out)
    """, ANTMAN_MEMORY_LIMIT="8MiB", ANTMAN_HOST_MEMORY="0")
    r = job.result
    assert r["device"].endswith("/device:CPU:1")
    assert r["allocator"] == "antman_universal"
    assert r["big"] is True, f"CPU:1 of a Session allocated 100 MB past an 8 MiB limit: {r}"
    assert r["gated"] >= 20, r


def test_mirrored_strategy_on_two_logical_cpus_trains_throttled() -> None:
    job = run_py(TWO_CPUS + """
        tf_antman.set_compute_share(0.5)
        strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
        with strategy.scope():
            w = tf.Variable(tf.ones((64, 64)))
        x = tf.random.stateless_uniform((64, 64), seed=(1, 2))
        @tf.function
        def step():
            def replica():
                with tf.GradientTape() as tape:
                    loss = tf.reduce_mean(tf.square(tf.matmul(x, w)))
                w.assign_sub(0.01 * tape.gradient(loss, w))
                return loss
            return strategy.reduce("MEAN", strategy.run(replica), axis=None)
        step()
        allocators = strategy.experimental_local_results(
            strategy.run(lambda: ops.antman_device_info()[0]))
        before = tf_antman.compute_stats()["ops_total"]
        served = tf_antman.memory_stats()["device_bytes_served"]
        losses = [float(step()) for _ in range(10)]
        emit({"losses": losses, "gated": tf_antman.compute_stats()["ops_total"] - before,
              "served": tf_antman.memory_stats()["device_bytes_served"] - served,
              "replicas": strategy.num_replicas_in_sync,
              "allocators": [a.numpy().decode() for a in allocators]})
    """, ANTMAN_ENABLE="1")
    r = job.result
    assert r["replicas"] == 2
    assert r["allocators"] == ["antman_universal"] * 2, r
    assert r["losses"][-1] < r["losses"][0]
    # both replicas' MatMuls (forward and gradient) went through the one manager
    assert r["gated"] >= 10 * 2 * 3, r  # (CPU:0 alone would pass this: the allocators above tell)
    assert r["served"] > 0
