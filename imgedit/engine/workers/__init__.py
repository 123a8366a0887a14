"""The workers, seen from the server: start-up's plan of them (`startup.py`), one supervisor each
(`pool.py`) over local processes (`processes.py`, their ranks taken where it can from the processes started
before the plan, `standby.py`) or Ray actors (`ray_pool.py`), the checkpoint's
inspection in a subprocess (`inspection.py`) and the GPUs' live readings through NVML (`gpus.py`).
Imports planning, config and `runtime.messages`."""
