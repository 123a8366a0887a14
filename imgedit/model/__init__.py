"""The model as files and components: the demo checkpoint, the processor, the prompt-encoding fix,
the LoRA file check and the inspection (sizes, LoRAs) the server runs in a subprocess.

Worker side: imports torch/diffusers (inside functions where the module is used by a command line);
may import `imgedit.config`, `imgedit.errors` and `imgedit.protocol`, never the server side.
"""
