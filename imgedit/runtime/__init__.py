"""The runtime: everything inside a worker process - loading the pipeline onto its GPUs, quantize
and offload, CFG pair / batch / Ulysses, adapters, the runner (the only caller of the pipeline)
and the worker loop. `runtime.messages` is the typed, torch-free boundary the server imports.

May import `imgedit.model`, `imgedit.planning` (the plan's dataclasses), `imgedit.config`,
`imgedit.errors` and `imgedit.protocol`; never the engine or the web.
"""
