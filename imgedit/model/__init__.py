"""The model as files and components: the demo checkpoint, the processor, the prompt-encoding fix,
the LoRA file check and the inspection (sizes, LoRAs) the server runs in a subprocess.

Worker side: imports torch/diffusers (inside functions where the module is used by a command line);
may import `imgedit.config`, `imgedit.errors` and `imgedit.protocol`, never the server side.
"""

import logging
import warnings

# Library messages that say nothing about this app's health, seen at every worker start and by the command
# lines here (2026-11-25, CPU and GPU machines): torchao's optional kernels that this build cannot load and
# its "no triton" on the CPU, torch's pytree deprecation notes for torchao's enums, diffusers' note on
# torchao's tensor classes. Only their errors are shown; LOG_LEVEL=DEBUG shows everything.
KNOWN_NOISE = ("torchao", "torch.utils._pytree", "diffusers.quantizers.torchao.torchao_quantizer")


def quiet_known_noise() -> None:
    """Before torch/diffusers are imported: the KNOWN_NOISE loggers show errors only, and peft's warning that
    a second LoRA makes a second adapter (which is what loading several LoRAs means) is not shown."""
    for name in KNOWN_NOISE:
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", message="Already found a `peft_config` attribute in the model")
