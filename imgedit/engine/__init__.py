"""The engine, server side: the one FIFO line (manager), the pool of worker handles (local
processes or Ray actors), jobs, batch, history, shutdown, GPU readings through NVML.

Never imports torch. May import `imgedit.planning`, `imgedit.config`, `imgedit.errors`,
`imgedit.protocol` and the worker's typed messages (`imgedit.runtime.messages`), nothing else of
the worker side.
"""
