"""Planning: which checkpoint, and GPUs + component sizes + settings -> a plan of workers
(placement, parallel groups, memory modes, the manual DEVICE_MAP).

Pure and torch-free (the server plans with it; tests feed made-up sizes). Imports `imgedit.config`,
`imgedit.errors` and nothing else of ours.
"""
