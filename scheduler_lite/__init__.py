"""scheduler_lite: AntMan-style scheduling for the GPUs of one workstation, and its simulator.

Entry points for other modules:
  scheduler_lite.model                      typed snapshot and decisions
  scheduler_lite.policy.book.ClusterBook    applies global decisions, answers policy queries
  scheduler_lite.policy.global_scheduler    schedule(state, SchedulerConfig) -> decisions
  scheduler_lite.policy.coordinator         round(now, GpuView, CoordinatorConfig, memo)
  scheduler_lite.policy.registry.POLICIES   every policy by name
  scheduler_lite.sim.main(argv)             the simulator CLI (python -m scheduler_lite.sim)
"""
