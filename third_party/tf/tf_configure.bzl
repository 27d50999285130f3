"""Finds the installed TensorFlow pip package and exposes it as @local_config_tf.

Non-interactive: the Python interpreter is $TF_ANTMAN_PYTHON (default: python3 on PATH). The
compile definitions come from tf.sysconfig of that very package, so the ABI flags always match
the TensorFlow the library will be loaded into.
"""

_PY_ENV = "TF_ANTMAN_PYTHON"

_PROBE = """
import json, os, tensorflow as tf
flags = tf.sysconfig.get_compile_flags()
print(json.dumps({
    "include": tf.sysconfig.get_include(),
    "lib": tf.sysconfig.get_lib(),
    "defines": [f[2:] for f in flags if f.startswith("-D")],
    "version": tf.__version__,
}))
"""

def _tf_configure_impl(ctx):
    python = ctx.os.environ.get(_PY_ENV, "python3")
    res = ctx.execute([python, "-c", _PROBE], environment = {"TF_CPP_MIN_LOG_LEVEL": "3"}, quiet = True)
    if res.return_code != 0:
        fail("tf_configure: '%s' could not import tensorflow (set %s to the venv's python):\n%s" %
             (python, _PY_ENV, res.stderr))
    info = json.decode(res.stdout.strip().splitlines()[-1])
    ctx.symlink(info["include"], "include")
    ctx.symlink(info["lib"] + "/libtensorflow_framework.so.2", "libtensorflow_framework.so.2")
    ctx.template("BUILD", ctx.attr._tpl, {
        "%{DEFINES}": repr(info["defines"]),
        "%{VERSION}": info["version"],
    })

tf_configure = repository_rule(
    implementation = _tf_configure_impl,
    environ = [_PY_ENV],
    local = True,
    attrs = {"_tpl": attr.label(default = Label("//third_party/tf:BUILD.tpl"))},
)
