"""tf-antman's job-side log: the one place that writes it.

Lines go through `absl.logging`, like those of TensorFlow's Python libraries (Keras, TF's
own modules once absl's handler is installed), so they sit with TensorFlow's and follow the same
verbosity (`absl.logging.set_verbosity`, absl's `--verbosity` flag under `absl.app`): warnings
show by default, INFO lines only when the verbosity allows them. Every line starts with
"tf-antman: " so it can be told apart from TensorFlow's.
"""

from __future__ import annotations

from typing import Any

from absl import logging as _absl

PREFIX = "tf-antman: "


class _Log:
    """`log.info("...%s", x)` and friends, with the prefix; the caller's file and line are reported."""

    def debug(self, msg: str, *args: Any, **kwargs: Any) -> None:
        _absl.debug(PREFIX + msg, *args, **kwargs)

    def info(self, msg: str, *args: Any, **kwargs: Any) -> None:
        _absl.info(PREFIX + msg, *args, **kwargs)

    def warning(self, msg: str, *args: Any, **kwargs: Any) -> None:
        _absl.warning(PREFIX + msg, *args, **kwargs)

    def error(self, msg: str, *args: Any, **kwargs: Any) -> None:
        _absl.error(PREFIX + msg, *args, **kwargs)

    def exception(self, msg: str, *args: Any, **kwargs: Any) -> None:
        _absl.exception(PREFIX + msg, *args, **kwargs)


# absl reports the first frame outside its own module as the source of a line; these wrappers
# would otherwise be that frame for every line.
for _name in ("debug", "info", "warning", "error", "exception"):
    _absl.ABSLLogger.register_frame_to_skip(__file__, _name)

log = _Log()
