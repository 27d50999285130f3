"""Pure scheduling policies: the global scheduler, the local coordinator and the baselines."""
