"""The "tf_antman" logger: on stderr by default, so a job's log shows tf-antman's state."""

import logging

log = logging.getLogger("tf_antman")
if not log.handlers:
    _handler = logging.StreamHandler()
    _handler.setFormatter(logging.Formatter("tf-antman: %(levelname)s %(message)s"))
    log.addHandler(_handler)
    log.setLevel(logging.INFO)
    log.propagate = False
