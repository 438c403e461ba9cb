"""The run's life room: what happens around each training step.

Modules: ``lifecycle`` (signals, stop flags, non-finite handling, ``status.json``, the run lock),
``reliability`` (lock, writable and free-space checks, exit with the launcher), ``process_defaults``
(CPU thread and OpenMP defaults, set before torch loads), ``step_runner`` (one global batch's forward
and backward: Megatron's schedules or the CPU runner), ``metrics`` (``metrics.jsonl``, FLOPs, plots),
``hc_health`` (HC diagnostics during training), ``run_record`` (what a run trained on), ``watchdog``
(per-rank section timeouts, exit 86 on a hang), ``straggler`` (the slowest rank's work per step),
``faults`` (``XHC_FAULT_INJECT``, for tests and the chaos run).
"""

from __future__ import annotations

from training.rooms import lazy_exports

_EXPORTS = {
    "HCHealth": "hc_health",
    "first_nonfinite_parameter": "lifecycle", "Lifecycle": "lifecycle", "NonFiniteState": "lifecycle",
    "TrainingAborted": "lifecycle", "write_status": "lifecycle",
    "dedupe_resumed": "metrics", "format_duration": "metrics", "MetricsLogger": "metrics",
    "model_flops_per_token": "metrics", "peak_tflops": "metrics", "plot_losses": "metrics",
    "read_jsonl": "metrics", "read_metrics": "metrics",
    "cpu_entry_point": "process_defaults", "set_omp_wait_policy": "process_defaults",
    "check_free_space": "reliability", "exit_with_launcher": "reliability", "human_mb": "reliability",
    "RunLock": "reliability", "RunLocked": "reliability",
    "build_run_record": "run_record", "read_run_record": "run_record", "RECORD_NAME": "run_record",
    "RecordError": "run_record", "RunRecord": "run_record", "write_record_file": "run_record",
    "write_run_record": "run_record",
    "CpuStepRunner": "step_runner", "float16_module_keep_hc_fp32": "step_runner",
    "make_step_runner": "step_runner", "MegatronStepRunner": "step_runner", "params_synced": "step_runner",
    "unwrap": "step_runner",
    "fault_point": "faults", "faults_active": "faults", "FaultSpecError": "faults", "parse_faults": "faults",
    "set_attempt": "faults",
    "record_attempt": "guard", "report_stragglers": "guard", "start_guard": "guard",
    "append_attempt": "watchdog", "count_attempts": "watchdog", "EXIT_HANG": "watchdog", "Watchdog": "watchdog",
    "WatchdogSettings": "watchdog", "hang_retry": "watchdog",
    "plot_rank_times": "straggler", "StragglerMonitor": "straggler",
}
__all__ = sorted(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
